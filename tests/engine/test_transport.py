"""The transport as the engine uses it: a real EngineCore process behind a SyncMPClient
or a real server, malformed input, out-of-band tensors, and crashes of either side."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import torch

from core.client import SyncMPClient
from core.config import EngineArgs, EngineConfig
from core.protocol import EngineCoreRequest, EngineCoreRequestType, SamplingParams
from core.utilities import (
    GET_NUM_UNFINISHED_REQUESTS,
    IS_SCHEDULER_PAUSED,
    PAUSE_SCHEDULER,
    Call,
    NoArgs,
    Utility,
)
from tests.support.servers import mapped_segments, wait_gone

TRANSPORTS = ["shm", "zmq"]


def _config(model_dir: str, transport: str, **overrides) -> EngineConfig:
    return EngineArgs(
        model=model_dir, transport=transport, max_model_len=256, max_num_batched_tokens=64,
        enable_prompt_embeds=True, **overrides,
    ).resolve()


def _request(request_id: str, prompt: list[int] | None = None, embeds: torch.Tensor | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt or [],
        prompt_embeds=embeds,
        sampling_params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )


def _run_to_completion(client: SyncMPClient, request_ids: set[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r: [] for r in request_ids}
    pending = set(request_ids)
    deadline = time.monotonic() + 60
    while pending:
        assert time.monotonic() < deadline, f"requests {pending} did not finish"
        for out in client.get_output().outputs:
            if out.request_id in tokens:
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    assert str(out.finish_reason) == "length", out
                    pending.discard(out.request_id)
    return tokens


@pytest.fixture(params=TRANSPORTS)
def client(request, tiny_llama_dir: str, tmp_path: Path):
    """A SyncMPClient whose EngineCore process writes its stderr to ``client.engine_log``."""
    log_path = tmp_path / "engine.log"
    saved = os.dup(2)
    with open(log_path, "wb") as log:
        os.dup2(log.fileno(), 2)  # the spawned engine inherits this fd 2
        try:
            client = SyncMPClient(_config(tiny_llama_dir, request.param))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    client.engine_log = log_path
    yield client
    client.shutdown()


def _send_raw(client: SyncMPClient, frames: list) -> None:
    with client._send_lock:
        client.transport.send(frames)


def test_malformed_frames_are_rejected_and_the_engine_keeps_serving(client: SyncMPClient) -> None:
    valid = msgspec.msgpack.encode(_request("x", [1, 2, 3]))
    add, abort = EngineCoreRequestType.ADD.value, EngineCoreRequestType.ABORT.value
    bad_messages = [
        [add, b"\xc1\xc1\xc1"],  # not msgpack
        [add, valid[: len(valid) // 2]],  # truncated
        [add, msgspec.msgpack.encode(["x", "not token ids"])],  # wrong types
        [add],  # no body
        [b"\x7f", valid],  # unknown request type
        [b"", valid],
        [abort, msgspec.msgpack.encode({"not": "a list"})],
        [EngineCoreRequestType.UTILITY.value, msgspec.msgpack.encode([0, 1])],  # short utility call
        [abort, msgspec.msgpack.encode(["x"]), b"extra frame"],
    ]
    for frames in bad_messages:
        _send_raw(client, frames)
    client.add_request(_request("good", [5, 6, 7]))
    assert len(_run_to_completion(client, {"good"})["good"]) == 4
    assert client.call(GET_NUM_UNFINISHED_REQUESTS()) == 0  # still answering
    log = client.engine_log.read_text()
    assert log.count("rejected a malformed message") == len(bad_messages), log


def test_a_sigterm_taken_by_another_thread_still_stops_an_idle_engine(client: SyncMPClient) -> None:
    """The kernel hands a process's signal to any of its threads that does not block it, and
    Python runs the handler in the main thread only, when that thread next runs Python: an idle
    engine, parked on its input queue, must still wake for a SIGTERM another thread took.
    On Linux, kill() given a thread's id offers the process's signal to that thread first."""
    assert client.call(GET_NUM_UNFINISHED_REQUESTS()) == 0  # idle, its threads all started
    pid = client.proc.pid
    others = sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task") if int(tid) != pid)
    os.kill(others[0], signal.SIGTERM)
    assert wait_gone(pid, 60), "the idle engine did not stop on its SIGTERM"
    client.proc.join(10)
    assert client.proc.exitcode == 0  # a drain (of nothing) and a clean exit, not a kill


def test_utility_arguments_are_decoded_typed_by_the_engine(client: SyncMPClient) -> None:
    """A call whose arguments are not the utility's (sent by hand: the client's binding
    refuses them first) is answered with the engine's message, not run or dropped."""
    bad = msgspec.structs.replace(PAUSE_SCHEDULER().args, mode="sometimes")
    with pytest.raises(RuntimeError, match=r"utility 'pause_scheduler' failed: .*Invalid enum value 'sometimes'"):
        client.call(Call(PAUSE_SCHEDULER, bad))
    with pytest.raises(RuntimeError, match="unknown utility method 'no_such_method'"):
        client.call(Call(Utility("no_such_method", NoArgs, bool, all), NoArgs()))
    assert client.call(IS_SCHEDULER_PAUSED()) is False  # nothing was paused
    assert client.call(GET_NUM_UNFINISHED_REQUESTS()) == 0


def test_requests_the_engine_cannot_run_finish_with_an_error(client: SyncMPClient) -> None:
    client.add_request(_request("oov", [10**6]))
    client.add_request(_request("wide", embeds=torch.zeros(3, 65)))
    client.add_request(_request("ok", [1]))
    errors, deadline = {}, time.monotonic() + 60
    while len(errors) < 2:
        assert time.monotonic() < deadline
        for out in client.get_output().outputs:
            if out.finished and str(out.finish_reason) == "error":
                errors[out.request_id] = out.stop_reason
    assert "vocabulary" in errors["oov"] and "shape" in errors["wide"]


def test_prompt_embeds_travel_out_of_band_and_the_pool_is_handed_back(tiny_llama_dir: str) -> None:
    client = SyncMPClient(_config(tiny_llama_dir, "shm"))
    try:
        writer = client.transport.pool_writer
        assert client.encoder.cuda_ipc is client.transport.cuda_exporter is not None  # CUDA tensors: IPC
        embeds = torch.randn(100, 64, generator=torch.Generator().manual_seed(0))
        client.add_request(_request("e1", embeds=embeds))
        client.add_request(_request("e2", embeds=embeds.clone()))
        client.add_request(_request("t", [3, 4, 5]))
        tokens = _run_to_completion(client, {"e1", "e2", "t"})
        assert tokens["e1"] == tokens["e2"]  # same embeddings, same greedy tokens
        assert writer.fallbacks == 0 and writer._tail >= 2 * embeds.nbytes  # both went through the pool
        writer._reclaim()
        assert writer.bytes_in_use == 0  # the engine released both regions
    finally:
        client.shutdown()


# ------------------------------------------------------------------ crashes


@pytest.mark.parametrize("victims", ["frontend", "both"])
def test_kill_9_leaves_no_orphan_and_nothing_in_dev_shm(random_model_dir: str, server_factory, victims: str) -> None:
    server = server_factory(["--model", random_model_dir, "--max-model-len", "512"])
    engine = server.engine_pid()
    segments = mapped_segments(engine)
    assert len(segments) >= 4  # two rings and two tensor pools, mapped
    assert not any(os.path.exists(p) for p in segments)  # names already removed after the handshake
    os.kill(server.proc.pid, signal.SIGKILL)
    if victims == "both":
        os.kill(engine, signal.SIGKILL)
    server.proc.wait(timeout=10)
    assert wait_gone(engine, 10), "the EngineCore outlived its frontend"
    assert not any(os.path.exists(p) for p in segments)


def test_a_failed_spawn_leaves_nothing_in_dev_shm(tiny_llama_dir: str, monkeypatch) -> None:
    import multiprocessing.context

    from shm.segment import SHM_DIR

    def refuse(self) -> None:
        raise OSError("no more processes")

    def ours() -> set[str]:  # ring and pool segments, and the doorbells' FIFO directory
        dirs = (SHM_DIR, tempfile.gettempdir())
        return {os.path.join(d, n) for d in dirs for n in os.listdir(d) if n.startswith("ringllm-")}

    before = ours()
    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", refuse)
    with pytest.raises(OSError, match="no more processes"):
        SyncMPClient(_config(tiny_llama_dir, "shm"))
    assert ours() <= before
