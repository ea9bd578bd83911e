"""The C kernels of the CPU decode path (kernels/cpu) against the torch reference.

Rotary and the KV write must be bitwise equal (the same arithmetic, no
fused multiply-adds); norms, silu and attention agree to float32 rounding.
Paged decode attention is also checked against dense float64 attention
through the dispatcher, over random mixes of decodes and prefill chunks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import kernels
from kernels import cpu, torch_ref
from kernels.settings import settings as kernel_settings
from tests.support.attention import RANDOM_BATCHES, run_case

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler to build kernels/cpu with")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,n", [(1, 64), (5, 768), (3, 1)])
def test_rms_norm_and_fused_residual_add(rows: int, n: int) -> None:
    g = _gen(rows)
    x, w, residual = torch.randn(rows, n, generator=g), torch.randn(n, generator=g), torch.randn(rows, n, generator=g)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), torch_ref.rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)
    ours_residual, ref_residual = residual.clone(), residual.clone()
    ours, ours_sum = cpu.add_rms_norm(x, ours_residual, w, 1e-5)
    ref, ref_sum = torch_ref.add_rms_norm(x, ref_residual, w, 1e-5)
    assert torch.equal(ours_sum, ref_sum) and ours_sum.data_ptr() == ours_residual.data_ptr()  # in place
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_rms_norm_over_the_heads_of_a_fused_row() -> None:
    """Per-head norms (Qwen3's q/k norm) read heads in place from a strided qkv view."""
    qkv = torch.randn(4, 12, 16, generator=_gen())
    heads = qkv[:, 2:9]
    w = torch.randn(16, generator=_gen(1))
    torch.testing.assert_close(cpu.rms_norm(heads, w, 1e-6), torch_ref.rms_norm(heads, w, 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rotary_is_bitwise_the_reference(head_dim: int) -> None:
    g = _gen(head_dim)
    positions = torch.tensor([0, 7, 300, 5], dtype=torch.int64)
    cos, sin = torch.randn(512, head_dim, generator=g), torch.randn(512, head_dim, generator=g)
    qkv = torch.randn(4, 7, head_dim, generator=g)
    ours, ref = qkv.clone(), qkv.clone()
    cpu.rotary(ours, 5, cos, sin, positions)
    torch_ref.rotary(ref, 5, cos, sin, positions)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[:, 5:], qkv[:, 5:])  # the value heads are left alone


def test_write_kv_skips_padding_slots_and_copies_exactly() -> None:
    qkv = torch.randn(3, 6, 8, generator=_gen())
    key, value = qkv[:, 2:4], qkv[:, 4:6]  # strided slices of a fused projection
    caches = [torch.zeros(4, 4, 2, 8) for _ in range(4)]
    slots = torch.tensor([9, -1, 2])
    cpu.write_kv(key, value, caches[0], caches[1], slots)
    torch_ref.write_kv_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


# Enough decodes (and work) that the C kernel shares them among threads, with a
# short prefill chunk among them.
_LARGE_BATCH = ([1] * 24 + [12], [100 + 7 * i for i in range(24)] + [30], 4, 3, 64, 16)


def test_write_kv_to_float16_caches_rounds_as_torch_does() -> None:
    qkv = torch.randn(3, 6, 8, generator=_gen()) * 100
    key, value = qkv[:, 2:4], qkv[:, 4:6]
    caches = [torch.zeros(4, 4, 2, 8, dtype=torch.float16) for _ in range(4)]
    slots = torch.tensor([9, -1, 2])
    cpu.write_kv(key, value, caches[0], caches[1], slots)
    torch_ref.write_kv_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("case", [
    pytest.param(([1, 1, 1, 1], [4, 17, 0, 9], 2, 4, 16, 4), id="batched-decodes-gqa"),
    pytest.param(_LARGE_BATCH, id="batch-large-enough-for-threads"),
    pytest.param(([40, 1, 17], [0, 9, 30], 2, 2, 8, 16), id="prefill-chunks-head-dim-8"),
    pytest.param(([130], [0], 4, 2, 64, 16), id="prefill-chunk-head-dim-64"),
])
def test_attention_over_float16_caches(case) -> None:
    """float16 KV caches (``--kv-cache-dtype float16``): the C kernels widen each key and value
    as they read it, and agree with dense float64 attention over the rounded keys and values,
    and with the torch reference reading the same caches."""
    ours = run_case(*case, attention=kernels.paged_attention, cache_dtype=torch.float16)
    reference = run_case(*case, attention=torch_ref.paged_attention, cache_dtype=torch.float16)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_silu_mul() -> None:
    gate_up = torch.randn(5, 2 * 96, generator=_gen()) * 4
    torch.testing.assert_close(cpu.silu_mul(gate_up), torch_ref.silu_mul(gate_up), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "query_lens,context_lens,kv_heads,group,head_dim,block_size",
    [
        pytest.param([1, 1, 1, 1], [4, 17, 0, 9], 2, 4, 16, 4, id="batched-decodes-gqa"),
        pytest.param([1], [300], 4, 3, 64, 16, id="long-decode-llama-shape"),
        pytest.param([9, 1, 20, 1, 3], [0, 12, 7, 33, 5], 2, 3, 16, 4, id="decodes-between-prefill-chunks"),
        pytest.param([1, 1], [0, 10], 1, 8, 128, 1, id="mqa-block-size-one"),
        pytest.param(*_LARGE_BATCH, id="batch-large-enough-for-threads"),
        # Prefill chunks with and without a cached prefix on both sides of the
        # head size where whole chunks give way to one query at a time.
        pytest.param([40, 1, 17], [0, 9, 30], 2, 2, 8, 16, id="prefill-chunks-head-dim-8"),
        pytest.param([40, 1, 17], [0, 9, 30], 2, 2, 32, 16, id="prefill-chunks-head-dim-32"),
        pytest.param([130], [0], 4, 2, 8, 16, id="prefill-chunk-large-enough-for-threads"),
        # A chunk of more (query, key) pairs than the C kernels took before (512 x 512), beside a decode.
        pytest.param([600, 1], [700, 45], 2, 3, 64, 16, id="long-chunk-beside-a-decode"),
        # Tiles that end at every count of keys (blocks of 13: groups of eight, four and single keys).
        pytest.param([1, 1, 1], [12, 25, 38], 2, 4, 128, 13, id="decode-tiles-of-every-remainder"),
        pytest.param([1, 5], [30, 7], 2, 2, 12, 4, id="head-dim-not-whole-vectors"),
    ],
)
def test_paged_decode_attention_matches_dense(query_lens, context_lens, kv_heads, group, head_dim, block_size):
    run_case(query_lens, context_lens, kv_heads, group, head_dim, block_size, attention=kernels.paged_attention)


@pytest.mark.parametrize("case", [_LARGE_BATCH, ([130], [0], 4, 2, 8, 16)], ids=["decodes", "prefill-chunk"])
def test_threaded_attention_is_bitwise_the_single_thread_result(case) -> None:
    """Threads split a large batch by decode (or a chunk by query), each computed exactly as on one thread."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run_case(*case, attention=kernels.paged_attention)
        torch.set_num_threads(max(2, threads))
        shared = run_case(*case, attention=kernels.paged_attention)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, shared)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_a_decode_has_the_same_bits_alone_and_in_any_batch(cache_dtype) -> None:
    """The kernel deals each decode's KV heads to the threads in ranges that depend on the batch's
    size (one range a thread for a lone decode, whole decodes in a large batch): every query head's
    arithmetic must not depend on that, on one thread or several."""
    kv_heads, group, head_dim, block_size, length = 8, 3, 128, 16, 75
    gen = _gen(3)
    blocks = 8 * ((length + block_size - 1) // block_size)
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(8, -1)
    query = torch.randn(8, kv_heads * group, head_dim, generator=gen)

    def attend(decodes: int) -> torch.Tensor:  # decodes 0 .. decodes-1, decode 0 the one compared
        out = torch.zeros_like(query)
        rows = torch.arange(decodes, dtype=torch.int64)
        seq_lens = torch.full((decodes,), length, dtype=torch.int64)
        cpu.paged_decode_attention(query, k_cache, v_cache, tables, rows, rows.clone(), seq_lens, length,
                                   head_dim**-0.5, out)
        return out[0]

    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            outputs += [attend(decodes) for decodes in (1, 2, 3, 8)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


@settings(max_examples=25, deadline=None)
@given(**RANDOM_BATCHES)
def test_paged_attention_through_the_dispatcher_random_batches(reqs, kv_heads, group, block_size, seed):
    run_case(
        [q for q, _ in reqs], [c for _, c in reqs], kv_heads, group, 8, block_size, seed,
        attention=kernels.paged_attention,
    )


def test_dispatch_picks_c_for_float32_cpu_and_torch_otherwise(monkeypatch) -> None:
    calls: list[str] = []
    for name in ("rms_norm", "silu_mul"):
        for module in (cpu, torch_ref):
            fn = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _fn=fn, _tag=f"{module.__name__}.{name}", **k: (
                calls.append(_tag), _fn(*a, **k))[1])
    x32, x64 = torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float64)
    kernels.rms_norm(x32, torch.ones(8), 1e-5)
    kernels.rms_norm(x64, torch.ones(8, dtype=torch.float64), 1e-5)
    kernels.silu_mul(x32)
    monkeypatch.setattr(kernel_settings, "cpu_kernels", False)
    kernels.silu_mul(x32)
    assert calls == [
        "kernels.cpu.rms_norm", "kernels.torch_ref.rms_norm", "kernels.cpu.silu_mul", "kernels.torch_ref.silu_mul",
    ]
