"""CUDA IPC in the out-of-band tier (shm.cuda_ipc).

On the CPU: the ticket protocol that decides when the producer may let go
of an exported tensor, with torch's CUDA sharing calls replaced by fakes
(the descriptor still crosses real msgpack and a real shared pool). On a
GPU: real tensors to a second process and back.
"""

from __future__ import annotations

import multiprocessing
import os

import msgspec
import pytest
import torch

from shm.channel import ChannelSpec, Duplex
from shm.cuda_ipc import CudaIpcExporter, CudaIpcImporter
from shm.serial import MsgpackDecoder, MsgpackEncoder
from shm.tensors import TensorPool, TensorPoolReader, TensorPoolWriter
from tests.support.pools import tensor_pool_pair

SHARED = (0, b"\x01" * 64, 4096, 512, b"/torch_ipc_refcount", 7, b"\x02" * 64, True)


class FakeCudaTensor:
    """What the exporter reads from a CUDA tensor, without a GPU."""

    def __init__(self, share_error: Exception | None = None) -> None:
        self.share_error = share_error
        self.shape, self.dtype = torch.Size([4, 8]), torch.bfloat16

    def untyped_storage(self):
        return self

    def _share_cuda_(self):
        if self.share_error is not None:
            raise self.share_error
        return SHARED

    def storage_offset(self) -> int:
        return 16

    def stride(self) -> tuple[int, ...]:
        return (8, 1)


@pytest.fixture
def tickets():
    with tensor_pool_pair(1 << 12) as pair:
        yield pair


def _over_the_wire(desc: list) -> list:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(desc))


def test_exported_tensor_is_held_until_the_consumer_has_copied_it(tickets, monkeypatch):
    writer, reader = tickets
    exporter, importer = CudaIpcExporter(writer), CudaIpcImporter(reader)
    copied = []

    def fake_copy_out(shared, storage_offset, shape, stride, dtype_name):
        # The ticket is still held while the consumer copies.
        exporter.collect()
        copied.append((shared, storage_offset, shape, stride, dtype_name, exporter.outstanding))
        return torch.ones(shape)

    monkeypatch.setattr(CudaIpcImporter, "_copy_out", staticmethod(fake_copy_out))
    tensor = FakeCudaTensor()
    desc = _over_the_wire(exporter.export(tensor))
    del tensor
    exporter.collect()
    assert exporter.outstanding == 1  # nobody consumed it: the producer keeps it
    out = importer.import_(desc)
    assert out.shape == (4, 8)
    assert copied == [(list(SHARED), 16, [4, 8], [8, 1], "bfloat16", 1)]
    exporter.collect()
    assert exporter.outstanding == 0
    writer._reclaim()
    assert writer.bytes_in_use == 0


def test_a_failed_import_still_releases_its_ticket(tickets, monkeypatch):
    writer, reader = tickets
    exporter, importer = CudaIpcExporter(writer), CudaIpcImporter(reader)

    def failing_copy_out(*args):
        raise ValueError("cannot open a CUDA IPC tensor: invalid handle")

    monkeypatch.setattr(CudaIpcImporter, "_copy_out", staticmethod(failing_copy_out))
    desc = _over_the_wire(exporter.export(FakeCudaTensor()))
    with pytest.raises(ValueError, match="invalid handle"):
        importer.import_(desc)
    exporter.collect()
    assert exporter.outstanding == 0


def test_unshareable_storage_falls_back_and_gives_the_ticket_back(tickets):
    writer, _ = tickets
    exporter = CudaIpcExporter(writer)
    assert exporter.export(FakeCudaTensor(share_error=RuntimeError("not from the caching allocator"))) is None
    assert exporter.outstanding == 0
    writer._reclaim()
    assert writer.bytes_in_use == 0


def test_no_free_ticket_means_no_export(tickets):
    writer, _ = tickets
    exporter = CudaIpcExporter(writer)
    held = [exporter.export(FakeCudaTensor()) for _ in range(4096 // 64 + 1)]  # a ticket takes 64 bytes
    assert held[0] is not None and held[-1] is None
    assert exporter.outstanding == sum(d is not None for d in held)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d[:5],
        lambda d: d[:2] + ["not bytes"] + d[3:],
        lambda d: d[:-3] + [[4, 8], [8], "bfloat16"],  # stride rank differs from shape
        lambda d: d[:-4] + [-1] + d[-3:],
        lambda d: [8] + d[1:],  # a ticket offset that is no ticket in use
        lambda d: [1 << 40] + d[1:],
    ],
)
def test_malformed_descriptors_are_refused_without_touching_tickets(tickets, monkeypatch, mutate):
    writer, reader = tickets
    exporter, importer = CudaIpcExporter(writer), CudaIpcImporter(reader)
    monkeypatch.setattr(CudaIpcImporter, "_copy_out", staticmethod(lambda *a: pytest.fail("opened a bad handle")))
    desc = _over_the_wire(exporter.export(FakeCudaTensor()))
    with pytest.raises(ValueError):
        importer.import_(mutate(desc))
    exporter.collect()
    assert exporter.outstanding == 1  # the real ticket is still held


def test_shm_transport_wires_cuda_ipc_and_zmq_does_not():
    from core.transport import ClientTransport

    for kind, wired in (("shm", True), ("zmq", False)):
        transport, _ = ClientTransport.create(kind)
        try:
            assert (transport.cuda_exporter is not None) == wired
            assert (transport.cuda_importer is not None) == wired
        finally:
            transport.close()


# ----------------------------------------------------------------- GPU only


def _gpu_consumer(spec: ChannelSpec, pool_name: str) -> None:
    """Decode CUDA tensors by IPC and send back their host copies."""
    duplex = Duplex.attach(spec)
    ppid = os.getppid()
    duplex.set_peer(lambda: os.getppid() == ppid, sentinel=os.pidfd_open(ppid))
    pool = TensorPool.attach(pool_name)
    decoder = MsgpackDecoder(torch.Tensor, cuda_ipc=CudaIpcImporter(TensorPoolReader(pool)))
    encoder = MsgpackEncoder()
    duplex.sender.send([b"HELLO"])
    while (frames := duplex.receiver.recv()) != [b"Q"]:
        tensor = decoder.decode(frames)
        assert tensor.is_cuda
        duplex.sender.send(encoder.encode(tensor.cpu()))
    pool.close()
    duplex.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_cross_processes_by_ipc_and_are_released():
    duplex, spec = Duplex.create(1 << 16)
    pool = TensorPool.create(1 << 16)
    writer = TensorPoolWriter(pool)
    exporter = CudaIpcExporter(writer)
    proc = multiprocessing.get_context("spawn").Process(target=_gpu_consumer, args=(spec, pool.name), daemon=True)
    proc.start()
    try:
        duplex.set_peer(proc.is_alive, proc.sentinel)
        assert duplex.receiver.recv(timeout=120) == [b"HELLO"]
        duplex.unlink()
        pool.unlink()
        encoder, decoder = MsgpackEncoder(pool=writer, cuda_ipc=exporter), MsgpackDecoder(torch.Tensor)
        base = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)
        for tensor in (base, base[3:40, 5:70], base.t(), torch.arange(10, device="cuda")):
            frames = encoder.encode(tensor)
            assert exporter.outstanding >= 1 and len(frames) == 1  # a handle, no bytes
            duplex.sender.send(frames, timeout=120)
            back = decoder.decode(duplex.receiver.recv(timeout=120))
            assert torch.equal(back, tensor.cpu())
        exporter.collect()
        assert exporter.outstanding == 0  # the consumer released every ticket
        duplex.sender.send([b"Q"])
        proc.join(timeout=120)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        duplex.close()
        pool.close()
