"""Messages exchanged between the frontend and the EngineCore process.

Every body is a ``msgspec.Struct`` with ``array_like=True`` (positional msgpack
arrays, no field names on the wire), ``omit_defaults=True`` and ``gc=False``
(these structs hold no reference cycles, so the GC need not track them).
Decoding is always typed: a malformed frame raises instead of producing junk.
"""

from __future__ import annotations

import enum
import importlib
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch
else:

    class _Torch:
        """``torch``, imported on first attribute access.

        The frontend encodes these structs but never decodes a tensor-bearing
        one, so it never needs torch (a second of start-up); the engine's
        decoder resolves the ``torch.Tensor`` annotations through this.
        """

        def __getattr__(self, name: str) -> Any:
            return getattr(importlib.import_module("torch"), name)

    torch = _Torch()

# --------------------------------------------------------------------------
# Request types: one byte in front of every frontend -> engine message.
# --------------------------------------------------------------------------


class EngineCoreRequestType(enum.Enum):
    """First frame of every message sent to the engine.

    WAKEUP is internal to the engine (it unblocks the busy loop on shutdown).
    vLLM's START_DP_WAVE and EXECUTOR_FAILED have no counterpart here: our
    models are dense (no data-parallel waves) and the executor runs in the
    engine process, whose failure already reaches the client as
    ENGINE_CORE_DEAD.
    """

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    WAKEUP = b"\x05"


# Sentinel the engine sends as the only frame of its last message when it dies.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


class FinishReason(enum.IntEnum):
    """Why a request finished; ints on the wire, OpenAI strings at the API."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return FINISH_REASON_STRINGS[self.value]


FINISH_REASON_STRINGS = ("stop", "length", "abort", "error")


# The most alternatives a request may ask for per token (``logprobs``,
# ``prompt_logprobs``, chat's ``top_logprobs``), as vLLM's --max-logprobs default.
MAX_LOGPROBS = 20
# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0
# Every stop string is looked for after every token: a request must not make that a
# scan of thousands (OpenAI allows 4).
MAX_STOP_STRINGS = 128
MAX_TOP_K = 2**31 - 1  # beyond any vocabulary; the samplers index with int32


class StructuredOutputsParams(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):
    """A constraint on what a request may generate (vLLM's StructuredOutputsParams).

    Exactly one of ``json`` (a JSON schema, as JSON text), ``regex``,
    ``choice``, ``grammar`` (EBNF/GBNF, or Lark), ``json_object`` (any JSON
    object) and ``structural_tag`` (xgrammar's structural tag, as JSON text)
    is set. Schemas travel as text: the engine keys its cache of compiled
    grammars by it. ``disable_any_whitespace`` makes JSON compact (no
    whitespace the model could spend its tokens on); otherwise
    ``max_whitespace`` bounds each run of whitespace between JSON elements
    (None: the engine's ``structured_outputs_max_whitespace``), so that a
    model cannot spend its whole budget on newlines inside an object.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    max_whitespace: int | None = None

    def kind_count(self) -> int:
        return sum(getattr(self, k) not in (None, False) for k in STRUCTURED_OUTPUT_KINDS)

    def kind(self) -> str:
        """The one constraint set (ValueError unless exactly one is)."""
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object, "
                f"structural_tag; got {', '.join(kinds) if kinds else 'none'}."
            )
        return kinds[0]

    def spec(self) -> str:
        """The constraint's text (the compiled-grammar cache's key, with the kind)."""
        kind = self.kind()
        if kind == "choice":
            return msgspec.json.encode(self.choice).decode()
        return "" if kind == "json_object" else getattr(self, kind)


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class ReasoningParams(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):
    """The request's output starts inside the model's reasoning (``<think>`` opened by the
    prompt), which ends where ``end_token_id`` (``</think>``, say) is sampled.

    Its structured-output grammar, if any, neither masks nor advances on the
    reasoning tokens nor on the end token itself: it applies from the token
    after. With ``budget``, a request that has generated that many tokens
    while still reasoning gets ``end_token_id`` as its next token, forced.
    """

    end_token_id: int
    budget: int | None = None


class SamplingParams(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):
    """Per-request decoding parameters, with vLLM's meaning.

    The engine uses the token-level fields; ``stop`` (strings) and
    ``include_stop_str_in_output`` are applied by the frontend's detokenizer,
    which aborts the request in the engine once a stop string is seen.
    ``bad_words_token_ids`` are the frontend's tokenizations of the request's
    ``bad_words``. Fields are appended at the end: the wire format is
    positional.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = []
    # Alternatives per generated / prompt token; None: no logprobs at all.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Constrained decoding: the engine masks every token its grammar rejects.
    structured_outputs: StructuredOutputsParams | None = None
    # The output begins inside the model's reasoning: grammars wait for its end, a budget caps it.
    reasoning: ReasoningParams | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Raise ValueError with an OpenAI-style message for bad values."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}."
            )
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(
                f"temperature must be in [0, 2], got {self.temperature}."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.top_k > MAX_TOP_K:
            raise ValueError(f"top_k must be at most {MAX_TOP_K}, got {self.top_k}.")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}.")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty.")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        for token_id, bias in (self.logit_bias or {}).items():
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}."
                )
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty.")
        if any(not word for word in self.bad_words_token_ids):
            raise ValueError("bad_words must not be empty.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}.")
        so = self.structured_outputs
        if so is not None:
            so.kind()
            if so.choice is not None and (not so.choice or any(not c for c in so.choice)):
                raise ValueError("structured_outputs.choice must list non-empty strings.")
        reasoning = self.reasoning
        if reasoning is not None and reasoning.budget is not None and reasoning.budget < 0:
            raise ValueError(f"reasoning budget must be at least 0, got {reasoning.budget}.")

    def token_ids_to_check(self) -> dict[str, list[int]]:
        """Every token id this request names, by the parameter that names it."""
        return {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": list(self.logit_bias or ()),
            "allowed_token_ids": self.allowed_token_ids or [],
            "bad_words": [t for word in self.bad_words_token_ids for t in word],
            "reasoning": [self.reasoning.end_token_id] if self.reasoning is not None else [],
        }


POOLING_TASKS = ("embed", "classify", "encode")


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    """A pooling request (vLLM's PoolingParams): the engine runs the prompt once and
    returns one tensor instead of sampling tokens.

    ``task``: ``embed`` (the pooled, optionally normalised vector), ``classify``
    (a classification head's scores: cross-encoders) or ``encode`` (the pooler's
    raw output, as vLLM's /pooling returns it). ``dimensions`` keeps the first
    that many components before normalising (Matryoshka models); ``normalize``
    and ``use_activation`` override the model's defaults. ``token_type_ids``
    (BERT's segment ids, one per prompt token) mark a sentence pair.
    """

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    token_type_ids: list[int] | None = None


class LoRARequest(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A LoRA adapter as the engine knows it (vLLM's LoRARequest): the name requests
    use, a number unique for the server's lifetime (a reloaded adapter gets a new
    one, so KV cached under the old weights is never reused), and the PEFT
    directory its weights are read from (again, if the engine evicted them)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class EngineCoreRequest(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):
    """A tokenized request, as the engine sees it: no text, only token ids.

    With ``prompt_embeds`` ([num_prompt_tokens, hidden_size], floating point)
    the prompt is given as embeddings instead and ``prompt_token_ids`` is
    empty; the tensor travels out of band (shared-memory pool or aux frame).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    client_index: int = 0
    cache_salt: str | None = None
    prompt_embeds: torch.Tensor | None = None
    # Data parallel: the engine this request must run on (else the client picks one).
    data_parallel_rank: int | None = None
    # Set for a pooling request (embeddings, scores): no token is sampled.
    pooling_params: PoolingParams | None = None
    # The LoRA adapter the request runs with (None: the base model).
    lora_request: LoRARequest | None = None

    @property
    def num_prompt_tokens(self) -> int:
        if self.prompt_embeds is not None:
            return int(self.prompt_embeds.shape[0])
        return len(self.prompt_token_ids)


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped lifecycle event of one request (for metrics)."""

    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new(cls, event_type: EngineCoreEventType) -> EngineCoreEvent:
        return cls(event_type, time.monotonic())


class LogprobsArrays(msgspec.Struct, array_like=True, gc=False):
    """Log probabilities of N tokens, each with its top-k alternatives.

    Row i describes one token: column 0 of ``token_ids``/``logprobs`` is the
    token itself (the sampled one, or the prompt token), columns 1..k the k
    most likely tokens at that position; ``ranks[i]`` is the token's rank
    among all (1 = most likely). numpy arrays, so they cross the transport
    in its tensor tiers (inline when small, the shared pool when large) and
    the frontend reads them without torch.
    """

    token_ids: np.ndarray  # [N, k + 1] int32
    logprobs: np.ndarray  # [N, k + 1] float32
    ranks: np.ndarray  # [N] int32

    def __len__(self) -> int:
        return int(self.ranks.shape[0])


class EngineCoreOutput(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):
    """New tokens of one request produced by one engine step.

    When the request asked for logprobs, rows ``logprobs_start ..`` of the
    enclosing ``EngineCoreOutputs.logprobs`` describe ``new_token_ids``, one
    row per token: the logprobs of a whole step travel as three arrays, not
    three per request. ``new_prompt_logprobs`` comes once, with the first
    token: one row per prompt token after the first (which has none).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    events: list[EngineCoreEvent] | None = None
    logprobs_start: int = -1
    new_prompt_logprobs: LogprobsArrays | None = None
    # A pooling request's result (float32), with the output that finishes it: a
    # tensor tier of the transport carries it, not the msgpack body.
    pooled: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Reply to a UTILITY call: its result encoded on its own, which the caller
    decodes as the type the utility declares (core/utilities.py); or
    ``failure_message`` when it raised."""

    call_id: int
    failure_message: str | None = None
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Speculative decoding totals since the engine started (vLLM's spec_decode
    counters): verifications, drafts proposed and accepted, and how often the
    draft at each position was accepted (position 0 is the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    @classmethod
    def new(cls, config: Any) -> SpecDecodingStats | None:
        """Zeroed totals for a ``SpeculativeConfig`` (None when speculation is off)."""
        if config is None:
            return None
        return cls(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification: ``num_accepted`` of its ``num_draft_tokens`` drafts accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def snapshot(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos)
        )


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A snapshot of the scheduler, attached to outputs for the frontend's metrics.

    The counters (prefix cache queries and hits, preemptions) are totals since
    the engine started, not per-interval deltas as in vLLM:
    a snapshot that is dropped or merged then loses nothing, and they map
    directly onto Prometheus counters. Every step's snapshot goes to client 0
    only, so that one frontend, not each of them, turns them into series.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0  # held requests (arrived while paused) included
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_counter: int = 0  # steps whose outputs were processed so far
    num_batched_tokens: int = 0  # tokens the step that took this snapshot computed
    spec_decoding: SpecDecodingStats | None = None  # with --speculative-config


class TransportStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One side's end of the frontend <-> engine transport: totals since start.

    Bytes are wire bytes (on the rings: records with their headers and
    padding); ``oob_bytes_sent`` counts tensor bytes that went through the
    out-of-band pool instead; ``ring_full_waits`` the sends that had to sleep
    until the consumer made room (back-pressure); ``doorbell_rings`` the
    wake-up syscalls this side made for a peer that had gone to sleep.
    """

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    oob_bytes_sent: int = 0
    ring_full_waits: int = 0
    doorbell_rings: int = 0


class EngineStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The EngineCore process's own counters, attached to client 0's step outputs.

    ``idle_seconds`` is the time the busy loop has spent blocked waiting for
    work, out of ``loop_seconds`` since it started, both up to ``timestamp``
    (engine monotonic clock). ``idle`` says the loop had no work left when
    the snapshot was taken, so that the frontend can count the time after it
    as idle too: a waiting engine sends nothing.
    """

    transport: TransportStats | None = None
    idle_seconds: float = 0.0
    loop_seconds: float = 0.0
    idle: bool = False
    timestamp: float = 0.0


class EngineCoreOutputs(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):
    """Everything one engine step has for one client.

    ``logprobs`` holds the step's sampled-token logprobs, for every request
    that asked (see ``EngineCoreOutput.logprobs_start``), with as many
    alternatives as the most any of them asked for; each request reads its
    own first k.
    """

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    # When the step's tokens were produced (engine monotonic clock): the
    # "new tokens" event of every output in this message.
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    engine_stats: EngineStats | None = None
    logprobs: LogprobsArrays | None = None


# How a pause treats the requests already in the engine (vLLM's PauseMode):
# "abort" finishes them (finish_reason "abort"), "wait" lets them finish,
# "keep" freezes them with their KV cache until resume. In every mode the
# requests that arrive while paused wait, and run after resume.
PAUSE_MODES = ("abort", "wait", "keep")


class MemoryUsage(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the engine process holds: resident set size, and device memory on a GPU."""

    rss_bytes: int = 0
    device_bytes: int = 0  # torch's allocated memory on the GPU; 0 on a CPU
    kv_cache_bytes: int = 0
    weights_bytes: int = 0  # weights resident on the device


class SleepResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What a sleep freed: the engine's memory just before and just after it."""

    level: int
    before: MemoryUsage
    after: MemoryUsage


def finished_outputs(
    request_ids: Iterable[str], reason: FinishReason, message: str | None = None
) -> EngineCoreOutputs:
    """Outputs that end requests with no new token: rejected, refused or aborted."""
    outputs = [
        EngineCoreOutput(request_id=r, new_token_ids=[], finish_reason=reason, stop_reason=message)
        for r in request_ids
    ]
    return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic())


class HandshakeReady(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the engine reports once its model is loaded and its KV cache sized."""

    status: str
    num_gpu_blocks: int
    max_model_len: int
    block_size: int
    dtype: str = ""  # the model's compute dtype, e.g. "float32" (for the start-up banner)
    kv_cache_dtype: str = ""  # what the KV cache holds, e.g. "float16"
    device: str = ""  # e.g. "cpu", "cuda:0"
    # Block tables a request has (core/kv/kv_groups.py): more than one where sliding-window
    # layers sit beside whole-context ones, and a block then holds fewer layers.
    kv_cache_groups: int = 1
    kv_cache_bytes: int = 0  # the memory behind the blocks (on a CPU, resident as they fill)


class EngineStartError(RuntimeError):
    """The EngineCore never became ready: it refused its config, could not load its model, or
    exited. The message is the reason, fit to show a user as it is."""


class EngineDeadError(RuntimeError):
    """The EngineCore process died or reported a fatal error; no request can finish."""

    def __init__(self, message: str = "EngineCore died unexpectedly.") -> None:
        super().__init__(message)


class EngineLostError(EngineDeadError):
    """Data parallel: one engine died, and with it ``request_ids``; the others serve on."""

    def __init__(self, engine_index: int, request_ids: list[str], message: str) -> None:
        super().__init__(message)
        self.engine_index = engine_index
        self.request_ids = request_ids


class EngineUnavailableError(EngineDeadError):
    """Data parallel: no engine a request may go to is serving right now (dead, or
    restarting), while the client as a whole lives on."""
