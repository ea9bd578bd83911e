"""Multi-LoRA in the engine, against peft: greedy tokens of every adapter equal ``PeftModel``'s
in float32, in batches that mix the base model and three adapters (chunked prompts, the prefix
cache on, the CPU step program and the forward pass), with adapters evicted and read again; two
adapters never share cached KV; a step holds at most ``max_loras`` adapters; an adapter in use
is not unloaded; and every bad adapter is refused with a message naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from app.llm import LLM
from core.config import EngineArgs, LoRAModule, SpeculativeConfig
from core.protocol import LoRARequest, SamplingParams
from kernels.lora import LoRABatch, LoRAGroup, LoRASlot, group_rows
from tests.support.lora_adapters import make_adapter, peft_greedy, peft_model

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_dtype="float32", device="cpu", block_size=4, max_num_seqs=16, max_model_len=128)


def _prompts(vocab: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (13,), generator=g).tolist()
    return [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 9, 1)] + [
        torch.randint(3, vocab, (6,), generator=g).tolist()
    ]


def _adapters(base_dir: str, root: Path) -> list[str]:
    """Three adapters unlike one another: every projection (rank 8), q and v under rsLoRA
    (rank 4), the MLP and o (rank 16)."""
    return [
        make_adapter(base_dir, root / "all", seed=1),
        make_adapter(base_dir, root / "qv", seed=2, targets=["q_proj", "v_proj"], rank=4, alpha=8, rslora=True,
                     std=0.4),
        make_adapter(base_dir, root / "mlp", seed=3, targets=["o_proj", "gate_proj", "up_proj", "down_proj"],
                     rank=16, alpha=32),
    ]


@pytest.fixture(scope="module", params=["stories", "gqa"])
def case(request, tmp_path_factory, stories_dir, tiny_llama_dir):
    """(base directory, adapter directories, prompts, peft's tokens by adapter index: None is the base)."""
    base = stories_dir if request.param == "stories" else tiny_llama_dir
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = _adapters(base, root)
    vocab = json.loads((Path(base) / "config.json").read_text())["vocab_size"]
    prompts = _prompts(vocab)
    reference = {}
    for index, adapter in [(None, None), *enumerate(adapters)]:
        model = peft_model(base, adapter)
        reference[index] = [peft_greedy(model, p, MAX_NEW) for p in prompts]
    # The adapters change what the model says, or the comparison would prove nothing.
    for index in range(len(adapters)):
        assert reference[index] != reference[None]
    return base, adapters, prompts, reference


def _requests(adapters: list[str]) -> list[LoRARequest]:
    return [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapters)]


def _mixed(prompts: list[list[int]], requests: list[LoRARequest]):
    """Every prompt under the base model and under each adapter, interleaved."""
    jobs = [(p, k) for p in range(len(prompts)) for k in [None, *range(len(requests))]]
    return ([prompts[p] for p, _ in jobs], [None if k is None else requests[k] for _, k in jobs], jobs)


@pytest.mark.parametrize("engine", [
    dict(max_loras=4),  # whole prompts, and decodes through the CPU step program
    dict(max_loras=4, max_num_batched_tokens=8),  # prompts in chunks beside decodes: the forward pass
    dict(max_loras=2, max_num_batched_tokens=16, max_cpu_loras=2),  # at most two adapters a step, one evicted
    dict(max_loras=4, async_scheduling=True),  # the next step scheduled while this one runs
    dict(max_loras=4, speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3)),  # drafts
])
def test_mixed_batches_equal_peft(case, engine):
    base, adapters, prompts, reference = case
    llm = LLM(base, **ENGINE, enable_lora=True, **engine)
    try:
        all_prompts, loras, jobs = _mixed(prompts, _requests(adapters))
        for attempt in range(2):  # the second from the prefix cache
            results = llm.generate(all_prompts, GREEDY, lora_request=loras)
            for (p, k), result in zip(jobs, results):
                assert result.token_ids == reference[k][p], (attempt, p, k)
        assert sum(r.num_cached_tokens for r in results) > 0
    finally:
        llm.shutdown()


def test_one_request_at_a_time_equals_peft(case):
    """A lone request: its prompt as one chunk and its decodes through the CPU step program."""
    base, adapters, prompts, reference = case
    llm = LLM(base, **ENGINE, enable_lora=True, max_lora_rank=16)
    try:
        for k, request in enumerate(_requests(adapters)):
            assert llm.generate(prompts[1], GREEDY, lora_request=request)[0].token_ids == reference[k][1]
        assert llm.generate(prompts[1], GREEDY)[0].token_ids == reference[None][1]
    finally:
        llm.shutdown()


def test_adapters_never_share_cached_kv(stories_dir, tmp_path):
    adapters = _adapters(stories_dir, tmp_path)[:2]
    first, second = _requests(adapters)
    prompt = _prompts(512)[0]
    llm = LLM(stories_dir, **ENGINE, enable_lora=True)
    try:
        assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0
        assert llm.generate(prompt, GREEDY, lora_request=first)[0].num_cached_tokens == 0  # not the base's
        assert llm.generate(prompt, GREEDY, lora_request=second)[0].num_cached_tokens == 0  # nor the other's
        assert llm.generate(prompt, GREEDY, lora_request=first)[0].num_cached_tokens > 0  # its own
        # The same name read again gets a new number: nothing cached under the old one is reused.
        renumbered = LoRARequest(first.lora_name, 7, first.lora_path)
        assert llm.generate(prompt, GREEDY, lora_request=renumbered)[0].num_cached_tokens == 0
    finally:
        llm.shutdown()


def test_a_step_holds_at_most_max_loras_adapters(stories_dir, tmp_path):
    requests = _requests(_adapters(stories_dir, tmp_path))
    llm = LLM(stories_dir, **ENGINE, enable_lora=True, max_loras=2)
    scheduler = llm.engine.engine_core.scheduler
    seen: list[set[int]] = []
    schedule = scheduler.schedule

    def watched():
        output = schedule()
        ids = {r.lora_int_id for r in scheduler.running if r.request_id in output.num_scheduled_tokens}
        seen.append(ids - {0})
        return output

    scheduler.schedule = watched
    try:
        prompts = _prompts(512) * 3
        loras = [requests[i % 3] for i in range(len(prompts))]
        results = llm.generate(prompts, GREEDY, lora_request=loras)
        assert all(len(r.token_ids) == MAX_NEW for r in results)
        assert max(len(ids) for ids in seen) == 2  # two at once, never three
    finally:
        llm.shutdown()


def test_an_adapter_in_use_is_not_removed(stories_dir, tmp_path):
    (path,) = _adapters(stories_dir, tmp_path)[:1]
    llm = LLM(stories_dir, **ENGINE, enable_lora=True)
    core = llm.engine.engine_core
    try:
        assert core.add_lora("mine", 1, path) is True
        assert core.list_loras() == [1]
        request = llm.input_processor.process(
            "busy", _prompts(512)[0], GREEDY, lora_request=LoRARequest("mine", 1, path)
        )
        llm.engine.add_request(request)
        with pytest.raises(ValueError, match="'mine' is in use by 1 unfinished request"):
            core.remove_lora(1)
        while core.scheduler.has_requests():
            llm.engine.get_output()
        assert core.pin_lora(1) is True
        assert core.remove_lora(1) is True
        assert core.list_loras() == []
        assert core.pin_lora(1) is False
    finally:
        llm.shutdown()


def _args(base: str, path: str, **kw) -> EngineArgs:
    return EngineArgs(model=base, enable_lora=True, lora_modules=[LoRAModule(name="a", path=path)], **kw)


def test_bad_adapters_are_refused_naming_the_problem(stories_dir, tiny_llama_dir, tmp_path):
    good = make_adapter(stories_dir, tmp_path / "good", seed=4)
    with pytest.raises(ValueError, match="rank 8 is above --max-lora-rank 4"):
        _args(stories_dir, good, max_lora_rank=4).resolve()
    with pytest.raises(ValueError, match="does not fit this model"):  # trained on another base
        _args(tiny_llama_dir, good).resolve()
    with pytest.raises(ValueError, match="no such directory"):
        _args(stories_dir, str(tmp_path / "missing")).resolve()
    no_weights = tmp_path / "no-weights"
    shutil.copytree(good, no_weights)
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors is missing"):
        _args(stories_dir, str(no_weights)).resolve()
    head = make_adapter(stories_dir, tmp_path / "head", seed=5, targets=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="target module 'lm_head' is not one ringllm adapts"):
        _args(stories_dir, head).resolve()
    dora = tmp_path / "dora"
    shutil.copytree(good, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA is not supported"):
        _args(stories_dir, str(dora)).resolve()
    torn = tmp_path / "torn"
    shutil.copytree(good, torn)
    tensors = load_file(str(torn / "adapter_model.safetensors"))
    dropped = next(name for name in tensors if "lora_B" in name)
    del tensors[dropped]
    save_file(tensors, str(torn / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="has no lora_B"):
        _args(stories_dir, str(torn)).resolve()
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        EngineArgs(model=stories_dir, lora_modules=[LoRAModule(name="a", path=good)]).resolve()
    with pytest.raises(ValueError, match="is for base model 'other'"):
        EngineArgs(model=stories_dir, enable_lora=True,
                   lora_modules=[LoRAModule(name="a", path=good, base_model_name="other")]).resolve()
    # A request naming a bad adapter the frontend did not check: the engine refuses it, and serves on.
    llm = LLM(stories_dir, **ENGINE, enable_lora=True, max_lora_rank=4)
    try:
        with pytest.raises(ValueError, match="above --max-lora-rank 4"):
            llm.generate(_prompts(512)[0], GREEDY, lora_request=LoRARequest("big", 1, good))
        assert llm.generate(_prompts(512)[0], GREEDY)[0].finish_reason == "length"
    finally:
        llm.shutdown()


def test_requests_with_adapters_need_enable_lora(stories_dir, tmp_path):
    good = make_adapter(stories_dir, tmp_path / "good", seed=4)
    llm = LLM(stories_dir, **ENGINE)
    try:
        with pytest.raises(ValueError, match="--enable-lora"):
            llm.generate(_prompts(512)[0], GREEDY, lora_request=LoRARequest("a", 1, good))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("rows", [[1, 2, 3], [0, 2, 5]])
def test_grouped_products_numpy_and_torch_paths_agree_with_dense(rows):
    """The CPU path (kernels/cpu's LoRA kernel, float32) and the device path (torch's addmm / index_add_, run here
    in float64) add the same deltas as dense products to the group's rows only: a fused product
    of two parts, each with its own A and B, into its own columns."""
    from core.lora.weights import LoRAPart, LoRAProduct

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 10, generator=g), torch.randn(6, 14, generator=g)
    a1, b1 = torch.randn(2, 10, generator=g), torch.randn(8, 2, generator=g)  # columns 0:8, rank 2
    a2, b2 = torch.randn(3, 10, generator=g), torch.randn(4, 3, generator=g)  # columns 10:14, rank 3
    expected = y.double().clone()
    expected[rows, 0:8] += x.double()[rows] @ a1.double().t() @ b1.double().t()
    expected[rows, 10:14] += x.double()[rows] @ a2.double().t() @ b2.double().t()

    for dtype in (torch.float32, torch.float64):
        a_t = torch.cat([a1, a2]).t().contiguous().to(dtype)
        parts = []
        for ranks, columns, b in ((slice(0, 2), slice(0, 8), b1), (slice(2, 5), slice(10, 14), b2)):
            b_t = b.t().contiguous().to(dtype)
            parts.append(LoRAPart(ranks, columns, b_t, b_t.numpy() if dtype == torch.float32 else None))
        product = LoRAProduct(a_t, tuple(parts), a_t.numpy() if dtype == torch.float32 else None)
        grouped = group_rows(np.array(rows, dtype=np.int64))
        assert isinstance(grouped, slice) == (rows == [1, 2, 3])
        index = None if isinstance(grouped, slice) else torch.from_numpy(grouped)
        batch = LoRABatch(native=dtype == torch.float32)  # float32: kernels/cpu's LoRA kernel
        batch.groups = [LoRAGroup({(0, "qkv"): product}, grouped, index)]
        out = y.to(dtype).clone()
        LoRASlot(batch, (0, "qkv")).add(x.to(dtype), out)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        untouched = y.to(dtype).clone()
        LoRASlot(batch, (1, "qkv")).add(x.to(dtype), untouched)  # a product the adapter does not adapt
        assert torch.equal(untouched, y.to(dtype))


def test_gpu_paths_equal_peft(case, monkeypatch):
    """The runner's GPU-only paths, run on the CPU (tests/support/gpu_paths.py): padded decode
    batches, sampled tokens fed back on the device, no CPU step program; the adapters' products
    through the forward pass, as a GPU runs them."""
    from tests.support.gpu_paths import take_gpu_paths

    take_gpu_paths(monkeypatch)
    base, adapters, prompts, reference = case
    llm = LLM(base, **ENGINE, enable_lora=True, max_loras=4)
    try:
        assert llm.engine.engine_core.model_executor.runner.cpu_program is None
        all_prompts, loras, jobs = _mixed(prompts, _requests(adapters))
        for (p, k), result in zip(jobs, llm.generate(all_prompts, GREEDY, lora_request=loras)):
            assert result.token_ids == reference[k][p], (p, k)
    finally:
        llm.shutdown()
