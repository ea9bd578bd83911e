"""msgspec/msgpack encoding of messages into frames, with tensors kept out of the msgpack body.

``MsgpackEncoder.encode(obj)`` returns a frame list ``[main, aux1, aux2, ...]``:
``main`` is the msgpack body. A tensor (``torch.Tensor`` or ``numpy.ndarray``)
is encoded in the body as ``[dtype, shape, data]``; per tensor, ``data`` is

- *inline*: an ext value (``EXT_RAW_TENSOR``) holding the raw bytes, for CPU
  tensors under ``inline_threshold`` bytes;
- *out of band*: an ext value holding a handle, when the encoder was given a
  pool and the pool has room: ``EXT_SHM_TENSOR`` (offset, nbytes) in a
  ``shm.tensors`` shared-memory pool for CPU tensors, ``EXT_CUDA_IPC`` (a CUDA
  IPC handle) for CUDA tensors when a CUDA exporter is wired up;
- an *aux frame*: an int, the index of the frame holding the bytes (the
  fallback: large tensors with no pool, or a full pool).

Decoding is always typed (``MsgpackDecoder(SomeStruct)``): tensor fields must be
annotated ``torch.Tensor`` or ``numpy.ndarray``, and malformed input raises
``msgspec.ValidationError`` / ``msgspec.DecodeError``. Nothing is ever unpickled.
torch is never imported here: a tensor can only exist if its caller imported it.
Decoded arrays are zero-copy wherever the bytes outlive the call: views of the
received frame (numpy) or of the shared pool (numpy and torch, handed back to
the producer once garbage collected); torch tensors from frames get their own
copy, since frames are immutable and torch tensors are writable.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from shm.cuda_ipc import CudaIpcExporter, CudaIpcImporter
from shm.ring import Frame
from shm.tensors import PoolHandle, TensorPoolReader, TensorPoolWriter

INLINE_THRESHOLD = 256
EXT_RAW_TENSOR = 1
EXT_SHM_TENSOR = 2
EXT_CUDA_IPC = 3

_POOL_HANDLE = struct.Struct("<QQ")  # offset, nbytes



class MsgpackEncoder:
    """Encode objects (msgspec structs and anything msgspec handles, plus tensors) into frames.

    ``pool`` enables the out-of-band tier for CPU tensors, ``cuda_ipc`` for CUDA
    tensors (without it they are copied to the host first). Not thread-safe:
    use one encoder per thread.
    """

    def __init__(
        self,
        inline_threshold: int = INLINE_THRESHOLD,
        pool: TensorPoolWriter | None = None,
        cuda_ipc: CudaIpcExporter | None = None,
    ) -> None:
        self.inline_threshold = inline_threshold
        self.pool = pool
        self.cuda_ipc = cuda_ipc
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._aux: list[Frame] | None = None

    def encode(self, obj: Any) -> list[Frame]:
        """A fresh ``bytes`` main frame followed by aux frames (memoryviews of the tensors)."""
        self._aux = frames = [b""]
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._aux = None
        return frames

    def encode_into(self, obj: Any, buf: bytearray) -> list[Frame]:
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
        dtype = str(t.dtype).removeprefix("torch.")
        if t.device.type == "cuda":
            if self.cuda_ipc is not None and (desc := self.cuda_ipc.export(t)) is not None:
                return [dtype, list(t.shape), msgspec.msgpack.Ext(EXT_CUDA_IPC, msgspec.msgpack.encode(desc))]
            t = t.cpu()
        elif t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        return [dtype, list(t.shape), self._data(raw)]

    def _encode_numpy(self, arr: np.ndarray) -> list:
        if arr.dtype.hasobject:
            raise TypeError("numpy arrays of Python objects cannot be encoded")
        arr = np.ascontiguousarray(arr)
        raw = arr.reshape(-1).view(np.uint8)
        return [arr.dtype.str, list(arr.shape), self._data(raw)]

    def _data(self, raw: np.ndarray) -> msgspec.msgpack.Ext | int:
        """Inline for small tensors, else the pool, else a new aux frame."""
        view = memoryview(raw)
        if raw.nbytes < self.inline_threshold:
            return msgspec.msgpack.Ext(EXT_RAW_TENSOR, view)
        if self.pool is not None and (handle := self.pool.put(view)) is not None:
            return msgspec.msgpack.Ext(EXT_SHM_TENSOR, _POOL_HANDLE.pack(handle.offset, handle.nbytes))
        aux = self._aux
        assert aux is not None
        aux.append(view)
        return len(aux) - 1


def _check_size(shape: list, itemsize: int, buf: Frame) -> None:
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

    ``pool`` / ``cuda_ipc`` resolve out-of-band handles (an out-of-band tensor
    arriving without them is a decode error). numpy arrays from frames are
    read-only views of the frame; torch tensors from frames get their own copy;
    pool tensors (numpy or torch) are writable zero-copy views of the pool.
    """

    def __init__(
        self,
        type: Any = Any,
        pool: TensorPoolReader | None = None,
        cuda_ipc: CudaIpcImporter | None = None,
    ) -> None:
        self._decoder = msgspec.msgpack.Decoder(type, dec_hook=self._dec_hook)
        self.pool = pool
        self.cuda_ipc = cuda_ipc
        self._frames: Sequence[Frame] = ()

    def decode(self, frames: Sequence[Frame]) -> Any:
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._frames = ()

    def _dec_hook(self, type: Any, obj: Any) -> Any:
        if type is np.ndarray:
            dtype, shape, data = self._header(obj)
            dt = np.dtype(dtype)
            if dt.hasobject:
                raise ValueError("refusing a numpy array of Python objects")
            buf, shared = self._bytes(data)
            _check_size(shape, dt.itemsize, buf)
            if shared:
                return buf.view(dt).reshape(shape)
            return np.frombuffer(buf, dtype=dt).reshape(shape)
        torch = sys.modules.get("torch")
        if torch is not None and type is torch.Tensor:
            dtype, shape, data = self._header(obj)
            dt = getattr(torch, dtype, None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"unknown torch dtype {dtype!r}")
            if isinstance(data, msgspec.msgpack.Ext) and data.code == EXT_CUDA_IPC:
                return self._cuda_tensor(data, dt, shape)
            buf, shared = self._bytes(data)
            _check_size(shape, dt.itemsize, buf)
            if len(buf) == 0:
                return torch.empty(shape, dtype=dt)
            if shared:  # a writable view of the pool: no copy
                return torch.from_numpy(buf).view(dt).reshape(shape)
            if isinstance(buf, bytes) or (isinstance(buf, memoryview) and buf.readonly):
                buf = bytearray(buf)  # torch tensors are writable: never alias immutable bytes
            return torch.frombuffer(buf, dtype=dt).reshape(shape)
        raise NotImplementedError(f"cannot decode objects of type {type!r}")

    @staticmethod
    def _header(obj: Any) -> tuple[str, list[int], Any]:
        if not (isinstance(obj, list) and len(obj) == 3):
            raise ValueError("a tensor must be encoded as [dtype, shape, data]")
        dtype, shape, data = obj
        if not isinstance(dtype, str) or not isinstance(shape, list):
            raise ValueError("malformed tensor header")
        return dtype, shape, data

    def _bytes(self, data: Any) -> tuple[Any, bool]:
        """The tensor's bytes and whether they are a (writable) view of the shared pool."""
        if isinstance(data, msgspec.msgpack.Ext):
            if data.code == EXT_RAW_TENSOR:
                return data.data, False
            if data.code == EXT_SHM_TENSOR:
                if self.pool is None:
                    raise ValueError("an out-of-band tensor arrived, but no tensor pool is attached")
                if len(data.data) != _POOL_HANDLE.size:
                    raise ValueError("malformed tensor pool handle")
                return self.pool.get(PoolHandle(*_POOL_HANDLE.unpack(data.data))), True
            raise ValueError(f"unknown tensor ext code {data.code}")
        if type(data) is int and 0 < data < len(self._frames):
            return self._frames[data], False
        raise ValueError(f"tensor data reference {data!r} matches no frame")

    def _cuda_tensor(self, data: msgspec.msgpack.Ext, dtype: Any, shape: list[int]) -> Any:
        if self.cuda_ipc is None:
            raise ValueError("a CUDA IPC tensor arrived, but no CUDA importer is wired up")
        tensor = self.cuda_ipc.import_(msgspec.msgpack.decode(data.data))
        if tensor.dtype != dtype or list(tensor.shape) != shape:
            raise ValueError("CUDA IPC tensor does not match its header")
        return tensor
