"""CUDA tensors across processes as CUDA IPC memory handles: the out-of-band tier on a GPU.

The producer (``CudaIpcExporter``) sends, instead of the bytes, what torch's
own ``torch.multiprocessing`` reduction sends: the eight fields of
``UntypedStorage._share_cuda_()`` (device, memory handle, storage size and
offset within its allocation, the reference-counter file and slot, an event
handle and whether to wait on it), plus the tensor's view of that storage
(element offset, shape, stride, dtype) and a *ticket*.

Lifetime, which is the point of the ticket:

- The exporter keeps the tensor referenced until its ticket, a data-less
  region of the shared tensor pool (``shm.tensors``), reads RELEASED; until
  then the producer's caching allocator cannot give the memory to anything
  else, whatever the producer does with its own references.
- The importer opens the handle (torch makes its stream wait for the
  producer's event, so writes still in flight on the producer land first),
  copies the tensor into memory of its own, waits for that copy, drops the
  mapping and only then releases the ticket.
- torch's own IPC reference counter is honoured as well: the importer's
  storage decrements it when freed, after syncing its stream, and until then
  the producer's allocator keeps the block in limbo even if the tensor is
  gone.

The copy costs one device-to-device transfer per tensor and buys that the
consumer never depends on the producer's memory, or process, once the
message is decoded. A ticket that cannot be had (pool full) or a storage
that cannot be shared makes ``export`` return None and the encoder copies
the tensor to the host instead.

Only torch's CUDA IPC is implemented; there is no cupy path. torch is not
imported here: a CUDA tensor can only reach this module if its caller
imported torch.
"""

from __future__ import annotations

import sys
from typing import Any

from shm.tensors import TensorPoolReader, TensorPoolWriter

# Types of the eight ``_share_cuda_`` fields, in order.
_SHARED_FIELD_TYPES: tuple[tuple[type, ...], ...] = (
    (int,),  # device index
    (bytes,),  # cudaIpcMemHandle of the allocation
    (int,),  # storage size in bytes
    (int,),  # storage offset in bytes within the allocation
    (bytes,),  # reference-counter shared file
    (int,),  # slot in that file
    (bytes, type(None)),  # cudaIpcEventHandle
    (bool,),  # whether the consumer must wait on that event
)


class CudaIpcExporter:
    """Producer side: an IPC descriptor out, the tensor kept alive until its ticket is released."""

    def __init__(self, tickets: TensorPoolWriter) -> None:
        self._tickets = tickets
        self._alive: dict[int, Any] = {}  # ticket offset -> tensor

    @property
    def outstanding(self) -> int:
        """Exported tensors the consumer has not released yet."""
        return len(self._alive)

    def collect(self) -> None:
        """Drop the references of every tensor whose consumer is done."""
        for ticket in [t for t in self._alive if self._tickets.is_released(t)]:
            del self._alive[ticket]

    def export(self, tensor: Any) -> list | None:
        """``[ticket, *the 8 _share_cuda_ fields, storage offset, shape, stride, dtype]``,
        or None when no ticket is free or the storage cannot be shared."""
        self.collect()
        ticket = self._tickets.take_ticket()
        if ticket is None:
            return None
        try:
            shared = tensor.untyped_storage()._share_cuda_()
        except RuntimeError:  # e.g. memory not from the caching allocator
            self._tickets.cancel_ticket(ticket)
            return None
        self._alive[ticket] = tensor
        return [
            ticket, *shared, tensor.storage_offset(), list(tensor.shape), list(tensor.stride()),
            str(tensor.dtype).removeprefix("torch."),
        ]


def _parse(desc: Any) -> tuple[int, list, int, list[int], list[int], str]:
    """Check a descriptor that came off the wire; ValueError when malformed."""
    if not isinstance(desc, list) or len(desc) != 1 + len(_SHARED_FIELD_TYPES) + 4:
        raise ValueError("malformed CUDA IPC descriptor")
    ticket, shared = desc[0], desc[1 : 1 + len(_SHARED_FIELD_TYPES)]
    storage_offset, shape, stride, dtype = desc[1 + len(_SHARED_FIELD_TYPES) :]
    for value, types in zip(shared, _SHARED_FIELD_TYPES):
        if type(value) not in types:
            raise ValueError("malformed CUDA IPC handle fields")
    ints = [storage_offset, *shape, *stride] if isinstance(shape, list) and isinstance(stride, list) else None
    if (
        ints is None
        or len(shape) != len(stride)
        or any(type(v) is not int or v < 0 for v in ints)
        or not isinstance(dtype, str)
    ):
        raise ValueError("malformed CUDA IPC tensor view")
    return ticket, list(shared), storage_offset, shape, stride, dtype


class CudaIpcImporter:
    """Consumer side: open the handle, copy into our own memory, then release the ticket."""

    def __init__(self, tickets: TensorPoolReader) -> None:
        self._tickets = tickets

    def import_(self, desc: Any) -> Any:
        ticket, shared, storage_offset, shape, stride, dtype_name = _parse(desc)
        self._tickets.check_ticket(ticket)
        try:
            return self._copy_out(shared, storage_offset, shape, stride, dtype_name)
        finally:
            self._tickets.release_ticket(ticket)

    @staticmethod
    def _copy_out(shared: list, storage_offset: int, shape: list[int], stride: list[int], dtype_name: str) -> Any:
        torch = sys.modules["torch"]
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {dtype_name!r}")
        try:
            torch.cuda._lazy_init()  # as torch's rebuild_cuda_tensor: the handle needs a context
            storage = torch.UntypedStorage._new_shared_cuda(*shared)
            # set_ checks the view against the storage's size.
            view = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, storage_offset, shape, stride)
            owned = view.clone()
            # The ticket goes back right after this returns: the copy must have
            # finished reading the producer's memory by then.
            torch.cuda.current_stream(storage.device).synchronize()
        except RuntimeError as exc:
            raise ValueError(f"cannot open a CUDA IPC tensor: {exc}") from exc
        return owned
