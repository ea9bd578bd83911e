"""OpenAI API request and response shapes, as msgspec Structs.

Requests are decoded straight from the JSON body with type checking (a wrong
type becomes a 400), unknown fields are ignored as OpenAI clients send many
optional ones. Options this server does not implement are refused with a 400
that says so, rather than silently ignored: see ``check_supported``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from app.errors import BadRequestError
from core.protocol import SamplingParams

# Completions default to 16 tokens, as in OpenAI's API; chat to "as many as fit".
COMPLETION_DEFAULT_MAX_TOKENS = 16


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------- requests


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completion and chat requests (vLLM's extensions included)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
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
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def check_common(self) -> None:
        if self.n != 1:
            raise BadRequestError(f"Only n=1 is supported (got n={self.n}).", "n")
        if self.stream_options is not None and not self.stream:
            raise BadRequestError("stream_options is only allowed when stream is true.", "stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise BadRequestError(f"{name} is not supported yet.", name)
        if self.repetition_penalty not in (None, 1.0):
            raise BadRequestError("repetition_penalty is not supported yet.", "repetition_penalty")
        if self.logit_bias:
            raise BadRequestError("logit_bias is not supported yet.", "logit_bias")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(SamplingFields, kw_only=True):
    # str, a list of token ids, or a one-element list of either: one prompt only.
    prompt: str | list[Any] | None = None
    # Or the prompt as embeddings: base64 of a torch.save'd tensor (vLLM's extension).
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        self.check_common()
        if self.echo:
            raise BadRequestError("echo is not supported yet.", "echo")
        if self.logprobs is not None:
            raise BadRequestError("logprobs are not supported yet.", "logprobs")
        if self.suffix:
            raise BadRequestError("suffix is not supported.", "suffix")
        if self.best_of not in (None, 1):
            raise BadRequestError("best_of > 1 is not supported.", "best_of")

    def single_prompt_embeds(self) -> str | None:
        """The one base64 prompt_embeds of this request, or None for a text/token prompt."""
        embeds = self.prompt_embeds
        if embeds is None:
            return None
        if self.prompt not in (None, "", []):
            raise BadRequestError("Give either prompt or prompt_embeds, not both.", "prompt_embeds")
        if isinstance(embeds, list):
            if len(embeds) != 1:
                raise BadRequestError(
                    f"Only one prompt per request is supported; got {len(embeds)} prompt_embeds.",
                    "prompt_embeds",
                )
            return embeds[0]
        return embeds

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request: text or token ids."""
        prompt = self.prompt
        if prompt is None:
            raise BadRequestError("Either prompt or prompt_embeds is required.", "prompt")
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise BadRequestError("The prompt is empty.", "prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if len(prompt) > 1:
            raise BadRequestError(
                f"Only one prompt per request is supported; got a batch of {len(prompt)}. "
                "Send one request per prompt.",
                "prompt",
            )
        (only,) = prompt
        if isinstance(only, str):
            return only
        if isinstance(only, list) and only and all(
            isinstance(t, int) and not isinstance(t, bool) for t in only
        ):
            return only
        raise BadRequestError(
            "prompt must be a string, a list of token ids, or a list holding one of those.", "prompt"
        )


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

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
        return message


class ResponseFormat(msgspec.Struct):
    type: str = "text"


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        self.check_common()
        if not self.messages:
            raise BadRequestError("messages must not be empty.", "messages")
        if self.logprobs or self.top_logprobs is not None:
            raise BadRequestError("logprobs are not supported yet.", "logprobs")
        if self.tools and self.tool_choice != "none":
            raise BadRequestError("Tool calling is not supported yet.", "tools")
        if self.response_format is not None and self.response_format.type != "text":
            raise BadRequestError(
                f"response_format {self.response_format.type!r} is not supported yet.", "response_format"
            )

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are sent.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


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


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(msgspec.Struct):
    """Both the whole response and each streamed chunk ("text_completion")."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: UsageInfo | None = None


class AssistantMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: None = None
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
