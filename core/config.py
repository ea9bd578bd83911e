"""Engine configuration: what a user asks for (EngineArgs), and that resolved once (EngineConfig).

``EngineArgs`` holds the settings as given, flat (the command line builds it in
app/cli.py; tests and the offline ``LLM`` build it directly); fields left at
``None`` depend on the checkpoint. Each user-facing field carries its one
description, a ``Knob`` (help text, --help section, what the command line
needs to parse it); app/cli.py builds the ``--kebab-case`` options from the
fields, defaults included, so a knob is written once. ``EngineArgs.resolve()``
reads the checkpoint's architecture (core/model_config.py), fills those
fields in, and returns an ``EngineConfig``: the model as served, and one
section per concern (``cache_config``, ``scheduler_config``,
``parallel_config``, ``lora_config``, ``speculative_config``,
``pooler_config``, ``structured_outputs_config``), each checking its own
settings as it is made; what spans concerns (a chunk budget against the
context, adapters against the model) is checked by ``resolve``. Everything
below the entry points takes an EngineConfig and never resolves again. All
are msgspec Structs, so they cross to the engine process typed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple

import msgspec

from core.lora.adapter_spec import read_adapter_spec
from core.model_config import ModelConfig
from core.models.gguf_checkpoint import GGUFCheckpoint, gguf_file
from core.pooler_config import PoolerConfig, parse_override
from core.protocol import LoRARequest

logger = logging.getLogger("ringllm")

# The CPU KV cache by default: vLLM's CPU default (4 GiB) where the machine has room for it, else a
# quarter of the memory available once the weights are loaded, and never below the minimum.
CPU_KV_CACHE_MEMORY = 4 << 30
CPU_KV_CACHE_MIN_MEMORY = 256 << 20
# The longest run of whitespace a JSON grammar allows between two elements, unless a request
# says otherwise: room for a newline and indentation, not for a model that never stops
# writing newlines (bench/README.md has the measurements behind it).
DEFAULT_JSON_MAX_WHITESPACE = 2
DTYPES = ("auto", "float32", "float16", "bfloat16")
# Other spellings --dtype accepts (vLLM's and PyTorch's).
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}
DEVICES = ("auto", "cpu", "cuda")
# A step's token budget unless --max-num-batched-tokens says otherwise. On a CPU, llama.cpp's
# micro-batch: a prompt's activations are held for every token of its chunk (and stay resident
# once touched), prefill speed does not gain from longer chunks (the products pass over the
# weights once per few dozen rows whatever the chunk), and other requests' decodes wait for a
# shorter chunk. On a GPU, longer chunks keep it busy.
CPU_STEP_BUDGET = 512
GPU_STEP_BUDGET = 2048
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
TRANSPORTS = ("shm", "zmq")
SCHEDULING_POLICIES = ("fcfs", "priority")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
QUANTIZATIONS = ("q8_0", "q4_0")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "q8_0")
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")
SPECULATIVE_METHODS = ("ngram", "draft_model")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# n-gram lookup without prompt_lookup_min/max: the longest suffix tried, and the shortest.
DEFAULT_PROMPT_LOOKUP_MAX = 5
DEFAULT_PROMPT_LOOKUP_MIN = 2
MAX_SPECULATIVE_TOKENS = 16
# vLLM's largest LoRA rank; three such parts of a fused product fit kernels/cpu's LoRA kernel.
MAX_LORA_RANK = 512
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
}


@dataclass(frozen=True)
class Knob:
    """A user-facing EngineArgs field's one description, read by app/cli.py to build its
    option: ``--kebab-case`` of the field's name, the field's default (shown in ``--help``),
    ``type`` from the field's type unless ``parse`` is given. A bool is a switch: ``--x`` /
    ``--no-x`` when on by default, ``--x`` alone when off. Fields without a Knob are set by
    the program, not by users."""

    help: str
    group: str  # the --help section (its concern); app/cli.py names and describes the sections
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # text -> value; argparse.ArgumentTypeError says why not
    aliases: tuple[str, ...] = ()  # short spellings, e.g. -dp
    metavar: str | None = None
    nargs: str | None = None  # "+": one or more values (a list field gathers repeated flags)
    flag: str | None = None  # a switch that turns a default-on knob off, spelled otherwise (--disable-log-stats)


def engine_knobs() -> list[tuple[msgspec.structs.FieldInfo, Knob]]:
    """EngineArgs' user-facing fields, in order, each with its Knob."""
    return [(field, knob) for field in msgspec.structs.fields(EngineArgs) if (knob := _knob(field.type)) is not None]


def _knob(field_type: Any) -> Knob | None:
    if typing.get_origin(field_type) is not Annotated:
        return None
    return next((meta for meta in field_type.__metadata__ if isinstance(meta, Knob)), None)


# What the command line's text becomes, for the knobs that are not a plain str, int or float.


def parse_size(text: str) -> int:
    """Bytes from '268435456', '256MiB', '1.5G' (decimal k/M/G, binary KiB/MiB/GiB)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 536870912, 512MiB, 2G)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def positive_int(text: str) -> int:
    number = int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _parse_dtype(text: str) -> str:
    return DTYPE_ALIASES.get(text, text)


def _parse_whitespace_bound(text: str) -> int | None:
    """A whitespace bound: a count >= 1, or "none" (None: unbounded)."""
    if text.lower() == "none":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a count of characters (at least 1) or 'none': {text!r}")
    return int(text)


def _parse_engine_cpu(text: str) -> str:
    if text in ("auto", "off") or text.isdigit():
        return text
    raise argparse.ArgumentTypeError(f"expected auto, off or a core number, got {text!r}")


def _parse_speculative_config(text: str) -> SpeculativeConfig:
    try:
        return msgspec.json.decode(text, type=SpeculativeConfig).resolved()
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"invalid speculative config {text!r}: {exc}") from None


def _parse_lora_module(text: str) -> LoRAModule:
    """``name=path``, or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            return msgspec.json.decode(text, type=LoRAModule)
        except msgspec.MsgspecError as exc:
            raise argparse.ArgumentTypeError(f"invalid LoRA module {text!r}: {exc}") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"invalid LoRA module {text!r}: expected name=path or JSON")
    return LoRAModule(name=name, path=path)


def _parse_pooler_config(text: str) -> PoolerConfig:
    try:
        return parse_override(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class SpeculativeConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``--speculative-config`` as vLLM takes it: who proposes draft tokens and how many.

    ``ngram`` looks the request's last tokens up earlier in its own context (prompt
    and output) and proposes what followed them there, trying suffixes from
    ``prompt_lookup_max`` tokens down to ``prompt_lookup_min``. ``draft_model`` names
    a smaller checkpoint that shares the target's tokenizer. Speculation pauses for
    the steps whose batch has ``disable_by_batch_size`` requests or more, where the
    engine is compute-bound and verifying drafts costs more than it saves.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None

    def resolved(self) -> SpeculativeConfig:
        """Checked (ValueError), with the n-gram window filled in."""
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ValueError(f"disable_by_batch_size must be >= 2, got {self.disable_by_batch_size}")
        if self.method == "draft_model":
            if not self.model:
                raise ValueError('the draft_model method needs "model": the draft checkpoint\'s directory')
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("prompt_lookup_min and prompt_lookup_max are for the ngram method")
            return self
        if self.model is not None:
            raise ValueError('"model" is for the draft_model method; ngram proposes from the request itself')
        high = self.prompt_lookup_max or self.prompt_lookup_min or DEFAULT_PROMPT_LOOKUP_MAX
        low = self.prompt_lookup_min or min(DEFAULT_PROMPT_LOOKUP_MIN, high)
        if not 1 <= low <= high:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {low} and {high}")
        return msgspec.structs.replace(self, prompt_lookup_min=low, prompt_lookup_max=high)


class LoRAModule(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """An adapter served from start-up (``--lora-modules name=path``, or vLLM's JSON form):
    requests name it as their ``model``; ``/v1/models`` lists it under ``base_model_name``
    (default: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


class CacheConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The paged KV cache: block size, what it stores, and its budget (EngineArgs' cache knobs)."""

    block_size: int
    kv_cache_dtype: str
    num_gpu_blocks_override: int | None
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(f"num_gpu_blocks_override must be >= 2 (one is the null block), "
                             f"got {self.num_gpu_blocks_override}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


class SchedulerConfig(msgspec.Struct, kw_only=True, frozen=True):
    """How requests share the engine's steps (EngineArgs' scheduler knobs)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    scheduling_policy: str
    async_scheduling: bool

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")


class ParallelConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Data parallelism: this engine's place among the engines, and its share of the host."""

    data_parallel_size: int
    data_parallel_rank: int
    data_parallel_size_local: int | None
    engine_threads: int | None

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1 or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {self.data_parallel_rank} is not in 0..{self.data_parallel_size - 1}"
            )
        if self.engine_threads is not None and self.engine_threads < 1:
            raise ValueError(f"engine_threads must be >= 1, got {self.engine_threads}")

    @property
    def engines_on_this_host(self) -> int:
        return self.data_parallel_size_local or self.data_parallel_size


class LoRAConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Serving LoRA adapters (present only with --enable-lora): how many, how large, and
    those served from start-up."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    lora_modules: list[LoRAModule]

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.max_lora_rank > MAX_LORA_RANK:  # a fused q/k/v adapter's ranks fit the C kernel's
            raise ValueError(f"max_lora_rank must be <= {MAX_LORA_RANK}, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        names = [module.name for module in self.lora_modules]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"LoRA module name {name!r} is used twice")

    def lora_requests(self) -> list[LoRARequest]:
        """The --lora-modules adapters as the engine knows them: ids 1, 2, ... in order."""
        return [LoRARequest(m.name, i, m.path) for i, m in enumerate(self.lora_modules, start=1)]


class StructuredOutputsConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Grammar-constrained decoding: the backend, and the JSON whitespace bound (None: none)."""

    backend: str
    max_whitespace: int | None

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                f"got {self.backend!r}"
            )
        if self.max_whitespace is not None and self.max_whitespace < 1:
            raise ValueError(f"structured_outputs_max_whitespace must be >= 1, got {self.max_whitespace}")


class EngineArgs(msgspec.Struct, kw_only=True, frozen=True):
    """Everything the EngineCore needs to build its model, KV cache and scheduler,
    as asked for. ``model`` is a local Hugging Face directory. The fields are grouped
    by concern, as ``--help`` shows them."""

    # model
    model: Annotated[str, Knob(
        "local Hugging Face model directory (config.json, *.safetensors, tokenizer files), or a GGUF file "
        "(or a directory holding one), served quantized as it is; nothing is downloaded "
        "(default: the embedded stories260K)",
        "model", metavar="DIR|FILE.gguf",
    )]
    served_model_name: Annotated[str | None, Knob(
        "model names clients use in requests: the first is the one /v1/models reports, the others are "
        "accepted as aliases (default: --model, or stories260K and ringllm-default)",
        "model", nargs="+", metavar="NAME",
    )] = None
    tokenizer: Annotated[str | None, Knob("tokenizer directory (default: --model)", "model", metavar="DIR")] = None
    dtype: Annotated[str, Knob(
        "compute dtype; auto: float32 on a CPU, the checkpoint's dtype on a GPU", "model",
        choices=DTYPES, parse=_parse_dtype,
    )] = "auto"
    device: Annotated[str, Knob("where the model runs; auto: a GPU if any", "model", choices=DEVICES)] = "auto"
    load_format: Annotated[str, Knob(
        "weights from the checkpoint (auto: safetensors, or gguf for a GGUF file) or seeded random ones of "
        "its shapes: dummy",
        "model", choices=LOAD_FORMATS,
    )] = "auto"
    quantization: Annotated[str | None, Knob(
        "quantize a Hugging Face checkpoint's layers and embedding at load, in llama.cpp's block format "
        "(CPU; a GGUF file keeps its own formats)",
        "model", choices=QUANTIZATIONS,
    )] = None
    seed: Annotated[int, Knob("seed of random sampling and of dummy weights", "model")] = 0
    max_model_len: Annotated[int | None, Knob(
        "context length: prompt plus completion tokens (default: the checkpoint's max_position_embeddings)",
        "model",
    )] = None
    enforce_eager: Annotated[bool, Knob("on a GPU, no CUDA graphs", "model")] = False
    enable_prompt_embeds: Annotated[bool, Knob(
        "accept prompt_embeds (base64 torch.save tensors) in /v1/completions", "model"
    )] = False
    logprobs_mode: Annotated[str, Knob(
        "what returned logprobs describe: the model's raw logits (vLLM's default) or the distribution "
        "sampled from, after penalties, temperature, min_p, top-k and top-p",
        "model", choices=LOGPROBS_MODES,
    )] = "raw_logprobs"

    # pooling
    runner: Annotated[str, Knob(
        "generate text, or pool (embeddings: /v1/embeddings; cross-encoders: /score, /rerank); auto: "
        "pooling for checkpoints without a language-model head (BERT, RoBERTa, XLM-R encoders and their "
        "...ForSequenceClassification, a headless LlamaModel), generate otherwise",
        "pooling", choices=RUNNERS,
    )] = "auto"
    convert: Annotated[str, Knob(
        "serve a generative checkpoint as a pooling model: embed (last-token pooling unless the "
        "directory's sentence-transformers modules or --override-pooler-config say otherwise)",
        "pooling", choices=CONVERTS,
    )] = "auto"
    override_pooler_config: Annotated[PoolerConfig | None, Knob(
        "a pooling model's pooler, over what its sentence-transformers modules say: "
        '{"pooling_type": "MEAN", "normalize": true} (LAST, MEAN, CLS or ALL)',
        "pooling", parse=_parse_pooler_config, metavar="JSON",
    )] = None

    # structured outputs and tools
    structured_outputs_backend: Annotated[str, Knob(
        "grammar backend for JSON schema, regex, choice and grammar constraints: xgrammar, the only one "
        "implemented, which auto picks",
        "structured outputs and tools", choices=STRUCTURED_OUTPUTS_BACKENDS,
    )] = "auto"
    structured_outputs_max_whitespace: Annotated[int | None, Knob(
        "JSON schemas and json_object: the longest run of whitespace between two elements that a request "
        "without structured_outputs.max_whitespace may write; none lifts the bound, as vLLM has it",
        "structured outputs and tools", parse=_parse_whitespace_bound, metavar="N|none",
    )] = DEFAULT_JSON_MAX_WHITESPACE

    # scheduler
    max_num_seqs: Annotated[int, Knob("most requests running at once", "scheduler")] = 64
    max_num_batched_tokens: Annotated[int | None, Knob(
        f"token budget of one engine step (default: {CPU_STEP_BUDGET} on a CPU, {GPU_STEP_BUDGET} on a GPU)",
        "scheduler",
    )] = None
    enable_chunked_prefill: Annotated[bool, Knob(
        "split long prompts over several steps, beside other requests' decodes", "scheduler"
    )] = True
    scheduling_policy: Annotated[str, Knob(
        "waiting-queue order and preemption victim: arrival (fcfs) or the request's priority",
        "scheduler", choices=SCHEDULING_POLICIES,
    )] = "fcfs"
    async_scheduling: Annotated[bool, Knob(
        "schedule the next batch while the model runs the current one (on the executor's worker thread)",
        "scheduler",
    )] = False
    speculative_config: Annotated[SpeculativeConfig | None, Knob(
        'speculative decoding, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5} proposes tokens that followed the same n-gram '
        "earlier in the request and verifies them in one step; disable_by_batch_size pauses it for batches "
        "that large (default: off)",
        "scheduler", parse=_parse_speculative_config, metavar="JSON",
    )] = None

    # cache
    block_size: Annotated[int, Knob("tokens per KV cache block", "cache")] = 16
    kv_cache_dtype: Annotated[str, Knob(
        "what the KV cache holds; auto: float16 on a CPU under float32 compute (llama.cpp's default f16 "
        "cache: half the memory and the bytes attention reads), else the compute dtype; float32 keeps a "
        "CPU's cache exact; q8_0 (CPU, head_dim a multiple of 32): llama.cpp's -ctk/-ctv q8_0, 32-value "
        "blocks of int8 and a scale, 0.53x float16's memory",
        "cache", choices=KV_CACHE_DTYPES,
    )] = "auto"
    num_gpu_blocks_override: Annotated[int | None, Knob(
        "number of KV cache blocks, whatever the memory", "cache"
    )] = None
    kv_cache_memory: Annotated[int | None, Knob(
        f"bytes for the KV cache, e.g. 512MiB (default on a CPU: {CPU_KV_CACHE_MEMORY >> 30} GiB, at most a "
        "quarter of the memory available after the weights, at least "
        f"{CPU_KV_CACHE_MIN_MEMORY >> 20} MiB and one max_model_len request, at most what max_num_seqs "
        "full-length requests use; on a GPU: measured)",
        "cache", parse=parse_size, metavar="BYTES",
    )] = None
    gpu_memory_utilization: Annotated[float, Knob(
        "fraction of GPU memory the engine may use, KV cache included", "cache"
    )] = 0.9
    enable_prefix_caching: Annotated[bool, Knob("reuse the KV cache of shared prompt prefixes", "cache")] = True

    # LoRA
    enable_lora: Annotated[bool, Knob(
        "serve LoRA adapters (PEFT directories): a request picks one by its model name", "LoRA"
    )] = False
    lora_modules: Annotated[list[LoRAModule], Knob(
        'adapters served from start-up: name=path, or {"name": ..., "path": ..., "base_model_name": ...}',
        "LoRA", parse=_parse_lora_module, nargs="+", metavar="NAME=PATH",
    )] = []
    max_loras: Annotated[int, Knob(
        "most distinct adapters in one batch", "LoRA", parse=positive_int, metavar="N"
    )] = 1
    max_lora_rank: Annotated[int, Knob("largest adapter rank accepted", "LoRA", parse=positive_int, metavar="R")] = 16
    max_cpu_loras: Annotated[int | None, Knob(
        "adapters kept loaded; more are read again from their directory when used (default: --max-loras)",
        "LoRA", parse=positive_int, metavar="N",
    )] = None

    # transport
    transport: Annotated[str, Knob(
        "shm: shared-memory rings; zmq: vLLM's ZeroMQ sockets, the baseline", "transport", choices=TRANSPORTS
    )] = "shm"
    engine_cpu: Annotated[str, Knob(
        "the core the EngineCore's Python threads share (its busy loop and I/O threads "
        "hand the GIL to each other every step, cheaply on one core): auto (the last core allowed), off "
        "(the kernel places them), or a core number; the math libraries' thread pools keep every core",
        "transport", parse=_parse_engine_cpu, metavar="{auto,off,N}",
    )] = "auto"
    # Seconds the engine drains on SIGTERM (no flag sets it).
    engine_drain_timeout: float = 5.0

    # scale-out
    data_parallel_size: Annotated[int, Knob(
        "EngineCore processes on this host, each with its own KV cache (the memory budget split between "
        "them); requests go to the least loaded one",
        "scale-out", parse=positive_int, aliases=("-dp",), metavar="N",
    )] = 1
    # This engine's index among them: set per engine process (core/dp_client.py), not a flag.
    data_parallel_rank: int = 0
    engine_threads: Annotated[int | None, Knob(
        "math-library threads per EngineCore (default: the cores split between the engines)",
        "scale-out", parse=positive_int, metavar="N",
    )] = None
    data_parallel_size_local: Annotated[int | None, Knob(
        "engines on this host, what its cores and memory budget are split between (default: all of "
        "them); the head waits for the others to register from --headless hosts",
        "scale-out", parse=positive_int, aliases=("-dpl",), metavar="N",
    )] = None

    # observability and control
    log_stats: Annotated[bool, Knob(
        "collect no engine statistics: no periodic stats line, and no vllm: series at /metrics "
        "(the ringllm: transport counters remain)",
        "observability and control", flag="--disable-log-stats",
    )] = True
    enable_sleep_mode: Annotated[bool, Knob(
        "serve POST /sleep, POST /wake_up and GET /is_sleeping (free the KV cache and weights while idle)",
        "observability and control",
    )] = False

    def resolve(self) -> EngineConfig:
        """Read the checkpoint's architecture, fill in what depends on it, check that
        the limits fit together (ValueError, OSError for an unreadable checkpoint).

        A GGUF file (``model`` names it, or a directory holding one) is checked whole
        first; its config and tokenizer are read from its metadata (core/models/gguf_checkpoint.py).
        Each concern's section checks its own settings as it is made, before the checkpoint is read."""
        sections = self._sections()
        return self._resolved(self._read_checkpoint(), *sections)

    def for_architecture(self, model_config: ModelConfig) -> EngineConfig:
        """Resolved against ``model_config`` as given, with no checkpoint read: ``model`` and
        ``tokenizer`` are taken as they are (a stand-in architecture, as the scheduler's tests use)."""
        sections = self._sections()
        checkpoint = _Checkpoint(self.model, self.tokenizer or self.model, self.load_format, model_config, gguf=False)
        return self._resolved(checkpoint, *sections)

    def _resolved(
        self, checkpoint: _Checkpoint, cache: CacheConfig, scheduler: SchedulerConfig, parallel: ParallelConfig,
        lora: LoRAConfig | None, outputs: StructuredOutputsConfig,
    ) -> EngineConfig:
        model_config = checkpoint.model_config
        self._check_kv_layout(model_config)
        max_model_len = self._check_context(model_config)
        scheduler = self._check_scheduler(model_config, max_model_len, scheduler)
        self._check_outputs()
        speculative, draft_model_config = self._check_speculative(
            model_config, checkpoint.tokenizer, scheduler.max_num_batched_tokens
        )
        pooler_config = self._pooler_config(model_config, None if checkpoint.gguf else checkpoint.model)
        chunked, prefix_caching, batched_tokens = self._pooling_limits(
            pooler_config, model_config, speculative, max_model_len, scheduler.max_num_batched_tokens
        )
        self._check_lora(model_config, pooler_config)
        return EngineConfig(
            model=checkpoint.model,
            served_model_name=self.served_model_name or self.model,
            tokenizer=checkpoint.tokenizer,
            dtype=self.dtype,
            device=self.device,
            load_format=checkpoint.load_format,
            quantization=self.quantization,
            seed=self.seed,
            max_model_len=max_model_len,
            enforce_eager=self.enforce_eager,
            enable_prompt_embeds=self.enable_prompt_embeds,
            logprobs_mode=self.logprobs_mode,
            model_config=model_config,
            cache_config=msgspec.structs.replace(cache, enable_prefix_caching=prefix_caching),
            scheduler_config=msgspec.structs.replace(
                scheduler, enable_chunked_prefill=chunked, max_num_batched_tokens=batched_tokens
            ),
            parallel_config=parallel,
            lora_config=lora,
            speculative_config=speculative,
            draft_model_config=draft_model_config,
            pooler_config=pooler_config,
            structured_outputs_config=outputs,
            transport=self.transport,
            engine_cpu=self.engine_cpu,
            engine_drain_timeout=self.engine_drain_timeout,
            log_stats=self.log_stats,
            enable_sleep_mode=self.enable_sleep_mode,
        )

    def _sections(
        self,
    ) -> tuple[CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig | None, StructuredOutputsConfig]:
        """The concerns' own sections, each checking itself (ValueError)."""
        cache = CacheConfig(
            block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype,
            num_gpu_blocks_override=self.num_gpu_blocks_override, kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization, enable_prefix_caching=self.enable_prefix_caching,
        )
        if self.kv_cache_dtype == "q8_0" and self.device == "cuda":
            raise ValueError("--kv-cache-dtype q8_0 is read by the CPU kernels only: use it with --device cpu")
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self._step_budget(),
            enable_chunked_prefill=self.enable_chunked_prefill, scheduling_policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling,
        )
        parallel = ParallelConfig(
            data_parallel_size=self.data_parallel_size, data_parallel_rank=self.data_parallel_rank,
            data_parallel_size_local=self.data_parallel_size_local, engine_threads=self.engine_threads,
        )
        lora = None
        if self.enable_lora:
            lora = LoRAConfig(
                max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                max_cpu_loras=self.max_cpu_loras or self.max_loras, lora_modules=list(self.lora_modules),
            )
        elif self.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        outputs = StructuredOutputsConfig(
            backend=self.structured_outputs_backend, max_whitespace=self.structured_outputs_max_whitespace
        )
        return cache, scheduler, parallel, lora, outputs

    def _check_kv_layout(self, model_config: ModelConfig) -> None:
        if self.kv_cache_dtype == "q8_0" and model_config.head_dim % 32:
            raise ValueError(
                f"--kv-cache-dtype q8_0 stores blocks of 32 values of a head: this model's head_dim "
                f"{model_config.head_dim} is not a multiple of 32; use float16"
            )

    def _read_checkpoint(self) -> _Checkpoint:
        """The checkpoint's architecture, and where its weights and tokenizer are read from."""
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        path = gguf_file(self.model)
        if path is None:
            if self.load_format == "gguf":
                raise ValueError(f"--load-format gguf: {self.model} is not a GGUF file")
            model_config = ModelConfig.from_dir(self.model)
            return _Checkpoint(self.model, self.tokenizer or self.model, self.load_format, model_config, gguf=False)
        if self.quantization is not None:
            raise ValueError("--quantization is for Hugging Face checkpoints: a GGUF file is quantized already")
        if self.load_format not in ("auto", "gguf", "dummy"):
            raise ValueError(f"--load-format {self.load_format} cannot read a GGUF file")
        checkpoint = GGUFCheckpoint(path)
        try:
            metadata = str(checkpoint.metadata_dir())
            model_config = ModelConfig.from_dir(metadata)
            checkpoint.check_names(model_config)
        finally:
            checkpoint.close()
        load_format = "gguf" if self.load_format == "auto" else self.load_format
        return _Checkpoint(path, self.tokenizer or metadata, load_format, model_config, gguf=True)

    def _check_context(self, model_config: ModelConfig) -> int:
        """The context length: max_model_len, or the checkpoint's."""
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        trained = model_config.max_position_embeddings
        if max_model_len > trained and not model_config.encoder:  # an encoder's positions end there: refused below
            logger.warning(
                "max_model_len %d is past the %d positions the model was trained on: it runs (rotary "
                "positions have no end), but its outputs past them may be poor", max_model_len, trained,
            )
        return max_model_len

    def _step_budget(self) -> int:
        """The step's token budget: as given, else the default of the device the model will run on
        (``auto``: a GPU where the machine has an NVIDIA device, which the engine then finds through torch)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        device = self.device
        if device == "auto":
            device = "cuda" if os.path.exists("/dev/nvidiactl") else "cpu"
        return GPU_STEP_BUDGET if device == "cuda" else CPU_STEP_BUDGET

    def _check_scheduler(
        self, model_config: ModelConfig, max_model_len: int, scheduler: SchedulerConfig
    ) -> SchedulerConfig:
        """The scheduler section once the context is known: without chunked prefill a prompt
        goes in one step, so a default budget grows to the context and a given one must hold it."""
        if self.enable_chunked_prefill or model_config.encoder or scheduler.max_num_batched_tokens >= max_model_len:
            return scheduler
        if self.max_num_batched_tokens is not None:
            raise ValueError("max_num_batched_tokens must be >= max_model_len without chunked prefill")
        return msgspec.structs.replace(scheduler, max_num_batched_tokens=max_model_len)

    def _check_outputs(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")

    def _check_speculative(
        self, model_config: ModelConfig, tokenizer: str, step_budget: int
    ) -> tuple[SpeculativeConfig | None, ModelConfig | None]:
        """The resolved speculative config, and the draft checkpoint's architecture (draft_model)."""
        speculative = self.speculative_config
        if speculative is None:
            return None, None
        speculative = speculative.resolved()
        if self.async_scheduling:
            # The proposer reads the tokens a step sampled before the next step is
            # scheduled; a batch scheduled ahead of them would carry no drafts.
            raise ValueError("--speculative-config does not work with --async-scheduling yet: choose one")
        if speculative.num_speculative_tokens + 1 > step_budget:
            raise ValueError("max_num_batched_tokens must leave room for one request's drafts and its token")
        if speculative.method != "draft_model":
            return speculative, None
        return speculative, _draft_model_config(speculative.model, tokenizer, model_config)

    def _pooling_limits(
        self,
        pooler_config: PoolerConfig | None,
        model_config: ModelConfig,
        speculative: SpeculativeConfig | None,
        max_model_len: int,
        step_budget: int,
    ) -> tuple[bool, bool, int]:
        """Chunked prefill, prefix caching and the step's token budget, as a pooling model can have them."""
        chunked, prefix_caching, batched_tokens = self.enable_chunked_prefill, self.enable_prefix_caching, step_budget
        if pooler_config is None:
            return chunked, prefix_caching, batched_tokens
        if speculative is not None:
            raise ValueError("--speculative-config is for generation; a pooling model samples no tokens")
        if model_config.encoder:
            if self.quantization is not None:
                raise ValueError("--quantization serves decoder models; this checkpoint is an encoder")
            if max_model_len > model_config.max_position_embeddings:
                raise ValueError(
                    f"max_model_len {max_model_len} exceeds the encoder's "
                    f"{model_config.max_position_embeddings} absolute positions"
                )
            # Bidirectional attention sees the whole prompt at once: no chunks, no cached prefix.
            return False, False, max(batched_tokens, max_model_len)
        if pooler_config.pooling_type != "LAST":
            prefix_caching = False  # the pooled states of a cached prefix are not kept
        return chunked, prefix_caching, batched_tokens

    def _check_lora(self, model_config: ModelConfig, pooler_config: PoolerConfig | None) -> None:
        """LoRA fits the model, and every --lora-modules adapter does (the LoRA section checked the rest)."""
        if not self.enable_lora:
            return
        if pooler_config is not None or model_config.encoder:
            raise ValueError("--enable-lora serves generative models; this one is served for pooling")
        served = self.served_model_name or self.model
        for module in self.lora_modules:
            if module.name == served:
                raise ValueError(f"LoRA module name {module.name!r} is the served model's name")
            if module.base_model_name is not None and module.base_model_name != served:
                raise ValueError(
                    f"LoRA module {module.name!r} is for base model {module.base_model_name!r}, "
                    f"and this server serves {served!r}"
                )
            read_adapter_spec(module.path, model_config, self.max_lora_rank)

    def _pooler_config(self, model_config: ModelConfig, model_dir: str | None) -> PoolerConfig | None:
        """The resolved pooler of a pooling model; None for a generative one."""
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {self.convert!r}")
        headless = not model_config.has_lm_head
        converted = self.convert in ("embed", "classify")
        pooling = self.runner == "pooling" or (self.runner == "auto" and (headless or converted))
        if not pooling:
            if headless:
                raise ValueError(
                    f"{model_config.architecture} has no language-model head and generates nothing: "
                    "serve it with --runner pooling (the default for it)"
                )
            if converted or self.override_pooler_config is not None:
                raise ValueError("--convert and --override-pooler-config need --runner pooling")
            return None
        override = self.override_pooler_config or PoolerConfig()
        if self.convert == "classify" and override.task is None:
            override = msgspec.structs.replace(override, task="classify")
        return override.resolved(model_config, model_dir)


class _Checkpoint(NamedTuple):
    """What EngineArgs._read_checkpoint found: the weights' path (a GGUF file's own), the
    tokenizer directory, the load format, the architecture, and whether it is a GGUF file."""

    model: str
    tokenizer: str
    load_format: str
    model_config: ModelConfig
    gguf: bool


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    """EngineArgs resolved against the checkpoint (``EngineArgs.resolve``): the model as served,
    its typed architecture, and a section per concern, with no field left to be worked out."""

    # The model as served: where it is read from, and how it runs.
    model: str
    served_model_name: str
    tokenizer: str
    dtype: str
    device: str
    load_format: str
    quantization: str | None
    seed: int
    max_model_len: int
    enforce_eager: bool
    enable_prompt_embeds: bool
    logprobs_mode: str
    model_config: ModelConfig  # the checkpoint's architecture
    # One section per concern.
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    lora_config: LoRAConfig | None  # None: LoRA is off
    speculative_config: SpeculativeConfig | None  # None: no speculation
    draft_model_config: ModelConfig | None  # the draft checkpoint's architecture (method draft_model)
    pooler_config: PoolerConfig | None  # a pooling model's pooler (embeddings, scores); None: it generates
    structured_outputs_config: StructuredOutputsConfig
    # The engine process.
    transport: str
    engine_cpu: str
    engine_drain_timeout: float
    log_stats: bool
    enable_sleep_mode: bool

    @property
    def is_pooling(self) -> bool:
        return self.pooler_config is not None


def _draft_model_config(draft_dir: str, target_tokenizer: str, target: ModelConfig) -> ModelConfig:
    """The draft checkpoint's architecture, checked against the target's: the same vocabulary
    (its size, and the token of every id where both directories hold a tokenizer.json)."""
    try:
        draft = ModelConfig.from_dir(draft_dir)
    except OSError as exc:
        raise ValueError(f"the draft model {draft_dir}: {exc}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size}): it must share the target's tokenizer"
        )
    vocabs = [_tokenizer_vocab(d) for d in (target_tokenizer, draft_dir)]
    if None not in vocabs and vocabs[0] != vocabs[1]:
        raise ValueError("the draft model's tokenizer maps tokens to other ids than the target's: it must share it")
    return draft


def _tokenizer_vocab(directory: str) -> dict | None:
    path = os.path.join(directory, "tokenizer.json") if os.path.isdir(directory) else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("model", {}).get("vocab")
