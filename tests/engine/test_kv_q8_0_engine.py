"""An engine on a q8_0 KV cache (``--kv-cache-dtype q8_0``): where it is refused, and what it changes.

A prompt's log-probabilities are computed chunk by chunk (16 tokens a step), each chunk attending
to its own and the earlier chunks' keys and values as the cache holds them (written, then read back,
as llama.cpp does): with a q8_0 cache they differ from a float32 cache's, by little. (That the
kernels read the quantized rows exactly is tests/unit/test_kv_q8_0.py; that the step programs
equal the forward pass on such a cache, tests/engine/test_cpu_program.py.)
"""

from __future__ import annotations

import pytest
import torch

from app.llm import LLM
from core.config import EngineArgs, SpeculativeConfig
from core.protocol import SamplingParams

ENGINE = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    """A seeded tiny Qwen3: heads of 32 values, one q8_0 block each."""
    import transformers

    from core.models.random_model import write_tokenizer
    from tests.support.engines import tiny_config

    torch.manual_seed(7)
    path = tmp_path_factory.mktemp("qwen3-q8-kv")
    transformers.Qwen3ForCausalLM(tiny_config("qwen3")).eval().save_pretrained(path)
    write_tokenizer(path)
    return str(path)


def test_q8_0_is_refused_where_it_cannot_be_read(stories_dir: str) -> None:
    with pytest.raises(ValueError, match="head_dim 8 is not a multiple of 32"):
        EngineArgs(model=stories_dir, kv_cache_dtype="q8_0").resolve()
    with pytest.raises(ValueError, match="CPU kernels only"):
        EngineArgs(model=stories_dir, kv_cache_dtype="q8_0", device="cuda").resolve()


def _prompt_logprobs(path: str, kv_cache_dtype: str, prompt: list[int]) -> torch.Tensor:
    llm = LLM(path, **ENGINE, kv_cache_dtype=kv_cache_dtype)
    try:
        runner = llm.engine.engine_core.model_executor.runner
        assert runner.kv_caches[0][0].dtype == {"q8_0": torch.uint8, "float32": torch.float32}[kv_cache_dtype]
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        (result,) = llm.generate([prompt], params)
        return torch.tensor(result.prompt_logprobs.logprobs)[:, 0]
    finally:
        llm.shutdown()


def test_prompt_logprobs_over_a_q8_0_cache_stay_close_to_float32(qwen3_dir: str) -> None:
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 250, (60,), generator=g).tolist()
    exact = _prompt_logprobs(qwen3_dir, "float32", prompt)
    quantized = _prompt_logprobs(qwen3_dir, "q8_0", prompt)
    deviation = (quantized - exact).abs()
    assert deviation.max() > 0  # the quantized rows were read
    assert deviation.max() < 0.02, deviation  # ~1/254 of each block's largest value, through two layers


def _greedy(path: str, prompts: list[list[int]], **args) -> tuple[list[list[int]], object]:
    llm = LLM(path, **{**ENGINE, "kv_cache_dtype": "q8_0", **args})
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        first = llm.generate(prompts[:1], params)  # its blocks then serve the others' shared prefix
        rest = llm.generate(prompts[1:], params)
        return [r.token_ids for r in first + rest], llm.engine.engine_core.scheduler
    finally:
        llm.shutdown()


def test_speculation_prefix_hits_and_preemption_over_a_q8_0_cache_change_no_token(qwen3_dir: str) -> None:
    """The same tokens as a plain q8_0 engine (no cache hits: each prompt computed whole) when
    drafts are verified and rolled back, when blocks written by an earlier request are reused,
    and when requests are preempted and recomputed: the quantized rows of a token do not depend
    on the step that wrote them."""
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(3, 250, (24,), generator=g).tolist()
    prompts = [prefix + [5, 6, 7, 8] * 4, prefix + torch.randint(3, 250, (9,), generator=g).tolist(),
               prefix[:16] + [9, 10, 11] * 5]
    plain, _ = _greedy(qwen3_dir, prompts, enable_prefix_caching=False)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    cached, scheduler = _greedy(qwen3_dir, prompts, speculative_config=spec)
    assert cached == plain
    assert scheduler.spec_stats.num_drafts > 0 and scheduler.spec_stats.num_accepted_tokens > 0
    assert scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    tiny = dict(num_gpu_blocks_override=17, max_model_len=64, max_num_batched_tokens=64)  # 64 tokens
    preempted, scheduler = _greedy(qwen3_dir, prompts, **tiny)
    assert preempted == plain and scheduler.num_preemptions > 0
