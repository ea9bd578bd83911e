"""Helpers for tests that run the whole engine against transformers (the oracle)."""

from __future__ import annotations

import torch
import transformers

from app.llm import LLM
from core.models.random_model import MODEL_CONFIG
from core.protocol import SamplingParams


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    common = dict(
        vocab_size=MODEL_CONFIG["vocab_size"] + 3, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_theta=500000.0)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=10000.0)
    if arch == "qwen3":
        return transformers.Qwen3Config(**{**common, "tie_word_embeddings": True}, head_dim=32)
    # Mixtures of experts: 8 experts of 32, 2 a token, renormalized (Qwen3-MoE); Mixtral's 4 of 48.
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=True, head_dim=32)
    if arch == "qwen2_moe":  # 3 of 8 experts, not renormalized, a shared expert; layer 1 dense
        return transformers.Qwen2MoeConfig(**common, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                           num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                                           mlp_only_layers=[1])
    if arch == "mixtral":
        return transformers.MixtralConfig(**{**common, "intermediate_size": 48}, num_local_experts=4,
                                          num_experts_per_tok=2)
    # The windowed families: windows far shorter than the prompts, so they matter.
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=8)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3, "tie_word_embeddings": True}, head_dim=16, sliding_window=8,
            query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        )
    raise ValueError(arch)


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


MAX_NEW = 12
BASE = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=8, max_model_len=128)
CHUNKED = dict(max_num_batched_tokens=32)  # splits every long prompt into chunks


def shared_prefix_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    prefix = rand(44)
    return [
        prefix + rand(5),
        prefix + rand(11),
        prefix[:32],  # exactly 8 blocks: cached whole, its last block is recomputed
        prefix[:20] + rand(7),  # diverges inside block 5
        rand(30),  # unrelated
        prefix + rand(2),
    ]


def greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def generate(path: str, prompts, params=None, passes: int = 1, **engine_args):
    """Results of each pass over the same prompts, and the scheduler afterwards."""
    llm = LLM(path, **{**BASE, **engine_args})
    try:
        results = [llm.generate(prompts, params or greedy()) for _ in range(passes)]
        return results, llm.engine.engine_core.scheduler
    finally:
        llm.shutdown()


def tokens(results) -> list[list[int]]:
    return [r.token_ids for r in results]
