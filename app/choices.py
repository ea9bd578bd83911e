"""One API request, several engine requests: the choices of ``n`` and of batch prompts.

OpenAI's ``n`` and a list of prompts both give one choice per (prompt, sample).
Each choice is its own engine request (``{id}-{index}``): they share the
prompt's KV blocks through the prefix cache and are scheduled like any
other requests. Here their outputs are gathered (whole responses) or merged
into one stream in arrival order (streams); either way, leaving early closes
every choice's output generator, which aborts all of them in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from app.output_processor import RequestOutput
from core.protocol import EngineCoreRequest

OutputsOf = Callable[[EngineCoreRequest], AsyncGenerator[RequestOutput, None]]


@dataclass
class Choice:
    """One choice of a response: ``index`` in the response, its prompt and its engine request."""

    index: int
    prompt_index: int
    request: EngineCoreRequest
    prompt_text: str = ""  # what echo shows of the prompt
    # Streaming state: whether the first delta went out, and the text offset of the next token.
    started: bool = False
    text_offset: int = 0
    last: RequestOutput | None = None


async def collect(outputs_of: OutputsOf, request: EngineCoreRequest) -> RequestOutput:
    """The whole output of one request: its deltas merged into one RequestOutput."""
    whole: RequestOutput | None = None
    async with contextlib.aclosing(outputs_of(request)) as outputs:
        async for out in outputs:
            if whole is None:
                whole = out
            else:
                whole.merge(out)
    if whole is None:
        raise RuntimeError("The engine finished the request without any output.")
    return whole


async def collect_all(outputs_of: OutputsOf, choices: list[Choice]) -> list[RequestOutput]:
    """Every choice's whole output, run concurrently; the first failure (or our
    own cancellation) cancels and so aborts the others."""
    if len(choices) == 1:
        return [await collect(outputs_of, choices[0].request)]
    tasks = [asyncio.ensure_future(collect(outputs_of, c.request)) for c in choices]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(outputs_of: OutputsOf, choices: list[Choice]) -> AsyncGenerator[tuple[Choice, RequestOutput], None]:
    """Deltas of all choices as they come, each with its choice. Closing this
    generator closes (and aborts) every choice still running."""
    if len(choices) == 1:
        async with contextlib.aclosing(outputs_of(choices[0].request)) as outputs:
            async for out in outputs:
                yield choices[0], out
        return
    queue: asyncio.Queue[tuple[Choice, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async with contextlib.aclosing(outputs_of(choice.request)) as outputs:
                async for out in outputs:
                    queue.put_nowait((choice, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((choice, exc))
        finally:
            queue.put_nowait((choice, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            choice, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
