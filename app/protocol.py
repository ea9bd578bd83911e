"""OpenAI API request and response shapes, as msgspec Structs.

Requests are decoded straight from the JSON body with type checking (a wrong
type becomes a 400), unknown fields are ignored as OpenAI clients send many
optional ones. Options this server does not implement are refused with a 400
that says so, rather than silently ignored: see ``check_supported``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar

import msgspec

from app.errors import BadRequestError
from core.protocol import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

# Completions default to 16 tokens, as in OpenAI's API; chat to "as many as fit".
COMPLETION_DEFAULT_MAX_TOKENS = 16


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------- requests


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    # vLLM's extension: usage (so far) in every chunk, not only in a last one.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """OpenAI's ``response_format.json_schema``: the schema under a name."""

    name: str = "response"
    schema: dict[str, Any] | bool | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: str = "text"  # text | json_object | json_schema
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs`` request object (its StructuredOutputsParams)."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    # ringllm: the longest run of whitespace between JSON elements (default: the server's
    # --structured-outputs-max-whitespace).
    max_whitespace: int | None = None
    # vLLM options that change nothing here when left unset, refused otherwise.
    whitespace_pattern: str | None = None
    disable_fallback: bool = False
    disable_additional_properties: bool = False


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()


def structured_outputs_params(
    structured: StructuredOutputs | None, response_format: ResponseFormat | None
) -> StructuredOutputsParams | None:
    """The engine's constraint from ``structured_outputs`` and OpenAI's ``response_format``
    (which may be combined, as in vLLM, when only one of them names a constraint)."""
    params = StructuredOutputsParams()
    param = "structured_outputs"
    if structured is not None:
        if structured.whitespace_pattern is not None:
            raise BadRequestError(
                "structured_outputs.whitespace_pattern is not supported; use disable_any_whitespace.", param
            )
        if structured.max_whitespace is not None and structured.max_whitespace < 1:
            raise BadRequestError(
                "structured_outputs.max_whitespace must be >= 1 (disable_any_whitespace allows none).", param
            )
        if structured.disable_additional_properties:
            raise BadRequestError(
                "structured_outputs.disable_additional_properties is not supported: set "
                '"additionalProperties": false in the schema.', param
            )
        params = StructuredOutputsParams(
            json=None if structured.json is None else _json_text(structured.json),
            regex=structured.regex,
            choice=structured.choice,
            grammar=structured.grammar,
            json_object=bool(structured.json_object),
            structural_tag=None if structured.structural_tag is None else _json_text(structured.structural_tag),
            disable_any_whitespace=structured.disable_any_whitespace,
            max_whitespace=structured.max_whitespace,
        )
    if response_format is not None and response_format.type != "text":
        param = "response_format"
        if params.kind_count():
            raise BadRequestError("Give response_format or a structured_outputs constraint, not both.", param)
        if response_format.type == "json_object":
            params.json_object = True
        elif response_format.type == "json_schema":
            fmt = response_format.json_schema
            if fmt is None or fmt.schema is None:
                raise BadRequestError("response_format json_schema needs json_schema.schema.", param)
            params.json = _json_text(fmt.schema)
        else:
            raise BadRequestError(
                f"response_format type must be text, json_object or json_schema, got {response_format.type!r}.",
                param,
            )
    if not params.kind_count():
        if structured is not None:
            raise BadRequestError(
                "structured_outputs must set one of json, regex, choice, grammar, json_object, structural_tag.",
                param,
            )
        return None
    try:
        params.kind()
    except ValueError as exc:
        raise BadRequestError(str(exc), param) from None
    if params.choice is not None and (not params.choice or any(not c for c in params.choice)):
        raise BadRequestError("structured_outputs.choice must list non-empty strings.", param)
    return params


# Fields every request model declares, so that none is silently ignored by the
# decoder, but that this server does not implement: each is accepted at the
# listed values only (its neutral ones) and refused with a 400 naming it
# otherwise. ``implemented`` on each model lists the fields it acts on; a test
# checks that both sets together are exactly the model's fields.
_GUIDED = "the guided_* fields were removed (as in vLLM): use structured_outputs, e.g. {\"structured_outputs\": {\"json\": SCHEMA}}"
REFUSED_COMMON: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "there is no beam search (vLLM V1's engine has none either)"),
    "length_penalty": ((1.0,), "it only applies to beam search, which there is not"),
    "spaces_between_special_tokens": ((True,), "only the tokenizer's own decoding is available"),
    "logits_processors": ((None,), "custom logits processors cannot be loaded"),
    "guided_json": ((None,), _GUIDED),
    "guided_regex": ((None,), _GUIDED),
    "guided_choice": ((None,), _GUIDED),
    "guided_grammar": ((None,), _GUIDED),
    "guided_decoding_backend": ((None,), _GUIDED),
    "guided_whitespace_pattern": ((None,), _GUIDED),
    "vllm_xargs": ((None,), "there are no custom sampling arguments"),
    "kv_transfer_params": ((None,), "there is no KV transfer (disaggregated prefill)"),
    "return_token_ids": ((None, False), "token ids are not returned beside the text; see return_tokens_as_token_ids"),
    "mm_processor_kwargs": ((None,), "there are no multimodal models"),
}


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completion and chat requests (vLLM's extensions included)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    user: str | None = None  # an end-user identifier (OpenAI's abuse monitoring): nothing to do with it here
    safety_identifier: str | None = None  # OpenAI's newer name for ``user``
    prompt_cache_key: str | None = None  # OpenAI's cache-routing hint: prefix caching here needs none
    request_id: str | None = None  # vLLM's: the response's id is built from it
    data_parallel_rank: int | None = None  # vLLM's: run on this engine of the -dp group
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool = False
    # Declared to be refused when set (REFUSED_COMMON).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    logits_processors: Any = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    return_token_ids: bool | None = None
    mm_processor_kwargs: Any = None

    implemented: ClassVar[frozenset[str]] = frozenset(
        {
            "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "stream",
            "stream_options", "n", "ignore_eos", "min_tokens", "include_stop_str_in_output",
            "skip_special_tokens", "priority", "cache_salt", "user", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs",
            "truncate_prompt_tokens", "return_tokens_as_token_ids", "safety_identifier", "prompt_cache_key",
            "request_id", "response_format", "structured_outputs", "data_parallel_rank",
        }
    )
    refused: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = REFUSED_COMMON

    def check_supported(self) -> None:
        """400 for a refused field set to anything but a neutral value, and for
        combinations of fields that have no meaning."""
        for name, (accepted, reason) in self.refused.items():
            value = getattr(self, name)
            if not any(value == ok and type(value) is type(ok) for ok in accepted):
                raise BadRequestError(f"{name} is not supported: {reason}.", name)
        if self.n < 1 or self.n > MAX_N:
            raise BadRequestError(f"n must be in [1, {MAX_N}], got {self.n}.", "n")
        if self.stream_options is not None and not self.stream:
            raise BadRequestError("stream_options is only allowed when stream is true.", "stream_options")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise BadRequestError("truncate_prompt_tokens must be at least 1.", "truncate_prompt_tokens")
        if self.prompt_logprobs is not None and self.prompt_embeds_given():
            raise BadRequestError("prompt_logprobs need token ids, not prompt_embeds.", "prompt_logprobs")
        self.structured_params()

    def structured_params(self) -> StructuredOutputsParams | None:
        """The engine's constraint from structured_outputs / response_format (400 when malformed)."""
        return structured_outputs_params(self.structured_outputs, self.response_format)

    @property
    def structured_param(self) -> str:
        """The request field a structured-output error is about."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return "structured_outputs"

    def prompt_embeds_given(self) -> bool:
        return False

    def response_id(self, prefix: str, engine_id: str) -> str:
        """The response's ``id``: from the client's ``request_id`` when it sent one (vLLM's
        extension), else the engine's id. The engine's own ids stay unique either way."""
        return engine_id if self.request_id is None else f"{prefix}-{self.request_id}"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with its JSON string keys as token ids."""
        if not self.logit_bias:
            return None
        try:
            return {int(token): float(bias) for token, bias in self.logit_bias.items()}
        except ValueError:
            raise BadRequestError("logit_bias keys must be token ids (integers as strings).", "logit_bias") from None

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        bad_words_token_ids: list[list[int]] | None = None,
        seed_offset: int = 0,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The engine's parameters for one choice: choice i of a seeded request gets
        seed + i. ``bad_words_token_ids`` are the tokenizations of ``bad_words``."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=None if self.seed is None else self.seed + seed_offset,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias_ids(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words_token_ids=bad_words_token_ids or [],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured,
        )


# Choices one request may ask for (n times the prompts of a batch).
MAX_N = 128


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, a list of token ids, or a batch: a list of strings or of token-id lists.
    prompt: str | list[Any] | None = None
    # Or prompts as embeddings: base64 of a torch.save'd tensor (vLLM's extension), one or a list.
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True
    suffix: str | None = None
    best_of: int | None = None

    implemented: ClassVar[frozenset[str]] = SamplingFields.implemented | {
        "prompt", "prompt_embeds", "max_tokens", "echo", "logprobs", "add_special_tokens",
    }
    refused: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        **REFUSED_COMMON,
        "suffix": ((None, ""), "there is no insertion mode"),
        "best_of": ((None, 1), "vLLM V1 dropped it; use n"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.", "logprobs")
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            raise BadRequestError(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")
        if self.n * self.batch_size() > MAX_N:
            raise BadRequestError(
                f"n times the number of prompts must be at most {MAX_N}, got {self.n} x {self.batch_size()}.", "n"
            )

    def batch_size(self) -> int:
        """How many prompts the request carries (a batch is a list of strings, token-id lists or embeddings)."""
        many = self.prompt_embeds if self.prompt_embeds is not None else self.prompt
        if isinstance(many, list) and many and not _is_token_ids(many):
            return len(many)
        return 1

    def prompt_embeds_given(self) -> bool:
        return self.prompt_embeds is not None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token: asked for, or implied by echo with logprobs."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompt_embeds_list(self) -> list[str] | None:
        """The base64 prompt_embeds of this request (one per prompt), or None for text/token prompts."""
        embeds = self.prompt_embeds
        if embeds is None:
            return None
        if self.prompt not in (None, "", []):
            raise BadRequestError("Give either prompt or prompt_embeds, not both.", "prompt_embeds")
        embeds = [embeds] if isinstance(embeds, str) else embeds
        if not embeds:
            raise BadRequestError("prompt_embeds is empty.", "prompt_embeds")
        return embeds

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, each text or token ids: one, or a batch."""
        prompt = self.prompt
        if prompt is None:
            raise BadRequestError("Either prompt or prompt_embeds is required.", "prompt")
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise BadRequestError("The prompt is empty.", "prompt")
        if _is_token_ids(prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt):
            return list(prompt)
        raise BadRequestError(
            "prompt must be a string, a list of token ids, or a list of either (a batch).", "prompt"
        )


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: str = "function"


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, kw_only=True):
    function: FunctionDefinition
    type: str = "function"

    def to_template_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming the one function the model must call."""

    function: NamedFunction
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn that called tools, and a tool's result answering one call.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content flattened to text."""
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise BadRequestError(
                        f"Only text content parts are supported (got {part.type!r}).", "messages"
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = self.content or ""
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            # Templates index into the arguments: a dict where they are JSON, as vLLM hands them.
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments(c)}}
                for c in self.tool_calls
            ]
        return message


def _arguments(call: ToolCall) -> Any:
    try:
        value = msgspec.json.decode(call.function.arguments)
    except msgspec.DecodeError:
        return call.function.arguments
    return value if isinstance(value, dict) else call.function.arguments


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | NamedToolChoice | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    echo: bool = False
    continue_final_message: bool = False
    documents: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    verbosity: str | None = None

    implemented: ClassVar[frozenset[str]] = SamplingFields.implemented | {
        "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
        "tool_choice", "chat_template", "chat_template_kwargs", "add_generation_prompt", "add_special_tokens",
        "parallel_tool_calls",
    }
    refused: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        **REFUSED_COMMON,
        "echo": ((False,), "chat does not echo the last message; /v1/completions echoes prompts"),
        "continue_final_message": ((False,), "the final message cannot be continued yet"),
        "documents": ((None,), "retrieval templates get no documents"),
        "reasoning_effort": ((None,), "this server runs no reasoning models"),
        "modalities": ((None, ["text"]), "only text output is produced"),
        "audio": ((None,), "there is no audio output"),
        "prediction": ((None,), "there are no predicted outputs"),
        "functions": ((None,), "the legacy functions API is not implemented; use tools"),
        "function_call": ((None,), "the legacy functions API is not implemented; use tool_choice"),
        "web_search_options": ((None,), "there is no web search"),
        "store": ((None, False), "this server stores no completions"),
        "metadata": ((None,), "this server stores no completions to tag"),
        "service_tier": ((None, "auto", "default"), "there is one service tier"),
        "verbosity": ((None,), "this server runs no reasoning models"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise BadRequestError("messages must not be empty.", "messages")
        self._check_tools()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise BadRequestError("top_logprobs needs logprobs set to true.", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise BadRequestError(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}.", "top_logprobs"
                )
        if self.prompt_logprobs is not None and self.stream:
            raise BadRequestError("prompt_logprobs are not available on a streamed chat.", "prompt_logprobs")

    def _check_tools(self) -> None:
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or ()]
        if any(t.type != "function" for t in self.tools or ()):
            raise BadRequestError("Only tools of type function are supported.", "tools")
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise BadRequestError(
                f"tool_choice must be none, auto, required or a named function, got {choice!r}.", "tool_choice"
            )
        if choice not in (None, "none") and not names:
            raise BadRequestError(
                f"Tool calling needs tools: tool_choice is {_choice_name(choice)} but no tools were given.",
                "tool_choice",
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise BadRequestError(f"tool_choice names {choice.function.name!r}, which is not among the tools.",
                                  "tool_choice")
        if self.forced_tool_call and self.structured_params() is not None:
            raise BadRequestError(
                "A required or named tool_choice constrains the output already: drop response_format / "
                "structured_outputs.", "tool_choice",
            )

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """As OpenAI: "auto" when tools are given without a choice, "none" without tools."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def forced_tool_call(self) -> bool:
        """tool_choice "required" or a named function: the output must be a call."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are sent.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


def _choice_name(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens),
        )


class CompletionLogprobs(msgspec.Struct):
    """OpenAI's legacy completions logprobs: one entry per token, in four parallel lists.

    The first prompt token of an echo has no logprob: null there and in
    ``top_logprobs``. ``text_offset`` is each token's position in the text.
    """

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(msgspec.Struct):
    """One token of a prompt position, in vLLM's ``prompt_logprobs`` (keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(msgspec.Struct):
    """Both the whole response and each streamed chunk ("text_completion")."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: UsageInfo | None = None


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] = []


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A fragment of tool call ``index``: id, type and name come first, then arguments in pieces."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: UsageInfo | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "ringllm"
    root: str | None = None
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str
