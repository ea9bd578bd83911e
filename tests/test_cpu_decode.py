"""The CPU decode program (core/worker/cpu_decode.py) against the model's own forward pass.

The program replaces ``model.forward`` + ``compute_logits`` on plain decode
steps; it runs the same kernels in the same order, so the logits must be
identical to the bit, for a batch of requests at different positions.
(That the model's forward matches transformers is tests/test_engine_equivalence.py.)
"""

from __future__ import annotations

import pytest
import torch

from core.config import EngineConfig
from core.engine_core import EngineCore
from core.protocol import EngineCoreRequest, SamplingParams
from kernels import cpu

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler to build kernels/cpu with")


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny seeded Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms) checkpoints."""
    import transformers

    from core.models.random_model import write_tokenizer
    from tests.support.engines import tiny_config

    dirs = {}
    for arch, cls in (("qwen2", transformers.Qwen2ForCausalLM), ("qwen3", transformers.Qwen3ForCausalLM)):
        torch.manual_seed(5)
        path = tmp_path_factory.mktemp(arch)
        cls(tiny_config(arch)).eval().save_pretrained(path)
        write_tokenizer(path)
        dirs[arch] = str(path)
    return dirs


@pytest.mark.parametrize("model", ["stories", "llama", "qwen2", "qwen3"])
def test_program_logits_equal_the_forward_pass(model: str, stories_dir: str, llama, qwen_dirs) -> None:
    path = {"stories": stories_dir, "llama": llama[1], **qwen_dirs}[model]
    engine = EngineCore(EngineConfig(model=path, max_model_len=128, max_num_seqs=8, block_size=4))
    runner = engine.model_executor.runner
    assert runner.cpu_decode is not None
    g = torch.Generator().manual_seed(0)
    for i, length in enumerate((3, 17, 40)):
        prompt = torch.randint(3, 250, (length,), generator=g).tolist()
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        request = EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params)
        engine.add_request(engine.preprocess_add_request(request))
    for _ in range(4):  # prefill, then a few decodes
        engine.step()
    with torch.inference_mode():
        so = engine.scheduler.schedule()
        runner._update_states(so)
        staged = runner._stage_inputs(so)
        assert staged.plain_decode and len(staged.req_ids) == 3
        program = runner.cpu_decode.run(3).clone()
        step = runner._device_inputs(staged)
        hidden = runner.model(step.input_ids, step.positions, runner.kv_caches, step.meta)
        forward = runner.model.compute_logits(hidden[step.logits_indices])
    assert torch.equal(program, forward)
