"""A GGUF file (llama.cpp's format) as a checkpoint: its header read once, weights left in blocks.

``--model FILE.gguf`` (or a directory holding one ``.gguf`` and no
``config.json``) serves the file's weights as they are: it is memory-mapped,
each quantized tensor's blocks repacked into the tiles the kernels read
(kernels/quant.py; no float32 copy is ever made), the float tensors (norms,
biases, unquantized matrices) copied into torch tensors.

Before anything is loaded the file is checked whole (``GGUFCheckpoint``): the
magic and version, every tensor's type among those served and its bytes
within the file, the architecture among those served. A file that fails is a
``GGUFError`` naming what is wrong, and the command line exits with status 2.

The file's metadata is its config and its tokenizer, written once as a Hugging
Face directory (``config.json``, ``tokenizer.json``, ``tokenizer_config.json``...)
in the cache, keyed by a hash of the metadata's bytes (core/models/gguf_metadata.py;
transformers' GGUF reader for the tokenizers it does not build), so that the rest
of ringllm (the frontend's tokenizer, ``ModelConfig``) reads a GGUF model as it
reads any other. Tensor names map to Hugging Face's with the gguf package's own
table, and llama.cpp's converter interleaves the rows of Llama's q and k
projections for its rotary convention: they are put back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core import envs
from core.models import gguf_metadata
from core.models.gguf_header import GGUFFormatError, GGUFHeader, TensorInfo

if TYPE_CHECKING:
    import torch

    from core.model_config import ModelConfig

ARCHITECTURES = gguf_metadata.ARCHITECTURES  # GGUF architecture -> the Hugging Face one it is served as
# llama.cpp's converter permutes these architectures' q/k rows (its rotary pairs neighbours).
_PERMUTED = {"llama"}
# and stores these architectures' norm weights as the scale they multiply by (Gemma's 1 + w).
_NORMS_SHIFTED = {"gemma3"}
# Tensor types served: F32, F16, BF16 and the block formats of kernels/quant.py, by GGML id.
_FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
_BLOCK_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K",
                14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS"}


class GGUFError(ValueError):
    """A GGUF file that cannot be served, and why."""


def gguf_file(model: str) -> str | None:
    """The GGUF file ``model`` names: itself, or the one ``.gguf`` in a directory that is not
    a Hugging Face checkpoint; None otherwise (GGUFError for a directory with several)."""
    if os.path.isfile(model):
        return model if model.endswith(".gguf") else None
    if not os.path.isdir(model) or os.path.isfile(os.path.join(model, "config.json")):
        return None
    found = sorted(p for p in os.listdir(model) if p.endswith(".gguf"))
    if len(found) > 1:
        raise GGUFError(f"{model} holds several GGUF files ({', '.join(found)}): give --model the one to serve")
    return os.path.join(model, found[0]) if found else None


def metadata_dir_of(path: str) -> str:
    """The Hugging Face directory (config, tokenizer) made from GGUF file ``path``'s metadata."""
    checkpoint = GGUFCheckpoint(path)
    try:
        return str(checkpoint.metadata_dir())
    finally:
        checkpoint.close()


def _type_name(ggml_type: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"an unknown type (id {ggml_type})"


def _made_once(target: Path, write: Callable[[Path], None]) -> Path:
    """``target``, a directory ``write`` fills, made on first use: written in a staging directory
    beside it and renamed into place, so concurrent first starts never read a half-made one."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        write(staging)
        try:
            os.replace(staging, target)
        except OSError:  # made meanwhile by another process: theirs is the same
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# The child process of ``GGUFCheckpoint._write_tokenizer_with_transformers``: argv = [file, output directory].
_WRITE_TOKENIZER = """
import sys
from core.models.gguf_checkpoint import GGUFCheckpoint, GGUFError
try:
    GGUFCheckpoint(sys.argv[1]).write_transformers_tokenizer(sys.argv[2])
except GGUFError as exc:
    sys.exit(str(exc))
"""


class GGUFCheckpoint:
    """An opened, checked GGUF file (GGUFError if it cannot be served): its header read by
    core/models/gguf_header.py, every tensor's type and extent checked against the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.header = GGUFHeader(path)
        except (GGUFFormatError, OSError) as exc:
            raise GGUFError(f"{path}: not a GGUF file ringllm can read ({exc})") from None
        served = {**_FLOAT_TYPES, **_BLOCK_TYPES}
        size = self.header.file_size
        for name, info in self.header.tensors.items():
            if info.ggml_type not in served:
                raise GGUFError(
                    f"{path}: tensor {name} is {_type_name(info.ggml_type)}, which ringllm does not serve "
                    f"(served: {', '.join(served.values())})"
                )
            block, block_bytes = _block_size(info.ggml_type)
            fastest = info.shape[0] if info.shape else 1
            if fastest % block or info.offset + tensor_bytes(info) > size:
                raise GGUFError(
                    f"{path}: tensor {name} ({'x'.join(map(str, info.shape))}, {_type_name(info.ggml_type)}) "
                    f"does not fit in the file's {size} bytes: the file is truncated or corrupt"
                )
        self.architecture = self._string("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise GGUFError(
                f"{path}: the architecture {self.architecture!r} is not served; served: {', '.join(ARCHITECTURES)}"
            )
        self.tensors = self.header.tensors

    def _string(self, key: str) -> str:
        value = self.header.get(key)
        if not isinstance(value, str):
            raise GGUFError(f"{self.path}: the metadata has no {key}")
        return value

    def metadata_digest(self) -> str:
        """A hash of the metadata: what the config and tokenizer come from."""
        return self.header.metadata_digest()

    # ------------------------------------------------------------ metadata

    def metadata_dir(self) -> Path:
        """A Hugging Face directory with this file's config and tokenizer, made on first use
        (keyed by the metadata's bytes, which the header has hashed without decoding them)."""
        target = Path(envs.RINGLLM_CACHE) / "gguf" / f"{Path(self.path).stem}-{self.metadata_digest()}"
        if (target / "config.json").is_file():
            return target

        def write(staging: Path) -> None:
            try:
                gguf_metadata.write_config(self.header, "output.weight" in self.tensors, staging)
            except gguf_metadata.MetadataError as exc:
                raise GGUFError(f"{self.path}: {exc}") from None
            for file in self._tokenizer_dir().iterdir():
                shutil.copy2(file, staging / file.name)

        return _made_once(target, write)

    def _tokenizer_dir(self) -> Path:
        """This file's tokenizer as transformers' files, made once per vocabulary: a model's
        files in other quantizations (whose other metadata differs) share it."""

        def write(staging: Path) -> None:
            if not gguf_metadata.write_tokenizer(self.header, staging):
                self._write_tokenizer_with_transformers(staging)

        return _made_once(Path(envs.RINGLLM_CACHE) / "gguf-tokenizers" / self.header.tokenizer_digest(), write)

    def _write_tokenizer_with_transformers(self, out: Path) -> None:
        """A tokenizer gguf_metadata does not build (SentencePiece vocabularies...), by
        transformers' GGUF reader in a child process: the frontend resolves configs too, and
        would otherwise carry transformers and torch for its whole life."""
        child = subprocess.run(
            [sys.executable, "-c", _WRITE_TOKENIZER, self.path, str(out)], capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},  # this one's imports
        )
        if child.returncode:
            lines = child.stderr.strip().splitlines()
            raise GGUFError(lines[-1] if lines else f"{self.path}: reading its tokenizer failed (exit {child.returncode})")

    def write_transformers_tokenizer(self, out: str) -> None:
        """Write this file's tokenizer as transformers reads it (what the child process runs)."""
        from transformers import AutoTokenizer

        folder, name = os.path.split(os.path.abspath(self.path))
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers says what it could not read
            raise GGUFError(f"{self.path}: transformers could not read its tokenizer: {exc}") from exc
        tokenizer.save_pretrained(out)

    # ------------------------------------------------------------ weights

    def hf_names(self, config: ModelConfig) -> dict[str, str]:
        """GGUF tensor name -> Hugging Face name, by the gguf package's table."""
        import gguf

        arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.architecture)
        table = gguf.get_tensor_name_map(arch, config.num_layers)
        names = ["model.embed_tokens", "model.norm", "lm_head"]
        for i in range(config.num_layers):
            layer = f"model.layers.{i}"
            names += [f"{layer}.{norm}_layernorm" for norm in ("input", "post_attention", "pre_feedforward",
                                                               "post_feedforward")]
            names += [f"{layer}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
            names += [f"{layer}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
            if config.moe is not None:  # the router, the stacked experts, Qwen2-MoE's shared expert
                names += [f"{layer}.mlp.{p}" for p in (
                    "gate", "experts.gate_proj", "experts.up_proj", "experts.down_proj", "shared_expert.gate_proj",
                    "shared_expert.up_proj", "shared_expert.down_proj", "shared_expert_gate",
                )]
        mapping = {}
        for hf in names:
            for suffix in (".weight", ".bias"):
                gguf_name = table.get_name(hf + suffix, try_suffixes=(".weight", ".bias"))
                if gguf_name is not None:
                    mapping[gguf_name] = hf + suffix
        return mapping

    def check_names(self, config: ModelConfig) -> None:
        """GGUFError unless every tensor has a place in the model ``config`` describes (checked
        before anything is loaded; shapes are checked as the weights are)."""
        names = self.hf_names(config)
        for name in self.tensors:
            if name not in names:
                raise GGUFError(f"{self.path}: tensor {name} has no place in a {self.architecture} model")
        if config.moe is not None:
            self._check_experts(config)

    def _check_experts(self, config: ModelConfig) -> None:
        """GGUFError naming the first expert tensor that is missing or of the wrong shape (the
        router and the stacked projections of every sparse layer), before anything is loaded."""
        moe = config.moe
        assert moe is not None
        hidden, rows, experts = config.hidden_size, moe.intermediate_size, moe.num_experts
        expected = {  # GGUF lists the fastest axis first
            "ffn_gate_inp": (hidden, experts), "ffn_gate_exps": (hidden, rows, experts),
            "ffn_up_exps": (hidden, rows, experts), "ffn_down_exps": (rows, hidden, experts),
        }
        for layer in moe.layers:
            for tensor, shape in expected.items():
                name = f"blk.{layer}.{tensor}.weight"
                info = self.tensors.get(name)
                if info is None:
                    raise GGUFError(f"{self.path}: tensor {name} is missing (layer {layer} has {experts} experts)")
                if tuple(info.shape) != shape:
                    raise GGUFError(f"{self.path}: tensor {name} is {list(info.shape)}, expected {list(shape)} "
                                    f"({experts} experts of {rows} x {hidden})")

    def weights(self, config: ModelConfig, dense: torch.dtype | None = None,
                progress: Callable[[int], None] | None = None) -> Iterator[tuple[str, Any]]:
        """(Hugging Face name, tensor) for every tensor: matrices as ``QuantizedMatrix``
        (block formats, and F32/F16 matrices, in the kernels' tiles: kernels/packed_file.py
        keeps them in a file made at the first load and mapped after), vectors as torch tensors;
        or, with ``dense``, everything as torch tensors of that dtype (a device without these
        kernels). ``progress`` is told the bytes of the file's tensors as they are read."""
        import torch

        from kernels.packed_file import PackSpec, packed_matrices
        from kernels.quant import QuantizedMatrix, QuantType

        names = self.hf_names(config)
        specs = []
        for tensor in self.tensors.values():  # every name checked before anything is packed
            if tensor.name not in names:
                raise GGUFError(f"{self.path}: tensor {tensor.name} has no place in a {self.architecture} model")
            hf, shape = names[tensor.name], tuple(reversed(tensor.shape))  # GGUF lists the fastest axis first
            tiled = tensor.ggml_type in _BLOCK_TYPES or (len(shape) in (2, 3) and tensor.ggml_type in (0, 1))
            if tiled:
                # Stacked experts [experts, rows, k] are one matrix of experts x rows rows.
                rows, k = int(np.prod(shape[:-1])), shape[-1]
                order = _interleaved_order(rows, self._heads(config, hf)) if self._permuted(hf) else None
                specs.append(PackSpec(tensor.name, QuantType(tensor.ggml_type), rows, k,
                                      self.tensor_bytes(tensor).reshape(rows, -1), order))
        packed: dict[str, Any] = {}
        if specs and dense is None:
            stat = os.stat(self.path)
            identity = f"{os.path.realpath(self.path)}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
            packed = packed_matrices(specs, identity, Path(self.path).stem, os.path.realpath(self.path),
                                     torch.get_num_threads(), progress)
        tiles = {spec.name: spec for spec in specs}
        for tensor in self.tensors.values():
            hf, shape = names[tensor.name], tuple(reversed(tensor.shape))
            if tensor.name in packed:  # packed_matrices told the progress bar
                yield hf, packed[tensor.name]
                continue
            data = self.tensor_bytes(tensor)
            value: Any
            if tensor.name in tiles and dense is not None:  # a device without these kernels: the values
                spec = tiles[tensor.name]
                matrix = QuantizedMatrix(spec.qtype, spec.blocks, spec.rows, spec.k, spec.order)
                value = torch.from_numpy(matrix.dequantize()).reshape(shape).to(dense)
            elif len(shape) == 2 and dense is None:  # BF16: widened to the F32 tiles
                order = _interleaved_order(shape[0], self._heads(config, hf)) if self._permuted(hf) else None
                value = QuantizedMatrix.from_floats(_float_tensor(tensor.ggml_type, data).reshape(shape).numpy(), order)
            else:
                value = _float_tensor(tensor.ggml_type, data).reshape(shape)
                if self._permuted(hf):
                    value = _unpermute(value, self._heads(config, hf))
                if dense is not None:
                    value = value.to(dense)
            if progress is not None:
                progress(data.nbytes)
            yield hf, value

    @property
    def norms_shifted(self) -> bool:
        """The file's norm weights already hold the offset the model's norms add (Gemma's 1)."""
        return self.architecture in _NORMS_SHIFTED

    def weight_bytes(self) -> int:
        """The bytes of the file's tensors (a progress bar's total)."""
        return sum(tensor_bytes(t) for t in self.tensors.values())

    def _permuted(self, hf_name: str) -> bool:
        return self.architecture in _PERMUTED and hf_name.endswith(("q_proj.weight", "k_proj.weight"))

    @staticmethod
    def _heads(config: ModelConfig, hf_name: str) -> int:
        return config.num_heads if hf_name.endswith("q_proj.weight") else config.num_kv_heads

    def tensor_bytes(self, tensor: TensorInfo) -> np.ndarray:
        """A tensor's bytes: a read-only view of the mapped file (uint8)."""
        return np.frombuffer(self.header.buffer(), np.uint8, tensor_bytes(tensor), tensor.offset)

    def close(self) -> None:
        """Drops the header and the mapping (what was loaded holds copies, never views)."""
        self.header.close()
        self.tensors = {}


def _block_size(ggml_type: int) -> tuple[int, int]:
    """(values, bytes) per block of a GGML type (the gguf package's table)."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]


def tensor_bytes(tensor: TensorInfo) -> int:
    """The bytes a tensor's data takes in the file."""
    block, block_bytes = _block_size(tensor.ggml_type)
    return tensor.elements // block * block_bytes


def _float_tensor(ggml_type: int, data: np.ndarray, keep_half: bool = False) -> torch.Tensor:
    """A float tensor's values from its bytes, copied out of the file: float32 (float16 with
    ``keep_half``)."""
    import torch

    if ggml_type == 0:
        return torch.from_numpy(data.view(np.float32).copy())
    if ggml_type == 1:
        half = torch.from_numpy(data.view(np.float16).copy())
        return half if keep_half else half.float()
    bits = data.view(np.uint16).astype(np.uint32) << 16  # BF16
    return torch.from_numpy(bits.view(np.float32))


def _interleaved_order(rows: int, heads: int) -> np.ndarray:
    """The file row that holds each Hugging Face row of a q or k projection: llama.cpp's
    converter pairs the two halves of every head's rotary dimensions."""
    half = rows // heads // 2
    order = np.arange(rows).reshape(heads, half, 2).transpose(0, 2, 1).reshape(rows)
    return order


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    return weight[_interleaved_order(weight.shape[0], heads)].contiguous()
