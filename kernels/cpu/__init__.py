"""The C kernels of the CPU decode path (cpu_kernels.c), built here and called through ctypes.

On a CPU, a small model's decode step is mostly the fixed cost of each
torch call rather than arithmetic: a fused RMSNorm is several calls, a rotary
embedding four, a gathered attention a dozen. These kernels do each of those
in one call that reads the tensors in place (attention reads the paged KV
cache where it lies, with no gathered copy).

The source is built on first use for this CPU and cached (kernels/cpu/library.py),
with OpenMP (attention of large batches is shared among torch's intra-op
thread count; the library binds to the OpenMP runtime torch has loaded, so
there is one thread pool), or serial where the compiler has no OpenMP.
Without a compiler ``load()`` returns None, and with ``settings.cpu_kernels``
off (``RINGLLM_CPU_KERNELS=0``) they are not used: the callers then use the
torch implementations (kernels/torch_ref.py), which compute the same thing.

Everything here takes float32 CPU tensors (KV caches: float32, float16 or q8_0);
the wrappers check nothing beyond what the dispatcher in kernels/__init__.py
guarantees (a wrong pointer would crash the process, not raise).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu.library import NativeLibrary, cpu_flags
from kernels.kv_format import KVFormat, head_dim_of
from kernels.settings import KernelSettings, on_change, settings

SOURCE = Path(__file__).with_name("cpu_kernels.c")
QUANT_SOURCE = Path(__file__).with_name("quant_kernels.c")  # products with GGUF block-format weights
PROGRAM_SOURCE = Path(__file__).with_name("step_program.c")  # a whole step in one call
MOE_SOURCE = Path(__file__).with_name("moe_kernels.c")  # a mixture of experts' experts
ISA_SOURCE = Path(__file__).with_name("built_isa.c")  # what the build may execute (the cache's check)
HEADERS = [Path(__file__).with_name("cpu_common.h")]
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-fvisibility=hidden"]
# Tried in order: threaded attention, then the same code on one thread.
OPENMP_VARIANTS = (["-fopenmp"], ["-fopenmp-simd"])
LIBRARY = NativeLibrary(
    "cpu_kernels", [SOURCE, QUANT_SOURCE, PROGRAM_SOURCE, MOE_SOURCE, ISA_SOURCE], FLAGS, OPENMP_VARIANTS, HEADERS
)

# For these head sizes such a chunk is attended at once (paged_prefill_attention,
# specialised for them: vector work along the keys); for others one query at a
# time (from 32 on, a dot product per key is long enough to be efficient).
# bench/README.md has the measurements.
PREFILL_KERNEL_HEAD_DIMS = (8, 16)

_lib: ctypes.CDLL | None = None


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None where it cannot be."""
    global _lib
    if _lib is None:
        _lib = LIBRARY.load()
        if _lib is not None:
            _apply_settings(settings)
            on_change(_apply_settings)
    return _lib


def lone_row_prefetch(flags: set[str] | None) -> bool:
    """Whether a lone row's quantized products prefetch their weights by software on a CPU of these
    flags. Measured on two cores (bench/README.md): a Zen 3 without AVX-512 streamed a lone row's
    Q4_K and Q6_K tiles faster with it, a Zen 4 with AVX-512 faster without it, whose hardware
    prefetcher keeps up on its own, in both its AVX-512 and AVX2 builds. AVX-512 stands for
    such a core."""
    return flags is None or "avx512f" not in flags


def _apply_settings(current: KernelSettings) -> None:
    """Hand the library the settings it holds rather than takes with each call."""
    chosen = current.lone_row_prefetch
    assert _lib is not None
    _lib.set_lone_row_prefetch(lone_row_prefetch(cpu_flags()) if chosen is None else chosen)


def padded_keys(n: int) -> int:
    """The prefill kernel's key count for a context of ``n``: its scratch is sized by it."""
    return _lib.padded_keys(n)


def prefill_scratch(seq_len: int, kv_heads: int, head_dim: int, threads: int) -> tuple[int, int]:
    """Floats of paged_prefill_attention's two scratch areas for a context of ``seq_len``:
    the transposed keys and values, and every thread's scores."""
    stride = padded_keys(seq_len)
    return 2 * kv_heads * head_dim * stride, threads * stride


# The largest head size the C kernels take (their per-row buffers live on the stack; MAX_HEAD_DIM in C).
MAX_HEAD_DIM = 1024


def usable(*tensors: torch.Tensor, cache: torch.Tensor | None = None) -> bool:
    """True if the C kernels are enabled and built, every tensor is a float32 CPU tensor,
    and ``cache`` (a KV cache, when given) a float32, float16 or q8_0 one (kernels/kv_format.py)
    of heads of at most MAX_HEAD_DIM."""
    if not settings.cpu_kernels or (_lib is None and load() is None):
        return False
    for t in tensors:
        if t.dtype is not torch.float32 or t.is_cuda or not t.is_cpu:
            return False
    return cache is None or (
        cache.dtype in (torch.float32, torch.float16, torch.uint8) and cache.is_cpu
        and head_dim_of(cache) <= MAX_HEAD_DIM
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [N, n] or [N, H, n] (the last dimension
    contiguous, the others at any stride, e.g. the heads of a fused qkv row)."""
    n = x.shape[-1]
    outer, inner = x.shape[0], (x.shape[1] if x.dim() == 3 else 1)
    inner_stride = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=x.dtype)
    _lib.rms_norm(x.data_ptr(), outer, x.stride(0), inner, inner_stride, weight.data_ptr(), out.data_ptr(), n, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); ``residual`` is updated in place."""
    n = x.shape[-1]
    out = torch.empty_like(residual)
    _lib.add_rms_norm(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), residual.numel() // n, n, eps
    )
    return out, residual


def rotary(
    qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor
) -> None:
    """Rotate the first ``heads`` heads of every token row of qkv [T, H, D] in place."""
    tokens, _, head_dim = qkv.shape
    _lib.rotary(
        qkv.data_ptr(), tokens, qkv.stride(0), heads, head_dim, cos.data_ptr(), sin_signed.data_ptr(),
        positions.data_ptr(),
    )


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store key/value [T, Hkv, D] (each token's heads contiguous) at their int64 slots; -1 skips."""
    tokens, kv_heads, head_dim = key.shape
    _lib.write_kv(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), tokens, kv_heads * head_dim,
        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), KVFormat.of(k_cache),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _gated(_lib.silu_mul, gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _gated(_lib.gelu_tanh_mul, gate_up)


def _gated(kernel: object, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for gate_up rows [gate | up], by ``kernel`` (contiguous rows)."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), rows, width // 2, out.data_ptr())  # type: ignore[operator]
    return out


def scale_rows(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x *= factor, in place (x contiguous [N, n])."""
    _lib.scale_rows(x.data_ptr(), x.shape[0], x.shape[1], factor)
    return x


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
) -> None:
    """out = causal attention of one request's prefill chunk query [n, Hq, D] (the last n of
    its first ``seq_len`` positions) over the blocks in ``table`` (int32), read in place; with
    a sliding ``window`` > 0 each query sees only the last ``window`` positions up to its own."""
    n, heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    threads = torch.get_num_threads()
    kv_floats, score_floats = prefill_scratch(seq_len, kv_heads, head_dim, threads)
    kv_scratch = torch.empty(kv_floats, dtype=torch.float32)
    scores = torch.empty(score_floats, dtype=torch.float32)
    _lib.paged_prefill_attention(
        query.data_ptr(), query.stride(0), n, heads, kv_heads, head_dim, k_cache.data_ptr(), v_cache.data_ptr(),
        KVFormat.of(k_cache), k_cache.shape[1], table.data_ptr(), seq_len, window, scale, out.data_ptr(), out.stride(0),
        kv_scratch.data_ptr(), scores.data_ptr(), threads,
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
) -> None:
    """out[rows[d]] = attention of query[rows[d]] [Hq, D] over the first seq_lens[d] tokens of the
    blocks in block_tables[tables[d]] (int32), read in place from the caches (the last ``window``
    of them with a sliding window > 0)."""
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = k_cache.shape[2]
    threads = torch.get_num_threads()
    scratch = torch.empty(threads * heads * max_len, dtype=torch.float32)
    _lib.paged_decode_attention(
        query.data_ptr(), query.stride(0), rows.data_ptr(), rows.shape[0], heads, kv_heads, head_dim,
        k_cache.data_ptr(), v_cache.data_ptr(), KVFormat.of(k_cache), k_cache.shape[1], block_tables.data_ptr(),
        block_tables.stride(0),
        tables.data_ptr(), seq_lens.data_ptr(), window, scale, out.data_ptr(), out.stride(0), scratch.data_ptr(),
        heads * max_len, threads,
    )
