"""msgpack frames with the inline and aux-frame tensor tiers, in process and across a real ring."""

from __future__ import annotations

import gc
import multiprocessing
import os

import msgspec
import numpy as np
import pytest
import torch

from core.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
    SchedulerStats,
    UtilityOutput,
)
from shm.channel import ChannelSpec, Duplex
from shm.serial import (
    _POOL_HANDLE,
    EXT_RAW_TENSOR,
    EXT_SHM_TENSOR,
    MsgpackDecoder,
    MsgpackEncoder,
)
from tests.support.pools import tensor_pool_pair


class TensorMessage(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    tensor: torch.Tensor
    array: np.ndarray | None = None
    more: list[torch.Tensor] = []
    note: str = ""


def _same_tensor(got: torch.Tensor, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


def _same_message(got: TensorMessage, want: TensorMessage) -> None:
    _same_tensor(got.tensor, want.tensor)
    if want.array is None:
        assert got.array is None
    else:
        assert got.array.dtype == want.array.dtype and got.array.shape == want.array.shape
        assert np.array_equal(got.array, want.array)
    assert len(got.more) == len(want.more)
    for g, w in zip(got.more, want.more):
        _same_tensor(g, w)
    assert got.note == want.note


def _wire(frames: list) -> list[bytes]:
    """What a receiver gets: plain bytes copies of every frame."""
    return [bytes(f) for f in frames]


def test_protocol_structs_round_trip() -> None:
    request = EngineCoreRequest(
        request_id="req-1",
        prompt_token_ids=[1, 2, 3, 50000],
        sampling_params=SamplingParams(max_tokens=5, temperature=0.0, stop=["\n"], seed=7),
        eos_token_id=2,
        arrival_time=12.5,
    )
    outputs = EngineCoreOutputs(
        engine_index=1,
        outputs=[
            EngineCoreOutput(request_id="a", new_token_ids=[5]),
            EngineCoreOutput(
                request_id="b",
                new_token_ids=[6, 7],
                finish_reason=FinishReason.STOP,
                stop_reason="\n",
                events=[EngineCoreEvent(EngineCoreEventType.SCHEDULED, 3.0)],
            ),
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25),
        utility_output=UtilityOutput(call_id=4, result=msgspec.Raw(msgspec.msgpack.encode([1, "x"]))),
    )
    encoder = MsgpackEncoder()
    for obj in (request, outputs):
        frames = encoder.encode(obj)
        assert len(frames) == 1  # no tensors: no aux frames
        assert MsgpackDecoder(type(obj)).decode(_wire(frames)) == obj


@pytest.mark.parametrize(
    "tensor, tier",
    [
        (torch.arange(6, dtype=torch.float32), "inline"),
        (torch.tensor(3.5), "inline"),  # 0-d
        (torch.zeros(0, 4), "inline"),  # empty
        (torch.tensor([True, False, True]), "inline"),
        (torch.randn(64, 33), "aux"),
        (torch.randn(40, 40).to(torch.bfloat16), "aux"),
        (torch.arange(1000, dtype=torch.int64).reshape(10, 100)[:, ::3], "aux"),  # not contiguous
        (torch.randn(16, 16, dtype=torch.float16).t(), "aux"),
    ],
    ids=lambda v: v if isinstance(v, str) else f"{str(v.dtype)[6:]}{list(v.shape)}",
)
def test_tensor_tiers(tensor: torch.Tensor, tier: str) -> None:
    message = TensorMessage(tensor=tensor, note="n")
    frames = MsgpackEncoder().encode(message)
    assert len(frames) == (1 if tier == "inline" else 2)
    decoded = MsgpackDecoder(TensorMessage).decode(_wire(frames))
    _same_message(decoded, message)
    decoded.tensor.zero_()  # writable, and owns its memory
    _same_message(MsgpackDecoder(TensorMessage).decode(_wire(frames)), message)


def test_numpy_arrays_and_tensor_lists() -> None:
    message = TensorMessage(
        tensor=torch.ones(2),
        array=np.arange(600, dtype=np.int32).reshape(20, 30)[::2],
        more=[torch.full((100,), 2.0), torch.tensor([1, 2], dtype=torch.int8), torch.randn(3, 50)],
    )
    frames = MsgpackEncoder().encode(message)
    assert len(frames) == 4  # array, more[0], more[2] exceed 256 bytes
    _same_message(MsgpackDecoder(TensorMessage).decode(_wire(frames)), message)


def test_inline_threshold_is_configurable() -> None:
    message = TensorMessage(tensor=torch.randn(100), array=np.zeros(3))
    assert len(MsgpackEncoder(inline_threshold=0).encode(message)) == 3
    assert len(MsgpackEncoder(inline_threshold=1 << 20).encode(message)) == 1
    for threshold in (0, 1 << 20):
        frames = MsgpackEncoder(inline_threshold=threshold).encode(message)
        _same_message(MsgpackDecoder(TensorMessage).decode(_wire(frames)), message)


def test_encode_into_reuses_the_buffer() -> None:
    encoder = MsgpackEncoder()
    buf = bytearray()
    message = TensorMessage(tensor=torch.randn(300), note="x" * 50)
    frames = encoder.encode_into(message, buf)
    assert frames[0] is buf and len(frames) == 2
    assert bytes(buf) == encoder.encode(message)[0]
    _same_message(MsgpackDecoder(TensorMessage).decode(_wire(frames)), message)


def _tensor_body(dtype: str, shape: list, data) -> bytes:
    return msgspec.msgpack.encode([[dtype, shape, data]])


@pytest.mark.parametrize(
    "frames",
    [
        [_tensor_body("system", [1], msgspec.msgpack.Ext(EXT_RAW_TENSOR, b"\0" * 4))],  # not a dtype
        [_tensor_body("float32", [2], msgspec.msgpack.Ext(EXT_RAW_TENSOR, b"\0" * 4))],  # wrong size
        [_tensor_body("float32", [1], msgspec.msgpack.Ext(99, b"\0" * 4))],  # unknown ext
        [_tensor_body("float32", [10**12], msgspec.msgpack.Ext(EXT_RAW_TENSOR, b""))],  # huge, no data
        [_tensor_body("float32", [-1], msgspec.msgpack.Ext(EXT_RAW_TENSOR, b"\0" * 4))],
        [_tensor_body("float32", [1], 1)],  # aux frame that does not exist
        [_tensor_body("float32", [1], 0)],  # the main frame is not an aux frame
        [_tensor_body("float32", [1], True), b"\0" * 4],
        [msgspec.msgpack.encode([["float32", [1]]])],
        [b"\xc1"],  # not msgpack
    ],
)
def test_malformed_frames_raise(frames: list[bytes]) -> None:
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
        MsgpackDecoder(TensorMessage).decode(frames)


def test_object_arrays_are_refused() -> None:
    with pytest.raises(TypeError):
        MsgpackEncoder().encode(TensorMessage(tensor=torch.ones(1), array=np.array([object()])))
    frames = [msgspec.msgpack.encode([["float32", [1], msgspec.msgpack.Ext(EXT_RAW_TENSOR, b"\0" * 4)], ["|O", [1], 1]]), b"\0" * 8]
    with pytest.raises(msgspec.ValidationError):
        MsgpackDecoder(TensorMessage).decode(frames)


def _reencode_child(spec: ChannelSpec) -> None:
    """Decode every message into TensorMessage and send it back re-encoded."""
    duplex = Duplex.attach(spec)
    ppid = os.getppid()
    duplex.set_peer(lambda: os.getppid() == ppid, sentinel=os.pidfd_open(ppid))
    duplex.sender.send([b"HELLO"])
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(TensorMessage)
    while (frames := duplex.receiver.recv()) != [b"Q"]:
        duplex.sender.send(encoder.encode(decoder.decode(frames)))
    duplex.close()


def test_tensors_travel_between_processes() -> None:
    duplex, spec = Duplex.create(1 << 16)
    proc = multiprocessing.get_context("spawn").Process(target=_reencode_child, args=(spec,), daemon=True)
    proc.start()
    try:
        duplex.set_peer(proc.is_alive, proc.sentinel)
        assert duplex.receiver.recv(timeout=120) == [b"HELLO"]
        duplex.unlink()
        messages = [
            TensorMessage(tensor=torch.arange(4)),
            TensorMessage(tensor=torch.randn(512, 512), array=np.arange(10.0)),  # 1 MiB: chunked
            TensorMessage(tensor=torch.randn(100, 7).to(torch.bfloat16), more=[torch.ones(3), torch.zeros(0)]),
        ]
        encoder, decoder = MsgpackEncoder(), MsgpackDecoder(TensorMessage)
        for message in messages:
            duplex.sender.send(encoder.encode(message), timeout=120)
            _same_message(decoder.decode(duplex.receiver.recv(timeout=120)), message)
        duplex.sender.send([b"Q"])
        proc.join(timeout=120)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        duplex.close()


# ------------------------------------------------------------ out-of-band tier


@pytest.fixture
def pool_pair():
    """A producer and a consumer view of one small pool, as two processes would have."""
    with tensor_pool_pair(1 << 16) as pair:
        yield pair


def test_pool_tier_is_zero_copy_and_released_when_collected(pool_pair) -> None:
    writer, reader = pool_pair
    message = TensorMessage(tensor=torch.randn(64, 33), array=np.arange(500.0), more=[torch.ones(2)])
    frames = MsgpackEncoder(pool=writer).encode(message)
    assert len(frames) == 1  # both large tensors went out of band, the small one inline
    assert writer.bytes_in_use > 64 * 33 * 4
    decoded = MsgpackDecoder(TensorMessage, pool=reader).decode(_wire(frames))
    _same_message(decoded, message)
    decoded.tensor.add_(1)  # writable: it is the pool's memory
    assert not torch.equal(decoded.tensor, message.tensor)
    view = decoded.tensor[3]  # a view keeps the region alive after the tensor itself is gone
    del decoded
    gc.collect()
    writer._reclaim()
    assert writer.bytes_in_use > 0
    del view
    gc.collect()
    writer._reclaim()
    assert writer.bytes_in_use == 0


def test_full_pool_falls_back_to_aux_frames(pool_pair) -> None:
    writer, reader = pool_pair
    encoder, decoder = MsgpackEncoder(pool=writer), MsgpackDecoder(TensorMessage, pool=reader)
    big = TensorMessage(tensor=torch.randn(6000))  # 24 kB: two fit in the 64 kB pool
    held = [decoder.decode(_wire(encoder.encode(big))) for _ in range(2)]
    frames = encoder.encode(big)
    assert len(frames) == 2 and writer.fallbacks == 1  # no room: an aux frame instead
    _same_message(decoder.decode(_wire(frames)), big)
    held.clear()
    gc.collect()
    assert len(encoder.encode(big)) == 1  # released regions are reused


def test_pool_handles_are_checked(pool_pair) -> None:
    writer, reader = pool_pair
    ok = _POOL_HANDLE.pack(0, 400)
    body = _tensor_body("float32", [100], msgspec.msgpack.Ext(EXT_SHM_TENSOR, ok))
    with pytest.raises(msgspec.ValidationError, match="no tensor pool"):
        MsgpackDecoder(TensorMessage).decode([body])
    with pytest.raises(msgspec.ValidationError, match="does not match a region"):
        MsgpackDecoder(TensorMessage, pool=reader).decode([body])  # nothing was put there
    for bad in (_POOL_HANDLE.pack(1 << 40, 4), _POOL_HANDLE.pack(8, 4), b"\0" * 3):
        body = _tensor_body("float32", [1], msgspec.msgpack.Ext(EXT_SHM_TENSOR, bad))
        with pytest.raises(msgspec.ValidationError):
            MsgpackDecoder(TensorMessage, pool=reader).decode([body])
