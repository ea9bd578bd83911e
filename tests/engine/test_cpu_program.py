"""The CPU step program (core/worker/cpu_program.py) against the model's own forward pass.

The program replaces ``model.forward`` + ``compute_logits`` on plain decode
steps and on steps that are one request's prefill chunk; it runs the same
kernels in the same order, so the logits must be identical to the bit: for a
batch of decodes at different positions, and for chunks with and without a
cached prefix, attended by the chunk kernel (head sizes 8 and 16) or a query
at a time (Qwen3's 32), with float or block-format (quantized) weights, for Gemma 3's
recipe (windowed and global layers, GeGLU, norms after each block), and for mixtures of
experts (the router a product, the experts one kernel operation). (That the
model's forward matches transformers is tests/equivalence/test_engine_equivalence.py.)
"""

from __future__ import annotations

import pytest
import torch

from core.config import EngineArgs
from core.engine_core import EngineCore
from core.protocol import EngineCoreRequest, SamplingParams
from core.worker.cpu_program import NativeStepProgram
from kernels import cpu

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler to build kernels/cpu with")


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny seeded Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms), Gemma 3 (sliding
    windows, GeGLU, norms after each block, a scaled embedding), Qwen3-MoE, Mixtral and
    Qwen2-MoE (a shared expert, a dense layer; their experts one operation of the program)
    checkpoints."""
    import transformers

    from core.models.random_model import write_tokenizer
    from tests.support.engines import tiny_config

    dirs = {}
    for arch, cls in (
        ("qwen2", transformers.Qwen2ForCausalLM), ("qwen3", transformers.Qwen3ForCausalLM),
        ("gemma3", transformers.Gemma3ForCausalLM), ("qwen3_moe", transformers.Qwen3MoeForCausalLM),
        ("mixtral", transformers.MixtralForCausalLM), ("qwen2_moe", transformers.Qwen2MoeForCausalLM),
    ):
        torch.manual_seed(5)
        path = tmp_path_factory.mktemp(arch)
        cls(tiny_config(arch)).eval().save_pretrained(path)
        write_tokenizer(path)
        dirs[arch] = str(path)
    return dirs


# Block formats too: their products (kernels/quant.py) are the layers' own in both paths.
MODELS = ["stories", "llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral", "qwen2_moe", "stories-q8_0",
          "qwen2-q4_0", "gemma3-q8_0", "qwen3_moe-q8_0", "qwen2_moe-q8_0"]


def _engine(model: str, stories_dir: str, llama, qwen_dirs, **config) -> EngineCore:
    name, _, quantization = model.partition("-")
    path = {"stories": stories_dir, "llama": llama[1], **qwen_dirs}[name]
    if quantization:
        config["quantization"] = quantization
    engine = EngineCore(EngineArgs(model=path, max_model_len=128, max_num_seqs=8, block_size=4, **config).resolve())
    # One native program a step, block formats or float32 (the row counts kernels/cpu's dense
    # kernel takes; the others run the Python program, which test_one_row_... covers).
    assert type(engine.model_executor.runner.cpu_program) is NativeStepProgram
    return engine


def _decode_logits(engine: EngineCore, decodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The next step, which must be ``decodes`` plain decodes: its logits by the step program
    and by the forward pass."""
    runner = engine.model_executor.runner
    with torch.inference_mode():
        so = engine.scheduler.schedule()
        runner._update_states(so)
        staged = runner._stage_inputs(so)
        assert staged.plain_decode and len(staged.req_ids) == decodes
        program = runner.cpu_program.run(decodes).clone()
        return program, _forward_logits(runner, staged)


def _forward_logits(runner, staged) -> torch.Tensor:
    step = runner._device_inputs(staged)
    hidden = runner.model(step.input_ids, step.positions, runner.kv_caches, step.meta)
    return runner.model.compute_logits(hidden[step.logits_indices])


# float16 caches (the CPU's default, auto) with one float and one block-format model; q8_0
# caches with the model whose heads are whole 32-value blocks.
@pytest.mark.parametrize("model,kv_cache_dtype", [(m, "float32") for m in MODELS] + [
    ("stories", "auto"), ("qwen2-q4_0", "float16"), ("qwen3", "q8_0"),
])
def test_decode_logits_equal_the_forward_pass(
    model: str, kv_cache_dtype: str, stories_dir: str, llama, qwen_dirs
) -> None:
    engine = _engine(model, stories_dir, llama, qwen_dirs, kv_cache_dtype=kv_cache_dtype)
    runner = engine.model_executor.runner
    expected = {"float32": torch.float32, "q8_0": torch.uint8}.get(kv_cache_dtype, torch.float16)
    assert all(k.dtype == v.dtype == expected for k, v in runner.kv_caches)
    g = torch.Generator().manual_seed(0)
    for i, length in enumerate((3, 17, 40)):
        prompt = torch.randint(3, 250, (length,), generator=g).tolist()
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        request = EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params)
        engine.add_request(engine.preprocess_add_request(request))
    for _ in range(4):  # prefill, then a few decodes
        engine.step()
    program, forward = _decode_logits(engine, 3)
    assert torch.equal(program, forward)


@pytest.mark.parametrize("case", ["last-of-three-chunks", "after-a-cached-prefix"])
@pytest.mark.parametrize("model", MODELS)
def test_prefill_chunk_logits_equal_the_forward_pass(
    model: str, case: str, stories_dir: str, llama, qwen_dirs
) -> None:
    """A lone request's chunk that samples: the last 5 tokens of a 37-token prompt after two
    16-token chunks (which sample nothing, also through the program), or a whole prompt
    whose first 12 tokens (three blocks) are cached from an earlier request."""
    engine = _engine(model, stories_dir, llama, qwen_dirs, max_num_batched_tokens=16, enable_prefix_caching=True)
    runner = engine.model_executor.runner
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 250, (37,), generator=g).tolist()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def add(request_id: str, prompt: list[int]) -> None:
        request = EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params)
        engine.add_request(engine.preprocess_add_request(request))

    if case == "last-of-three-chunks":
        add("r0", prompt)
        engine.step()
        engine.step()
    else:
        add("r0", prompt[:12] + [5, 6, 7])
        while engine.scheduler.has_requests():
            engine.step()
        add("r1", prompt[:12] + torch.randint(3, 250, (4,), generator=g).tolist())
    with torch.inference_mode():
        so = engine.scheduler.schedule()
        runner._update_states(so)
        staged = runner._stage_inputs(so)
        assert runner._program_takes_chunk(staged) and staged.sample.size == 1
        assert staged.computed[0] == (32 if case == "last-of-three-chunks" else 12)
        program = runner.cpu_program.run_chunk(staged.total, sample=True).clone()
        forward = _forward_logits(runner, staged)
    assert torch.equal(program, forward)


@pytest.mark.parametrize("dense_for_one", [False, True])
def test_one_row_float32_steps_equal_the_forward_pass(dense_for_one: bool, stories_dir: str, llama, qwen_dirs,
                                                      monkeypatch) -> None:
    """A lone float32 decode: numpy's BLAS in the forward pass, so the Python program; or, where
    one row goes to the dense kernel too (with speculation), the one-call program."""
    from kernels.settings import settings

    engine = _engine("qwen3", stories_dir, llama, qwen_dirs, kv_cache_dtype="float32")
    monkeypatch.setattr(settings, "few_rows_for_one", dense_for_one)
    assert engine.model_executor.runner.cpu_program._in_program(1) is dense_for_one
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    request = EngineCoreRequest(request_id="r", prompt_token_ids=list(range(5, 30)), sampling_params=params)
    engine.add_request(engine.preprocess_add_request(request))
    for _ in range(3):
        engine.step()
    logits, forward = _decode_logits(engine, 1)
    assert torch.equal(logits, forward)


@pytest.mark.parametrize("model", ["llama", "qwen2-q4_0"])
def test_lora_decodes_equal_the_forward_pass(model: str, stories_dir: str, llama, qwen_dirs, tmp_path) -> None:
    """Decodes of two adapters and the base model in one step: the adapters' deltas are an
    operation of the one-call program (float32 and block-format bases alike), bit-equal to the
    forward pass's. (That the deltas are peft's: tests/equivalence/test_lora.py.)"""
    from core.protocol import LoRARequest
    from tests.support.lora_adapters import make_adapter

    name = model.partition("-")[0]
    base = {"llama": llama[1], **qwen_dirs}[name]
    adapters = [make_adapter(base, tmp_path / f"a{i}", seed=i, rank=4 * (i + 1)) for i in range(2)]
    engine = _engine(model, stories_dir, llama, qwen_dirs, kv_cache_dtype="float32", enable_lora=True, max_loras=2)
    runner = engine.model_executor.runner
    assert runner.cpu_program.applies_lora
    g = torch.Generator().manual_seed(2)
    for i, lora in enumerate([None, *(LoRARequest(f"a{j}", j + 1, path) for j, path in enumerate(adapters))]):
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        prompt = torch.randint(3, 250, (7 + 5 * i,), generator=g).tolist()
        request = EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params,
                                    lora_request=lora)
        engine.add_request(engine.preprocess_add_request(request))
    for _ in range(4):
        engine.step()
    program, forward = _decode_logits(engine, 3)
    assert len(runner.lora.batch.groups) == 2
    assert torch.equal(program, forward)
