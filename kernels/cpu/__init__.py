"""The C kernels of the CPU decode path (cpu_kernels.c), built here and called through ctypes.

On a CPU, a small model's decode step is mostly the fixed cost of each
torch call rather than arithmetic: a fused RMSNorm is several calls, a rotary
embedding four, a gathered attention a dozen. These kernels do each of those
in one call that reads the tensors in place (attention reads the paged KV
cache where it lies, with no gathered copy).

The source is compiled on first use with the machine's C compiler (``cc``,
or ``$CC``) for this very CPU (``-march=native``) into a per-user cache
(``kernels.settings``' cache_dir, ``$RINGLLM_CACHE`` in an engine): about half a second, once. A
cache may be shared by machines of different CPUs (a home directory on NFS,
an image built elsewhere), and a library built for another CPU may use
instructions this one lacks (SIGILL). So the cache is keyed by the source,
the flags and what ``-march=native`` means to the compiler here (the CPU
model and each extension on or off), and a library is used only if the
extensions it was built with (``built_isa``) are all in the CPU's flags:
one that is not is rebuilt. It is built with OpenMP (attention of
large batches is shared among torch's intra-op thread count; the library
binds to the OpenMP runtime torch has loaded, so there is one thread pool),
or serial where the compiler has no OpenMP. Without a compiler ``load()`` returns
None, and with ``settings.cpu_kernels`` off (``RINGLLM_CPU_KERNELS=0``) they are not used: the
callers then use the torch implementations (kernels/torch_ref.py), which
compute the same thing.

Everything here takes float32 CPU tensors; the wrappers check nothing
beyond what the dispatcher in kernels/__init__.py guarantees (a wrong
pointer would crash the process, not raise).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kernels.settings import settings

logger = logging.getLogger("ringllm.kernels")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
# Tried in order: threaded attention, then the same code on one thread.
OPENMP_VARIANTS = (["-fopenmp"], ["-fopenmp-simd"])

# For these head sizes such a chunk is attended at once (paged_prefill_attention,
# specialised for them: vector work along the keys); for others one query at a
# time (from 32 on, a dot product per key is long enough to be efficient).
# bench/README.md has the measurements.
PREFILL_KERNEL_HEAD_DIMS = (8, 16)
VECTOR_LANES = 8  # VLANES in cpu_kernels.c: the prefill kernel pads its keys to a multiple of it

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_P, _I, _I, _I, _I, _P, _P, _I, _F],
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F],
    "rotary": [_P, _I, _I, _I, _I, _P, _P, _P],
    "write_kv": [_P, _I, _P, _I, _I, _I, _P, _P, _P],
    "silu_mul": [_P, _I, _I, _P],
    "paged_decode_attention": [_P, _I, _P, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _P, _F, _P, _I, _P, _I, _I],
    "paged_prefill_attention": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, _F, _P, _I, _P, _P, _I],
}

# The extensions built_isa() reports, bit k for ISA_FLAGS[k], named as /proc/cpuinfo names them.
ISA_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni",
    "avx_vnni", "avx512_bf16", "avx512_fp16",
)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    return Path(settings.cache_dir) / "kernels"


def native_target(compiler: str) -> str:
    """What ``-march=native`` expands to for this compiler on this CPU (the CPU model,
    each extension on or off, cache sizes): the part of the cache key that differs
    between machines. Paths (temporary files) are left out, so it is stable."""
    probe = subprocess.run(
        [compiler, "-march=native", "-###", "-x", "c", "-c", os.devnull, "-o", os.devnull],
        capture_output=True, text=True,
    )
    return " ".join(token for token in probe.stderr.split() if "/" not in token)


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags as the kernel reports them; None where /proc/cpuinfo has none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def missing_extensions(lib: ctypes.CDLL) -> list[str]:
    """The extensions ``lib`` was built to use that this CPU lacks (none where unknown)."""
    flags = cpu_flags()
    if flags is None:
        return []
    try:
        report = lib.built_isa
    except AttributeError:  # not a library of this source
        return ["extensions it does not report"]
    report.argtypes, report.restype = [], ctypes.c_uint64
    built = report()
    return [name for k, name in enumerate(ISA_FLAGS) if built >> k & 1 and name not in flags]


def library_path(compiler: str, flags: list[str], target: str) -> Path:
    """Where the library for this source, compiler, flags and CPU target is cached."""
    key = "\0".join([compiler, *flags, target]).encode()
    digest = hashlib.sha256(SOURCE.read_bytes() + key).hexdigest()[:16]
    return _cache_dir() / f"cpu_kernels-{digest}.so"


def _compile(compiler: str, flags: list[str], target: Path) -> Path:
    """Compile to a private name next to ``target`` (concurrent first starts never load a
    half-written file); returns that name, which the caller renames."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True, text=True)
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def _open(compiler: str, flags: list[str]) -> ctypes.CDLL:
    """The library for these flags: from the cache if it was built for this CPU, else built now."""
    target = library_path(compiler, flags, native_target(compiler))
    if target.exists():
        lib = ctypes.CDLL(str(target))
        missing = missing_extensions(lib)
        if not missing:
            return lib
        logger.warning(
            "the cached CPU kernels %s use %s, which this CPU lacks: rebuilding them", target, ", ".join(missing)
        )
    fresh = _compile(compiler, flags, target)
    try:
        lib = ctypes.CDLL(str(fresh))  # by its fresh name: the loader would hand back a library of the old one
        missing = missing_extensions(lib)
        if missing:
            raise OSError(f"the compiler built CPU kernels that use {', '.join(missing)}, which this CPU lacks")
        os.replace(fresh, target)
    finally:
        if fresh.exists():
            fresh.unlink()
    return lib


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None where it cannot be (or is turned off)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            logger.warning("no C compiler found: the CPU decode path uses torch kernels (slower)")
            return None
        lib = None
        for variant in OPENMP_VARIANTS:
            try:
                lib = _open(compiler, [*FLAGS, *variant])
                break
            except (OSError, subprocess.CalledProcessError) as exc:
                detail = getattr(exc, "stderr", "") or exc
        if lib is None:
            logger.warning("could not build the CPU kernels, using torch kernels instead: %s", detail)
            return None
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = None
        _lib = lib
        return lib


def usable(*tensors: torch.Tensor) -> bool:
    """True if the C kernels are enabled and built and every tensor is a float32 CPU tensor."""
    if not settings.cpu_kernels or (_lib is None and load() is None):
        return False
    for t in tensors:
        if t.dtype is not torch.float32 or t.is_cuda or not t.is_cpu:
            return False
    return True


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
    _lib.add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), residual.numel() // n, n, eps)
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
        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] rows [N, 2n] -> [N, n]."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    _lib.silu_mul(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """out = causal attention of one request's prefill chunk query [n, Hq, D] (the last n of
    its first ``seq_len`` positions) over the blocks in ``table`` (int32), read in place."""
    n, heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    threads = torch.get_num_threads()
    stride = -(-seq_len // VECTOR_LANES) * VECTOR_LANES  # the kernel's padded key count
    kv_scratch = torch.empty(2 * kv_heads * head_dim * stride, dtype=torch.float32)
    scores = torch.empty(threads * stride, dtype=torch.float32)
    _lib.paged_prefill_attention(
        query.data_ptr(), query.stride(0), n, heads, kv_heads, head_dim, k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.shape[1], table.data_ptr(), seq_len, scale, out.data_ptr(), out.stride(0), kv_scratch.data_ptr(),
        scores.data_ptr(), threads,
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
) -> None:
    """out[rows[d]] = attention of query[rows[d]] [Hq, D] over the first seq_lens[d] tokens of the
    blocks in block_tables[tables[d]] (int32), read in place from the caches."""
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = k_cache.shape[2]
    threads = torch.get_num_threads()
    scratch = torch.empty(threads * heads * max_len, dtype=torch.float32)
    _lib.paged_decode_attention(
        query.data_ptr(), query.stride(0), rows.data_ptr(), rows.shape[0], heads, kv_heads, head_dim,
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], block_tables.data_ptr(), block_tables.stride(0),
        tables.data_ptr(), seq_lens.data_ptr(), scale, out.data_ptr(), out.stride(0), scratch.data_ptr(),
        heads * max_len, threads,
    )
