"""Data-parallel engines on hosts without a frontend, and without Ray (vLLM's ``--headless``).

The head (the frontend's host) runs engines ``start_rank .. start_rank + local - 1``
as its own children and waits for the others. For each of those it creates a
ZeroMQ/TCP transport on ``--data-parallel-address`` and answers, on a small
request/reply socket at ``--data-parallel-rpc-port``, the question "where do I
connect, engine r?". A headless host (``python -m app --headless ...``) asks
for each of its ranks, spawns those engines as its children with the answers,
and lives as long as they do. From then on the frontend and a remote engine
talk as any two ends of the transport do: HELLO, READY, requests, outputs; a
lost TCP link (heartbeats, or the peer's exit) ends both ends' waits.

The registration answer is two TCP addresses in JSON: nothing is unpickled.
"""

from __future__ import annotations

import json
import logging
import multiprocessing.connection
import threading
import time
from typing import Any

import zmq

from core.client import spawn_engine
from core.config import EngineConfig
from core.transport import TransportSpec
from shm.zmq_channel import ZmqChannelSpec

logger = logging.getLogger("ringllm.headless")

RETRY_INTERVAL_S = 0.2



class RemoteEngineHandle:
    """An engine a headless host runs: no process to watch from here (its TCP link is)."""

    sentinel = None
    exitcode: int | None = None

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._stopped = False

    def is_alive(self) -> bool:
        return not self._stopped

    def terminate(self) -> None:
        """Closing our end of the link (the client does, next) makes the engine exit."""
        self._stopped = True

    def kill(self) -> None:
        self._stopped = True

    def join(self, timeout: float | None = None) -> None:
        pass


class HeadLauncher:
    """The head's side: local ranks as children, remote ranks through the registration socket."""

    def __init__(self, config: EngineConfig, address: str, rpc_port: int, start_rank: int, size_local: int) -> None:
        self.frontend_host = address
        self._local = range(start_rank, start_rank + size_local)
        self._answers: dict[int, dict[str, str]] = {}
        self._lock = threading.Lock()
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{address}:{rpc_port}")
        self._closing = False
        self._thread = threading.Thread(target=self._serve_registrations, name="HeadlessRegistry", daemon=True)
        self._thread.start()
        remote = [r for r in range(config.parallel_config.data_parallel_size) if r not in self._local]
        self._remote = set(remote)
        logger.info("engines %s run here; waiting for engines %s at tcp://%s:%d", list(self._local), remote,
                    address, rpc_port)

    def is_local(self, engine_index: int) -> bool:
        return engine_index in self._local

    def can_restart(self, engine_index: int) -> bool:
        return engine_index in self._local  # a headless host's engines are its own

    def launch(self, config: EngineConfig, spec: TransportSpec, load_table: str | None) -> Any:
        rank = config.parallel_config.data_parallel_rank
        if rank in self._local:
            proc = spawn_engine(config, [spec], load_table)
            proc.start()
            return proc
        channel = spec.channel
        assert isinstance(channel, ZmqChannelSpec)
        with self._lock:
            self._answers[rank] = {"input_address": channel.input_address, "output_address": channel.output_address}
        return RemoteEngineHandle(rank)

    def _serve_registrations(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._closing:
            if not poller.poll(200):
                continue
            answer = None
            try:
                rank = int(json.loads(self._socket.recv())["rank"])
                with self._lock:
                    answer = self._answers.get(rank)
                if answer is not None:
                    reply = answer
                elif rank in self._remote:  # its transport is not made yet: ask again shortly
                    reply = {"retry": f"engine {rank} is not ready to be connected yet"}
                else:
                    reply = {"error": f"rank {rank} is not waited for"}
            except (ValueError, KeyError, TypeError) as exc:
                reply = {"error": f"malformed registration: {exc}"}
            self._socket.send(json.dumps(reply).encode())
            if answer is not None:
                logger.info("engine %d registered from a headless host", rank)

    def shutdown(self) -> None:
        self._closing = True
        self._thread.join(timeout=2)
        self._socket.close(linger=0)


def _ask(context: zmq.Context, endpoint: str, rank: int, timeout: float) -> dict[str, str]:
    """Where engine ``rank`` connects. The request waits in the socket until the head
    is up (zmq connects lazily), so a headless host may start first; the head may also
    answer "retry" while it is still making that engine's transport."""
    deadline = time.monotonic() + timeout
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(endpoint)
        while True:
            socket.send(json.dumps({"rank": rank}).encode())
            if not socket.poll(int(max(deadline - time.monotonic(), 0) * 1000)):
                raise TimeoutError(f"no answer from the head at {endpoint} for engine {rank}")
            reply = json.loads(socket.recv())
            if "retry" not in reply:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the head at {endpoint} never got ready for engine {rank}")
            time.sleep(RETRY_INTERVAL_S)
    finally:
        socket.close(linger=0)
    if "error" in reply:
        raise RuntimeError(f"the head refused engine {rank}: {reply['error']}")
    return reply


def run_headless(
    configs: list[EngineConfig], address: str, rpc_port: int, timeout: float = 600.0
) -> int:
    """Register ``configs``' ranks with the head, run their engines until they exit.
    The exit code: 0 if every engine exited cleanly."""
    context = zmq.Context.instance()
    endpoint = f"tcp://{address}:{rpc_port}"
    deadline = time.monotonic() + timeout
    procs = []
    try:
        for config in configs:
            rank = config.parallel_config.data_parallel_rank
            answer = _ask(context, endpoint, rank, deadline - time.monotonic())
            spec = TransportSpec("zmq", ZmqChannelSpec(answer["input_address"], answer["output_address"], None))
            proc = spawn_engine(config, [spec], None)
            proc.start()
            procs.append(proc)
            logger.info("engine %d started (pid %d), connecting to the head at %s", rank,
                        proc.pid, address)
        while any(p.is_alive() for p in procs):  # (a timeout too: is_alive reaps, a sentinel may lag)
            multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
        codes = [p.exitcode for p in procs]
        logger.info("engines exited with %s", codes)
        return 0 if all(c == 0 for c in codes) else 1
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
