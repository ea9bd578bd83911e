"""Engine clients: how the frontend reaches an EngineCore.

- ``InprocClient``: the EngineCore lives in this process; ``get_output`` steps it.
- ``SyncMPClient``: spawned EngineCore process; a reader thread collects outputs.
- ``AsyncMPClient``: spawned EngineCore process; outputs are read on the event
  loop (the transport's doorbell is registered with ``loop.add_reader``).

Every multi-process client watches its engine: a dead process or an
ENGINE_CORE_DEAD message turns into ``EngineDeadError`` for every waiter.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any

import msgspec

from core.config import EngineConfig
from core.engine_core import EngineCore, run_engine_core
from core.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineDeadError,
    HandshakeReady,
)
from core.transport import ClientTransport, PeerDeadError
from shm.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger("ringllm.client")

STARTUP_TIMEOUT_S = 300.0


class InprocClient:
    """No IPC: for tests and the offline ``LLM`` class."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine_core = EngineCore(config)
        self.max_model_len = self.engine_core.config.max_model_len
        self.num_gpu_blocks = self.engine_core.num_gpu_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(self.engine_core.preprocess_add_request(request))

    def get_output(self) -> EngineCoreOutputs:
        outputs, _ = self.engine_core.step_fn()
        return outputs.get(0) or EngineCoreOutputs()

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, list(args))

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class MPClient:
    """Spawns the EngineCore process, runs the handshake, owns the transport."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config.resolve()
        self.transport, spec = ClientTransport.create(self.config.transport)
        # Large request tensors go out of band through the transport's pool,
        # CUDA ones as IPC handles (shm only).
        self.encoder = MsgpackEncoder(pool=self.transport.pool_writer, cuda_ipc=self.transport.cuda_exporter)
        self.decoder = MsgpackDecoder(
            EngineCoreOutputs, pool=self.transport.pool_reader, cuda_ipc=self.transport.cuda_importer
        )
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(self.config, spec, os.getpid()),
            name="EngineCore",
            daemon=True,
        )
        try:
            self.proc.start()
        except BaseException:
            self.transport.close()  # nobody will attach: remove the segments now
            raise
        self.transport.set_peer(self.proc.is_alive, self.proc.sentinel)
        self.engine_dead: EngineDeadError | None = None
        self._closing = False  # set by shutdown(): the engine's exit is expected
        self._call_ids = itertools.count()
        try:
            ready = self._handshake()
        except BaseException:
            self._stop_process()
            self.transport.close()
            raise
        self.ready = ready  # what the engine reported: KV cache size, dtype, device
        self.num_gpu_blocks = ready.num_gpu_blocks
        self.max_model_len = ready.max_model_len

    def _handshake(self) -> HandshakeReady:
        """HELLO when the engine attached to the transport, READY once it can serve."""
        deadline_msg = "EngineCore did not become ready in time"
        for expected in (b"HELLO", b"READY"):
            try:
                frames = self.transport.recv(timeout=STARTUP_TIMEOUT_S)
            except PeerDeadError:
                raise RuntimeError(
                    f"EngineCore process exited during start-up (exit code {self.proc.exitcode})"
                ) from None
            if frames is None:
                raise TimeoutError(deadline_msg)
            if bytes(frames[0]) == ENGINE_CORE_DEAD:
                raise RuntimeError(bytes(frames[1]).decode() if len(frames) > 1 else "EngineCore died")
            if bytes(frames[0]) != expected:
                raise RuntimeError(f"handshake: expected {expected!r}, got {bytes(frames[0])[:32]!r}")
            if expected == b"HELLO":
                # Both sides hold the channel: drop its names now, so that nothing
                # is left in /dev/shm even if both processes are killed.
                self.transport.engine_attached(timeout=STARTUP_TIMEOUT_S)
        return msgspec.msgpack.decode(frames[1], type=HandshakeReady)

    def _decode_outputs(self, frames: list) -> EngineCoreOutputs:
        if bytes(frames[0]) == ENGINE_CORE_DEAD:
            detail = bytes(frames[1]).decode() if len(frames) > 1 else ""
            raise EngineDeadError(f"EngineCore died: {detail}".rstrip(": "))
        return self.decoder.decode(frames)

    def _frames(self, request_type: EngineCoreRequestType, payload: Any) -> list:
        """[type byte, msgpack body, aux frames...]; not thread-safe (the encoder is not)."""
        return [request_type.value, *self.encoder.encode(payload)]

    def _mark_dead(self, exc: BaseException) -> EngineDeadError:
        if self.engine_dead is None:
            if self._closing:
                self.engine_dead = EngineDeadError("the engine client was shut down")
                return self.engine_dead
            self.engine_dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
                f"EngineCore process died (exit code {self.proc.exitcode})"
            )
            logger.error("%s", self.engine_dead)
        return self.engine_dead

    def _stop_process(self) -> None:
        """SIGTERM (the engine drains briefly), then SIGKILL if it lingers."""
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=self.config.engine_drain_timeout + 5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)

    def shutdown(self) -> None:
        self._closing = True
        self._stop_process()
        self._join_reader()
        self.transport.close()

    def _join_reader(self) -> None:
        """Wait for whatever reads the transport to stop (it sees the engine exit)."""


class SyncMPClient(MPClient):
    """Blocking client: a reader thread feeds outputs and utility replies."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.outputs_queue: queue.Queue[EngineCoreOutputs | Exception] = queue.Queue()
        self.utility_results: dict[int, Future] = {}
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_outputs, name="EngineCoreOutputReader", daemon=True)
        self._reader.start()

    def _join_reader(self) -> None:
        self._reader.join(timeout=5)

    def _read_outputs(self) -> None:
        while True:
            try:
                frames = self.transport.recv()
                outputs = self._decode_outputs(frames)
            except (PeerDeadError, EngineDeadError, OSError, ValueError) as exc:
                dead = self._mark_dead(exc)
                for fut in self.utility_results.values():
                    fut.set_exception(dead)
                self.utility_results.clear()
                self.outputs_queue.put(dead)
                return
            if outputs.utility_output is not None:
                fut = self.utility_results.pop(outputs.utility_output.call_id, None)
                if fut is not None:
                    _resolve_utility(fut, outputs.utility_output)
            else:
                self.outputs_queue.put(outputs)

    def _send(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if self.engine_dead is not None:
            raise self.engine_dead
        with self._send_lock:
            try:
                self.transport.send(self._frames(request_type, payload))
            except PeerDeadError as exc:
                raise self._mark_dead(exc) from None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, request_ids)

    def get_output(self) -> EngineCoreOutputs:
        item = self.outputs_queue.get()
        if isinstance(item, Exception):
            self.outputs_queue.put(item)  # every later caller fails too
            raise item
        return item

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        fut: Future = Future()
        self.utility_results[call_id] = fut
        self._send(EngineCoreRequestType.UTILITY, (0, call_id, method, list(args)))
        return fut.result()


class AsyncMPClient(MPClient):
    """asyncio client: outputs are read on the loop, without a thread."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | Exception] | None = None
        self.utility_results: dict[int, asyncio.Future] = {}
        self._reader_task: asyncio.Task | None = None
        self._send_lock: asyncio.Lock | None = None

    def _ensure_reader(self) -> None:
        if self._reader_task is None:
            self.outputs_queue = asyncio.Queue()
            self._send_lock = asyncio.Lock()
            self._reader_task = asyncio.get_running_loop().create_task(self._read_outputs())

    async def _read_outputs(self) -> None:
        assert self.outputs_queue is not None
        while True:
            try:
                frames = await self.transport.recv_async()
                outputs = self._decode_outputs(frames)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                dead = self._mark_dead(exc)
                for fut in self.utility_results.values():
                    if not fut.done():
                        fut.set_exception(dead)
                self.utility_results.clear()
                self.outputs_queue.put_nowait(dead)
                return
            if outputs.utility_output is not None:
                fut = self.utility_results.pop(outputs.utility_output.call_id, None)
                if fut is not None and not fut.done():
                    _resolve_utility(fut, outputs.utility_output)
            else:
                self.outputs_queue.put_nowait(outputs)

    async def _send(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        self._ensure_reader()
        if self.engine_dead is not None:
            raise self.engine_dead
        assert self._send_lock is not None
        async with self._send_lock:  # keeps message order when a send has to wait
            try:
                await self.transport.send_async(self._frames(request_type, payload))
            except PeerDeadError as exc:
                raise self._mark_dead(exc) from None

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(EngineCoreRequestType.ABORT, request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_reader()
        assert self.outputs_queue is not None
        item = await self.outputs_queue.get()
        if isinstance(item, Exception):
            self.outputs_queue.put_nowait(item)
            raise item
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self.utility_results[call_id] = fut
        await self._send(EngineCoreRequestType.UTILITY, (0, call_id, method, list(args)))
        return await fut

    def shutdown(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        self.transport.stop_async()
        super().shutdown()


def _resolve_utility(fut: Any, out: Any) -> None:
    if out.failure_message is not None:
        fut.set_exception(RuntimeError(out.failure_message))
    else:
        fut.set_result(out.result)
