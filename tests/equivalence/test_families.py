"""The families added as recipes, against transformers (the oracle), float32.

Mistral with its sliding window (every layer sees the last 8 positions) and Gemma 3's
text decoder (interleaved local and global layers with their own ropes, GeGLU, four
norms a layer scaling by 1 + w, a scaled embedding, query_pre_attn_scalar). The
windows are far shorter than the prompts, so a window applied wrongly (or not at
all) changes the tokens: ``test_the_window_changes_the_oracles_tokens`` shows the
tests would see it. Through the engine: chunked prefill mixed with decodes, prefix
caching hits, preemption, and n-gram speculation with its rollbacks; blocks out of a
window are freed as requests advance (Mistral's in every layer; Gemma 3's local layers
keep a block table, and a smaller pool, of their own: core/kv/kv_groups.py).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from app.llm import LLM
from core.config import EngineArgs, SpeculativeConfig
from core.models.loader import load_model
from core.models.random_model import write_tokenizer
from core.protocol import SamplingParams
from tests.support.engines import hf_greedy, tiny_config
from tests.support.paged import assert_matches_transformers

FAMILIES = {"mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# A tight KV cache: the least each family starts with at max_model_len 64 (a Gemma 3 block holds
# one layer, its global and two local groups drawing from one pool), ~64 tokens a layer.
TIGHT_BLOCKS = {"mistral": 17, "gemma3": 49}
MAX_NEW = 12


def _randomize(model: torch.nn.Module) -> None:
    """Norm weights away from their initial values, so that a norm read with the wrong
    offset (Gemma's 1 + w) or left out cannot pass unnoticed."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    torch.manual_seed(1234)
    hf = getattr(transformers, FAMILIES[request.param])(tiny_config(request.param)).eval().float()
    _randomize(hf)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    write_tokenizer(path)
    return request.param, hf, str(path)


def _prompts(vocab: int, lengths=(3, 17, 40, 9, 30)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _shared_prefix_prompts(vocab: int) -> list[list[int]]:
    """Prompts sharing a 24-token prefix (six 4-token blocks, three windows' worth)."""
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(3, vocab, (24,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 5, 11)]


def test_logits_and_paged_greedy_match_transformers(family) -> None:
    _, hf, path = family
    ours = load_model(EngineArgs(model=path).resolve(), "cpu", torch.float32)
    vocab = hf.config.vocab_size
    harness = assert_matches_transformers(hf, ours, _prompts(vocab, (29,))[0], _prompts(vocab), MAX_NEW)
    assert harness.mixed_steps > 0


def test_the_window_changes_the_oracles_tokens(family) -> None:
    """Without its window (or with every layer global) the oracle writes other tokens: the
    equalities here and below hold only if our windows are the oracle's."""
    _, hf, _ = family
    config = hf.config.to_dict()
    if "layer_types" in config:  # Gemma 3: every layer global
        config["layer_types"] = ["full_attention"] * len(config["layer_types"])
    else:
        config["sliding_window"] = None
    unwindowed = type(hf)(type(hf.config)(**{k: v for k, v in config.items() if k != "transformers_version"}))
    unwindowed.load_state_dict(hf.state_dict())
    prompts = _prompts(hf.config.vocab_size)
    assert [hf_greedy(unwindowed.eval(), p, MAX_NEW) for p in prompts] != [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def _engine_greedy(path: str, prompts: list[list[int]], **args) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, **{"dtype": "float32", "device": "cpu", "block_size": 4, "max_num_seqs": 8, **args})
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in llm.generate(prompts, params)], llm


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_batched_tokens=16),  # chunks mixed with decodes
        dict(max_num_batched_tokens=64, num_gpu_blocks_override="tight", max_model_len=64),  # preemption
        dict(speculative_config=SpeculativeConfig(
            method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
        )),
    ],
    ids=["chunked", "preempting", "ngram-speculation"],
)
def test_engine_greedy_matches_transformers(family, engine_args) -> None:
    name, hf, path = family
    if engine_args.get("num_gpu_blocks_override") == "tight":
        engine_args = {**engine_args, "num_gpu_blocks_override": TIGHT_BLOCKS[name]}
    prompts = _prompts(hf.config.vocab_size) + [[5, 6, 7, 8] * 6]  # a repeating one: drafts get accepted
    tokens, llm = _engine_greedy(path, prompts, **engine_args)
    try:
        assert tokens == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
        core = llm.engine.engine_core
        if "num_gpu_blocks_override" in engine_args:
            # ~64 tokens a layer of the ~190 the six requests reach: Gemma 3's global layer keeps
            # every block, so requests are preempted; Mistral frees what is out of its window as
            # it goes, and fits.
            assert (core.scheduler.num_preemptions > 0) == (name == "gemma3")
        if "speculative_config" in engine_args:  # drafts were verified (and the rejected ones rolled back)
            assert core.scheduler.spec_stats.num_drafts > 0
    finally:
        llm.shutdown()


def test_prefix_cache_hits_keep_windowed_attention_exact(family) -> None:
    """Later prompts reuse the cached blocks of the first one's prefix (their K/V written
    by windowed and global layers alike) and still equal the oracle."""
    _, hf, path = family
    prompts = _shared_prefix_prompts(hf.config.vocab_size)
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=8)
    try:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        first = llm.generate(prompts[:1], params)[0]
        rest = llm.generate(prompts[1:], params)
        assert all(r.num_cached_tokens >= 24 for r in rest)
        assert [first.token_ids, *(r.token_ids for r in rest)] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    finally:
        llm.shutdown()


def test_local_layers_keep_only_their_window(family) -> None:
    """Blocks leave a window's group as its requests advance, for the other groups to use: a
    31-block pool (one block a layer: Gemma's groups are one layer each here) runs a 52-token
    request, whose 13 blocks in the global layer and 13 in each local one would need 39
    without that, and its tokens still equal the oracle's. Two requests at a time share it,
    preempting when it runs short. (Mistral: every layer windowed, one group.)"""
    name, hf, path = family
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layer_block_bytes = 2 * 4 * cfg.num_key_value_heads * head_dim * 4  # K and V, 4 tokens, float32
    layers_a_block = 1 if name == "gemma3" else cfg.num_hidden_layers
    prompts = _prompts(cfg.vocab_size, (40, 30, 17))
    tokens, llm = _engine_greedy(
        path, prompts, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, kv_cache_dtype="float32",
        kv_cache_memory=31 * layers_a_block * layer_block_bytes,
    )
    try:
        core = llm.engine.engine_core
        assert core.num_gpu_blocks == 31
        assert core.model_executor.runner.kv_groups.windows == ((0, 8, 8) if name == "gemma3" else (8,))
        assert tokens == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    finally:
        llm.shutdown()
