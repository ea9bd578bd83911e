"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers (the oracle), float32.

Tiny random configs, their weights written both ways: experts stacked under transformers 5's own
parameter names, and apart as published checkpoints name them (each expert's projections;
Mixtral's ``block_sparse_moe.experts.N.w1/w3/w2``). Routing differs by family: Mixtral and
Qwen3-MoE (``norm_topk_prob``) renormalize the top k, this Qwen2-MoE does not and adds its shared
expert under a sigmoid gate; Qwen2-MoE's config also keeps one layer dense (``mlp_only_layers``).
Through the engine: chunked prefill mixed with decodes, prefix-cache hits, n-gram speculation and
preemption; LoRA adapters on the attention projections against peft. From GGUF files (the stacked
expert tensors llama.cpp writes), against the same weights.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import save_file

from app.llm import LLM
from core.config import EngineArgs, SpeculativeConfig
from core.models.default_model import DEFAULT_MODEL_DIR
from core.models.loader import load_model
from core.models.random_model import MODEL_CONFIG, write_tokenizer
from core.protocol import SamplingParams
from tests.support.engines import hf_greedy
from tests.support.paged import assert_matches_transformers, single_prefill

MAX_NEW = 12
COMMON = dict(
    vocab_size=MODEL_CONFIG["vocab_size"] + 3, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2,
)


def moe_config(family: str, **overrides) -> transformers.PretrainedConfig:
    if family == "mixtral":
        fields = dict(intermediate_size=64, num_local_experts=6, num_experts_per_tok=2)
    elif family == "qwen2_moe":
        fields = dict(
            intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
            num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1],
        )
    else:
        fields = dict(
            intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            head_dim=32,
        )
    config_class = {"mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
                    "qwen3_moe": transformers.Qwen3MoeConfig}[family]
    return config_class(**{**COMMON, **fields, **overrides})


CLASSES = {
    "mixtral": transformers.MixtralForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM,
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
}


def _write_layout(hf: torch.nn.Module, path, family: str, layout: str) -> None:
    """The model's weights as one safetensors file: experts stacked under transformers 5's own
    parameter names, or apart under the published checkpoints' names."""
    out = {}
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for name, tensor in hf.state_dict().items():
        tensor = tensor.detach().clone().contiguous()
        stacked = re.match(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if stacked is None or layout == "stacked":
            published = family == "mixtral" and layout == "per-expert"
            out[name.replace(".mlp.", ".block_sparse_moe.") if published else name] = tensor
            continue
        prefix = stacked.group(1) + (".block_sparse_moe" if family == "mixtral" else ".mlp")
        for e, expert in enumerate(tensor):
            if stacked.group(2) == "down_proj":
                out[f"{prefix}.experts.{e}.{names[2]}.weight"] = expert.clone()
            else:
                gate, up = expert.chunk(2)
                out[f"{prefix}.experts.{e}.{names[0]}.weight"] = gate.clone()
                out[f"{prefix}.experts.{e}.{names[1]}.weight"] = up.clone()
    for file in path.glob("*.safetensors"):
        file.unlink()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=[(f, layout) for f in CLASSES for layout in ("stacked", "per-expert")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def moe(request, tmp_path_factory):
    family, layout = request.param
    return family, *_checkpoint(tmp_path_factory.mktemp(f"{family}-{layout}"), family, layout)


def _checkpoint(path, family: str, layout: str) -> tuple[transformers.PreTrainedModel, str]:
    """A seeded tiny model of ``family`` saved at ``path`` with its experts in ``layout``."""
    torch.manual_seed(4321)
    hf = CLASSES[family](moe_config(family)).eval().float()
    with torch.no_grad():  # routers sharp enough that the top k are clear choices
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
    hf.save_pretrained(path)  # config.json (the weights transformers writes are replaced)
    _write_layout(hf, path, family, layout)
    write_tokenizer(path)
    return hf, str(path)


def _prompts(vocab: int, lengths=(3, 17, 40, 9, 30)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_logits_and_paged_greedy_match_transformers(moe) -> None:
    _, hf, path = moe
    ours = load_model(EngineArgs(model=path).resolve(), "cpu", torch.float32)
    vocab = hf.config.vocab_size
    assert_matches_transformers(hf, ours, _prompts(vocab, (29,))[0], _prompts(vocab), MAX_NEW)


@pytest.mark.parametrize("family", list(CLASSES))
def test_torch_experts_match_transformers(family, tmp_path, monkeypatch) -> None:
    """Without the C kernels (a GPU's path), the experts grouped by expert in torch."""
    from kernels.settings import settings

    monkeypatch.setattr(settings, "cpu_kernels", False)
    hf, path = _checkpoint(tmp_path, family, "stacked")
    ours = load_model(EngineArgs(model=path).resolve(), "cpu", torch.float32)
    assert all(layer.mlp.kernel is None for layer in ours.model.layers if hasattr(layer.mlp, "experts"))
    vocab = hf.config.vocab_size
    assert_matches_transformers(hf, ours, _prompts(vocab, (29,))[0], _prompts(vocab, (3, 17)), MAX_NEW)


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=16),  # chunks mixed with decodes, prefix hits
    dict(speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)),
    dict(max_num_batched_tokens=64, num_gpu_blocks_override=17, max_model_len=64),  # preemption
], ids=["chunked-prefix-hits", "ngram-speculation", "preempting"])
def test_engine_greedy_matches_transformers(moe, engine_args) -> None:
    _, hf, path = moe
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(3, hf.config.vocab_size, (24,), generator=g).tolist()
    prompts = [prefix + [5, 6, 7, 8] * 3, prefix + torch.randint(3, hf.config.vocab_size, (15,), generator=g).tolist(),
               prefix[:20] + torch.randint(3, hf.config.vocab_size, (9,), generator=g).tolist()]
    engine = dict(dtype="float32", kv_cache_dtype="float32", device="cpu", block_size=4, max_num_seqs=4)
    llm = LLM(path, **{**engine, **engine_args})
    try:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        first = llm.generate(prompts[:1], params)[0]
        rest = llm.generate(prompts[1:], params)  # their first 20-24 tokens from the first one's blocks
        assert [first.token_ids, *(r.token_ids for r in rest)] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
        scheduler = llm.engine.engine_core.scheduler
        if "speculative_config" in engine_args:
            assert scheduler.spec_stats.num_drafts > 0  # drafts verified (the rejected ones rolled back)
        elif "num_gpu_blocks_override" in engine_args:
            assert scheduler.num_preemptions > 0
        else:
            assert all(r.num_cached_tokens >= 20 for r in rest)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_two_data_parallel_engines_give_transformers_greedy_tokens(tmp_path, server_factory) -> None:
    """A real server with two engines (``-dp 2``), each running the experts as one operation of its
    step program, and the openai client: every request's tokens are transformers' greedy ones, and
    both engines served some (their ``engine`` label in /metrics)."""
    import asyncio

    import httpx
    import openai

    from tests.support.metrics import parse_metrics, value

    hf, path = _checkpoint(tmp_path / "model", "qwen3_moe", "stacked")
    server = server_factory(["--model", path, "-dp", "2", "--dtype", "float32", "--kv-cache-dtype", "float32"])
    prompts = _prompts(hf.config.vocab_size, (5, 9, 12, 17, 21, 30, 8, 14))

    async def greedy() -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            done = await asyncio.gather(*(client.completions.create(
                model=path, prompt=p, max_tokens=MAX_NEW, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            ) for p in prompts))
        finally:
            await client.close()
        return [[int(t.removeprefix("token_id:")) for t in c.choices[0].logprobs.tokens] for c in done]

    assert asyncio.run(greedy()) == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    samples = parse_metrics(httpx.get(server.base_url + "/metrics", timeout=10).text)
    for engine in ("0", "1"):
        assert value(samples, "vllm:request_success_total", engine=engine, finished_reason="length", model_name=path)


@pytest.fixture(scope="module")
def moe_ggufs(tmp_path_factory) -> dict[str, tuple[transformers.PreTrainedModel, object]]:
    """GGUF files made from per-expert checkpoints as llama.cpp's converter lays them out (stacked
    experts, llama.cpp's keys), with stories260K's vocabulary: each family in F32, and the Qwen
    MoEs in Q8_0 too."""
    from tests.support.gguf_files import write_gguf

    files = {}
    for family in CLASSES:
        torch.manual_seed(99)
        # llama.cpp's qwen2moe has experts in every layer: no dense ones in a file
        config = moe_config(family, vocab_size=512, mlp_only_layers=[])
        hf = CLASSES[family](config).eval().float()
        path = tmp_path_factory.mktemp(f"{family}-gguf")
        hf.save_pretrained(path)
        _write_layout(hf, path, family, "per-expert")
        for tokenizer_file in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(DEFAULT_MODEL_DIR / tokenizer_file, path / tokenizer_file)
        for qtype in ("f32", "q8_0") if family != "mixtral" else ("f32",):
            files[f"{family}-{qtype}"] = (hf, write_gguf(path, path / f"{family}-{qtype}.gguf", qtype=qtype))
    return files


@pytest.mark.parametrize("name", ["mixtral-f32", "qwen2_moe-f32", "qwen3_moe-f32", "qwen2_moe-q8_0", "qwen3_moe-q8_0"])
def test_gguf_experts_equal_transformers(name, moe_ggufs, monkeypatch) -> None:
    """F32 files against the checkpoint they were made from; Q8_0 files against the same
    checkpoint with every matrix the file quantized replaced by the values it holds (the gguf
    package's own Q8_0 round trip), our products on float activations. Each expert's rows are a
    view of the file's stacked tensor, multiplied by the block kernels. (transformers' own GGUF
    reader cannot be the oracle here: it ignores a qwen2moe file's expert sizes.)"""
    from kernels.settings import settings

    monkeypatch.setattr(settings, "quantize_activations", False)
    hf, path = moe_ggufs[name]
    ours = load_model(EngineArgs(model=str(path)).resolve(), "cpu")
    moe_layers = [layer.mlp for layer in ours.model.layers if hasattr(layer.mlp, "experts")]
    # every expert served from the file's stacked tensors, in the kernels' tiles (F32 files too)
    qtypes = {part.qtype.name for m in moe_layers for gate_up, down in m.experts.quantized for part in
              (*gate_up.parts, *down.parts)}
    assert moe_layers and qtypes == {"Q8_0" if name.endswith("q8_0") else "F32"}
    if name.endswith("q8_0"):
        hf = _as_q8_0_holds_it(hf)
    ids = _prompts(hf.config.vocab_size, (29,))[0]
    with torch.no_grad():
        expected = hf.eval()(torch.tensor([ids])).logits[0]
    got = single_prefill(ours, ids)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def _as_q8_0_holds_it(hf: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """A copy of ``hf`` whose matrices write_gguf quantizes hold what Q8_0 keeps of them."""
    import copy

    from gguf import GGMLQuantizationType, quants

    oracle = copy.deepcopy(hf)
    with torch.no_grad():
        for p in oracle.parameters():
            if p.dim() >= 2 and p.shape[-1] % 32 == 0:
                blocks = quants.quantize(p.numpy(), GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0)).reshape(p.shape))
    return oracle


@pytest.mark.parametrize("bad,message", [
    (dict(expert_used_count=9), "expert_used_count 9 is not between 1 and qwen3moe.expert_count 8"),
    (dict(expert_count=6), r"tensor blk.0.ffn_gate_inp.weight is \[64, 8\], expected \[64, 6\]"),
    (dict(leave_out=("blk.1.ffn_up_exps.weight",)), "tensor blk.1.ffn_up_exps.weight is missing"),
], ids=["more-used-than-there-are", "wrong-shape", "missing"])
def test_bad_expert_files_are_refused_before_loading(bad, message, moe_ggufs, tmp_path) -> None:
    """At configuration, naming the key or the tensor (the CLI exits with status 2 on these)."""
    from tests.support.gguf_files import write_gguf

    _, path = moe_ggufs["qwen3_moe-f32"]
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(write_gguf(path.parent, tmp_path / "bad.gguf", qtype="f32", **bad))).resolve()


def test_lora_on_the_attention_projections_equals_peft(tmp_path) -> None:
    """An adapter on q, k, v and o of a Qwen3-MoE (a batch mixing the base and the adapter, prompts
    in chunks), against peft."""
    from core.protocol import LoRARequest
    from tests.support.lora_adapters import make_adapter, peft_greedy, peft_model

    hf, base = _checkpoint(tmp_path / "base", "qwen3_moe", "stacked")
    adapter = make_adapter(base, tmp_path / "attention", seed=1, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    prompts = _prompts(hf.config.vocab_size, (5, 21))
    adapted = peft_model(base, adapter)
    expected = [peft_greedy(adapted, p, MAX_NEW) for p in prompts]
    assert expected != [hf_greedy(hf, p, MAX_NEW) for p in prompts]  # the adapter changes the tokens
    llm = LLM(base, dtype="float32", kv_cache_dtype="float32", device="cpu", block_size=4, enable_lora=True,
              max_num_batched_tokens=16)
    try:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        request = LoRARequest("attention", 1, adapter)
        results = llm.generate(prompts + prompts, params, lora_request=[request, request, None, None])
        assert [r.token_ids for r in results] == expected + [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tensor,message", [
    ("layers.0.mlp.experts.3.gate_proj", "adapts an expert; adapters on a mixture of experts' experts"),
    ("layers.2.mlp.down_proj", "layer 2's down_proj, but that layer's MLP is a mixture of experts"),
], ids=["an-expert", "a-sparse-layers-mlp"])
def test_adapters_on_experts_are_refused_with_the_reason(tensor, message, tmp_path) -> None:
    """At start (--lora-modules: exit 2), and by the frontend and the engine on a load."""
    import json

    from core.config import LoRAModule

    _, base = _checkpoint(tmp_path / "base", "qwen3_moe", "stacked")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["gate_proj", "down_proj"]}))
    prefix = f"base_model.model.model.{tensor}"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(4, 64), f"{prefix}.lora_B.weight": torch.zeros(64, 4)},
              str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineArgs(model=base, enable_lora=True, lora_modules=[LoRAModule(name="a", path=str(adapter))]).resolve()


@pytest.mark.parametrize("family", list(CLASSES))
def test_structured_outputs_hold_with_experts(family, tmp_path) -> None:
    """A JSON schema enforced on a mixture of experts: every output parses and validates (the
    grammar masks each step's logits, whatever computed them)."""
    import json

    import jsonschema

    from app.tokenizer import load_tokenizer
    from core.protocol import StructuredOutputsParams

    hf, path = _checkpoint(tmp_path, family, "stacked")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    guided = StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=4)
    try:
        params = SamplingParams(max_tokens=64, temperature=0.8, seed=3, structured_outputs=guided)
        results = llm.generate(_prompts(hf.config.vocab_size, (5, 12, 20)), params)
    finally:
        llm.shutdown()
    tokenizer = load_tokenizer(path)
    for result in results:  # each stopped at the end-of-sequence token, which this test vocabulary spells
        assert result.finish_reason == "stop" and result.token_ids[-1] == hf.config.eos_token_id, family
        jsonschema.validate(json.loads(tokenizer.decode(result.token_ids[:-1])), schema)
