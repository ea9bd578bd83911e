"""Continuous batching under one token budget per step.

There is no prefill phase and no decode phase. Every request has
``num_tokens`` known tokens of which ``num_computed_tokens`` are in the KV
cache; each step hands out at most ``max_num_batched_tokens`` tokens so that
requests catch up: 1 for a request that is decoding, a chunk for one still
in its prompt. Running requests are served first (they already hold memory),
then waiting ones in queue order while budget, sequence slots and free blocks
last. When a running request cannot get a block, the most recently admitted
running request is preempted: its blocks are freed and it goes back to the
front of the queue to recompute everything later.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable

from core.config import EngineConfig
from core.kv.block_pool import KVCacheBlock
from core.kv.kv_cache_manager import KVCacheManager, cdiv
from core.protocol import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
)
from core.sched.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from core.sched.request import Request, RequestStatus
from core.sched.request_queue import create_request_queue


class Scheduler:
    def __init__(self, config: EngineConfig, num_gpu_blocks: int) -> None:
        if config.max_model_len is None:
            raise ValueError("EngineConfig.resolve() must run before building the scheduler")
        self.max_model_len = config.max_model_len
        self.max_num_running_reqs = config.max_num_seqs
        self.max_num_scheduled_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.block_size = config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_gpu_blocks, config.block_size, enable_caching=config.enable_prefix_caching
        )
        # Preempting everything else must always let a request run alone to
        # max_model_len, or a long request could wait forever.
        needed = cdiv(self.max_model_len, self.block_size)
        if self.kv_cache_manager.block_pool.num_usable_blocks < needed:
            raise ValueError(
                f"{num_gpu_blocks} KV cache blocks (one reserved) cannot hold one request of "
                f"max_model_len={self.max_model_len} ({needed} blocks of {self.block_size} tokens)"
            )

        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = create_request_queue(config.scheduling_policy)
        self.running: list[Request] = []  # in admission order; preemption takes from the end
        # Finished or aborted since the last schedule(): the runner must drop them.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0

    # ---------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already in the scheduler")
        self.requests[request.request_id] = request
        self.waiting.add_request(request)
        request.record_event(EngineCoreEventType.QUEUED)

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> None:
        """Finish requests from outside the step (aborts); ``None`` means all.

        Unknown or already finished ids are ignored, so a late or repeated
        abort is harmless. Blocks are released at once.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        if request_ids is None:
            request_ids = list(self.requests)
        elif isinstance(request_ids, str):
            request_ids = [request_ids]
        running_ids: set[str] = set()
        waiting: list[Request] = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                running_ids.add(req_id)
            else:
                waiting.append(request)
            request.status = finished_status
            self._free_request(request)
        if running_ids:
            self.running = [r for r in self.running if r.request_id not in running_ids]
        self.waiting.remove_requests(waiting)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_scheduled_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_blocks_of: dict[str, list[KVCacheBlock]] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []  # first-time and resumed requests
        preempted: list[Request] = []

        # 1. Running requests: decodes and unfinished prefill chunks.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            while (new_blocks := self.kv_cache_manager.allocate_slots(request, num_new_tokens)) is None:
                # Everything before req_index is already scheduled, so the
                # victim at the end is at worst this very request.
                victim = self.running.pop()
                self._preempt_request(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break  # this request was the last one standing
            scheduled_running.append(request)
            new_blocks_of[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # 2. Waiting requests, in queue order, unless memory just ran out.
        while not preempted and self.waiting and token_budget > 0:
            if len(self.running) >= self.max_num_running_reqs:
                break
            request = self.waiting.peek_request()
            _, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_computed
            if num_new_tokens > token_budget:
                if not self.enable_chunked_prefill:
                    break  # whole prompts only; keep arrival order
                num_new_tokens = token_budget
            request.num_computed_tokens = num_computed
            if self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
                break  # not enough free blocks; retry once something finishes
            self.waiting.pop_request()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            request.record_event(EngineCoreEventType.SCHEDULED)
            self.running.append(request)
            scheduled_new.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens

        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=r.request_id,
                    token_ids=list(r.all_token_ids),
                    sampling_params=r.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
                    num_computed_tokens=r.num_computed_tokens,
                    prompt_embeds=r.prompt_embeds,
                )
                for r in scheduled_new
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in scheduled_running],
                new_block_ids=[
                    [b.block_id for b in new_blocks_of[r.request_id]] for r in scheduled_running
                ],
                num_computed_tokens=[r.num_computed_tokens for r in scheduled_running],
            ),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_scheduled_tokens - token_budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
        )
        self.finished_req_ids = set()
        # The output above carries the counts from before this step; from now
        # on the scheduler treats the scheduled tokens as computed.
        for req_id, n in num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        return output

    def _preempt_request(self, request: Request) -> None:
        """Recompute policy: drop the request's KV cache and requeue it first."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED)
        self.waiting.prepend_request(request)

    # ---------------------------------------------------------------- update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Append sampled tokens, finish requests that hit a stop condition,
        and group the resulting outputs by client."""
        per_client: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        index_of = model_runner_output.req_id_to_index
        sampled = model_runner_output.sampled_token_ids
        stopped: set[str] = set()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted after it was scheduled
            i = index_of.get(req_id)
            new_token_ids = sampled[i] if i is not None else []
            if not new_token_ids:
                continue  # a prefill chunk short of the prompt's end
            for k, token_id in enumerate(new_token_ids):
                request.append_output_token_ids(token_id)
                if self._check_stop(request):
                    new_token_ids = new_token_ids[: k + 1]
                    stopped.add(req_id)
                    self._free_request(request)
                    break
            per_client[request.client_index].append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    events=request.take_events(),
                )
            )
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]

        stats = self.make_stats()
        now = time.monotonic()
        if not per_client:
            per_client[0] = []  # the stats go out even when no request produced a token
        return {
            client: EngineCoreOutputs(outputs=outs, scheduler_stats=stats, timestamp=now)
            for client, outs in per_client.items()
        }

    def _check_stop(self, request: Request) -> bool:
        """Set a finished status (and stop_reason) if the last token ends the request."""
        params = request.sampling_params
        if request.num_output_tokens >= params.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        if request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # ---------------------------------------------------------------- queries

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_requests(self) -> bool:
        """True while a step is needed: unfinished requests, or finished ones
        the runner has not been told about yet."""
        return bool(self.requests) or bool(self.finished_req_ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        return len(self.running), len(self.waiting)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
        )
