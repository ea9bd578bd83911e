"""Paged attention cases checked against dense attention in float64."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from kernels import torch_ref
from kernels.kv_format import from_storage, to_storage
from kernels.metadata import AttentionMetadata


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] as the last n positions of a context k/v [s, Hkv, D], in float64."""
    n, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(s - n, s)[:, None]
    scores = scores.masked_fill(torch.arange(s)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(
    query_lens, context_lens, kv_heads, group, head_dim, block_size, seed=0, attention=torch_ref.paged_attention,
    cache_dtype=torch.float32,
) -> torch.Tensor:
    """Checks ``attention`` on one batch against dense float64 attention; returns its output.
    With a float16 or q8_0 (uint8) ``cache_dtype`` the dense reference takes the keys and values
    as the cache holds them (rounded to float16, or quantized: kernels/kv_format.py)."""
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    seq_lens = [c + q for q, c in zip(query_lens, context_lens)]
    blocks_needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: table padding
    tables = torch.zeros(len(seq_lens), max(blocks_needed), dtype=torch.int32)
    # Unwritten slots (and block 0, which pads the tables) hold a large finite
    # value: reading one would visibly skew the result.
    unwritten = to_storage(torch.full((head_dim,), 1e3), cache_dtype)
    k_cache = unwritten.expand(num_blocks, block_size, kv_heads, -1).clone()
    v_cache = k_cache.clone()
    keys, values, slots = [], [], []
    for r, s in enumerate(seq_lens):
        ids = [order.pop() for _ in range(blocks_needed[r])]
        tables[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        keys.append(torch.randn(s, kv_heads, head_dim, generator=gen))
        values.append(torch.randn(s, kv_heads, head_dim, generator=gen))
        pos = torch.arange(s)
        slots.append(tables[r, pos // block_size].long() * block_size + pos % block_size)
    torch_ref.write_kv_cache(torch.cat(keys), torch.cat(values), k_cache, v_cache, torch.cat(slots))

    query = torch.randn(sum(query_lens), heads, head_dim, generator=gen)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    scale = head_dim**-0.5
    out = attention(query, k_cache, v_cache, meta, scale)
    for r in range(len(seq_lens)):
        stored_keys, stored_values = (
            from_storage(to_storage(t, cache_dtype), torch.float32) for t in (keys[r], values[r])
        )
        expected = dense_attention(query[qsl[r] : qsl[r + 1]], stored_keys, stored_values, scale)
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]].double(), expected, atol=1e-5, rtol=1e-5)
    return out


# Random batches for ``run_case``: (query length, context) per request, a query length of
# 1 (a decode) half the time so that batches of decodes are common.
RANDOM_BATCHES = dict(
    reqs=st.lists(st.tuples(st.one_of(st.just(1), st.integers(1, 12)), st.integers(0, 40)), min_size=1, max_size=6),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    block_size=st.sampled_from([1, 2, 4, 16]),
    seed=st.integers(0, 2**16),
)
