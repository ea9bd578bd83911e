"""msgspec/msgpack encoding of messages into frames, with tensors kept out of the msgpack body.

``MsgpackEncoder.encode(obj)`` returns a frame list ``[main, aux1, aux2, ...]``:
``main`` is the msgpack body, and each large tensor's bytes travel as their own
frame, so they are copied once into the ring instead of through the msgpack
buffer. A tensor (``torch.Tensor`` or ``numpy.ndarray``) is encoded in the body
as ``[dtype, shape, data]`` where ``data`` is

- an ext value (code ``EXT_RAW_TENSOR``) holding the raw bytes, when the tensor
  has fewer than ``inline_threshold`` bytes (the *inline* tier), or
- an int: the index of the aux frame holding the bytes (the *aux frame* tier).

The out-of-band tier (a shared-memory pool on CPU, CUDA IPC on GPU) will be a
third form of ``data``, an ext value with its own code carrying a pool handle,
resolved by a pool object given to both the encoder and the decoder; the two
existing forms do not change.

Decoding is always typed (``MsgpackDecoder(SomeStruct)``): tensor fields must be
annotated ``torch.Tensor`` or ``numpy.ndarray``, and malformed input raises
``msgspec.ValidationError`` / ``msgspec.DecodeError``. Nothing is ever unpickled.
torch is never imported here: a tensor can only exist if its caller imported it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Union

import msgspec
import numpy as np

INLINE_THRESHOLD = 256
EXT_RAW_TENSOR = 1

FrameOut = Union[bytes, bytearray, memoryview]


class MsgpackEncoder:
    """Encode objects (msgspec structs and anything msgspec handles, plus tensors) into frames.

    Not thread-safe: use one encoder per thread.
    """

    def __init__(self, inline_threshold: int = INLINE_THRESHOLD) -> None:
        self.inline_threshold = inline_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._aux: list[FrameOut] | None = None

    def encode(self, obj: Any) -> list[FrameOut]:
        """A fresh ``bytes`` main frame followed by aux frames (memoryviews of the tensors)."""
        self._aux = frames = [b""]
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._aux = None
        return frames

    def encode_into(self, obj: Any, buf: bytearray) -> list[FrameOut]:
        """Like ``encode`` but the main frame is ``buf`` (resized), saving an allocation.
        The caller must not reuse ``buf`` until the frames have been sent."""
        self._aux = frames = [buf]
        try:
            self._encoder.encode_into(obj, buf)
        finally:
            self._aux = None
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._encode_torch(obj, torch)
        if isinstance(obj, np.ndarray):
            return self._encode_numpy(obj)
        raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")

    def _encode_torch(self, tensor: Any, torch: Any) -> list:
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()  # the CUDA IPC tier will avoid this copy
        t = t.resolve_conj().resolve_neg().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        return [str(t.dtype).removeprefix("torch."), list(t.shape), self._data(raw)]

    def _encode_numpy(self, arr: np.ndarray) -> list:
        if arr.dtype.hasobject:
            raise TypeError("numpy arrays of Python objects cannot be encoded")
        arr = np.ascontiguousarray(arr)
        raw = arr.reshape(-1).view(np.uint8)
        return [arr.dtype.str, list(arr.shape), self._data(raw)]

    def _data(self, raw: np.ndarray) -> msgspec.msgpack.Ext | int:
        """Inline ext for small tensors, else the index of a new aux frame."""
        view = memoryview(raw)
        if raw.nbytes < self.inline_threshold:
            return msgspec.msgpack.Ext(EXT_RAW_TENSOR, view)
        aux = self._aux
        assert aux is not None
        aux.append(view)
        return len(aux) - 1


def _check_size(shape: list, itemsize: int, buf: FrameOut) -> None:
    """Reject headers that disagree with their data (before anything is allocated)."""
    count = 1
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise ValueError(f"bad tensor shape {shape!r}")
        count *= dim
    if count * itemsize != len(buf):
        raise ValueError(f"tensor of shape {shape} needs {count * itemsize} bytes, got {len(buf)}")


class MsgpackDecoder:
    """Decode frames produced by ``MsgpackEncoder`` into ``type``. One per thread.

    numpy arrays are zero-copy, read-only views of the received frame; torch
    tensors are writable and get their own copy of the bytes.
    """

    def __init__(self, type: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type, dec_hook=self._dec_hook)
        self._frames: Sequence[FrameOut] = ()

    def decode(self, frames: Sequence[FrameOut]) -> Any:
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._frames = ()

    def _dec_hook(self, type: Any, obj: Any) -> Any:
        if type is np.ndarray:
            dtype, shape, buf = self._parts(obj)
            dt = np.dtype(dtype)
            if dt.hasobject:
                raise ValueError("refusing a numpy array of Python objects")
            _check_size(shape, dt.itemsize, buf)
            return np.frombuffer(buf, dtype=dt).reshape(shape)
        torch = sys.modules.get("torch")
        if torch is not None and type is torch.Tensor:
            dtype, shape, buf = self._parts(obj)
            dt = getattr(torch, dtype, None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"unknown torch dtype {dtype!r}")
            _check_size(shape, dt.itemsize, buf)
            if len(buf) == 0:
                return torch.empty(shape, dtype=dt)
            if isinstance(buf, bytes) or (isinstance(buf, memoryview) and buf.readonly):
                buf = bytearray(buf)  # torch tensors are writable: never alias immutable bytes
            return torch.frombuffer(buf, dtype=dt).reshape(shape)
        raise NotImplementedError(f"cannot decode objects of type {type!r}")

    def _parts(self, obj: Any) -> tuple[str, list[int], FrameOut]:
        if not (isinstance(obj, list) and len(obj) == 3):
            raise ValueError("a tensor must be encoded as [dtype, shape, data]")
        dtype, shape, data = obj
        if not isinstance(dtype, str) or not isinstance(shape, list):
            raise ValueError("malformed tensor header")
        if isinstance(data, msgspec.msgpack.Ext):
            if data.code != EXT_RAW_TENSOR:
                raise ValueError(f"unknown tensor ext code {data.code}")
            return dtype, shape, data.data
        if type(data) is int and 0 < data < len(self._frames):
            return dtype, shape, self._frames[data]
        raise ValueError(f"tensor data reference {data!r} matches no frame")
