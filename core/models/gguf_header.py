"""A GGUF file's header read in one pass: metadata fields, then (optionally) the tensor table.

The gguf package's reader builds a numpy view for every element of every field;
a Llama-3 or Qwen vocabulary holds 128k-152k tokens and 280k-150k merges, so
reading one file's header that way takes seconds of Python. Here numeric
arrays are one ``np.frombuffer`` each and string arrays are walked once,
recording where each string lies and decoding them only when asked
(``StringArray``): the frontend, which needs the tokenizer cache's key and the
config, never decodes the vocabulary; the engine reads the tensor table as well.

GGUF (llama.cpp's format, versions 2 and 3, little-endian): magic ``GGUF``, the
version, the tensor and field counts, the fields (key, type, value), the tensor
infos (name, dimensions fastest first, type, offset), then the tensors' data
from the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Value types: numeric ones by their numpy dtype; 7 bool, 8 string, 9 array.
_NUMERIC = {
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"), 4: np.dtype("<u4"),
    5: np.dtype("<i4"), 6: np.dtype("<f4"), 10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
}
_BOOL, _STRING, _ARRAY = 7, 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """Bytes that are not a GGUF header this reader can parse (truncated, corrupt, big-endian)."""


class StringArray(Sequence[str]):
    """An array of strings inside the header, decoded on access (UTF-8, invalid bytes replaced)."""

    __slots__ = ("_buf", "_starts", "_ends")

    def __init__(self, buf: memoryview, starts: np.ndarray, ends: np.ndarray) -> None:
        self._buf, self._starts, self._ends = buf, starts, ends

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]  # type: ignore[return-value]
        return bytes(self._buf[self._starts[i] : self._ends[i]]).decode("utf-8", "replace")

    def __iter__(self) -> Iterator[str]:
        buf = self._buf
        for s, e in zip(self._starts.tolist(), self._ends.tolist()):
            yield bytes(buf[s:e]).decode("utf-8", "replace")

    def tolist(self) -> list[str]:
        return list(self)


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: ``shape`` as GGUF lists it (fastest axis first),
    ``offset`` from the start of the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    """Reads little-endian values from a buffer, refusing to read past its end."""

    __slots__ = ("buf", "pos", "size")

    def __init__(self, buf: memoryview, pos: int = 0) -> None:
        self.buf, self.pos, self.size = buf, pos, len(buf)

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFFormatError(f"the header ends early (byte {self.pos}, {n} more wanted, {self.size} in all)")

    def u32(self) -> int:
        self.need(4)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self) -> int:
        self.need(8)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self) -> str:
        n = self.u64()
        self.need(n)
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return s

    def numbers(self, dtype: np.dtype, count: int) -> np.ndarray:
        self.need(count * dtype.itemsize)
        out = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += count * dtype.itemsize
        return out

    def strings(self, count: int) -> StringArray:
        """Walks ``count`` strings (a length, then the bytes, each), recording where they lie."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        starts = [0] * count
        try:
            for i in range(count):
                (n,) = unpack(buf, pos)
                starts[i] = pos = pos + 8
                pos += n
        except struct.error:
            raise GGUFFormatError(f"the header ends inside an array of {count} strings") from None
        if pos > size:
            raise GGUFFormatError(f"an array of {count} strings runs past the header's end")
        first = np.array(starts, np.int64)
        ends = np.empty_like(first)
        ends[:-1] = first[1:] - 8  # each string ends where the next one's length begins
        if count:
            ends[-1] = pos
        self.pos = pos
        return StringArray(buf, first, ends)

    def value(self, vtype: int) -> Any:
        if vtype in _NUMERIC:
            return self.numbers(_NUMERIC[vtype], 1)[0].item()
        if vtype == _BOOL:
            return bool(self.numbers(_NUMERIC[0], 1)[0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = self.u32(), self.u64()
            if item in _NUMERIC:
                return self.numbers(_NUMERIC[item], count)
            if item == _BOOL:
                return self.numbers(_NUMERIC[0], count).astype(bool)
            if item == _STRING:
                return self.strings(count)
            if item == _ARRAY:  # arrays of arrays: no served key has one; read them to move past
                return [self.value(_ARRAY) for _ in range(count)]
            raise GGUFFormatError(f"an array of unknown value type {item}")
        raise GGUFFormatError(f"unknown value type {vtype}")


class GGUFHeader:
    """The parsed header of one GGUF file: ``fields`` (key -> int, float, bool, str, numpy
    array or StringArray) and, when read with ``tensors=True``, the tensor table and where the
    data begins. The file stays mapped while the object lives (string arrays point into it)."""

    def __init__(self, path: str, tensors: bool = True) -> None:
        self.path = path
        with open(path, "rb") as f:
            try:
                self._map: mmap.mmap | None = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise GGUFFormatError("the file is empty") from None
        self.file_size = len(self._map)
        buf = memoryview(self._map)
        cur = _Cursor(buf)
        cur.need(4)
        if bytes(buf[:4]) != MAGIC:
            raise GGUFFormatError(f"no GGUF magic (the file starts with {bytes(buf[:4])!r})")
        cur.pos = 4
        self.version = cur.u32()
        if self.version not in (2, 3):
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            kind = "a big-endian file" if swapped in (2, 3) else f"version {self.version}"
            raise GGUFFormatError(f"{kind}: only little-endian GGUF versions 2 and 3 are read")
        tensor_count, field_count = cur.u64(), cur.u64()
        if tensor_count > self.file_size or field_count > self.file_size:
            raise GGUFFormatError(f"{tensor_count} tensors and {field_count} fields cannot fit in the file")
        self.fields: dict[str, Any] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # each field's bytes, key to value
        for _ in range(field_count):
            start = cur.pos
            key = cur.string()
            self.fields[key] = cur.value(cur.u32())
            self._spans[key] = (start, cur.pos)
        self.fields_end = cur.pos
        self.tensor_count = tensor_count
        self.tensors: dict[str, TensorInfo] = {}
        self.data_offset: int | None = None
        if tensors:
            infos = []
            for _ in range(tensor_count):
                name = cur.string()
                dims = cur.u32()
                if dims > 8:
                    raise GGUFFormatError(f"tensor {name} has {dims} dimensions")
                shape = tuple(int(d) for d in cur.numbers(_NUMERIC[10], dims))
                infos.append((name, shape, cur.u32(), cur.u64()))
            alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
            if alignment <= 0 or alignment & (alignment - 1):
                raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
            self.data_offset = -(-cur.pos // alignment) * alignment
            for name, shape, ggml_type, offset in infos:
                if name in self.tensors:
                    raise GGUFFormatError(f"tensor {name} is listed twice")
                self.tensors[name] = TensorInfo(name, shape, ggml_type, self.data_offset + offset)

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def metadata_digest(self) -> str:
        """A hash of the metadata fields' bytes: what a config and tokenizer made from this file
        depend on (the tensors' bytes do not enter; the tensor table is not needed)."""
        assert self._map is not None
        return hashlib.sha256(memoryview(self._map)[: self.fields_end]).hexdigest()[:16]

    def tokenizer_digest(self) -> str:
        """A hash of the fields a tokenizer is made from (``tokenizer.*`` and the architecture,
        which picks transformers' converter): the same for a model's files in any quantization."""
        assert self._map is not None
        view, digest = memoryview(self._map), hashlib.sha256()
        for key, (start, end) in self._spans.items():
            if key.startswith("tokenizer.") or key == "general.architecture":
                digest.update(view[start:end])
        return digest.hexdigest()[:16]

    def buffer(self) -> memoryview:
        """The whole file, mapped read-only (for views of its tensors)."""
        assert self._map is not None
        return memoryview(self._map)

    def close(self) -> None:
        """Unmaps the file once nothing points into it any more (string arrays and views do)."""
        self.fields, self.tensors = {}, {}
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # views of it still live: the mapping goes with the last of them
                pass
            self._map = None

    def __enter__(self) -> GGUFHeader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
