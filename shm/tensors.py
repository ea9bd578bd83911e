"""The out-of-band tensor tier: bytes that bypass the message rings.

CPU tensors go through a ``TensorPool``: one shared segment per direction,
written by exactly one producer and read by exactly one consumer. The
producer copies a tensor's bytes into a free region and sends only
``(offset, nbytes)`` in the message; the consumer maps the same bytes as a
tensor without copying and hands the region back when that tensor is
garbage collected. Nothing travels back over the rings: every region starts
with a one-word state that the producer sets to IN_USE and the consumer to
RELEASED (each word has one writer at a time, so plain aligned 8-byte stores
suffice, as in ``shm.ring``). The producer allocates like a ring buffer and
reclaims regions oldest first, so the pool is bounded and a consumer that
holds a region long only delays reuse; when no room is left ``put`` returns
None and the caller falls back to an aux frame.

Region layout (64-byte aligned, so tensors are cache-line and SIMD aligned)::

    [u64 state | u64 nbytes | padding to 64 | nbytes of data | padding to 64]

CUDA tensors cross as CUDA IPC handles instead (``shm.cuda_ipc``); each
one holds a *ticket*, a data-less region of the same pool whose state tells
the producer when the consumer is done with the tensor.
"""

from __future__ import annotations

import mmap
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from shm.ring import WEAK_MEMORY, fence
from shm.segment import NAME_PREFIX, attach_segment, create_segment, unlink_segment

_MAGIC = 0x52494E474C504F4C  # "RINGLPOL"
_HEADER = 64  # segment header: magic, capacity
_ALIGN = 64
_IN_USE = 1
_RELEASED = 2
POOL_NAME_PREFIX = NAME_PREFIX + "pool-"


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


@dataclass(frozen=True)
class PoolHandle:
    """Where a tensor's bytes are in the pool; what crosses the ring."""

    offset: int  # of the region, relative to the arena
    nbytes: int


class TensorPool:
    """One shared segment; ``create`` on the frontend, ``attach`` on the engine."""

    def __init__(self, name: str, mm: mmap.mmap, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self._mm = mm
        self._words = memoryview(mm).cast("Q")  # u64 view of the whole segment
        self.closed = False

    @classmethod
    def create(cls, capacity: int) -> TensorPool:
        """A new segment (mode 0600, random name). Pages are only backed once written."""
        capacity = _align(max(capacity, 4 * _ALIGN))
        name, mm = create_segment(POOL_NAME_PREFIX, _HEADER, capacity, _MAGIC)
        return cls(name, mm, capacity)

    @classmethod
    def attach(cls, name: str) -> TensorPool:
        mm, capacity = attach_segment(name, POOL_NAME_PREFIX, _HEADER, _MAGIC, "tensor pool")
        return cls(name, mm, capacity)

    def unlink(self) -> None:
        unlink_segment(self.name)

    def close(self) -> None:
        """Unmap. Tensors still viewing the pool keep their mapping alive (numpy holds it)."""
        if self.closed:
            return
        self.closed = True
        self._words.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # zero-copy tensors still reference it; the OS unmaps at exit

    def _state_index(self, offset: int) -> int:
        return (_HEADER + offset) // 8

    def _data_start(self, offset: int) -> int:
        return _HEADER + offset + _ALIGN


class TensorPoolWriter:
    """Producer side: copy bytes in, get a handle; reclaims released regions oldest first."""

    def __init__(self, pool: TensorPool) -> None:
        self.pool = pool
        self._head = 0  # bytes reclaimed so far (monotonic)
        self._tail = 0  # bytes allocated so far (monotonic)
        # Outstanding regions in allocation order: (offset, bytes it occupies incl. skipped tail).
        self._regions: deque[tuple[int, int]] = deque()
        self.fallbacks = 0  # times put() found no room
        self.bytes_written = 0  # tensor bytes sent out of band so far

    def _reclaim(self) -> None:
        words = self.pool._words
        regions = self._regions
        while regions:
            offset, size = regions[0]
            if offset >= 0 and words[self.pool._state_index(offset)] != _RELEASED:
                break
            regions.popleft()
            self._head += size
        if WEAK_MEMORY:
            fence()

    def _allocate(self, payload: int) -> int | None:
        """Offset of a free region for ``payload`` bytes, or None."""
        need = _ALIGN + _align(payload)
        cap = self.pool.capacity
        if need > cap:
            return None
        self._reclaim()
        pos = self._tail % cap
        skip = cap - pos if pos + need > cap else 0
        if self._tail + skip + need - self._head > cap:
            return None
        if skip:
            self._regions.append((-1, skip))  # the unusable end of the arena
            self._tail += skip
            pos = 0
        self._regions.append((pos, need))
        self._tail += need
        return pos

    def put(self, data: Any) -> PoolHandle | None:
        """Copy a C-contiguous buffer into the pool; None when the pool is full."""
        view = memoryview(data).cast("B")
        offset = self._allocate(view.nbytes)
        if offset is None:
            self.fallbacks += 1
            return None
        pool = self.pool
        start = pool._data_start(offset)
        pool._mm[start : start + view.nbytes] = view
        index = pool._state_index(offset)
        pool._words[index + 1] = view.nbytes
        if WEAK_MEMORY:
            fence()
        pool._words[index] = _IN_USE  # published to the consumer by the message that follows
        self.bytes_written += view.nbytes
        return PoolHandle(offset, view.nbytes)

    def take_ticket(self) -> int | None:
        """A data-less region whose state tells when the consumer is done (CUDA IPC)."""
        offset = self._allocate(0)
        if offset is not None:
            index = self.pool._state_index(offset)
            self.pool._words[index + 1] = 0
            if WEAK_MEMORY:
                fence()
            self.pool._words[index] = _IN_USE
        return offset

    def cancel_ticket(self, offset: int) -> None:
        """Reclaim a ticket that was never sent (its consumer will never release it)."""
        self.pool._words[self.pool._state_index(offset)] = _RELEASED

    def is_released(self, offset: int) -> bool:
        return self.pool._words[self.pool._state_index(offset)] == _RELEASED

    @property
    def bytes_in_use(self) -> int:
        return self._tail - self._head


class TensorPoolReader:
    """Consumer side: turn handles into arrays that view the pool, released when collected."""

    def __init__(self, pool: TensorPool) -> None:
        self.pool = pool

    def _check(self, handle: PoolHandle) -> int:
        pool = self.pool
        offset, nbytes = handle.offset, handle.nbytes
        if (
            offset < 0
            or offset % _ALIGN
            or nbytes < 0
            or offset + _ALIGN + nbytes > pool.capacity
        ):
            raise ValueError(f"pool handle {handle} is out of bounds")
        index = pool._state_index(offset)
        if pool._words[index] != _IN_USE or pool._words[index + 1] != nbytes:
            raise ValueError(f"pool handle {handle} does not match a region in use")
        return index

    def get(self, handle: PoolHandle) -> np.ndarray:
        """A writable uint8 array over the region (zero-copy); the region is released
        once the array and everything made from it (torch.from_numpy included) is gone."""
        index = self._check(handle)
        if WEAK_MEMORY:
            fence()
        start = self.pool._data_start(handle.offset)
        array = np.frombuffer(self.pool._mm, dtype=np.uint8, count=handle.nbytes, offset=start)
        weakref.finalize(array, self._release_index, index)
        return array

    def check_ticket(self, offset: int) -> None:
        """ValueError unless ``offset`` names a ticket in use (it came off the wire)."""
        if type(offset) is not int:
            raise ValueError(f"CUDA IPC ticket {offset!r} is not an offset")
        self._check(PoolHandle(offset, 0))

    def release_ticket(self, offset: int) -> None:
        """Tell the producer the consumer is done with a ticket's tensor (see check_ticket)."""
        self._release_index(self.pool._state_index(offset))

    def _release_index(self, index: int) -> None:
        if self.pool.closed:  # nobody left to hand it back to
            return
        if WEAK_MEMORY:
            fence()
        self.pool._words[index] = _RELEASED
