"""GGUF files served as they are, against transformers reading the same files (the oracle).

The files are written here with the gguf package (tests/support/gguf_files.py):
stories260K in Q8_0, Q4_0, Q5_0 and F32, and small Qwen2/Qwen3 models, five of them
with the projections' formats of Q4_K_M, Q3_K_M, Q2_K and IQ4_XS files and the 32-value formats
llama-quantize falls back to (IQ4_NL, Q5_1, Q4_1). transformers
dequantizes a GGUF file with the gguf package and runs its own model: with our
activations left in float32 (a test-only kernel setting) the logits must agree to
1e-4 relative. With int8 activations, as served, the deviation is measured over
more than 1,000 positions and bounded.
"""

from __future__ import annotations

import functools

import json
from pathlib import Path

import gguf
import pytest
import torch
import transformers

from core.config import EngineArgs
from core.engine_core import EngineCore
from core.models.default_model import DEFAULT_MODEL_DIR
from core.models.gguf_checkpoint import GGUFCheckpoint
from core.models.loader import load_model
from core.protocol import EngineCoreOutputs, EngineCoreRequest, SamplingParams
from core.worker.cpu_program import NativeStepProgram
from kernels import cpu
from kernels.quant import QuantType
from kernels.settings import settings
from tests.support.gguf_files import gemma3_checkpoint, private_cache, qwen_dir, write_gguf
from tests.support.paged import single_prefill
from tests.support.quant_blocks import random_blocks
from tests.support.servers import start_server, stop_server

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler to build kernels/cpu with")

STORY_PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog was sad because",
                 "One day, a big bird"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    """The GGUF files' config and tokenizer directories go to a cache of this module's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RINGLLM_CACHE", str(private_cache(tmp_path_factory.mktemp("cache") / "ringllm")))
        yield


@pytest.fixture(scope="module")
def stories_gguf(tmp_path_factory, cache) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("stories-gguf")
    return {q: write_gguf(DEFAULT_MODEL_DIR, folder / f"stories-{q}.gguf", q) for q in ("q8_0", "q4_0", "q5_0", "f32")}


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory, cache) -> dict[str, Path]:
    """Qwen2 in Q8_0 (biases), and Qwen3 (q/k norms, tied) with the projections' formats of Q4_K_M,
    Q3_K_M, Q2_K and IQ4_XS files, and of the 32-value formats llama-quantize falls back to where rows are
    not of 256 (IQ4_NL, Q5_1) and Q4_1, beside Q8_0 ones."""
    folder = tmp_path_factory.mktemp("qwen-gguf")
    files = {"qwen2-q8_0": write_gguf(qwen_dir(folder / "qwen2", "qwen2", 64, 96, 4, 2, 7), folder / "qwen2-q8_0.gguf")}
    # head_dim 128, transformers' Qwen3 default: its GGUF reader does not read the file's own.
    qwen3 = qwen_dir(folder / "qwen3", "qwen3", 256, 512, 4, 2, 8, head_dim=128)
    shapes = {"attn_q": (512, 256), "attn_k": (256, 256), "attn_v": (256, 256), "attn_output": (256, 512),
              "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}
    mixes = {  # GGML type ids: 3 Q4_1, 7 Q5_1, 10 Q2_K, 11 Q3_K, 12 Q4_K, 13 Q5_K, 14 Q6_K, 20 IQ4_NL, 23 IQ4_XS
        "q4_k_m": dict.fromkeys(shapes, 12) | {"attn_v": 14, "ffn_down": 14},
        "q3_k_m": dict.fromkeys(shapes, 11) | {"attn_v": 13, "attn_output": 12, "ffn_down": 12},
        "q2_k": dict.fromkeys(shapes, 10) | {"attn_v": 11, "ffn_down": 11},
        "iq4_xs": dict.fromkeys(shapes, 23),
        # llama-quantize's formats for rows not of 256: IQ4_NL for Q3_K and IQ4_XS, Q5_1 for Q5_K
        "iq4_nl": dict.fromkeys(shapes, 20) | {"attn_v": 7, "ffn_down": 3},
    }
    for mix, types in mixes.items():
        overrides = {}
        for layer in range(2):
            for name, (rows, k) in shapes.items():
                data = random_blocks(QuantType(types[name]), rows, k, seed=layer * 10 + types[name] + rows)
                overrides[f"blk.{layer}.{name}.weight"] = (data, types[name])
        files[f"qwen3-{mix}"] = write_gguf(qwen3, folder / f"qwen3-{mix}.gguf", "q8_0", overrides)
    return files


def test_gemma3_gguf_equals_transformers_on_the_checkpoint_it_was_made_from(tmp_path, cache) -> None:
    """Gemma 3 read from a GGUF file (norms stored shifted, windows and ropes from llama.cpp's keys)
    gives the logits and greedy tokens of transformers on the Hugging Face checkpoint."""
    from tests.support.paged import PagedHarness

    hf_dir = gemma3_checkpoint(tmp_path / "gemma3")
    oracle = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ours = _ours(write_gguf(hf_dir, tmp_path / "gemma3-f32.gguf", "f32"))
    ids = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.no_grad():
        expected = oracle(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(single_prefill(ours, ids), expected, atol=1e-4, rtol=1e-4)
    prompts = [ids[:n] for n in (3, 12, 30)]
    greedy = [oracle.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert PagedHarness(ours).generate(prompts, 12) == greedy


def _ours(path: Path) -> torch.nn.Module:
    return load_model(EngineArgs(model=str(path)).resolve(), "cpu")


@functools.cache
def _oracle(path: Path) -> torch.nn.Module:
    """transformers reading the file (once per file: its tests only run it, under no_grad)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


STORIES, STORY_LENGTH = 4, 260  # the most any test below reads


def _prompt_ids(count: int, length: int) -> list[list[int]]:
    """``count`` token sequences of ``length`` that stories260K writes (greedy, in float32) after
    varied story openings: text of the kind it was trained on, for every file made from it."""
    assert count <= STORIES and length <= STORY_LENGTH
    return [ids[:length] for ids in _stories_writing()[:count]]


@functools.cache
def _stories_writing() -> list[list[int]]:
    count, length = STORIES, STORY_LENGTH
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    out = []
    for text in (STORY_PROMPTS * count)[:count]:
        ids = [1, *tokenizer.encode(text, add_special_tokens=False)]
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=length - len(ids), do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        out.append(seq[0].tolist())
    return out


def _oracle_logits(oracle: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return oracle(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q5_0", "f32"])
def test_float_activation_logits_equal_transformers_reading_the_same_file(qtype, stories_gguf, monkeypatch) -> None:
    monkeypatch.setattr(settings, "quantize_activations", False)
    path = stories_gguf[qtype]
    oracle = _oracle(path)
    (ids,) = _prompt_ids(1, 64)
    ours, expected = single_prefill(_ours(path), ids), _oracle_logits(oracle, ids)
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("name", ["qwen2-q8_0", "qwen3-q4_k_m", "qwen3-q3_k_m", "qwen3-q2_k", "qwen3-iq4_xs",
                                  "qwen3-iq4_nl"])
def test_qwen_files_with_k_formats_equal_transformers(name, qwen_gguf, monkeypatch) -> None:
    monkeypatch.setattr(settings, "quantize_activations", False)
    path = qwen_gguf[name]
    types = {gguf.GGMLQuantizationType(t.ggml_type).name for t in GGUFCheckpoint(path).tensors.values()}
    assert types >= {"qwen2-q8_0": {"Q8_0"}, "qwen3-q4_k_m": {"Q4_K", "Q6_K", "Q8_0"},
                     "qwen3-q3_k_m": {"Q3_K", "Q4_K", "Q5_K", "Q8_0"}, "qwen3-iq4_xs": {"IQ4_XS", "Q8_0"},
                     "qwen3-q2_k": {"Q2_K", "Q3_K", "Q8_0"},
                     "qwen3-iq4_nl": {"IQ4_NL", "Q5_1", "Q4_1", "Q8_0"}}[name]
    ids = [1, *range(40, 100)]
    ours, expected = single_prefill(_ours(path), ids), _oracle_logits(_oracle(path), ids)
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_int8_activations_over_a_thousand_positions(qtype, stories_gguf) -> None:
    """As served: activations rounded to int8 per block. Measured on stories260K (the numbers
    are in bench/README.md), and bounded: each product's rounding is at most 0.56 % of its
    blocks' largest activation (tests/unit/test_quant_kernels.py proves it per product), and the
    model's 21 products each add such a relative error to the logits, which therefore stay
    within 21 x 0.56 % ~ 12 % of their own range; nearly every greedy choice survives."""
    path = stories_gguf[qtype]
    oracle, ours = _oracle(path), _ours(path)
    deviations, agree, positions = [], 0, 0
    for ids in _prompt_ids(4, 260):
        got, expected = single_prefill(ours, ids), _oracle_logits(oracle, ids)
        deviations.append(((got - expected).abs().max() / (expected.max() - expected.min())).item())
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
        positions += len(ids)
    assert positions >= 1000
    assert max(deviations) <= 0.12
    assert agree / positions >= 0.95, (agree, positions)


def test_the_head_size_is_the_files_own(tmp_path, cache) -> None:
    """A Qwen3 file whose heads are not transformers' default size (it reads none from the file)."""
    path = write_gguf(qwen_dir(tmp_path / "q", "qwen3", 64, 96, 4, 2, 9, head_dim=16), tmp_path / "q.gguf")
    config = EngineArgs(model=str(path)).resolve().model_config
    assert (config.head_dim, config.num_heads, config.num_kv_heads) == (16, 4, 2)
    assert _ours(path) is not None  # every tensor found its place


def test_the_tokenizer_from_the_files_metadata_equals_the_original(stories_gguf) -> None:
    """The frontend tokenizes with what transformers read from the file: the same ids, and the
    same text back, as the checkpoint's own tokenizer.json. (Not for runs of spaces: this
    SentencePiece model folds them, a normaliser setting GGUF does not carry, so the file's
    tokenizer keeps them, as llama.cpp's does; tests/equivalence/test_llama_server.py compares with it.)"""
    config = EngineArgs(model=str(stories_gguf["q8_0"])).resolve()
    ours = transformers.AutoTokenizer.from_pretrained(config.tokenizer)
    original = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    texts = [*STORY_PROMPTS, "leading words, tabs\tand\nnew lines", "Ünïcödé — ☃ 🦙 and bytes", "", "a" * 300]
    for text in texts:
        assert ours.encode(text) == original.encode(text), text
        ids = original.encode(text)
        assert ours.decode(ids) == original.decode(ids)
    assert (ours.bos_token_id, ours.eos_token_id) == (original.bos_token_id, original.eos_token_id)


@pytest.mark.parametrize("name", ["qwen2-q8_0", "qwen3-q4_k_m", "qwen3-q3_k_m", "qwen3-q2_k", "qwen3-iq4_xs",
                                  "qwen3-iq4_nl"])
def test_the_engine_steps_through_the_native_program_and_writes_transformers_tokens(
    name, qwen_gguf, monkeypatch
) -> None:
    """Served, every decode step and lone prefill chunk of a GGUF model is one native program
    call (core/worker/cpu_program.py); with float activations its greedy tokens are the
    oracle's, batched at different lengths."""
    monkeypatch.setattr(settings, "quantize_activations", False)
    path = qwen_gguf[name]
    engine = EngineCore(EngineArgs(model=str(path), max_model_len=128, max_num_seqs=4, block_size=4).resolve())
    runner = engine.model_executor.runner
    assert type(runner.cpu_program) is NativeStepProgram
    decodes = []
    run = runner.cpu_program.run
    monkeypatch.setattr(runner.cpu_program, "run", lambda n: decodes.append(n) or run(n))
    prompts = [[1, *range(40, 40 + n)] for n in (5, 19, 33)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        request = EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params)
        engine.add_request(engine.preprocess_add_request(request))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.scheduler.has_requests():
        for output in engine.step()[0].get(0, EngineCoreOutputs()).outputs:
            tokens[output.request_id] += output.new_token_ids
    engine.shutdown()
    assert sum(decodes) == 3 * 11  # every decode step: 11 after each prompt's first token
    oracle = _oracle(path)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = oracle.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens[f"r{i}"] == expected, i


def test_a_gguf_file_served_to_the_openai_client(stories_gguf, tmp_path) -> None:
    """`python -m app --model FILE.gguf`, as a user runs it: greedy completions (whole and
    streamed) equal transformers' continuations of the same file (F32 tiles take float
    activations, so the products are float32 ones), their logprobs agree, and a JSON-schema
    request on the Q4_0 file gives what jsonschema accepts."""
    import jsonschema

    path = stories_gguf["f32"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    oracle = _oracle(path)
    server = start_server(["--model", str(path), "--served-model-name", "s", "--kv-cache-dtype", "float32"],
                          tmp_path / "f32.log")
    try:
        client = server.openai()
        for prompt in STORY_PROMPTS[:3]:
            ids = tokenizer(prompt).input_ids
            with torch.no_grad():
                out = oracle.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0]
                logprobs = oracle(out[None]).logits[0, len(ids) - 1 : -1].log_softmax(-1)
            # What a client sees: the whole decode less the prompt's own.
            prompt_text = tokenizer.decode(ids, skip_special_tokens=True)
            expected = tokenizer.decode(out, skip_special_tokens=True)[len(prompt_text):]
            body = dict(model="s", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
            whole = client.completions.create(**body, logprobs=1).choices[0]
            streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)
            assert whole.text == streamed == expected, prompt
            chosen = logprobs.gather(1, out[len(ids):, None])[:, 0]
            assert torch.allclose(torch.tensor(whole.logprobs.token_logprobs), chosen, atol=1e-4), prompt
    finally:
        stop_server(server)

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    server = start_server(["--model", str(stories_gguf["q4_0"]), "--served-model-name", "s"], tmp_path / "q4.log")
    try:
        reply = server.openai().completions.create(
            model="s", prompt="Once upon a time", max_tokens=60, temperature=0.8, seed=3,
            extra_body={"structured_outputs": {"json": schema}},
        ).choices[0]
        jsonschema.validate(json.loads(reply.text), schema)
    finally:
        stop_server(server)
