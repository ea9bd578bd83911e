"""A single-producer single-consumer byte ring in a named shared-memory segment.

Layout of the segment (every hot field on its own 64-byte cache line, so the
two processes never write to the same line)::

    0    head       u64  bytes consumed so far   (written by the consumer only)
    64   tail       u64  bytes published so far  (written by the producer only)
    128  sleep_seq  u64  odd while the consumer sleeps on its doorbell (consumer)
    192  space_seq  u64  odd while the producer waits for space        (producer)
    256  magic u64, capacity u64
    320  data       ``capacity`` bytes (a power of two)

``head`` and ``tail`` only grow; a position in the data area is
``counter & (capacity - 1)`` and ``tail - head`` is the number of bytes in use.
Each side keeps a private copy of the other's counter and re-reads the shared
one only when the ring looks full (producer) or empty (consumer).

Records start at 8-byte aligned positions and never straddle the end::

    [u32 body_len | u32 info | u32 frame_len * n | frame bytes ...] padding to 8

``info`` holds the frame count and two flags. A record that does not fit
before the end of the data area is preceded by a wrap marker (``body_len ==
0xFFFFFFFF``) telling the consumer to continue at position 0. A message whose
record would exceed a quarter of the ring is split into chunk records: the
first carries the frame table and flag MORE, the following ones flag CONT
(and MORE, except the last) and carry only payload bytes. The consumer
reassembles them, so any message is delivered whatever its size; nothing is
ever dropped or overwritten.

Memory ordering. The producer writes a record, then stores ``tail``; the
consumer loads ``tail``, then reads the record (and symmetrically for
``head``). On x86-64 (TSO) plain aligned 8-byte stores and loads are not
reordered with each other, so that is enough, provided each counter access is
a single 8-byte access. ``struct.pack_into("Q", ...)`` does not qualify:
CPython zero-fills the target before writing the value, and the peer can read
that transient 0 (seen here as ring corruption under load). The counters are
therefore read and written as items of a ``memoryview`` cast to native "Q",
which CPython copies with one fixed-size 8-byte memcpy, i.e. one aligned move
(and is faster than struct). The one reordering TSO
allows is a store followed by a load of another location, which is exactly the
"set my sleeping flag, then re-check the counter" / "publish the counter, then
check the sleeping flag" handshake; both sides put a full fence there. Pure
Python has no fence instruction, so ``fence`` acquires and releases a lock,
which glibc implements with a locked read-modify-write (a full barrier on
x86-64). On weakly ordered CPUs (ARM64, POWER) ``fence`` is additionally
called before each counter store and after each counter load; that relies on
glibc's lock operations being full barriers there, which holds for the
common implementations but is untested: x86-64 is the supported platform.
"""

from __future__ import annotations

import mmap
import platform
import struct
import threading
from collections.abc import Sequence
from typing import Union

from shm.segment import NAME_PREFIX, attach_segment, create_segment, unlink_segment

Frame = Union[bytes, bytearray, memoryview]


# Header fields as indexes of 8-byte words (byte offsets 0, 64, 128, 192, 256).
_HEAD = 0
_TAIL = 8
_SLEEP_SEQ = 16
_SPACE_SEQ = 24
_META = 32  # magic, capacity
_DATA = 320  # byte offset of the data area
_MAGIC = 0x52494E474C4C4D31  # "RINGLLM1"
MIN_CAPACITY = 1024

_WRAP = 0xFFFFFFFF
_MORE = 1 << 31  # more chunks of this message follow
_CONT = 1 << 30  # this record continues a chunked message (no frame table)
_NFRAMES = (1 << 24) - 1

_U32 = struct.Struct("I")
_U32X2 = struct.Struct("II")  # a record header: body length, info; or two frame lengths

WEAK_MEMORY = platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686")

_fence_lock = threading.Lock()
_fence_acquire = _fence_lock.acquire
_fence_release = _fence_lock.release


def fence() -> None:
    """Full memory barrier: a lock round trip is a locked read-modify-write."""
    _fence_acquire()
    _fence_release()


_headers: dict[int, struct.Struct] = {}
_HEADER1 = struct.Struct("III")
_HEADER2 = struct.Struct("IIII")


def _header(nframes: int) -> struct.Struct:
    """The cached struct for a record header with ``nframes`` frame lengths."""
    s = _headers.get(nframes)
    if s is None:
        s = _headers[nframes] = struct.Struct(f"II{nframes}I")
    return s


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class _ChunkedWrite:
    """Producer state of a message being written as several chunk records."""

    __slots__ = ("frames", "views", "lengths", "remaining", "index", "offset", "first")

    def __init__(self, frames: Sequence[Frame], lengths: list[int]) -> None:
        self.frames = frames  # identity check: the caller must retry with the same object
        self.views = [memoryview(f).cast("B") for f in frames]
        self.lengths = lengths
        self.remaining = sum(lengths)
        self.index = 0  # frame being copied
        self.offset = 0  # bytes of that frame already copied
        self.first = True


class _ChunkedRead:
    """Consumer state of a message being reassembled from chunk records."""

    __slots__ = ("lengths", "buf", "filled")

    def __init__(self, lengths: tuple[int, ...]) -> None:
        self.lengths = lengths
        self.buf = bytearray(sum(lengths))
        self.filled = 0


class _SleepFlag:
    """One side's "I am asleep" word in the ring header, odd while that side sleeps.

    The side that sleeps ``announce``s (then re-checks the ring) and
    ``withdraw``s; the other side calls ``wake_due`` after publishing a new
    counter value, which says once per sleep that the sleeper must be rung.
    Each process holds its own instance: the sleeper's fields are ``_seq``,
    the waker's ``_checked`` and ``_rung``.
    """

    __slots__ = ("_counters", "_index", "_mm", "_seq", "_checked", "_rung")

    def __init__(self, counters: memoryview, index: int, mm: mmap.mmap, position: int) -> None:
        self._counters = counters
        self._index = index
        self._mm = mm
        self._seq = counters[index]
        self._checked = position
        self._rung = 0

    def announce(self) -> None:
        self._seq += 1
        self._counters[self._index] = self._seq
        fence()  # the flag must be visible before the sleeper re-reads the ring

    def withdraw(self) -> None:
        if self._mm.closed:  # a sleeper cancelled after its owner closed the ring (shutdown)
            return
        self._seq += 1
        self._counters[self._index] = self._seq

    def wake_due(self, position: int) -> bool:
        """After publishing ``position``: True once per sleep if the sleeper must be rung."""
        if position == self._checked:
            return False
        self._checked = position
        fence()  # the counter store must be visible before we look at the flag
        seq = self._counters[self._index]
        if seq & 1 and seq != self._rung:
            self._rung = seq
            return True
        return False


class ShmRing:
    """One direction of a channel: exactly one producer process and one consumer process.

    The producer calls ``try_write``/``consumer_wakeup_due``/``begin_space_wait``
    (``end_space_wait``); the consumer calls ``try_read``/``producer_wakeup_due``/
    ``begin_sleep`` (``end_sleep``). Each
    side must use the ring from one thread at a time. The ring itself never
    blocks and makes no system calls; waiting is the job of ``shm.channel``.
    """

    def __init__(self, name: str, mm: mmap.mmap, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self._mm = mm
        # The header as native u64 words. An item store through a memoryview is one
        # aligned 8-byte write; struct.pack_into is NOT usable for the counters: it
        # zero-fills its target before writing, so the peer could read a counter of 0.
        self._counters = memoryview(mm)[:_DATA].cast("Q")
        self._mask = capacity - 1
        # Messages whose single record exceeds this are chunked; keeping chunks
        # to a quarter of the ring lets producer and consumer copy concurrently,
        # and guarantees a record (plus a wrap marker) always fits an empty ring.
        self.max_record = capacity // 4
        head = self._counters[_HEAD]
        tail = self._counters[_TAIL]
        # producer side
        self._tail = tail
        self._head_cache = head
        self._pending: _ChunkedWrite | None = None
        # consumer side
        self._head = head
        self._tail_cache = tail
        self._partial: _ChunkedRead | None = None
        # The consumer's sleeping flag (it waits for data) and the producer's (for space).
        self._sleep_flag = _SleepFlag(self._counters, _SLEEP_SEQ, mm, tail)
        self._space_flag = _SleepFlag(self._counters, _SPACE_SEQ, mm, head)
        self.begin_sleep = self._sleep_flag.announce
        self.end_sleep = self._sleep_flag.withdraw
        self.begin_space_wait = self._space_flag.announce
        self.end_space_wait = self._space_flag.withdraw

    # ------------------------------------------------------------------ setup

    @classmethod
    def create(cls, capacity: int) -> ShmRing:
        """A new segment ``/dev/shm/ringllm-<random>`` (mode 0600); capacity rounds up to a power of two."""
        capacity = max(MIN_CAPACITY, 1 << (max(capacity, 1) - 1).bit_length())
        if capacity > 1 << 31:
            raise ValueError(f"ring capacity {capacity} exceeds 2 GiB")
        name, mm = create_segment(NAME_PREFIX, _DATA, capacity, _MAGIC, meta=8 * _META)
        return cls(name, mm, capacity)

    @classmethod
    def attach(cls, name: str) -> ShmRing:
        """Map an existing segment created by ``create`` in another process."""
        mm, capacity = attach_segment(name, NAME_PREFIX, _DATA, _MAGIC, "ring", meta=8 * _META)
        if capacity < MIN_CAPACITY or capacity & (capacity - 1):
            mm.close()
            raise ValueError(f"segment {name} has a bad ring capacity {capacity}")
        return cls(name, mm, capacity)

    def unlink(self) -> None:
        """Remove the segment's name; the mappings stay valid until both sides close."""
        unlink_segment(self.name)

    def close(self) -> None:
        if not self._mm.closed:
            self._counters.release()
            self._mm.close()

    @property
    def bytes_written(self) -> int:
        """Producer side: bytes put in the ring so far, record headers and padding
        included (the tail counter, so counting costs nothing)."""
        return self._tail

    @property
    def bytes_read(self) -> int:
        """Consumer side: bytes taken out of the ring so far (the head counter)."""
        return self._head

    # --------------------------------------------------------------- producer

    def try_write(self, frames: Sequence[Frame]) -> bool:
        """Append one message (a list of frames) if there is room; never blocks.

        Frames are bytes, bytearray or C-contiguous byte-format memoryviews
        (``len`` must be the size in bytes: ``.cast("B")`` others). A message too
        large for one record is written chunk by chunk: this may return False
        after writing some chunks, and the caller must then retry with the
        *same* ``frames`` object until it returns True before writing anything
        else.
        """
        if self._pending is not None:
            if frames is not self._pending.frames:
                raise RuntimeError("a chunked message is half written: retry it before sending another")
            return self._write_chunks()
        # One and two frames ([body], [type, body]) are the protocol's shapes:
        # they skip the generic path's list and argument unpacking.
        n = len(frames)
        if n == 1:
            len0 = len(frames[0])
            body = 4 + len0
        elif n == 2:
            first, second = frames
            len0 = len(first)
            len1 = len(second)
            body = 8 + len0 + len1
        else:
            lengths = list(map(len, frames))
            body = 4 * n + sum(lengths)
        rec = (body + 15) & ~7
        if rec > self.max_record:
            if 4 * n + 16 > self.max_record:
                raise ValueError(f"{n} frames do not fit one record header of a {self.capacity}-byte ring")
            self._pending = _ChunkedWrite(frames, list(map(len, frames)))
            return self._write_chunks()

        mm = self._mm
        tail = self._tail
        pos = tail & self._mask
        room = self.capacity - pos
        need = rec if rec <= room else room + rec
        if tail + need - self._head_cache > self.capacity:
            self._head_cache = self._counters[_HEAD]
            if WEAK_MEMORY:
                fence()
            if tail + need - self._head_cache > self.capacity:
                return False
        if rec > room:
            _U32X2.pack_into(mm, _DATA + pos, _WRAP, 0)
            tail += room
            pos = 0
        off = _DATA + pos
        if n == 1:
            _HEADER1.pack_into(mm, off, body, 1, len0)
            mm[off + 12 : off + 12 + len0] = frames[0]
        elif n == 2:
            _HEADER2.pack_into(mm, off, body, 2, len0, len1)
            off += 16
            mm[off : off + len0] = first
            off += len0
            mm[off : off + len1] = second
        else:
            (_headers.get(n) or _header(n)).pack_into(mm, off, body, n, *lengths)
            off += 8 + 4 * n
            for frame, length in zip(frames, lengths):
                mm[off : off + length] = frame
                off += length
        self._tail = tail = tail + rec
        if WEAK_MEMORY:
            fence()
        self._counters[_TAIL] = tail
        return True

    def _write_chunks(self) -> bool:
        """Write as many chunks of the pending message as fit; True once the last is out."""
        st = self._pending
        assert st is not None
        mm = self._mm
        cap = self.capacity
        while True:
            tail = self._tail
            pos = tail & self._mask
            room = cap - pos
            header = 8 + 4 * len(st.lengths) if st.first else 8
            if room < header + 8:
                need = room  # only a wrap marker fits here
            else:
                need = min(_pad8(header + st.remaining), self.max_record, room)
            if tail + need - self._head_cache > cap:
                self._head_cache = self._counters[_HEAD]
                if WEAK_MEMORY:
                    fence()
                if tail + need - self._head_cache > cap:
                    return False
            off = _DATA + pos
            if room < header + 8:
                _U32X2.pack_into(mm, off, _WRAP, 0)
                tail += room
            else:
                payload = min(st.remaining, need - header)
                last = payload == st.remaining
                flags = 0 if last else _MORE
                if st.first:
                    _header(len(st.lengths)).pack_into(
                        mm, off, header - 8 + payload, flags | len(st.lengths), *st.lengths
                    )
                    st.first = False
                else:
                    _U32X2.pack_into(mm, off, payload, flags | _CONT)
                self._copy_payload(st, off + header, payload)
                tail += _pad8(header + payload)
                if last:
                    self._pending = None
            self._tail = tail
            if WEAK_MEMORY:
                fence()
            self._counters[_TAIL] = tail
            if self._pending is None:
                return True

    def _copy_payload(self, st: _ChunkedWrite, off: int, nbytes: int) -> None:
        mm = self._mm
        st.remaining -= nbytes
        while nbytes:
            view = st.views[st.index]
            left = len(view) - st.offset
            if left == 0:
                st.index += 1
                st.offset = 0
                continue
            take = min(left, nbytes)
            mm[off : off + take] = view[st.offset : st.offset + take]
            off += take
            nbytes -= take
            st.offset += take

    def consumer_wakeup_due(self) -> bool:
        """After writing: True once per consumer sleep if the consumer must be rung."""
        return self._sleep_flag.wake_due(self._tail)

    # --------------------------------------------------------------- consumer

    def try_read(self) -> list[bytes] | None:
        """The next whole message as a list of frames (copied out), or None if there is none yet."""
        mm = self._mm
        while True:
            head = self._head
            if head == self._tail_cache:
                self._tail_cache = self._counters[_TAIL]
                if WEAK_MEMORY:
                    fence()
                if head == self._tail_cache:
                    return None
            pos = head & self._mask
            off = _DATA + pos
            body, info = _U32X2.unpack_from(mm, off)
            if body == _WRAP:
                self._publish_head(head + self.capacity - pos)
                continue
            rec = (body + 15) & ~7
            if rec > self.capacity - pos:
                raise RuntimeError(f"ring {self.name} is corrupt: record of {body} bytes at {pos}")
            if info & (_MORE | _CONT):
                frames = self._read_chunk(off, body, info)
            elif info == 1:
                length = _U32.unpack_from(mm, off + 8)[0]
                frames = [mm[off + 12 : off + 12 + length]]
            elif info == 2:
                len0, len1 = _U32X2.unpack_from(mm, off + 8)
                mid = off + 16 + len0
                frames = [mm[off + 16 : mid], mm[mid : mid + len1]]
            else:
                lengths = (_headers.get(info) or _header(info)).unpack_from(mm, off)
                off += 8 + 4 * info
                frames = []
                for i in range(2, info + 2):
                    end = off + lengths[i]
                    frames.append(mm[off:end])
                    off = end
            self._publish_head(head + rec)
            if frames is not None:
                return frames

    def _publish_head(self, head: int) -> None:
        self._head = head
        if WEAK_MEMORY:
            fence()
        self._counters[_HEAD] = head

    def _read_chunk(self, off: int, body: int, info: int) -> list[bytes] | None:
        mm = self._mm
        if not info & _CONT:
            if self._partial is not None:
                raise RuntimeError(f"ring {self.name} is corrupt: new message inside a chunked one")
            n = info & _NFRAMES
            lengths = _header(n).unpack_from(mm, off)[2:]
            self._partial = st = _ChunkedRead(lengths)
            start = off + 8 + 4 * n
            payload = body - 4 * n
        else:
            st = self._partial
            if st is None:
                raise RuntimeError(f"ring {self.name} is corrupt: continuation without a start")
            start = off + 8
            payload = body
        end = st.filled + payload
        if end > len(st.buf):
            raise RuntimeError(f"ring {self.name} is corrupt: chunk overflows its message")
        st.buf[st.filled : end] = mm[start : start + payload]
        st.filled = end
        if info & _MORE:
            return None
        self._partial = None
        if end != len(st.buf):
            raise RuntimeError(f"ring {self.name} is corrupt: chunked message is short")
        if len(st.lengths) == 1:
            return [bytes(st.buf)]
        view = memoryview(st.buf)
        frames = []
        pos = 0
        for length in st.lengths:
            frames.append(bytes(view[pos : pos + length]))
            pos += length
        return frames

    def producer_wakeup_due(self) -> bool:
        """After reading: True once per producer wait if the producer must be rung."""
        return self._space_flag.wake_due(self._head)
