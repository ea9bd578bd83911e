"""Sampled token ids that stay on the device until someone needs them on the host.

On a GPU, reading sampled ids with ``.tolist()`` right after sampling would
make the host wait for the whole forward pass before it could prepare the
next step. Instead (vLLM V1's AsyncGPUModelRunnerOutput):

- ``SampledTokens`` starts a device-to-host copy into pinned memory on a
  separate stream, ordered after sampling, and records an event; the ids
  are materialised (event wait + ``tolist``) only when asked for.
- ``AsyncModelRunnerOutput`` is what ``execute_model`` returns then; the
  executor's future calls ``get_output()`` on the thread that reads the
  result (the engine thread, right before ``update_from_output``), so the
  runner's own thread never waits for the copy.
- ``DeferredTokens`` is the runner's side. The runner appends every sampled
  token to its persistent batch, but on a GPU it only knows the token's
  *position* at that point: it writes a placeholder there and records where
  the real id lives (which step's device tensor, which index). When a later
  step feeds that position to the model, the id is copied on the device,
  from the sampled tensor into the step's input ids, with no host round
  trip, so the async-scheduling pipeline (step N+1 scheduled and launched
  while step N runs) never stalls on step N's tokens. A step only ever feeds
  a placeholder as the *input* of the request's next decode; the host copy
  of the batch keeps the placeholder, which nothing else reads (a request
  resumed after preemption comes back from the scheduler with real ids).

On the CPU the forward pass has finished when sampling returns, so the
runner materialises at once and none of this is used, except in tests that
switch it on to exercise the same bookkeeping without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from core.protocol import LogprobsArrays
from core.sched.output import ModelRunnerOutput

# What the persistent batch holds at a position whose token is still on the device.
PLACEHOLDER_TOKEN_ID = -1


class SampledTokens:
    """One step's sampled ids [n]: on the device now, on the host once copied."""

    def __init__(self, device_ids: torch.Tensor, copy_stream: torch.cuda.Stream | None) -> None:
        self.device_ids = device_ids
        self._event: torch.cuda.Event | None = None
        self._list: list[int] | None = None
        if copy_stream is None:
            self._host = device_ids
            return
        copy_stream.wait_stream(torch.cuda.current_stream(device_ids.device))
        with torch.cuda.stream(copy_stream):
            self._host = torch.empty(device_ids.shape, dtype=device_ids.dtype, pin_memory=True)
            self._host.copy_(device_ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(copy_stream)
        # The main stream may free device_ids while the copy is still reading it.
        device_ids.record_stream(copy_stream)

    def tolist(self) -> list[int]:
        """The ids on the host; waits for the copy the first time. Safe from any thread."""
        if self._list is None:
            if self._event is not None:
                self._event.synchronize()
            self._list = self._host.tolist()
        return self._list


# () -> (logprobs, logprobs_rows, prompt_logprobs), as in ModelRunnerOutput.
LogprobsExtras = Callable[
    [], tuple[LogprobsArrays | None, list[int] | None, dict[str, LogprobsArrays] | None]
]


class AsyncModelRunnerOutput:
    """A ModelRunnerOutput whose sampled ids may still be on their way to the host.

    ``extras``, when some request asked for logprobs, brings them to the host
    (logprobs, prompt logprobs) at the same moment as the ids.
    """

    def __init__(
        self,
        req_ids: list[str],
        sampled_positions: list[int],
        tokens: SampledTokens,
        extras: LogprobsExtras | None = None,
    ) -> None:
        self.req_ids = req_ids
        self._sampled_positions = sampled_positions  # index into req_ids of each sampled token
        self._tokens = tokens
        self._extras = extras

    def get_output(self) -> ModelRunnerOutput:
        sampled: list[list[int]] = [[] for _ in self.req_ids]
        for i, token_id in zip(self._sampled_positions, self._tokens.tolist()):
            sampled[i] = [token_id]
        logprobs, rows, prompt_logprobs = self._extras() if self._extras is not None else (None, None, None)
        return ModelRunnerOutput.for_requests(
            self.req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            logprobs_rows=rows,
            prompt_logprobs=prompt_logprobs,
        )


@dataclass
class _Deferred:
    tokens: SampledTokens
    index: int  # into tokens.device_ids
    position: int  # of the token in its request


class DeferredTokens:
    """Requests whose latest token the runner has only as a placeholder (see module doc)."""

    def __init__(self) -> None:
        self._by_req: dict[str, _Deferred] = {}

    def __bool__(self) -> bool:
        return bool(self._by_req)

    def add(self, req_id: str, tokens: SampledTokens, index: int, position: int) -> None:
        self._by_req[req_id] = _Deferred(tokens, index, position)

    def discard(self, req_id: str) -> None:
        """The request left the batch (finished, preempted, or re-added with real ids)."""
        self._by_req.pop(req_id, None)

    def take_inputs(
        self, req_ids: list[str], computed: np.ndarray, counts: np.ndarray, starts: np.ndarray
    ) -> list[tuple[SampledTokens, list[int], list[int]]]:
        """Placeholders this step feeds to the model, grouped by the step that sampled them.

        Request ``i`` computes positions ``computed[i]:computed[i] + counts[i]``
        at flat input rows from ``starts[i]``. Returns ``(tokens, input rows,
        indices into tokens.device_ids)`` per group; entries consumed here are
        forgotten.
        """
        groups: dict[int, tuple[SampledTokens, list[int], list[int]]] = {}
        for i, req_id in enumerate(req_ids):
            entry = self._by_req.get(req_id)
            if entry is None:
                continue
            offset = entry.position - int(computed[i])
            if offset >= counts[i]:
                continue  # not reached yet: the request was scheduled for less
            # A placeholder is the next position to compute once it exists.
            assert offset >= 0, f"{req_id}: placeholder at {entry.position} is behind computed {computed[i]}"
            del self._by_req[req_id]
            group = groups.setdefault(id(entry.tokens), (entry.tokens, [], []))
            group[1].append(int(starts[i]) + offset)
            group[2].append(entry.index)
        return list(groups.values())
