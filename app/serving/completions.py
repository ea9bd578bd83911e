"""/v1/completions: prompts as text, token ids or embeddings, echo, legacy logprobs; whole or streamed."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.responses import Response

from app.choices import Choice
from app.errors import BadRequestError
from app.logprobs import Logprobs, completion_logprobs
from app.output_processor import RequestOutput
from app.protocol.common import now
from app.protocol.completions import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from app.serving.base import (
    Admit,
    OpenAIServing,
    json_response,
    usage_of,
)

if TYPE_CHECKING:
    import torch


class OpenAIServingCompletion(OpenAIServing):
    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """OpenAI's default of 16, shortened to what fits."""
        return max(min(COMPLETION_DEFAULT_MAX_TOKENS, super().default_max_tokens(num_prompt_tokens)), 1)

    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[list[int], torch.Tensor | None, str]]:
        """(token ids, embeddings, text for echo) of each prompt."""
        tokenizer = self.input_processor.tokenizer
        try:
            if (embeds_list := req.prompt_embeds_list()) is not None:
                return [([], self.input_processor.load_prompt_embeds(e), "") for e in embeds_list]
        except ValueError as exc:
            raise BadRequestError(str(exc), "prompt_embeds") from None
        prompts = []
        for prompt in req.prompts():
            try:
                ids = self.input_processor.tokenize_prompt(prompt, req.add_special_tokens)
            except ValueError as exc:
                raise BadRequestError(str(exc), "prompt") from None
            truncated = self._truncate(req, ids)
            text = ""
            if req.echo:
                text = prompt if isinstance(prompt, str) and truncated is ids else tokenizer.decode(
                    truncated, skip_special_tokens=req.skip_special_tokens
                )
            prompts.append((truncated, None, text))
        return prompts

    async def create_completion(self, body: bytes, admit: Admit | None = None) -> Response:
        req, engine_id, request_id = self._open_request(body, CompletionRequest, "cmpl")
        echo_only = req.echo and req.max_tokens == 0  # the prompt alone: one token is run, and dropped
        structured = req.structured_params()
        choices = self._choices(
            engine_id, req, self._completion_prompts(req), 1 if echo_only else req.max_tokens, structured
        )
        if admit is not None:
            admit(len(choices))
        param = req.structured_param if structured is not None else None
        if req.stream:
            return await self._stream_response(
                request_id, req, choices, CompletionResponse, self._completion_deltas(req, echo_only),
                echo_only=echo_only, structured=structured, param=param,
            )
        outputs = await self._collect_all(choices, param)
        response_choices = []
        for choice, out in zip(choices, outputs):
            text, logprobs = self._completion_delta(req, choice, out, echo_only)
            response_choices.append(
                CompletionChoice(
                    index=choice.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason="length" if echo_only else out.finish_reason,
                    stop_reason=None if echo_only else out.stop_reason,
                    prompt_logprobs=self._prompt_logprobs(req, out),
                )
            )
        return json_response(
            CompletionResponse(
                id=request_id,
                created=now(),
                model=self.response_model(req.model),
                choices=response_choices,
                usage=usage_of(choices, outputs, echo_only),
            )
        )

    def _completion_delta(
        self, req: CompletionRequest, choice: Choice, out: RequestOutput, echo_only: bool
    ) -> tuple[str, CompletionLogprobs | None]:
        """Text and logprobs of a delta (or of a whole output), the echoed prompt
        in front of the first one."""
        text = "" if echo_only else out.text
        entries = Logprobs([], [], []) if echo_only or out.logprobs is None else out.logprobs
        first_prompt_token = None
        if req.echo and not choice.started:
            text = choice.prompt_text + text
            prompt_ids = choice.request.prompt_token_ids
            if req.logprobs is not None and prompt_ids:
                first_prompt_token = prompt_ids[0]
                prompt_entries = out.prompt_logprobs or Logprobs([], [], [])
                entries = Logprobs(
                    prompt_entries.token_ids + entries.token_ids,
                    prompt_entries.logprobs + entries.logprobs,
                    prompt_entries.ranks + entries.ranks,
                )
        choice.started = True
        if req.logprobs is None:
            return text, None
        logprobs, choice.text_offset = completion_logprobs(
            self.token_texts, entries, req.logprobs, choice.text_offset, first_prompt_token,
            req.return_tokens_as_token_ids,
        )
        return text, logprobs

    def _completion_deltas(
        self, req: CompletionRequest, echo_only: bool
    ) -> Callable[[Choice, RequestOutput], CompletionChoice | None]:
        """The chunk choice of a streamed output (None when it has nothing to say); the
        first carries the echoed prompt and the prompt logprobs."""

        def delta(choice: Choice, out: RequestOutput) -> CompletionChoice | None:
            first = not choice.started
            text, logprobs = self._completion_delta(req, choice, out, echo_only)
            prompt_lps = self._prompt_logprobs(req, out) if first else None
            if not (text or out.finished or prompt_lps or (logprobs is not None and logprobs.tokens)):
                return None
            finish_reason = ("length" if echo_only else out.finish_reason) if out.finished else None
            return CompletionChoice(
                choice.index, text, logprobs, finish_reason, None if echo_only else out.stop_reason, prompt_lps
            )

        return delta
