"""Turn EngineCoreOutputs (token ids) into per-request text deltas.

The engine knows token ids only; this is where they become text. For each
request the OutputProcessor keeps an incremental detokenizer, checks stop
strings (which can span tokens), holds back the few characters that might
still turn out to be the start of a stop string, and hands a
:class:`RequestOutput` delta to the request's :class:`RequestOutputCollector`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from app.detokenizer import IncrementalDetokenizer
from app.logprobs import Logprobs, StepLogprobs
from core.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LogprobsArrays,
)


@dataclass(slots=True)
class RequestOutput:
    """What one request produced since the previous RequestOutput (a delta).

    ``text``, ``token_ids`` and ``logprobs`` (when asked for: one entry per
    token id) are deltas; ``num_output_tokens`` is the running total.
    ``prompt_logprobs`` comes with the first delta, when asked for.
    ``finish_reason`` is one of "stop", "length", "abort", "error".
    ``stop_reason`` is the stop string or stop token id that ended the request.
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0  # also counts a prompt given as embeddings
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    pooled: Any = None  # a pooling request's result (numpy float32), with its finished output

    def merge(self, later: RequestOutput) -> None:
        """Fold a later delta into this one (the consumer fell behind)."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = later.logprobs
            else:
                self.logprobs.extend(later.logprobs)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.num_output_tokens = later.num_output_tokens
        self.num_cached_tokens = later.num_cached_tokens
        if later.pooled is not None:
            self.pooled = later.pooled


class RequestOutputCollector:
    """A one-slot mailbox between the output handler and one request's consumer.

    A consumer that lags does not build a queue: deltas put before it reads are
    merged into one, so it always gets everything new in a single object. An
    exception put here is raised by the next get() and wins over any output.
    Usable without an event loop through :meth:`get_nowait`.
    """

    __slots__ = ("_item", "_ready")

    def __init__(self) -> None:
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if self._item is None or isinstance(item, BaseException):
            self._item = item
        elif isinstance(self._item, RequestOutput):
            self._item.merge(item)
        # else: an exception is pending; the request is over, drop the output.
        self._ready.set()

    async def get(self) -> RequestOutput:
        while self._item is None:
            await self._ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self._item is None else self._take()

    def _take(self) -> RequestOutput:
        item, self._item = self._item, None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item


@dataclass(slots=True)
class RequestState:
    """The frontend's bookkeeping for one unfinished request."""

    request_id: str
    prompt_token_ids: list[int]
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer
    collector: RequestOutputCollector
    stop: list[str]
    include_stop_str_in_output: bool
    min_tokens: int
    # Characters held back while they could still be the start of a stop string.
    holdback: int
    num_logprobs: int  # alternatives per token kept from the engine's logprobs

    pending_text: str = ""
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


def find_stop_string(text: str, new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string in ``text`` that ends within its last ``new_chars`` characters.

    Returns (start index, stop string); ties go to the stop listed first.
    Matches ending before the new characters were looked for in earlier steps.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(len(text) - new_chars - len(stop) + 1, 0))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


class OutputProcessor:
    """Detokenizes engine outputs and routes them to per-request collectors."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, collector: RequestOutputCollector) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id} is already running.")
        params = request.sampling_params
        self.requests[request.request_id] = RequestState(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
            ),
            collector=collector,
            stop=list(params.stop),
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            holdback=max((len(s) for s in params.stop), default=1) - 1,
            num_logprobs=params.logprobs or 0,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def process_outputs(
        self, outputs: Iterable[EngineCoreOutput], logprobs: LogprobsArrays | None = None
    ) -> list[str]:
        """Detokenize one engine step's outputs and deliver them; ``logprobs`` is
        the step's ``EngineCoreOutputs.logprobs``.

        Returns the ids of requests a stop string finished: they are still
        running in the engine, which the caller must tell to abort them.
        Outputs of requests no longer tracked (aborted) are ignored.
        """
        to_abort: list[str] = []
        # Read once for the whole step: plain lists, so the arrays (possibly a
        # view of the transport's shared pool) can go.
        rows = None if logprobs is None else StepLogprobs(logprobs)
        for output in outputs:
            state = self.requests.get(output.request_id)
            if state is None:
                continue
            request_output = self._process_one(state, output, rows)
            if request_output.finished:
                del self.requests[state.request_id]
                if not output.finished:
                    to_abort.append(state.request_id)
            state.collector.put(request_output)
        return to_abort

    def _process_one(
        self, state: RequestState, output: EngineCoreOutput, step_logprobs: StepLogprobs | None
    ) -> RequestOutput:
        new_ids = output.new_token_ids
        state.num_output_tokens += len(new_ids)
        if output.num_cached_tokens:
            state.num_cached_tokens = output.num_cached_tokens
        delta = state.detokenizer.update(new_ids) if new_ids else ""
        finish_reason = None if output.finish_reason is None else str(output.finish_reason)
        stop_reason = output.stop_reason
        if finish_reason is not None:
            delta += state.detokenizer.flush()

        text = state.pending_text + delta
        if state.stop and delta and state.num_output_tokens >= state.min_tokens:
            match = find_stop_string(text, len(delta), state.stop)
            if match is not None:
                index, stop = match
                text = text[: index + len(stop)] if state.include_stop_str_in_output else text[:index]
                finish_reason, stop_reason = str(FinishReason.STOP), stop

        if finish_reason is None and state.holdback:
            keep = min(state.holdback, len(text))
            text, state.pending_text = text[: len(text) - keep], text[len(text) - keep :]
        else:
            state.pending_text = ""
        return RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            text=text,
            token_ids=list(new_ids),
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_output_tokens=state.num_output_tokens,
            num_cached_tokens=state.num_cached_tokens,
            num_prompt_tokens=state.num_prompt_tokens,
            logprobs=(
                None if output.logprobs_start < 0 or step_logprobs is None
                else step_logprobs.entries(output.logprobs_start, len(new_ids), state.num_logprobs)
            ),
            prompt_logprobs=(
                None if output.new_prompt_logprobs is None else Logprobs.from_arrays(output.new_prompt_logprobs)
            ),
            pooled=output.pooled,
        )

    def abort_requests(self, request_ids: Iterable[str], notify: bool = False) -> list[str]:
        """Forget requests (client gone, or aborted by the caller).

        With ``notify`` each collector receives a last output with finish
        reason "abort" (for callers that still wait on it); by default the
        collectors get nothing, since their consumer is the one aborting.
        Returns the ids that were still being tracked.
        """
        aborted = []
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            aborted.append(request_id)
            if notify:
                state.collector.put(
                    RequestOutput(
                        request_id=request_id,
                        prompt_token_ids=state.prompt_token_ids,
                        text="",
                        token_ids=[],
                        finished=True,
                        finish_reason=str(FinishReason.ABORT),
                        num_output_tokens=state.num_output_tokens,
                        num_cached_tokens=state.num_cached_tokens,
                        num_prompt_tokens=state.num_prompt_tokens,
                    )
                )
        return aborted

    def propagate_error(self, exc: BaseException) -> None:
        """Fail every unfinished request with ``exc`` (the engine died)."""
        for state in self.requests.values():
            state.collector.put(exc)
        self.requests.clear()

    def fail_requests(self, request_ids: Iterable[str], exc: BaseException) -> None:
        """Fail these requests with ``exc`` (one data-parallel engine died)."""
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                state.collector.put(exc)
