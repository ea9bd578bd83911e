"""The engine as a whole against transformers (the oracle), greedy, float32.

Small token budgets force chunked prefill and steps that mix prefill chunks
with decodes; a tiny KV cache forces preemption and recompute.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from app.llm import LLM
from core.models.random_model import write_tokenizer
from core.protocol import SamplingParams
from tests.support.engines import hf_greedy, tiny_config

PROMPT_LENGTHS = [3, 17, 40, 9, 64]
MAX_NEW = 12


MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@pytest.fixture(scope="module", params=list(MODEL_CLASSES))
def hf_model(request, tmp_path_factory):
    torch.manual_seed(1234)
    config = tiny_config(request.param)
    model = getattr(transformers, MODEL_CLASSES[request.param])(config).eval().float()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    write_tokenizer(path)  # the engine's frontend half needs one; prompts are token ids anyway
    return model, str(path)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _our_greedy(path: str, prompts: list[list[int]], **engine_args) -> tuple[list[list[int]], int]:
    """Our greedy tokens per prompt, and how many preemptions the run took."""
    llm = LLM(path, dtype="float32", device="cpu", **engine_args)
    try:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        tokens = [r.token_ids for r in llm.generate(prompts, params)]
        return tokens, llm.engine.engine_core.scheduler.num_preemptions
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "engine_args",
    [
        # Chunked prefill: 32-token budget splits the 40- and 64-token prompts
        # and mixes their chunks with other requests' decodes.
        dict(max_num_batched_tokens=32, max_num_seqs=8, block_size=4),
        # A cache too small for all five at once: preemption and recompute.
        dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=4, num_gpu_blocks_override=40, max_model_len=128),
    ],
    ids=["chunked", "preempting"],
)
def test_greedy_matches_transformers(hf_model, engine_args) -> None:
    model, path = hf_model
    prompts = _prompts(model.config.vocab_size)
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    tokens, preemptions = _our_greedy(path, prompts, **engine_args)
    assert tokens == expected
    assert (preemptions > 0) == ("num_gpu_blocks_override" in engine_args)


@pytest.mark.parametrize("max_num_seqs", [1, 2], ids=["alone", "together"])
def test_long_prompts_in_one_chunk_match_transformers(max_num_seqs, tmp_path) -> None:
    """Prompts of more (query, key) pairs than the C kernels once took (512 x 512), each prefilled
    in one chunk: alone (the C step program's chunk) and together (one forward pass over both);
    head_dim 16 takes the whole-chunk kernel, 32 the one-query-at-a-time one."""
    torch.manual_seed(99)
    for arch in ("llama", "qwen3"):
        config = tiny_config(arch)
        config.max_position_embeddings = 1024
        model = getattr(transformers, MODEL_CLASSES[arch])(config).eval().float()
        path = tmp_path / arch
        model.save_pretrained(path)
        write_tokenizer(path)
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (600, 530)]
        expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
        tokens, _ = _our_greedy(str(path), prompts, max_num_batched_tokens=2048, max_num_seqs=max_num_seqs,
                                max_model_len=1024)
        assert tokens == expected, arch
