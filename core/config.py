"""Engine configuration: what a user asks for (EngineArgs), and that resolved once (EngineConfig).

``EngineArgs`` holds the settings as given (the command line builds it in
app/cli.py; tests and the offline ``LLM`` build it directly); fields left at
``None`` depend on the checkpoint. ``EngineArgs.resolve()`` reads the
checkpoint's architecture (core/model_config.py), fills those fields in,
checks the limits fit together, and returns an ``EngineConfig``: the same
settings, frozen, with nothing left open. Everything below the entry points
takes an EngineConfig and never resolves again. Both are msgspec Structs, so
they cross to the engine process typed.
"""

from __future__ import annotations

import json
import os

import msgspec

from core.lora.adapter_spec import read_adapter_spec
from core.model_config import ModelConfig
from core.models.gguf_checkpoint import GGUFCheckpoint, gguf_file
from core.pooler_config import PoolerConfig
from core.protocol import LoRARequest

# The CPU KV cache by default: vLLM's CPU default (4 GiB) where the machine has room for it, else a
# quarter of the memory available once the weights are loaded, and never below the minimum.
CPU_KV_CACHE_MEMORY = 4 << 30
CPU_KV_CACHE_MIN_MEMORY = 256 << 20
# The longest run of whitespace a JSON grammar allows between two elements, unless a request
# says otherwise: room for a newline and indentation, not for a model that never stops
# writing newlines (bench/README.md has the measurements behind it).
DEFAULT_JSON_MAX_WHITESPACE = 2
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
QUANTIZATIONS = ("q8_0", "q4_0")
KV_CACHE_DTYPES = ("auto", "float32", "float16")
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")
SPECULATIVE_METHODS = ("ngram", "draft_model")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# n-gram lookup without prompt_lookup_min/max: the longest suffix tried, and the shortest.
DEFAULT_PROMPT_LOOKUP_MAX = 5
DEFAULT_PROMPT_LOOKUP_MIN = 2
MAX_SPECULATIVE_TOKENS = 16


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


class EngineArgs(msgspec.Struct, kw_only=True, frozen=True):
    """Everything the EngineCore needs to build its model, KV cache and scheduler,
    as asked for. ``model`` is a local Hugging Face directory."""

    model: str
    served_model_name: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    # What the KV cache holds: auto (float16 under float32 compute on a CPU, as llama.cpp's
    # default; else the compute dtype) | float32 | float16 (CPU: half the memory and the
    # bytes attention reads, keys and values rounded as llama.cpp's are).
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    load_format: str = "auto"  # auto | safetensors | gguf | dummy (a GGUF file is read as gguf)
    # Quantize a Hugging Face checkpoint's dense layers and embedding at load (GGUF block formats).
    quantization: str | None = None  # q8_0 | q4_0
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int | None = None  # bytes for the KV cache (default: CPU default_cpu_kv_budget, GPU profiled)
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    transport: str = "shm"  # shm | zmq
    enable_prompt_embeds: bool = False  # accept prompts given as embeddings
    scheduling_policy: str = "fcfs"  # fcfs | priority
    # Schedule step N+1 while step N runs on the executor's worker thread.
    async_scheduling: bool = False
    engine_drain_timeout: float = 5.0  # seconds the engine drains on SIGTERM
    # Attach scheduler and engine stats to outputs (the frontend's metrics);
    # off with --disable-log-stats, as in vLLM.
    log_stats: bool = True
    # Allow the sleep/wake_up utilities (--enable-sleep-mode).
    enable_sleep_mode: bool = False
    # What logprobs describe: the model's raw logits (vLLM's default) or the
    # distribution actually sampled from (after penalties, temperature, cuts).
    logprobs_mode: str = "raw_logprobs"  # raw_logprobs | processed_logprobs
    # Grammar backend for structured outputs: "auto" and "xgrammar" are the same (the only one).
    structured_outputs_backend: str = "auto"
    # JSON grammars: the longest whitespace run between elements when a request does
    # not set one (None: unbounded, as vLLM has it).
    structured_outputs_max_whitespace: int | None = DEFAULT_JSON_MAX_WHITESPACE
    # The core of the engine process's Python threads (core/affinity.py): auto | off | a core number.
    engine_cpu: str = "auto"
    # Data parallel: this many EngineCore processes share the host's cores and
    # memory budget (the KV cache budget is split between them); this engine's
    # index among them. engine_threads: the math libraries' threads per engine
    # (default: the cores split between the engines).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    engine_threads: int | None = None
    # Engines on this engine's host (default: all of them): what the host's cores and
    # memory budget are split between.
    data_parallel_size_local: int | None = None
    # Speculative decoding (--speculative-config); None: off.
    speculative_config: SpeculativeConfig | None = None
    # vLLM's --runner (auto: pooling for checkpoints without a language-model head) and
    # --convert (serve a generative checkpoint as a pooling model), --override-pooler-config.
    runner: str = "auto"
    convert: str = "auto"
    override_pooler_config: PoolerConfig | None = None
    # Multi-LoRA (--enable-lora): adapters served from start-up, the most distinct adapters in
    # one step, the largest rank accepted, and how many stay loaded (default: max_loras).
    enable_lora: bool = False
    lora_modules: list[LoRAModule] = []
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @property
    def engines_on_this_host(self) -> int:
        return self.data_parallel_size_local or self.data_parallel_size

    def resolve(self) -> EngineConfig:
        """Read the checkpoint's architecture, fill in what depends on it, check that
        the limits fit together (ValueError, OSError for an unreadable checkpoint).

        A GGUF file (``model`` names it, or a directory holding one) is checked whole
        first; its config and tokenizer are read from its metadata (core/models/gguf_checkpoint.py)."""
        model, tokenizer, load_format = self.model, self.tokenizer, self.load_format
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        path = gguf_file(model)
        if path is not None:
            if self.quantization is not None:
                raise ValueError("--quantization is for Hugging Face checkpoints: a GGUF file is quantized already")
            if load_format not in ("auto", "gguf", "dummy"):
                raise ValueError(f"--load-format {load_format} cannot read a GGUF file")
            checkpoint = GGUFCheckpoint(path)
            try:
                metadata = str(checkpoint.metadata_dir())
                model_config = ModelConfig.from_dir(metadata)
                checkpoint.check_names(model_config)
            finally:
                checkpoint.close()
            model, tokenizer = path, tokenizer or metadata
            load_format = "gguf" if load_format == "auto" else load_format
        elif load_format == "gguf":
            raise ValueError(f"--load-format gguf: {model} is not a GGUF file")
        else:
            model_config = ModelConfig.from_dir(model)
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        window = model_config.sliding_window
        if window is not None and window < max_model_len:  # our attention sees the whole context
            raise ValueError(
                f"this checkpoint uses sliding-window attention (window {window}), which is not "
                f"supported; serve it with max_model_len <= {window}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len \
                and not model_config.encoder:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len without chunked prefill"
            )
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                f"got {self.structured_outputs_backend!r}"
            )
        if self.structured_outputs_max_whitespace is not None and self.structured_outputs_max_whitespace < 1:
            raise ValueError(
                f"structured_outputs_max_whitespace must be >= 1, got {self.structured_outputs_max_whitespace}"
            )
        if self.data_parallel_size < 1 or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {self.data_parallel_rank} is not in 0..{self.data_parallel_size - 1}"
            )
        if self.engine_threads is not None and self.engine_threads < 1:
            raise ValueError(f"engine_threads must be >= 1, got {self.engine_threads}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        speculative, draft_model_config = self.speculative_config, None
        if speculative is not None:
            speculative = speculative.resolved()
            if self.async_scheduling:
                # The proposer reads the tokens a step sampled before the next step is
                # scheduled; a batch scheduled ahead of them would carry no drafts.
                raise ValueError("--speculative-config does not work with --async-scheduling yet: choose one")
            if speculative.num_speculative_tokens + 1 > self.max_num_batched_tokens:
                raise ValueError("max_num_batched_tokens must leave room for one request's drafts and its token")
            if speculative.method == "draft_model":
                draft_model_config = _draft_model_config(speculative.model, tokenizer or model, model_config)
        pooler_config = self._pooler_config(model_config, model if path is None else None)
        chunked, prefix_caching, batched_tokens = (
            self.enable_chunked_prefill, self.enable_prefix_caching, self.max_num_batched_tokens
        )
        if pooler_config is not None:
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
                chunked, prefix_caching, batched_tokens = False, False, max(batched_tokens, max_model_len)
            elif pooler_config.pooling_type != "LAST":
                prefix_caching = False  # the pooled states of a cached prefix are not kept
        self._check_lora(model_config, pooler_config)
        return EngineConfig(
            **{
                **msgspec.structs.asdict(self),
                "max_cpu_loras": self.max_cpu_loras or self.max_loras,
                "model": model,
                "load_format": load_format,
                "max_model_len": max_model_len,
                "enable_chunked_prefill": chunked,
                "enable_prefix_caching": prefix_caching,
                "max_num_batched_tokens": batched_tokens,
                "pooler_config": pooler_config,
                "served_model_name": self.served_model_name or self.model,
                "tokenizer": tokenizer or model,
                "speculative_config": speculative,
            },
            model_config=model_config,
            draft_model_config=draft_model_config,
        )


    def _check_lora(self, model_config: ModelConfig, pooler_config: PoolerConfig | None) -> None:
        """The LoRA settings fit together, and every --lora-modules adapter fits the model."""
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("--lora-modules needs --enable-lora")
            return
        if pooler_config is not None or model_config.encoder:
            raise ValueError("--enable-lora serves generative models; this one is served for pooling")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        names: set[str] = set()
        served = self.served_model_name or self.model
        for module in self.lora_modules:
            if module.name in names:
                raise ValueError(f"LoRA module name {module.name!r} is used twice")
            if module.name == served:
                raise ValueError(f"LoRA module name {module.name!r} is the served model's name")
            names.add(module.name)
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


class EngineConfig(EngineArgs, kw_only=True, frozen=True):
    """EngineArgs resolved against the checkpoint (``EngineArgs.resolve``): its typed
    architecture, and no field left to be worked out."""

    served_model_name: str
    tokenizer: str
    max_model_len: int
    model_config: ModelConfig
    # The draft checkpoint's architecture (speculative method draft_model).
    draft_model_config: ModelConfig | None = None
    # A pooling model's pooler (embeddings, scores); None: the model generates.
    pooler_config: PoolerConfig | None = None
    max_cpu_loras: int = 1

    def lora_requests(self) -> list[LoRARequest]:
        """The --lora-modules adapters as the engine knows them: ids 1, 2, ... in order."""
        return [LoRARequest(m.name, i, m.path) for i, m in enumerate(self.lora_modules, start=1)]

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
