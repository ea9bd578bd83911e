"""The request fields completions and chat share: sampling, logprobs, streaming options,
structured outputs (vLLM's ``structured_outputs`` and OpenAI's ``response_format``), and the
options this server refuses by name rather than ignore."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from app.errors import BadRequestError
from core.protocol import SamplingParams, StructuredOutputsParams


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
