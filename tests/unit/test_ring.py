"""The shared-memory transport between real processes: ordering, chunking, backpressure,
dead peers, cleanup, idle CPU and the asyncio ends. The ordering tests also run over
the ZeroMQ baseline channel, which has the same interface."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import random
import signal
import struct
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shm import channel
from shm.channel import ChannelSpec, Duplex, PeerDeadError, ReceiverGroup
from shm.ring import ShmRing
from shm.segment import SHM_DIR
from shm.zmq_channel import ZmqChannelSpec, ZmqDuplex

CAPACITY = 4096  # small on purpose: wraps and chunking happen constantly
SPAWN = multiprocessing.get_context("spawn")
RECV_TIMEOUT = 60.0  # only there so that a broken transport fails instead of hanging


# ---------------------------------------------------------------- child side


def _attach(spec: ChannelSpec | ZmqChannelSpec) -> Duplex:
    """Attach as the spawned peer, watch the parent, and say HELLO."""
    duplex = ZmqDuplex.attach(spec) if isinstance(spec, ZmqChannelSpec) else Duplex.attach(spec)
    ppid = os.getppid()
    duplex.set_peer(lambda: os.getppid() == ppid, sentinel=os.pidfd_open(ppid))
    duplex.sender.send([b"HELLO"])
    return duplex


def _echo_child(spec: ChannelSpec) -> None:
    """First frame is a command: E<frames> echo the rest, S<us> pause, Q quit."""
    duplex = _attach(spec)
    while True:
        frames = duplex.receiver.recv()
        command = frames[0][:1]
        if command == b"E":  # replies carry a header frame: zmq has no zero-frame messages
            duplex.sender.send([b"R", *frames[1:]])
        elif command == b"S":
            time.sleep(int.from_bytes(frames[0][1:], "little") / 1e6)
        else:
            break
    duplex.close()


def _parked_child(spec: ChannelSpec) -> None:
    """Attach, then never read: the parent's ring fills up."""
    _attach(spec)
    time.sleep(600)


def _dying_child(spec: ChannelSpec) -> None:
    duplex = _attach(spec)
    duplex.sender.send([b"last", b"words"])
    os.kill(os.getpid(), signal.SIGKILL)


def _payload(i: int, size: int) -> list[bytes]:
    return [i.to_bytes(4, "little") + random.Random(i).randbytes(size)]


def _blast_both_ways(duplex: Duplex, count: int, size: int, drain_delay: float) -> bool:
    """Send ``count`` messages while another thread (starting late) checks ``count`` incoming ones."""
    ok: list[bool] = []

    def drain() -> None:
        time.sleep(drain_delay)  # let both rings fill up first
        for i in range(count):
            ok.append(duplex.receiver.recv(timeout=RECV_TIMEOUT) == _payload(i, size))

    thread = threading.Thread(target=drain)
    thread.start()
    for i in range(count):
        duplex.sender.send(_payload(i, size))
    thread.join()
    return len(ok) == count and all(ok)


def _blaster_child(spec: ChannelSpec, count: int, size: int) -> None:
    duplex = _attach(spec)
    ok = _blast_both_ways(duplex, count, size, drain_delay=0.2)
    duplex.sender.send([b"DONE", bytes([ok]), duplex.sender.waits_for_space.to_bytes(8, "little")])
    duplex.receiver.recv()


def _idle_child(spec: ChannelSpec) -> None:
    """Block in recv() for 2 s with nothing arriving and report the CPU time it took."""
    duplex = _attach(spec)
    start = time.process_time()
    got = duplex.receiver.recv(timeout=2.0)
    cpu = time.process_time() - start
    duplex.sender.send([b"none" if got is None else b"message", struct.pack("d", cpu)])
    duplex.receiver.recv()


# --------------------------------------------------------------- parent side


def _segment_paths(spec: ChannelSpec) -> list[str]:
    return [os.path.join(SHM_DIR, d.segment) for d in (spec.forward, spec.backward)] + [
        path for d in (spec.forward, spec.backward) for path in (d.data_bell, d.space_bell)
    ] + [spec.directory]


def _start(
    target, *args, capacity: int = CAPACITY, sentinel: bool = True, kind: str = "shm"
) -> tuple[Duplex, ChannelSpec, object]:
    """Create a channel, spawn ``target(spec, *args)``, wait for HELLO, then unlink every name."""
    duplex, spec = (ZmqDuplex if kind == "zmq" else Duplex).create(capacity)
    proc = SPAWN.Process(target=target, args=(spec, *args), daemon=True)
    proc.start()
    duplex.set_peer(proc.is_alive, proc.sentinel if sentinel else None)
    try:
        assert duplex.receiver.recv(timeout=RECV_TIMEOUT) == [b"HELLO"]
        duplex.peer_attached(RECV_TIMEOUT)
    except BaseException:
        _stop(duplex, proc)
        raise
    return duplex, spec, proc


def _stop(duplex: Duplex, proc) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join()
    duplex.close()


class EchoPeer:
    """A long-lived echo child plus a thread collecting its replies."""

    def __init__(self, kind: str = "shm") -> None:
        self.kind = kind
        self.duplex, self.spec, self.proc = _start(_echo_child, kind=kind)
        self.replies: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                self.replies.put(self.duplex.receiver.recv())
            except PeerDeadError as exc:
                self.replies.put(exc)
                return

    def pause_consumer(self, microseconds: int) -> None:
        self.duplex.sender.send([b"S" + microseconds.to_bytes(4, "little")])

    def echo(self, frames: list) -> None:
        self.duplex.sender.send([b"E", *frames])

    def collect(self, count: int) -> list[list[bytes]]:
        replies = [self.replies.get(timeout=RECV_TIMEOUT) for _ in range(count)]
        assert all(r[0] == b"R" for r in replies)
        return [[bytes(f) for f in r[1:]] for r in replies]

    def close(self) -> None:
        self.duplex.sender.send([b"Q"])
        self.proc.join(timeout=RECV_TIMEOUT)
        assert isinstance(self.replies.get(timeout=RECV_TIMEOUT), PeerDeadError)
        _stop(self.duplex, self.proc)


@pytest.fixture(scope="module", params=["shm", "zmq"])
def echo(request) -> Iterator[EchoPeer]:
    peer = EchoPeer(request.param)
    yield peer
    peer.close()


def _as_bytes(frames: list) -> list[bytes]:
    return [bytes(memoryview(f).cast("B")) for f in frames]


# --------------------------------------------------------------------- tests


def test_record_layout_every_offset_and_exact_fit() -> None:
    """Records ending exactly at the end need no wrap marker; one byte more needs one."""
    ring = ShmRing.create(1024)
    peer = ShmRing.attach(ring.name)
    ring.unlink()
    try:
        assert ring.capacity == 1024 and ring.max_record == 256
        rng = random.Random(0)
        for start in range(0, 1024, 8):
            # move both counters so the next record starts at `start`
            while ring._tail % 1024 != start:
                gap = (start - ring._tail) % 1024
                assert ring.try_write([] if gap == 8 else [b""])  # 8- or 16-byte records
                assert peer.try_read() is not None
            room = 1024 - start
            for length in (room - 12 - 1, room - 12, room - 12 + 1, 244):
                if not 0 <= length <= 244:
                    continue
                record = (12 + length + 7) & ~7
                tail = ring._tail
                data = rng.randbytes(length)
                assert ring.try_write([data])
                wrapped = record > 1024 - tail % 1024
                assert ring._tail - tail == record + (1024 - tail % 1024 if wrapped else 0)
                assert peer.try_read() == [data]
                assert peer.try_read() is None
    finally:
        peer.close()
        ring.close()


def test_ring_rejects_interleaving_a_half_written_message() -> None:
    ring = ShmRing.create(1024)
    peer = ShmRing.attach(ring.name)
    ring.unlink()
    try:
        big = [bytes(range(256)) * 20]
        assert not ring.try_write(big)  # larger than the ring: needs the consumer
        with pytest.raises(RuntimeError, match="half written"):
            ring.try_write([b"other"])
        written, received = False, None
        while received is None:
            if not written:
                written = ring.try_write(big)
            received = peer.try_read()
        assert received == big
        assert ring.try_write([]) and peer.try_read() == []
    finally:
        peer.close()
        ring.close()
    with pytest.raises(ValueError):
        ShmRing.attach("not-a-ring")


def test_no_spin_only_right_after_waking_an_idle_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver skips its spin after its sender rang a peer that had been quiet,
    and spins again once messages flow (else a ping-pong that fell asleep once
    would ring and sleep at every message from then on). The channel's clock is held
    still between the steps: the windows are microseconds, which a loaded machine's
    scheduler could spend between two lines of this test."""
    now = [1000.0]
    monkeypatch.setattr(channel, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    creator, spec = Duplex.create(1 << 16)
    attacher = Duplex.attach(spec)
    creator.unlink()
    try:
        receiver, sender = creator.receiver, creator.sender
        assert receiver.partner is sender
        spin = receiver.spin_s
        assert spin > 0 and receiver.spin_budget(spin) == spin  # nothing rung yet

        attacher.receiver.ring.begin_sleep()  # the peer goes to sleep on its input
        sender.send([b"request"])  # ... so this send rings it awake
        assert sender.woke_consumer_at == now[0]
        now[0] += spin / 2
        assert receiver.spin_budget(spin) == 0.0
        now[0] += spin  # the ring is older than a spin: spinning is worth it again
        assert receiver.spin_budget(spin) == spin
        assert attacher.receiver.try_recv() == [b"request"]

        attacher.sender.send([b"reply"])
        assert receiver.recv(timeout=1) == [b"reply"]  # a message just arrived: not quiet
        attacher.receiver.ring.end_sleep()
        attacher.receiver.ring.begin_sleep()
        sender.send([b"next"])  # rings again, but the peer answered a moment ago
        now[0] += spin / 2
        assert now[0] - sender.woke_consumer_at < spin and now[0] - receiver.last_message_at < channel.QUIET_S
        assert receiver.spin_budget(spin) == spin
        attacher.receiver.ring.end_sleep()
    finally:
        attacher.close()
        creator.close()


def test_receiver_group_waits_on_several_rings_from_one_thread() -> None:
    """One thread receives from three channels: it sleeps on all doorbells at once,
    reads the rings round robin (a busy peer cannot starve the others), and
    notices a dead peer once that peer's ring is drained."""
    creators, attached = [], []
    alive = [True, True, True]
    try:
        for i in range(3):
            creator, spec = Duplex.create(1 << 16)
            creators.append(creator)
            attached.append(Duplex.attach(spec))
            creator.unlink()
            attached[-1].set_peer(lambda i=i: alive[i])
        group = ReceiverGroup([d.receiver for d in attached])
        assert group.recv(timeout=0.05) is None
        later = threading.Timer(0.05, creators[2].sender.send, ([b"late"],))
        later.start()
        assert group.recv(timeout=RECV_TIMEOUT) == (2, [b"late"])  # woken from its sleep
        later.join()
        for i in range(3):
            creators[0].sender.send([b"a%d" % i])
        creators[1].sender.send([b"b"])
        got = [group.recv(timeout=RECV_TIMEOUT) for _ in range(4)]
        assert got == [(0, [b"a0"]), (1, [b"b"]), (0, [b"a1"]), (0, [b"a2"])]
        creators[1].sender.send([b"last words"])
        alive[1] = False
        assert group.recv(timeout=RECV_TIMEOUT) == (1, [b"last words"])
        with pytest.raises(PeerDeadError):
            group.recv(timeout=RECV_TIMEOUT)
    finally:
        for duplex in attached + creators:
            duplex.close()


def test_messages_arrive_once_in_order_byte_identical(echo: EchoPeer) -> None:
    rng = random.Random(1)
    messages: list[list] = [
        [],  # a message with no frames
        [b""],
        [b"", b"x", b""],
        [rng.randbytes(n) for n in (1, 7, 8, 9, 100, 300)],  # multi-frame
        [bytearray(rng.randbytes(500)), memoryview(np.arange(200, dtype=np.float32)).cast("B")],
    ]
    # Lengths around every exact-fit point of a 1024-byte record, in a row.
    messages += [[rng.randbytes(n)] for n in range(996, 1030)]
    # Larger than a record, than the ring, than three rings; multi-frame large ones.
    messages += [[rng.randbytes(n)] for n in (1025, 4096, 4097, 3 * CAPACITY + 5)]
    messages += [[rng.randbytes(3000), b"", rng.randbytes(9000), b"tail"]]
    messages += [[rng.randbytes(rng.randrange(0, 2000)) for _ in range(rng.randrange(0, 4))] for _ in range(300)]
    for frames in messages:
        echo.echo(frames)
    assert echo.collect(len(messages)) == [_as_bytes(m) for m in messages]
    assert echo.replies.empty()


@pytest.fixture(scope="module")
def shm_echo() -> Iterator[EchoPeer]:
    """The rings only: zmq queues 1000 messages per socket before it pushes back."""
    peer = EchoPeer("shm")
    yield peer
    peer.close()


def test_slow_consumer_backpressure(shm_echo: EchoPeer) -> None:
    echo = shm_echo
    waits_before = echo.duplex.sender.waits_for_space
    messages = [[random.Random(i).randbytes(900)] for i in range(60)]
    for frames in messages:
        echo.pause_consumer(2000)
        echo.echo(frames)
    assert echo.collect(len(messages)) == messages
    assert echo.duplex.sender.waits_for_space > waits_before  # the producer really had to wait


# Lengths at record boundaries: 1012 bytes fill a largest (quarter-ring) record exactly,
# 1013 is the smallest chunked message; then around a whole ring.
_boundaries = st.sampled_from([1011, 1012, 1013, CAPACITY - 12, CAPACITY, CAPACITY + 1])
_sizes = st.one_of(st.integers(0, 64), st.integers(0, 1100), st.integers(1000, 3 * CAPACITY), _boundaries)
_message = st.tuples(
    st.lists(_sizes, max_size=4),  # frame lengths
    st.sampled_from([0, 0, 0, 200, 1000]),  # consumer pause before it, µs
    st.sampled_from([0, 0, 0, 100, 500]),  # producer pause after it, µs
)


@settings(max_examples=12, deadline=None)
@given(st.lists(_message, min_size=1, max_size=40), st.integers(0, 2**32))
def test_property_random_sizes_and_pacing(echo: EchoPeer, script: list, seed: int) -> None:
    rng = random.Random(seed)
    expected = []
    for lengths, consumer_pause, producer_pause in script:
        frames = [rng.randbytes(n) for n in lengths]
        expected.append(frames)
        if consumer_pause:
            echo.pause_consumer(consumer_pause)
        echo.echo(frames)
        if producer_pause:
            time.sleep(producer_pause / 1e6)
    assert echo.collect(len(expected)) == expected


def test_both_directions_full_do_not_deadlock() -> None:
    count, size = 150, 3000
    duplex, spec, proc = _start(_blaster_child, count, size)
    try:
        assert _blast_both_ways(duplex, count, size, drain_delay=0.2)
        done = duplex.receiver.recv(timeout=RECV_TIMEOUT)
        assert done[:2] == [b"DONE", b"\x01"]
        # both senders found their ring full while the other side was not reading
        assert int.from_bytes(done[2], "little") > 0
        assert duplex.sender.waits_for_space > 0
        duplex.sender.send([b"BYE"])
    finally:
        _stop(duplex, proc)


def test_consumer_killed_producer_raises_and_nothing_is_left() -> None:
    duplex, spec, proc = _start(_parked_child, sentinel=False)  # only the liveness callback
    try:
        assert not any(os.path.exists(p) for p in _segment_paths(spec))  # unlinked after HELLO
        killer = threading.Timer(0.3, os.kill, (proc.pid, signal.SIGKILL))
        killer.start()
        with pytest.raises(PeerDeadError):
            for _ in range(100_000):
                duplex.sender.send([b"x" * 500], timeout=RECV_TIMEOUT)  # TimeoutError would fail
        killer.join()
        assert duplex.sender.waits_for_space > 0
    finally:
        _stop(duplex, proc)
    assert not any(os.path.exists(p) for p in _segment_paths(spec))


def test_producer_killed_receiver_gets_its_last_words_then_raises() -> None:
    duplex, spec, proc = _start(_dying_child)
    try:
        proc.join(timeout=RECV_TIMEOUT)
        assert proc.exitcode == -signal.SIGKILL
        assert duplex.receiver.recv(timeout=RECV_TIMEOUT) == [b"last", b"words"]
        with pytest.raises(PeerDeadError):
            duplex.receiver.recv(timeout=RECV_TIMEOUT)
    finally:
        _stop(duplex, proc)
    assert not any(os.path.exists(p) for p in _segment_paths(spec))


def test_idle_receiver_uses_almost_no_cpu() -> None:
    duplex, spec, proc = _start(_idle_child)
    try:
        result = duplex.receiver.recv(timeout=RECV_TIMEOUT)
        assert result[0] == b"none"  # recv(timeout=2) returned None: nothing was sent
        (cpu_seconds,) = struct.unpack("d", result[1])
        assert cpu_seconds < 0.1  # under 5% of one core while blocked for 2 s
        duplex.sender.send([b"BYE"])
    finally:
        _stop(duplex, proc)


@pytest.mark.parametrize("kind", ["shm", "zmq"])
async def test_async_ends_inside_an_event_loop(kind: str) -> None:
    duplex, spec, proc = _start(_echo_child, kind=kind)
    sender, receiver = duplex.async_ends()
    rng = random.Random(2)
    messages = [[rng.randbytes(rng.choice((0, 10, 900, 5000, 3 * CAPACITY)))] for _ in range(80)]
    ticks = 0
    stop_ticking = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop_ticking.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    async def produce() -> None:
        for i, frames in enumerate(messages):
            if i % 10 == 0:  # idle gaps: the receiver goes to sleep on its doorbell
                await asyncio.sleep(0.01)
            if i % 7 == 0:  # a slow consumer: the sender waits for space
                await sender.send([b"S" + (3000).to_bytes(4, "little")])
            await sender.send([b"E", *frames])

    async def consume() -> list:
        replies = [await receiver.recv() for _ in messages]
        assert all(r[0] == b"R" for r in replies)
        return [[bytes(f) for f in r[1:]] for r in replies]

    try:
        tick_task = asyncio.create_task(ticker())
        _, received = await asyncio.wait_for(asyncio.gather(produce(), consume()), RECV_TIMEOUT)
        assert received == messages
        assert ticks > 0  # the loop kept running other tasks
        if kind == "shm":  # (zmq queues up to 1000 messages before pushing back)
            assert duplex.sender.waits_for_space > 0
        await sender.send([b"Q"])
        with pytest.raises(PeerDeadError):
            await asyncio.wait_for(receiver.recv(), RECV_TIMEOUT)
        stop_ticking.set()
        await tick_task
    finally:
        sender.close()
        receiver.close()
        _stop(duplex, proc)
