"""Build a model from a local Hugging Face directory and fill its weights.

The module is built straight on the target device, in the compute dtype,
with uninitialised weights (our layers skip the random initialisation that
the checkpoint overwrites anyway: that matters for multi-GB models on CPU).
Not the meta device: materialising meta tensors imports torch's symbolic
shape machinery, a second of start-up.
Checkpoints larger than a few MB show a progress bar while they load, so that
a minute-long start is visibly busy rather than hung.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from core.config import KV_CACHE_DTYPES, EngineConfig
from core.model_config import ModelConfig
from core.models.gguf_checkpoint import GGUFCheckpoint
from core.models.layers import Linear
from core.models.moe import ExpertWeights, MoEWeights
from core.models.registry import model_class
from kernels.quant import BLOCKS, QuantizedMatrix, QuantType

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "half": torch.float16,
    "float": torch.float32,
}

DUMMY_STD = 0.02  # like initializer_range: keeps activations and logits finite
PROGRESS_MIN_BYTES = 8 * 2**20  # smaller checkpoints load too fast for a progress bar to help


class _ProgressBar(tqdm):
    """tqdm with a thread lock only. tqdm's default write lock adds a multiprocessing
    lock, a named POSIX semaphore (/dev/shm/sem.mp-*) that the resource tracker warns
    about at every exit and that a killed engine leaves behind; one loader thread
    draws this bar, so a thread lock is all it needs."""

    _lock = threading.RLock()


@contextmanager
def _loading_bar(total: int, disable: bool, file: TextIO | None = None) -> Iterator[_ProgressBar]:
    """The bar over the weights' bytes. Lines logged while it is drawn (the C kernels' build
    reports from another thread) are printed above it, not onto its line."""
    with _ProgressBar(total=total, desc="Loading weights", unit="B", unit_scale=True, unit_divisor=1024, file=file,
                      disable=disable, mininterval=0.5) as bar, logging_redirect_tqdm(tqdm_class=_ProgressBar):
        yield bar


def resolve_dtype(dtype: str | torch.dtype, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """The compute dtype; ``"auto"`` is float32 on CPU, the checkpoint's half dtype on a GPU.

    CPUs have no fast half-precision matmuls (bf16/fp16 run slower there and
    drift from the float32 reference). On a GPU the checkpoint's own dtype is
    what it was trained and published in, except float32, which runs in
    bfloat16 there (as vLLM does: float32 would halve the speed for nothing).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        try:
            return _DTYPES[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(_DTYPES)}") from None
    if device.type == "cpu":
        return torch.float32
    ckpt = model_config.dtype or "bfloat16"
    return _DTYPES[ckpt] if ckpt in ("float16", "bfloat16") else torch.bfloat16


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What the KV cache holds. ``"auto"`` is float16 under float32 compute on a CPU, as
    llama.cpp's default cache: half the memory and half the bytes attention reads, the
    kernels widening each value as they read it; elsewhere it is the compute ``dtype``.
    Tests that compare with transformers pin ``"float32"``. ``"q8_0"`` is stored as bytes
    (torch.uint8; kernels/kv_format.py). The GPU kernels read the compute dtype only."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        kv_dtype = torch.float16 if device.type == "cpu" and dtype == torch.float32 else dtype
    elif kv_cache_dtype == "q8_0":
        kv_dtype = torch.uint8  # bytes of 32-value blocks (kernels/kv_format.py)
    else:
        kv_dtype = _DTYPES[kv_cache_dtype]
    if device.type != "cpu" and kv_dtype != dtype:
        raise ValueError(f"on a GPU the KV cache holds the compute dtype ({str(dtype)[6:]}): "
                         "leave --kv-cache-dtype at auto")
    return kv_dtype


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    config: EngineConfig, device: torch.device | str, dtype: torch.dtype | str = "auto"
) -> nn.Module:
    """Instantiate the checkpoint's architecture on ``device`` and load its weights.

    ``config.load_format == "dummy"`` fills deterministic random weights
    (seeded by ``config.seed``) instead of reading safetensors files.
    """
    device = torch.device(device)
    dtype = resolve_dtype(dtype, config.model_config, device)
    if config.quantization is not None and device.type != "cpu":
        raise ValueError("--quantization is for the CPU (its block formats have no kernels on other devices)")
    if (config.quantization is not None or config.load_format == "gguf") and device.type == "cpu" \
            and dtype != torch.float32:
        raise ValueError("weights in block formats run with float32 activations on a CPU: leave --dtype at auto")
    with torch.device(device), _default_dtype(dtype):
        model = model_class(config.model_config)(config.model_config, config.max_model_len)

    if config.load_format == "dummy":
        fill_dummy_weights(model, config.seed)
    elif config.load_format in ("auto", "safetensors", "gguf"):
        if config.load_format == "gguf":
            checkpoint = GGUFCheckpoint(config.model)
            total = checkpoint.weight_bytes()
            # Off a CPU the block formats have no kernels: their values, in the compute dtype.
            try:
                with _loading_bar(total, disable=total < PROGRESS_MIN_BYTES) as bar:
                    weights = checkpoint.weights(
                        config.model_config, dense=None if device.type == "cpu" else dtype, progress=bar.update)
                    if checkpoint.norms_shifted:
                        loaded = model.load_weights(weights, norms_shifted=True)
                    else:
                        loaded = model.load_weights(weights)
            finally:
                checkpoint.close()
        else:
            loaded = model.load_weights(iter_safetensors(config.model))
        missing = model.expected_weights() - loaded
        if missing:
            shown = ", ".join(sorted(missing)[:5])
            raise ValueError(f"checkpoint {config.model} lacks {len(missing)} tensors, e.g. {shown}")
    else:
        raise ValueError(f"unknown load_format {config.load_format!r}; use auto, safetensors, gguf or dummy")
    if config.quantization is not None:
        quantize_model(model, QuantType[config.quantization.upper()])
    model.prepare_for_inference()
    return model.eval()


def quantize_model(model: nn.Module, qtype: QuantType) -> None:
    """Every dense layer, expert and the embedding in ``qtype`` blocks, by the gguf package's own
    quantizer (the same bytes as its reference code, which llama.cpp's follows, gives); the
    float weights are dropped. Matrices whose rows do not hold whole blocks stay float32, as
    llama.cpp's converter leaves them, in the same tiled layout (so that every product of
    the model runs in kernels/quant.py, and a step is one program: core/worker/cpu_program.py);
    so do experts' routers, as llama-quantize leaves them (a rounded router could send a
    token to other experts)."""
    import gguf

    block = BLOCKS[qtype][0]

    def blocks(weight: torch.Tensor) -> QuantizedMatrix:
        values = weight.detach().float().numpy()
        if weight.shape[1] % block:
            return QuantizedMatrix.from_floats(values)
        data = gguf.quants.quantize(values, gguf.GGMLQuantizationType(qtype))
        return QuantizedMatrix(qtype, data, weight.shape[0], weight.shape[1])

    embedding = model.get_input_embeddings()
    tied = model.lm_head.weight is embedding.weight
    embedding.set_quantized(blocks(embedding.weight))
    routers = {id(module.gate) for module in model.modules() if isinstance(module, MoEWeights)}
    for module in model.modules():
        if isinstance(module, Linear) and id(module) in routers:
            module.set_quantized([QuantizedMatrix.from_floats(module.weight.detach().float().numpy())])
        elif isinstance(module, Linear) and module.quantized is None and not (tied and module is model.lm_head):
            module.set_quantized([blocks(module.weight)])
        elif isinstance(module, ExpertWeights) and module.quantized is None:
            module.convert(blocks)
    model.tie_weights()


def iter_safetensors(
    model_dir: str | os.PathLike, progress: bool = True, file: TextIO | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a single-file or sharded safetensors checkpoint.

    With ``progress``, a bar in bytes goes to ``file`` (default stderr) when
    the files add up to PROGRESS_MIN_BYTES or more.
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    total = sum((model_dir / shard).stat().st_size for shard in files)
    with _loading_bar(total, disable=not progress or total < PROGRESS_MIN_BYTES, file=file) as bar:
        for shard in files:
            with safe_open(str(model_dir / shard), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    bar.update(tensor.nbytes)
                    yield name, tensor
        bar.update(total - bar.n)  # the files' headers: end at 100%


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Deterministic random weights: N(0, DUMMY_STD), norm scales 1.

    Values are drawn on the CPU from one seeded generator in parameter order,
    so the same seed gives the same model on every device.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, DUMMY_STD, generator=gen)
            param.copy_(values)
