"""Sleep mode: hand back the KV cache's and the weights' memory while the engine idles.

Level 1 takes the weights off the device and keeps a copy to put back: in
pinned host memory when they live on a GPU, and on a CPU, where host memory
is the device, in a temporary safetensors file, so that the process's
resident memory really shrinks (the copy sits in the page cache, which the
kernel may drop). Level 2 keeps no copy: waking up loads the checkpoint
again. Both drop the KV cache, which is re-created (zeroed) on wake-up; the
scheduler has freed every block before, so no request expects its contents.

Weights in block formats (kernels/quant.py: GGUF files, ``--quantization``,
and a mixture of experts' experts on a CPU, kept in the kernels' tiles) are
numpy arrays beside the parameters. Level 2 drops them with the rest;
level 1 has no copy of them to put back and is refused for such a model.

The model object stays: its parameters get zero-size storage, and
``prepare_for_inference`` runs after every change of weights, so that the
model's fast-path views (``kernels.linear.CpuWeight``) neither keep the old
storage alive nor point at freed memory.
"""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import tempfile
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set size (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def device_bytes(device: torch.device) -> int:
    """Memory torch has allocated on ``device`` when it is a GPU; 0 on a CPU."""
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def release_freed_memory(device: torch.device) -> None:
    """Give memory freed by dropped tensors back to the system now.

    glibc keeps freed heap memory for reuse and torch's CUDA allocator keeps
    freed blocks cached; both are what sleep mode exists to hand back.
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator decides
        pass


def block_weights(model: nn.Module) -> list[Any]:
    """The model's weights in block formats (the layers' ``quantized``), each listed once
    (a head tied to its embedding shares the embedding's matrix)."""
    held: dict[int, Any] = {}
    for module in model.modules():
        for matrix in _matrices(getattr(module, "quantized", None)):
            held[id(matrix)] = matrix
    return list(held.values())


def _matrices(weight: Any) -> list[Any]:
    """A layer's block-format matrices: a weight's parts, or (experts) those of each weight listed."""
    if weight is None:
        return []
    if isinstance(weight, (list, tuple)):
        return [matrix for item in weight for matrix in _matrices(item)]
    return list(getattr(weight, "parts", [weight]))


def weight_bytes(model: nn.Module) -> int:
    """The bytes of the model's weights: its parameters and its block-format matrices."""
    return tensor_bytes(list(model.parameters())) + sum(m.nbytes for m in block_weights(model))


def drop_weights(model: nn.Module) -> None:
    """Replace every parameter's storage with an empty tensor of the same rank and dtype,
    and let go of the block-format weights."""
    for param in model.parameters():  # tied weights are one Parameter, listed once
        param.data = torch.empty([0] * param.dim(), dtype=param.dtype, device=param.device)
    for module in model.modules():
        if getattr(module, "quantized", None) is not None:
            module.quantized = None
    model.prepare_for_inference()


class WeightStash:
    """Level 1: the model's weights, moved off the device until ``restore``."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        params = list(model.named_parameters())
        self._host: dict[str, torch.Tensor] | None = None
        self._dir: str | None = None
        if device.type == "cuda":
            self._host = {}
            for name, param in params:
                host = torch.empty(param.shape, dtype=param.dtype, pin_memory=True)
                host.copy_(param.detach())
                self._host[name] = host
        else:
            self._dir = tempfile.mkdtemp(prefix="ringllm-sleep-")
            save_file({name: p.detach().contiguous() for name, p in params}, self._path)
        drop_weights(model)

    @property
    def _path(self) -> str:
        assert self._dir is not None
        return os.path.join(self._dir, "weights.safetensors")

    def restore(self, model: nn.Module) -> None:
        """Put the weights back on the device (new storage) and drop the copy."""
        if self._host is not None:
            weights = {name: t.to(self.device) for name, t in self._host.items()}
        else:
            weights = load_file(self._path, device=str(self.device))
        for name, param in model.named_parameters():
            param.data = weights[name]
        model.prepare_for_inference()
        self.discard()

    def discard(self) -> None:
        self._host = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
