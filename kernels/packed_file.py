"""A checkpoint's packed weights in one file: made once (in C, on every core), memory-mapped after.

Packing a GGUF file's blocks into the kernels' tiles (kernels/quant.py) reads
and writes every byte of the weights: seconds for a 7B model, at every start,
and a private copy as large as the file for as long as the server runs. Here
the tiles are written once into a file under ``settings.cache_dir/packed``,
named by a key of the source's identity (path, size, modification time), the
matrices' shapes and the tile layout's version; later starts map it
read-only, so start-up costs no packing, the pages are the kernel's page cache
(shared by data-parallel engines on one host, dropped and re-read under memory
pressure rather than swapped), and the server's private memory stays small.

The file is written under a temporary name and renamed into place once
complete, under a lock, so that engines starting together pack it once and a
crash leaves no half-written file under the final name. Where the cache's disk
lacks room the matrices are packed into private memory, as before, and the
reason is logged.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import shutil
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kernels import cpu
from kernels.quant import QuantizedMatrix, QuantType, row_bytes
from kernels.settings import settings

log = logging.getLogger(__name__)

# The tile layout's version: part of every key, so a change of kernels/cpu/quant_kernels.c's
# packed format makes new files rather than misreading old ones.
LAYOUT_VERSION = 2  # 2: Q6_K groups of three vectors (six low bits each, the fourth part in their tops)
MAGIC = b"RINGPACK"
_HEADER = struct.Struct("<8sI32sQQH")  # magic, layout version, key, matrices, total bytes, source path length
_ALIGN = 4096  # each matrix starts on a page
_SPARE_BYTES = 1 << 30  # room left on the cache's disk beyond the file itself


@dataclass(frozen=True)
class PackSpec:
    """One matrix to pack: ``blocks`` uint8 [rows, row_bytes(qtype, k)] in GGUF's layout (a view
    of the source), packed row i taken from ``blocks[order[i]]`` (``order`` None: row i)."""

    name: str
    qtype: QuantType
    rows: int
    k: int
    blocks: np.ndarray
    order: np.ndarray | None = None


def _key(identity: str, specs: Sequence[PackSpec]) -> bytes:
    tile_rows = cpu.load().packed_bytes(int(QuantType.F32), 1, 1) // 4  # one F32 column of a tile
    digest = hashlib.sha256(f"{identity}|layout {LAYOUT_VERSION}|tile {tile_rows}".encode())
    for spec in specs:
        digest.update(f"|{spec.name}:{int(spec.qtype)}:{spec.rows}:{spec.k}".encode())
        if spec.order is not None:
            digest.update(np.ascontiguousarray(spec.order, np.int64).tobytes())
    return digest.digest()


def _offsets(specs: Sequence[PackSpec]) -> tuple[list[int], int]:
    lib, offsets, at = cpu.load(), [], _ALIGN  # the header has the first page
    for spec in specs:
        offsets.append(at)
        at += -(-lib.packed_bytes(int(spec.qtype), spec.rows, spec.k) // _ALIGN) * _ALIGN
    return offsets, at


def _header(path: Path) -> tuple[tuple, str] | None:
    """(the header's fields, the source's path) of a packed file; None if it has none."""
    try:
        with open(path, "rb") as f:
            head = f.read(_ALIGN)
    except OSError:
        return None
    if len(head) < _HEADER.size:
        return None
    fields = _HEADER.unpack_from(head)
    if fields[0] != MAGIC:
        return None
    return fields, head[_HEADER.size : _HEADER.size + fields[5]].decode("utf-8", "replace")


def _valid(path: Path, key: bytes, count: int, total: int) -> bool:
    found = _header(path)
    try:
        size = path.stat().st_size
    except OSError:
        return False
    return found is not None and size == total and found[0][1:5] == (LAYOUT_VERSION, key, count, total)


def _write(path: Path, key: bytes, source: str, specs: Sequence[PackSpec], offsets: list[int], total: int,
           threads: int, progress: Callable[[int], None] | None) -> None:
    """Packs every matrix into a new file at ``path`` (written under a temporary name first)."""
    lib = cpu.load()
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(staging, "w+b") as f:
            f.truncate(total)
            out = mmap.mmap(f.fileno(), total)
            base = np.frombuffer(out, np.uint8)
            try:
                for spec, offset in zip(specs, offsets, strict=True):
                    order = None if spec.order is None else np.ascontiguousarray(spec.order, np.int64)
                    lib.pack_matrix(int(spec.qtype), spec.blocks.ctypes.data, spec.rows, spec.k,
                                    None if order is None else order.ctypes.data, base.ctypes.data + offset, threads)
                    if progress is not None:
                        progress(spec.blocks.nbytes)
                name = source.encode()[: _ALIGN - _HEADER.size]
                out[: _HEADER.size + len(name)] = _HEADER.pack(MAGIC, LAYOUT_VERSION, key, len(specs), total,
                                                               len(name)) + name
            finally:
                del base  # the view first: a mapping with views of it cannot close
                out.close()
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def _check_specs(specs: Sequence[PackSpec]) -> None:
    for spec in specs:
        shape = (spec.rows, row_bytes(spec.qtype, spec.k))
        if spec.blocks.dtype != np.uint8 or spec.blocks.shape != shape or not spec.blocks.flags.c_contiguous:
            raise ValueError(f"{spec.name}: {spec.qtype.name} data of shape {spec.blocks.shape}, not {shape}")


def _remove_stale(folder: Path, prefix: str, keep: Path) -> None:
    """Files of an earlier version of the same source (another key) or of a source that is gone,
    and staging files that a killed process left."""
    for old in folder.glob("*.bin"):
        if old == keep:
            continue
        found = _header(old)
        if old.name.startswith(f"{prefix}-") or found is None or not os.path.exists(found[1]):
            old.unlink(missing_ok=True)
            Path(f"{old}.lock").unlink(missing_ok=True)
    for staging in folder.glob(f".{prefix}-*.tmp"):
        pid = staging.name.rsplit(".", 2)[-2]
        if not pid.isdigit() or not os.path.exists(f"/proc/{pid}"):
            staging.unlink(missing_ok=True)


def packed_matrices(specs: Sequence[PackSpec], identity: str, label: str, source: str, threads: int,
                    progress: Callable[[int], None] | None = None) -> dict[str, QuantizedMatrix]:
    """Every spec's matrix, packed: read from the cache file of (``identity``, the specs), made
    first if there is none (``progress`` is told each source matrix's bytes as it is packed);
    in private memory where the cache has no room for the file. ``label`` begins the file's
    name; ``source`` (the source file's path) names the files that a new version replaces."""
    _check_specs(specs)
    key = _key(identity, specs)
    offsets, total = _offsets(specs)
    folder = Path(settings.cache_dir) / "packed"
    prefix = f"{label}-{hashlib.sha256(source.encode()).hexdigest()[:8]}"
    path = folder / f"{prefix}-{key.hex()[:16]}.bin"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / f"{path.name}.lock", "w")
    except OSError as exc:
        log.warning("packed weights in memory: cannot use %s (%s)", folder, exc)
        return _in_memory(specs, progress)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # an engine packing the same file: wait for it, then map its file
        if not _valid(path, key, len(specs), total):
            free = shutil.disk_usage(folder).free
            if free < total + _SPARE_BYTES:
                log.warning("packed weights in memory: %s has %.1f GB free, the packed file needs %.1f GB",
                            folder, free / 1e9, total / 1e9)
                return _in_memory(specs, progress)
            _remove_stale(folder, prefix, path)
            _write(path, key, source, specs, offsets, total, threads, progress)
        elif progress is not None:
            progress(sum(spec.blocks.nbytes for spec in specs))
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), total, access=mmap.ACCESS_READ)
    data = np.frombuffer(mapped, np.uint8)
    lib = cpu.load()
    return {
        spec.name: QuantizedMatrix.from_packed(
            spec.qtype, data[offset : offset + lib.packed_bytes(int(spec.qtype), spec.rows, spec.k)], spec.rows, spec.k)
        for spec, offset in zip(specs, offsets, strict=True)
    }


def _in_memory(specs: Sequence[PackSpec], progress: Callable[[int], None] | None) -> dict[str, QuantizedMatrix]:
    out = {}
    for spec in specs:
        out[spec.name] = QuantizedMatrix(spec.qtype, spec.blocks, spec.rows, spec.k, spec.order)
        if progress is not None:
            progress(spec.blocks.nbytes)
    return out
