"""A hypothesis-driven fuzzer of the request ring: arbitrary and mutated frames written
into a live EngineCore process (shared-memory rings), each batch followed by a valid
request that must come back token for token as it does on a clean engine.

What a frame may do: be rejected with a logged error, or (a mutation that still makes
sense) run as a request or an abort of its own. What it may not do: crash the engine,
stop its input thread, or touch the concurrent valid request.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.client import SyncMPClient
from core.config import EngineArgs
from core.protocol import EngineCoreRequest, EngineCoreRequestType, SamplingParams
from core.utilities import GET_NUM_UNFINISHED_REQUESTS, UTILITIES, UtilityCall

ADD, ABORT, UTILITY, WAKEUP = (t.value for t in EngineCoreRequestType)
PROMPT = [5, 6, 7, 8]


def _request(request_id: str, prompt: list[int], max_tokens: int = 4, **params) -> EngineCoreRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=sampling)


TEMPLATES = {
    ADD: [
        msgspec.msgpack.encode(_request("fuzz-a", [1, 2, 3])),
        msgspec.msgpack.encode(_request("fuzz-b", [9] * 20, stop=["x"], logprobs=2, seed=3)),
    ],
    ABORT: [msgspec.msgpack.encode(["fuzz-a", "nobody"])],
    UTILITY: [
        msgspec.msgpack.encode([0, 10**6, "no_such_method", {}]),
        msgspec.msgpack.encode([0, 10**6 + 1, "pause_scheduler", {"mode": "sometimes"}]),  # a bad argument
    ],
}

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn, template: bytes) -> bytes:
    data = bytearray(template)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "repeat"]))
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC1, 0xCF, 0xD3, 0xDC, 0xDD, 0xDF, 0xFF]))
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            data[i:i] = data[i : i + draw(st.integers(1, 16))]
    return bytes(data)


@st.composite
def frames(draw: st.DrawFn) -> list[bytes]:
    kind = draw(st.sampled_from([ADD, ABORT, UTILITY, WAKEUP, b"", b"\x02", b"\x7f", b"\x00\x00"]))
    source = draw(st.sampled_from(["bytes", "msgpack", "mutated", "verbatim"]))
    if source == "verbatim":  # a valid message, perhaps sent twice in a batch
        body = draw(st.sampled_from(TEMPLATES.get(kind, TEMPLATES[ADD])))
    elif source == "bytes":
        body = draw(st.binary(max_size=64))
    elif source == "msgpack":
        body = msgspec.msgpack.encode(draw(msgpack_values))
    else:
        body = draw(mutated(draw(st.sampled_from(TEMPLATES.get(kind, TEMPLATES[ADD])))))
    extra = draw(st.lists(st.binary(max_size=16), max_size=2))
    return [kind, body, *extra][: draw(st.integers(1, 4))]


def _is_control_call(message: list[bytes]) -> bool:
    """A well-formed call of a real utility (pause, sleep...) is a valid command, not fuzz."""
    if len(message) != 2 or message[0] != UTILITY:
        return False
    try:
        call = msgspec.msgpack.decode(message[1], type=UtilityCall)
        UTILITIES[call.method].decode_args(call.args)
    except (msgspec.DecodeError, ValueError, RecursionError, KeyError):  # invalid UTF-8 is a ValueError
        return False
    return True


def _surely_malformed(message: list[bytes]) -> bool:
    """Rejected whatever the engine's checks: an unknown type, or a body that is not msgpack."""
    if message[0] not in (ADD, ABORT, UTILITY, WAKEUP):
        return True
    if message[0] == WAKEUP:
        return False
    if len(message) < 2:
        return True
    try:
        msgspec.msgpack.decode(message[1])
    except (msgspec.DecodeError, ValueError, RecursionError):  # invalid UTF-8 is a ValueError
        return True
    return False


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """A live EngineCore process (shm transport) whose stderr goes to ``engine.engine_log``."""
    log_path = tmp_path_factory.mktemp("fuzz") / "engine.log"
    saved = os.dup(2)
    with open(log_path, "wb") as log:
        os.dup2(log.fileno(), 2)  # the spawned engine inherits this fd 2
        try:
            client = SyncMPClient(EngineArgs(model=tiny_llama_dir, transport="shm", max_model_len=128).resolve())
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    client.engine_log = log_path
    client.reference = _run(client, "reference")
    client.sent_malformed = 0
    yield client
    client.shutdown()


def _run(client: SyncMPClient, request_id: str) -> list[int]:
    """The valid request's tokens; other requests' outputs (fuzz that ran) are skipped."""
    client.add_request(_request(request_id, PROMPT))
    tokens: list[int] = []
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"{request_id} did not finish: the engine stopped serving"
        for out in client.get_output().outputs:
            if out.request_id == request_id:
                tokens += out.new_token_ids
                if out.finished:
                    assert str(out.finish_reason) == "length", out
                    return tokens


@settings(
    max_examples=60, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=st.lists(frames(), min_size=1, max_size=8), replay=st.booleans(), counter=st.integers(0, 10**9))
def test_fuzzed_frames_never_crash_the_engine_nor_touch_a_valid_request(
    engine: SyncMPClient, batch, replay: bool, counter: int
) -> None:
    for message in batch * (2 if replay else 1):  # a replayed batch repeats its messages
        if _is_control_call(message):
            continue
        engine.sent_malformed += _surely_malformed(message)
        with engine._send_lock:
            engine.transport.send(message)
    assert _run(engine, f"valid-{counter}-{time.monotonic_ns()}") == engine.reference
    assert engine.engine_dead is None and engine.proc.is_alive()


def test_the_fuzzed_engine_logged_every_malformed_frame_and_is_idle(engine: SyncMPClient) -> None:
    """Runs after the fuzzer (same module, same engine)."""
    deadline = time.monotonic() + 30
    while engine.call(GET_NUM_UNFINISHED_REQUESTS()) and time.monotonic() < deadline:
        time.sleep(0.05)  # fuzz frames that ran as requests finish on their own
    assert engine.call(GET_NUM_UNFINISHED_REQUESTS()) == 0
    log = Path(engine.engine_log).read_text(errors="replace")
    assert log.count("rejected a malformed message") >= engine.sent_malformed > 0
    assert "fatal error" not in log


def test_a_repeated_request_id_is_dropped_not_fatal(engine: SyncMPClient) -> None:
    """Found by the fuzzer (a replayed batch): the same ADD twice made the scheduler raise
    in the busy loop, which killed the engine. The second copy is now dropped with a
    logged error."""
    frame = [ADD, msgspec.msgpack.encode(_request("twice", PROMPT, max_tokens=64))]
    with engine._send_lock:
        engine.transport.send(frame)
        engine.transport.send(frame)
    assert _run(engine, "after-twice") == engine.reference
    assert engine.engine_dead is None
    assert "request id 'twice' is already running" in Path(engine.engine_log).read_text(errors="replace")
