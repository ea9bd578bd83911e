"""The ZeroMQ channel over TCP, as an engine on another host uses it: real spawned
processes exchange messages both ways, and with no process sentinel at all (a remote
peer has none) a killed, closed or frozen peer makes a blocked recv raise PeerDeadError
on either side, through the sockets' monitors and ZMTP heartbeats. The timeouts below
are liveness bounds only, so that a broken channel fails instead of hanging."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
import time

import pytest

from shm.waiting import PeerDeadError
from shm.zmq_channel import HEARTBEAT_TIMEOUT_MS, ZmqChannelSpec, ZmqDuplex

SPAWN = multiprocessing.get_context("spawn")
HOST = "127.0.0.1"
RECV_TIMEOUT = 60.0  # a message that should come
DEATH_TIMEOUT = 30.0  # a dead peer that should be noticed (in practice: milliseconds)
BIG = 1 << 20


# ---------------------------------------------------------------- child side


def _echo_child(spec: ZmqChannelSpec) -> None:
    """The engine's side, with no sentinel for the frontend: say HELLO, then echo
    every message (first frame replaced by b"R") until told b"Q"."""
    duplex = ZmqDuplex.attach(spec)
    duplex.sender.send([b"HELLO"])
    try:
        while True:
            frames = duplex.receiver.recv()
            if frames[0] == b"Q":
                break
            duplex.sender.send([b"R", *frames[1:]])
    except PeerDeadError:
        pass
    duplex.close()


def _frontend_child(specs, results) -> None:
    """The frontend's side in a child: create, publish the spec, wait for the engine's
    HELLO, confirm, then block on recv (the parent kills us)."""
    duplex, spec = ZmqDuplex.create(host=HOST)
    specs.put(spec)
    assert duplex.receiver.recv(timeout=RECV_TIMEOUT) == [b"HELLO"]
    duplex.peer_attached(RECV_TIMEOUT)
    duplex.sender.send([b"WELCOME"])
    try:
        duplex.receiver.recv(timeout=600)
    except PeerDeadError:
        results.put("engine gone")


# --------------------------------------------------------------- parent side


def _start(target=_echo_child) -> tuple[ZmqDuplex, ZmqChannelSpec, multiprocessing.Process]:
    """Create a tcp channel, spawn the engine, wait for HELLO. No sentinel, no ``alive()``:
    only the connections tell that the peer is gone."""
    duplex, spec = ZmqDuplex.create(host=HOST)
    proc = SPAWN.Process(target=target, args=(spec,), daemon=True)
    proc.start()
    duplex.set_peer(None)
    try:
        assert duplex.receiver.recv(timeout=RECV_TIMEOUT) == [b"HELLO"]
        duplex.peer_attached(RECV_TIMEOUT)
    except BaseException:
        _stop(duplex, proc)
        raise
    return duplex, spec, proc


def _stop(duplex: ZmqDuplex, proc) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGCONT)  # in case it was stopped
        proc.kill()
    proc.join()
    duplex.close()


def _expect_peer_dead(recv) -> float:
    """Call a blocking ``recv(timeout)``; it must raise PeerDeadError. Returns how long it took."""
    start = time.monotonic()
    with pytest.raises(PeerDeadError):
        got = recv(DEATH_TIMEOUT)
        pytest.fail(f"recv returned {got!r} instead of noticing the dead peer")
    return time.monotonic() - start


def _big_frame(seed: int) -> bytes:
    return bytes((seed + i) % 251 for i in range(256)) * (BIG // 256)


# --------------------------------------------------------------------- tests


def test_tcp_spec_names_the_host_and_ephemeral_ports() -> None:
    duplex, spec = ZmqDuplex.create(host=HOST)
    try:
        assert spec.is_tcp and spec.directory is None
        for address in (spec.input_address, spec.output_address):
            scheme, host, port = address.split(":")
            assert (scheme, host) == ("tcp", "//" + HOST) and int(port) > 0
        assert spec.input_address != spec.output_address
        duplex.unlink()  # nothing to remove; must not fail
    finally:
        duplex.close()
    # Every interface bound, another address advertised to the engine.
    duplex, spec = ZmqDuplex.create(host="0.0.0.0", advertise_host=HOST)
    try:
        assert spec.input_address.startswith(f"tcp://{HOST}:")
        engine = ZmqDuplex.attach(spec)
        engine.sender.send([b"HELLO"])
        assert duplex.receiver.recv(timeout=RECV_TIMEOUT) == [b"HELLO"]
        engine.close()
    finally:
        duplex.close()
    # The ipc kind is unchanged.
    duplex, spec = ZmqDuplex.create()
    try:
        assert not spec.is_tcp and spec.input_address.startswith("ipc://") and os.path.isdir(spec.directory)
    finally:
        duplex.close()
    assert not os.path.exists(spec.directory)


def test_messages_both_ways_with_a_big_multipart_message() -> None:
    duplex, _, proc = _start()
    try:
        for i in range(50):
            duplex.sender.send([b"E", i.to_bytes(4, "little")])
            assert duplex.receiver.recv(timeout=RECV_TIMEOUT) == [b"R", i.to_bytes(4, "little")]
        frames = [b"E", b"header", _big_frame(1), b"", b"tail", _big_frame(2)]
        duplex.sender.send(frames)
        got = duplex.receiver.recv(timeout=RECV_TIMEOUT)
        assert [bytes(f) for f in got] == [b"R", *frames[1:]]
        # Pipelined: many in flight before the first reply is read.
        for i in range(20):
            duplex.sender.send([b"E", i.to_bytes(4, "little"), _big_frame(i)])
        for i in range(20):
            got = duplex.receiver.recv(timeout=RECV_TIMEOUT)
            assert bytes(got[1]) == i.to_bytes(4, "little") and bytes(got[2]) == _big_frame(i)
        duplex.sender.send([b"Q"])
        proc.join(RECV_TIMEOUT)
        assert proc.exitcode == 0
    finally:
        _stop(duplex, proc)


def test_async_ends_over_tcp() -> None:
    duplex, _, proc = _start()

    async def talk() -> None:
        sender, receiver = duplex.async_ends()
        try:
            for i in range(10):
                await sender.send([b"E", i.to_bytes(4, "little"), _big_frame(i)])
            for i in range(10):
                got = await asyncio.wait_for(receiver.recv(), RECV_TIMEOUT)
                assert bytes(got[1]) == i.to_bytes(4, "little") and bytes(got[2]) == _big_frame(i)
            proc.kill()
            with pytest.raises(PeerDeadError):
                await asyncio.wait_for(receiver.recv(), DEATH_TIMEOUT)
        finally:
            sender.close()
            receiver.close()

    try:
        asyncio.run(talk())
    finally:
        _stop(duplex, proc)


def test_killed_engine_wakes_a_blocked_recv_and_fails_sends() -> None:
    duplex, _, proc = _start()
    try:
        duplex.sender.send([b"E", b"ping"])
        assert duplex.receiver.recv(timeout=RECV_TIMEOUT) == [b"R", b"ping"]
        # Kill while the parent is already blocked in recv.
        killer = SPAWN.Process(target=_kill_later, args=(proc.pid, 0.3))
        killer.start()
        _expect_peer_dead(duplex.receiver.recv)
        killer.join()
        with pytest.raises(PeerDeadError):  # the ROUTER can no longer reach it
            duplex.sender.send([b"E", b"again"], timeout=DEATH_TIMEOUT)
    finally:
        _stop(duplex, proc)


def _kill_later(pid: int, delay: float) -> None:
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)


def test_last_words_are_read_before_peer_dead() -> None:
    duplex, _, proc = _start()
    try:
        for i in range(5):
            duplex.sender.send([b"E", bytes([i])])
        duplex.sender.send([b"Q"])  # the engine replies to all five, then closes
        for i in range(5):
            assert duplex.receiver.recv(timeout=RECV_TIMEOUT) == [b"R", bytes([i])]
        proc.join(RECV_TIMEOUT)
        _expect_peer_dead(duplex.receiver.recv)
    finally:
        _stop(duplex, proc)


def test_killed_frontend_wakes_the_engine() -> None:
    """The reverse: the frontend's process is killed; the engine's blocked recv notices."""
    specs, results = SPAWN.Queue(), SPAWN.Queue()
    frontend = SPAWN.Process(target=_frontend_child, args=(specs, results), daemon=True)
    frontend.start()
    engine = None
    try:
        spec = specs.get(timeout=RECV_TIMEOUT)
        engine = ZmqDuplex.attach(spec)
        engine.sender.send([b"HELLO"])
        assert engine.receiver.recv(timeout=RECV_TIMEOUT) == [b"WELCOME"]
        killer = SPAWN.Process(target=_kill_later, args=(frontend.pid, 0.3))
        killer.start()
        _expect_peer_dead(engine.receiver.recv)
        killer.join()
        with pytest.raises(PeerDeadError):  # nobody reads: the PUSH has no peer
            for _ in range(10_000):  # until zmq's queues are full
                engine.sender.send([b"x" * 4096], timeout=DEATH_TIMEOUT)
    finally:
        if frontend.is_alive():
            frontend.kill()
        frontend.join()
        if engine is not None:
            engine.close()


def test_closed_engine_is_noticed_by_the_frontend_child() -> None:
    """The frontend (a child) notices the engine (this process) closing its end."""
    specs, results = SPAWN.Queue(), SPAWN.Queue()
    frontend = SPAWN.Process(target=_frontend_child, args=(specs, results), daemon=True)
    frontend.start()
    try:
        engine = ZmqDuplex.attach(specs.get(timeout=RECV_TIMEOUT))
        engine.sender.send([b"HELLO"])
        assert engine.receiver.recv(timeout=RECV_TIMEOUT) == [b"WELCOME"]
        engine.close()
        assert results.get(timeout=DEATH_TIMEOUT) == "engine gone"
        frontend.join(RECV_TIMEOUT)
        assert frontend.exitcode == 0
    finally:
        if frontend.is_alive():
            frontend.kill()
        frontend.join()


def test_frozen_engine_is_dropped_by_heartbeats() -> None:
    """SIGSTOP keeps the TCP connection open (the kernel still ACKs), but the peer's
    zmq answers no PINGs: the connection is dropped after the heartbeat timeout."""
    duplex, _, proc = _start()
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        took = _expect_peer_dead(duplex.receiver.recv)
        assert took >= HEARTBEAT_TIMEOUT_MS / 1000 * 0.5  # it was the heartbeat, not a closed socket
    finally:
        _stop(duplex, proc)


# ZMTP greeting: signature, version 3.99 (unknown), a mechanism nobody speaks.
_BAD_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x63" + b"XXXX".ljust(20, b"\0") + bytes(32)


@pytest.mark.parametrize(
    "payload", [b"", b"GET / HTTP/1.0\r\n\r\n", _BAD_GREETING], ids=["silent", "http", "bad-greeting"]
)
def test_stray_connections_are_not_a_dead_peer(payload: bytes) -> None:
    """A client that is no ZMTP peer (a port scanner, a wrong address) connects to both
    ports and goes away, or is dropped by zmq: the engine still counts as alive."""
    duplex, spec, proc = _start()
    try:
        for address in (spec.input_address, spec.output_address):
            host, port = address[len("tcp://"):].rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=RECV_TIMEOUT) as stray:
                if payload:
                    stray.sendall(payload)
                    stray.settimeout(0.5)
                    try:
                        while stray.recv(4096):  # until zmq drops it (or we give up and close)
                            pass
                    except OSError:
                        pass
        time.sleep(0.5)  # let the monitors report the strays
        assert duplex.receiver.recv(timeout=0.5) is None
        duplex.sender.send([b"E", b"still there"])
        assert duplex.receiver.recv(timeout=RECV_TIMEOUT) == [b"R", b"still there"]
    finally:
        _stop(duplex, proc)
