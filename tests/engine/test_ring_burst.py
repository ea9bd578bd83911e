"""A burst through rings made small enough to fill, in both directions: the client
writes requests faster than the engine takes them, and the engine writes outputs
(logprobs, with the tensor pool too small to hold them) faster than the client
reads. Back-pressure must neither deadlock nor drop: count in = count out."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from core.client import SyncMPClient
from core.config import EngineArgs
from core.protocol import EngineCoreRequest, SamplingParams
from core.utilities import GET_NUM_UNFINISHED_REQUESTS

BURST = 400
TOKENS = 6


def test_a_burst_through_full_rings_loses_nothing(tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Sizes only (no behaviour replaced): 64 KiB rings, 64 KiB tensor pools.
    monkeypatch.setattr("core.transport.RING_CAPACITY", 1 << 16)
    monkeypatch.setattr("core.transport.POOL_TO_ENGINE_BYTES", 1 << 16)
    monkeypatch.setattr("core.transport.POOL_TO_CLIENT_BYTES", 1 << 16)
    client = SyncMPClient(EngineArgs(model=tiny_llama_dir, transport="shm", max_model_len=256, max_num_seqs=128).resolve())
    try:
        def burst() -> None:
            for i in range(BURST):
                params = SamplingParams(
                    max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=20, prompt_logprobs=20
                )
                client.add_request(EngineCoreRequest(
                    request_id=f"r{i}", prompt_token_ids=[(i * 7 + j) % 200 + 1 for j in range(200)],
                    sampling_params=params,
                ))

        # The engine stopped (SIGSTOP) reads nothing: the request ring surely fills, and
        # the sender waits, until the engine goes on.
        os.kill(client.proc.pid, signal.SIGSTOP)
        try:
            sender = threading.Thread(target=burst)
            sender.start()
            deadline = time.monotonic() + 30
            while client.transport.stats().ring_full_waits == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            os.kill(client.proc.pid, signal.SIGCONT)
        sender.join(timeout=60)
        assert not sender.is_alive()
        tokens: dict[str, int] = {}
        finished: set[str] = set()
        engine_waits = 0
        deadline = time.monotonic() + 120
        while len(finished) < BURST:
            assert time.monotonic() < deadline, f"{BURST - len(finished)} requests never finished"
            outputs = client.get_output()
            if outputs.engine_stats is not None and outputs.engine_stats.transport is not None:
                engine_waits = outputs.engine_stats.transport.ring_full_waits
            for out in outputs.outputs:
                assert out.request_id not in finished, f"output after the end of {out.request_id}"
                tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
                if out.finished:
                    assert str(out.finish_reason) == "length"
                    finished.add(out.request_id)
        assert tokens == {f"r{i}": TOKENS for i in range(BURST)}
        assert client.transport.stats().ring_full_waits > 0  # the request ring was full
        assert engine_waits > 0  # and the output ring (3 MB of logprobs through 64 KiB)
        assert client.call(GET_NUM_UNFINISHED_REQUESTS()) == 0
    finally:
        client.shutdown()
