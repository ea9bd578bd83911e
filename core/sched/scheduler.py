"""Continuous batching under one token budget per step.

There is no prefill phase and no decode phase. Every request has
``num_tokens`` known tokens of which ``num_computed_tokens`` are in the KV
cache (or scheduled into it); each step hands out at most
``max_num_batched_tokens`` tokens so that requests catch up: 1 for a request
that is decoding, a chunk for one still in its prompt. Running requests are
served first (they already hold memory), then waiting ones in queue order
while budget, sequence slots and free blocks last; a waiting request starts
from the longest prefix the prefix cache holds for it.

When a running request cannot get a block, another running request is
preempted (recompute policy: its blocks are freed, it goes back to the
waiting queue and later starts over, helped by whatever of its prefix is
still cached): under ``fcfs`` the most recently admitted one, under
``priority`` the one with the lowest priority (largest value), latest
arrival first. Under ``priority`` a waiting request that cannot be admitted
(no sequence slot or no blocks) also preempts running requests of strictly
lower priority.

Cost per step is proportional to the requests scheduled, not to all
requests or all blocks: no structure is rebuilt or scanned whole, except on
preemption and aborts, which are rare.

Pausing (``pause``/``resume``): while paused, requests that arrive are held
aside, out of the waiting queue, and join it in arrival order on resume.
PAUSED_NEW lets the requests already in the engine run to the end (the
"wait" and "abort" modes); PAUSED_ALL schedules nothing at all ("keep"), so
running requests keep their KV blocks and computed tokens, and continue
exactly where they stopped.

Speculative decoding: after a step the engine hands the proposer's draft
tokens to ``update_draft_token_ids``; the next schedule gives a request its
drafts after its known tokens, within the token budget (KV slots included),
and lists them in ``scheduled_spec_decode_tokens``. The runner verifies them
in the same pass and returns the accepted ones plus one token it sampled;
``update_from_output`` then takes the rejected drafts back out of
``num_computed_tokens``. Their KV slots hold stale values past the computed
tokens, which the next steps overwrite, and no block is registered in the
prefix cache before the tokens filling it are known (accepted).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence

from core.config import EngineConfig
from core.kv.block_hash import RequestBlockHasher
from core.kv.kv_cache_manager import KVCacheManager
from core.kv.kv_groups import KVCacheGroups
from core.protocol import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
    SpecDecodingStats,
)
from core.request import Request, RequestStatus
from core.sched.output import (
    CachedRequestData,
    DraftTokenIds,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from core.sched.request_queue import create_request_queue
from core.structured.manager import StructuredOutputManager
from core.structured.reasoning import forced_rows, rows_in_reasoning
from core.structured.reasoning import valid_drafts as valid_reasoning_drafts

_RUNNING = RequestStatus.RUNNING
_NO_DRAFTS: list[int] = []
_NO_BLOCK_IDS: tuple[list[int], ...] = ()  # no new block in any KV cache group


def _budget_reached(request: Request, placeholders: int) -> bool:
    """Whether the next token of a request inside a reasoning, after the ``placeholders`` in
    flight, is one its budget forces (if none of those ends the reasoning)."""
    budget = request.reasoning.budget  # type: ignore[union-attr]
    return budget is not None and request.num_output_tokens + placeholders >= budget


class PauseState(enum.IntEnum):
    UNPAUSED = 0
    PAUSED_NEW = 1  # new requests are held; the ones already in the engine go on
    PAUSED_ALL = 2  # nothing is scheduled; running requests keep their KV cache


class _StepPlan:
    """What one schedule() call has decided so far, so preemption can undo it."""

    __slots__ = ("token_budget", "num_scheduled_tokens", "spec_tokens", "new_block_ids", "running", "new", "preempted")

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.num_scheduled_tokens: dict[str, int] = {}
        self.spec_tokens: dict[str, list[int]] = {}  # drafts scheduled for verification
        self.new_block_ids: dict[str, list[list[int]]] = {}  # per KV cache group
        self.running: list[Request] = []  # scheduled requests the runner already holds
        self.new: list[Request] = []  # first-time and resumed requests
        self.preempted: list[Request] = []

    def unschedule(self, request: Request) -> None:
        """Take back what this step gave a request that is being preempted."""
        n = self.num_scheduled_tokens.pop(request.request_id, None)
        if n is None:
            return
        self.token_budget += n
        self.new_block_ids.pop(request.request_id, None)
        self.spec_tokens.pop(request.request_id, None)
        if request in self.new:
            self.new.remove(request)
        else:
            self.running.remove(request)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_gpu_blocks: int,
        structured_output_manager: StructuredOutputManager | None = None,
    ) -> None:
        self.max_model_len = config.max_model_len
        self.max_num_running_reqs = config.scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = config.scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = config.scheduler_config.enable_chunked_prefill
        self.log_stats = config.log_stats
        self.block_size = config.cache_config.block_size
        self.policy = config.scheduler_config.scheduling_policy
        # The most distinct LoRA adapters in one step (None: LoRA is off).
        self.max_loras = config.lora_config.max_loras if config.lora_config is not None else None
        # One pool for every KV cache group (core/kv/kv_groups.py), whose windows the manager honours.
        groups = KVCacheGroups.of(config.model_config)
        cache = config.cache_config
        self.kv_cache_manager = KVCacheManager(
            num_gpu_blocks, cache.block_size, enable_caching=cache.enable_prefix_caching, windows=groups.windows,
        )
        # Shared by every request: hashes each full block once, as it fills.
        self.block_hasher = RequestBlockHasher(cache.block_size) if cache.enable_prefix_caching else None
        # Preempting everything else must always let a request run alone to
        # max_model_len, or a long request could wait forever.
        needed = groups.least_blocks(self.block_size, self.max_num_scheduled_tokens, self.max_model_len)
        if self.kv_cache_manager.block_pool.num_usable_blocks < needed:
            raise ValueError(
                f"{num_gpu_blocks} KV cache blocks (one reserved) cannot hold one request of "
                f"max_model_len={self.max_model_len} ({needed} blocks of {self.block_size} tokens); give it more "
                "blocks or lower --max-model-len"
            )

        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []  # in admission order
        # Finished or aborted since the last schedule(): the runner must drop them.
        self.finished_req_ids: set[str] = set()
        # Preempted outside schedule() (reset_prefix_cache): told to the runner next step.
        self.preempted_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.step_id = 0  # step_id of the next SchedulerOutput
        self.pause_state = PauseState.UNPAUSED
        # Requests that arrived while paused, in arrival order (also in self.requests).
        self.held: dict[str, Request] = {}
        # Structured outputs: requests whose grammar is compiling (WAITING_FOR_FSM),
        # in arrival order, and those whose grammar failed, to report as errors.
        self.structured_output_manager = structured_output_manager or StructuredOutputManager(config)
        self.waiting_for_fsm: dict[str, Request] = {}
        self.grammar_errors: list[Request] = []
        self.spec_stats = SpecDecodingStats.new(config.speculative_config)

    # ---------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already in the scheduler")
        hasher = self.block_hasher
        if hasher is None:
            request.block_hasher = None
            request.block_hashes = []
        elif request.block_hasher is None or request.block_hasher.block_size != hasher.block_size:
            request.set_block_hasher(hasher)  # not hashed on the input thread
        self.requests[request.request_id] = request
        if self.pause_state == PauseState.UNPAUSED:
            self._enqueue(request)
        else:
            self.held[request.request_id] = request
        request.record_event(EngineCoreEventType.QUEUED)

    def _enqueue(self, request: Request) -> None:
        """Into the waiting queue, or aside while its grammar compiles."""
        if request.structured is not None and request.structured.matcher is None:
            request.status = RequestStatus.WAITING_FOR_FSM
            self.waiting_for_fsm[request.request_id] = request
        else:
            self.waiting.add_request(request)

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready join the waiting queue (at its end: the
        queue did not wait for them); those whose grammar failed finish with its error."""
        for req_id, request in list(self.waiting_for_fsm.items()):
            structured = request.structured
            assert structured is not None
            if not structured.ready():
                continue
            del self.waiting_for_fsm[req_id]
            try:
                error = structured.start()
            except Exception as exc:  # noqa: BLE001 - this request's failure, not the engine's
                error = f"Invalid structured output ({structured.key.kind}): {exc}"
            if error is None:
                request.status = RequestStatus.WAITING
                self.waiting.add_request(request)
            else:
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = error
                self._free_request(request)
                self.grammar_errors.append(request)

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
            elif self.held.pop(req_id, None) is None and self.waiting_for_fsm.pop(req_id, None) is None:
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
        if self.waiting_for_fsm:
            self._admit_compiled()
        plan = _StepPlan(self.max_num_scheduled_tokens)
        if self.pause_state != PauseState.PAUSED_ALL:
            self._schedule_running(plan)
            if not plan.preempted:  # memory just ran out: admitting anyone now would only thrash
                self._schedule_waiting(plan)

        kv = self.kv_cache_manager
        new_block_ids = plan.new_block_ids
        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=r.request_id,
                    token_ids=list(r.all_token_ids),
                    sampling_params=r.sampling_params,
                    block_ids=kv.get_block_ids(r.request_id),
                    num_computed_tokens=r.num_computed_tokens,
                    prompt_embeds=r.prompt_embeds,
                    num_prompt_tokens=r.num_prompt_tokens,
                    eos_token_id=r.eos_token_id,
                    pooling_params=r.pooling_params,
                    lora_int_id=r.lora_int_id,
                )
                for r in plan.new
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in plan.running],
                new_block_ids=[new_block_ids.get(r.request_id, _NO_BLOCK_IDS) for r in plan.running],
                num_computed_tokens=[r.num_computed_tokens for r in plan.running],
            ),
            num_scheduled_tokens=(
                plan.num_scheduled_tokens if self.max_loras is None else self._by_adapter(plan.num_scheduled_tokens)
            ),
            total_num_scheduled_tokens=self.max_num_scheduled_tokens - plan.token_budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids | {r.request_id for r in plan.preempted},
            step_id=self.step_id,
            scheduled_spec_decode_tokens=plan.spec_tokens,
        )
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        self.step_id += 1
        # The output above carries the counts from before this step; from now
        # on the scheduler treats the scheduled tokens as computed, and a step
        # that reaches the end of the known tokens owes one sampled token.
        num_scheduled = plan.num_scheduled_tokens
        guided: list[Request] = []
        for requests in (plan.running, plan.new):
            for request in requests:
                computed = request.num_computed_tokens + num_scheduled[request.request_id]
                request.num_computed_tokens = computed
                if computed >= len(request.all_token_ids) + request.num_output_placeholders:
                    request.num_output_placeholders += 1
                    if request.structured is not None or request.reasoning is not None:
                        guided.append(request)
        if guided:
            self._guide(output, guided, plan.spec_tokens)
        return output

    def _guide(self, output: SchedulerOutput, requests: list[Request], spec_tokens: dict[str, list[int]]) -> None:
        """The masks of the step's sampling requests that have a grammar or are inside a
        reasoning that matters: a bitmask row for each row of those whose grammar applies
        (a row, and one more per draft verified: the mask after that draft; all ones for
        rows still inside the reasoning), and the rows whose token a budget forces."""
        grammar: list[Request] = []
        grammar_drafts: list[list[int]] = []
        skips: list[int] = []
        row_ids: list[str] = []
        forced: list[tuple[str, int, int]] = []
        for request in requests:
            req_id = request.request_id
            drafts = spec_tokens.get(req_id, _NO_DRAFTS)
            skip = 0
            reasoning = request.reasoning
            if reasoning is not None:
                skip = rows_in_reasoning(reasoning, drafts)
                # The placeholder just counted is the token of this step's first row.
                num_output = request.num_output_tokens + request.num_output_placeholders - 1
                end = reasoning.end_token_id
                forced.extend((req_id, j, end) for j in forced_rows(reasoning, num_output, skip))
            if request.structured is not None and skip <= len(drafts):  # some row under the grammar
                grammar.append(request)
                grammar_drafts.append(drafts[skip:] if skip else drafts)
                skips.append(skip)
                row_ids.extend([req_id] * (len(drafts) + 1))
        if grammar:
            output.grammar_req_ids = row_ids
            output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                grammar, grammar_drafts if any(grammar_drafts) else None, skips if any(skips) else None
            )
        if forced:
            output.forced_token_ids = forced

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Decodes and unfinished prefill chunks of running requests, in order."""
        allocate = self.kv_cache_manager.allocate_slots
        running = self.running
        max_model_len = self.max_model_len
        req_index = 0
        while req_index < len(running) and plan.token_budget > 0:
            request = running[req_index]
            placeholders = request.num_output_placeholders
            num_tokens = len(request.all_token_ids) + placeholders
            # A request under a grammar waits for its token in flight: its next
            # bitmask depends on it. So does one whose reasoning budget may force its next
            # token, unless the token in flight ends the reasoning.
            if placeholders and (
                request.structured is not None
                or request.num_output_tokens + placeholders >= request.sampling_params.max_tokens
                or num_tokens >= max_model_len
                or (request.reasoning is not None and _budget_reached(request, placeholders))
            ):
                req_index += 1  # the token in flight is its last one
                continue
            drafts = request.spec_token_ids
            num_new_tokens = min(num_tokens + len(drafts) - request.num_computed_tokens, plan.token_budget)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            new_blocks = allocate(request, num_new_tokens)
            while new_blocks is None:
                victim_index = self._preemption_victim_index()
                victim = running.pop(victim_index)
                if victim_index < req_index:
                    req_index -= 1  # scheduled earlier in this loop: undo that
                    plan.unschedule(victim)
                self._preempt_request(victim)
                plan.preempted.append(victim)
                if victim is request:
                    break  # running[req_index] is now the next request
                new_blocks = allocate(request, num_new_tokens)
            if new_blocks is None:
                continue
            req_id = request.request_id
            plan.running.append(request)
            if any(new_blocks):
                plan.new_block_ids[req_id] = [[b.block_id for b in group] for group in new_blocks]
            plan.num_scheduled_tokens[req_id] = num_new_tokens
            plan.token_budget -= num_new_tokens
            if drafts:  # those the budget left room for follow the known tokens
                num_drafts = request.num_computed_tokens + num_new_tokens - num_tokens
                if num_drafts > 0:
                    plan.spec_tokens[req_id] = drafts[:num_drafts]
                request.spec_token_ids = []
            req_index += 1

    def _by_adapter(self, scheduled: dict[str, int]) -> dict[str, int]:
        """The step's requests ordered by LoRA adapter (stable): each adapter's rows are then
        one contiguous run, which the runner's grouped products take as a slice."""
        requests = self.requests
        ids = [requests[r].lora_int_id for r in scheduled]
        if all(a <= b for a, b in zip(ids, ids[1:])):
            return scheduled
        items = list(scheduled.items())
        return dict(items[i] for i in sorted(range(len(ids)), key=ids.__getitem__))

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in queue order, each from its longest cached prefix."""
        kv = self.kv_cache_manager
        waiting = self.waiting
        # With LoRA: the adapters of the step so far, and the requests passed over because
        # theirs would be one too many (they keep their place in the queue).
        adapters = None if self.max_loras is None else {r.lora_int_id for r in self.running} - {0}
        passed_over: list[Request] = []
        while waiting and plan.token_budget > 0:
            request = waiting.peek_request()
            if adapters is not None and request.lora_int_id and request.lora_int_id not in adapters:
                if len(adapters) >= self.max_loras:
                    passed_over.append(waiting.pop_request())
                    continue
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_computed
            if num_new_tokens > plan.token_budget:
                if not self.enable_chunked_prefill:
                    break  # whole prompts only; keep queue order
                num_new_tokens = plan.token_budget
            if len(self.running) >= self.max_num_running_reqs and not self._preempt_for(request, plan):
                break
            while (
                new_blocks := kv.allocate_slots(request, num_new_tokens, computed_blocks, num_computed)
            ) is None:
                if not self._preempt_for(request, plan):
                    break
            if new_blocks is None:
                break  # not enough free blocks; retry once something finishes
            waiting.pop_request()
            if adapters is not None and request.lora_int_id:
                adapters.add(request.lora_int_id)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_computed
            if kv.enable_caching:
                kv.prefix_cache_stats.record(request.num_tokens, num_computed)
            request.num_computed_tokens = num_computed
            request.status = _RUNNING
            request.record_event(EngineCoreEventType.SCHEDULED)
            self.running.append(request)
            plan.new.append(request)
            plan.num_scheduled_tokens[request.request_id] = num_new_tokens
            plan.token_budget -= num_new_tokens
            if plan.preempted:
                break  # the victims wait at least one step: no ping-pong
        for request in reversed(passed_over):
            waiting.prepend_request(request)

    def _preemption_victim_index(self) -> int:
        """Index in ``running`` of the request to preempt next (O(running)
        under priority, O(1) under fcfs; preemption is the rare path)."""
        running = self.running
        if self.policy != "priority":
            return len(running) - 1
        # Lowest priority (largest value), then latest arrival; among exact
        # ties the latest admitted, as under fcfs.
        return max(
            range(len(running) - 1, -1, -1),
            key=lambda i: (running[i].priority, running[i].arrival_time),
        )

    def _preempt_for(self, request: Request, plan: _StepPlan) -> bool:
        """Priority policy only: preempt the lowest-priority running request if
        its priority is strictly lower than ``request``'s. Equal priorities
        never preempt each other, or two requests could take turns forever."""
        if self.policy != "priority" or not self.running:
            return False
        index = self._preemption_victim_index()
        if self.running[index].priority <= request.priority:
            return False
        victim = self.running.pop(index)
        plan.unschedule(victim)
        self._preempt_request(victim)
        plan.preempted.append(victim)
        return True

    def _preempt_request(self, request: Request) -> None:
        """Recompute policy: drop the request's KV cache and requeue it."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.spec_token_ids = []
        request.preempted_at_step = self.step_id
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED)
        self.waiting.prepend_request(request)

    # ---------------------------------------------------------------- update

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Keep the proposer's drafts for the next schedule, cut to what the request
        may still produce: the drafts and the token sampled after them must fit in
        max_tokens and max_model_len, and for a request under a grammar to the prefix the
        grammar accepts (its verification then masks each draft's row as the grammar stands
        after the drafts before it)."""
        requests = self.requests
        max_model_len = self.max_model_len
        for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = requests.get(req_id)
            if request is None or request.status != _RUNNING:
                continue  # finished in the step that proposed them, or preempted
            room = min(
                max_model_len - request.num_tokens, request.sampling_params.max_tokens - request.num_output_tokens
            ) - 1
            drafts = drafts[:room] if room > 0 else []
            if drafts:
                if request.reasoning is not None:
                    drafts = valid_reasoning_drafts(
                        request.reasoning, request.structured, request.num_output_tokens, drafts
                    )
                elif request.structured is not None:
                    drafts = request.structured.valid_drafts(drafts)
            request.spec_token_ids = drafts

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Append sampled tokens, finish requests that hit a stop condition,
        and group the resulting outputs by client."""
        per_client: dict[int, list[EngineCoreOutput]] = {}
        index_of = model_runner_output.req_id_to_index
        sampled = model_runner_output.sampled_token_ids
        logprobs_rows = model_runner_output.logprobs_rows
        prompt_logprobs = model_runner_output.prompt_logprobs
        pooler_output = model_runner_output.pooler_output
        requests = self.requests
        step_id = scheduler_output.step_id
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        stopped: set[str] = set()
        if self.grammar_errors:
            for request in self.grammar_errors:
                per_client.setdefault(request.client_index, []).append(
                    EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        finish_reason=request.get_finished_reason(),
                        stop_reason=request.stop_reason,
                        events=request.take_events(),
                    )
                )
            self.grammar_errors = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.status != _RUNNING or request.preempted_at_step > step_id:
                continue  # aborted, finished or preempted since it was scheduled
            i = index_of.get(req_id)
            if pooler_output is not None:
                pooled = pooler_output[i] if i is not None else None
                if pooled is not None:  # the prompt has run: the request is done
                    request.status = RequestStatus.FINISHED_STOPPED
                    stopped.add(req_id)
                    self._free_request(request)
                    out = EngineCoreOutput(
                        request_id=req_id, new_token_ids=[], finish_reason=FinishReason.STOP,
                        num_cached_tokens=request.num_cached_tokens, events=request.take_events(), pooled=pooled,
                    )
                    per_client.setdefault(request.client_index, []).append(out)
                continue
            new_token_ids = sampled[i] if i is not None else None
            if not new_token_ids:
                continue  # a prefill chunk short of the prompt's end
            request.num_output_placeholders -= 1  # one sample per step, however many tokens it gave
            if spec_tokens and (drafts := spec_tokens.get(req_id)):
                # The accepted drafts' KV stays; the rejected ones' slots are past the computed tokens.
                num_accepted = len(new_token_ids) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_stats.observe(len(drafts), num_accepted)  # type: ignore[union-attr]
            guided = request.structured is not None or request.reasoning is not None
            for k, token_id in enumerate(new_token_ids):
                request.append_output_token_ids(token_id)
                if (guided and self._guided_stops(request, token_id)) or self._check_stop(request):
                    new_token_ids = new_token_ids[: k + 1]
                    stopped.add(req_id)
                    self._free_request(request)
                    break
            out = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=new_token_ids,
                finish_reason=request.get_finished_reason() if req_id in stopped else None,
                stop_reason=request.stop_reason,
                num_cached_tokens=request.num_cached_tokens,
                events=request.take_events(),
                logprobs_start=-1 if logprobs_rows is None else logprobs_rows[i],
            )
            if prompt_logprobs is not None:
                out.new_prompt_logprobs = prompt_logprobs.get(req_id)
            client_outputs = per_client.get(request.client_index)
            if client_outputs is None:
                per_client[request.client_index] = [out]
            else:
                client_outputs.append(out)
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]

        now = time.monotonic()
        engine_outputs = {
            client: EngineCoreOutputs(outputs=outs, timestamp=now) for client, outs in per_client.items()
        }
        if model_runner_output.logprobs is not None:
            # The step's arrays whole, in the runner's row order (which each output
            # points into): one frontend is the usual case, and slicing per client
            # would cost more than the rows of other clients' requests.
            for client_outputs in engine_outputs.values():
                client_outputs.logprobs = model_runner_output.logprobs
        if self.log_stats:
            # Client 0 gets every step's snapshot, even one in which it has no
            # output: one frontend turns them into series, none counts twice.
            stats = self.make_stats()
            stats.step_counter = step_id + 1
            stats.num_batched_tokens = scheduler_output.total_num_scheduled_tokens
            first = engine_outputs.get(0)
            if first is None:
                engine_outputs[0] = first = EngineCoreOutputs(timestamp=now)
            first.scheduler_stats = stats
        return engine_outputs

    @classmethod
    def _guided_stops(cls, request: Request, token_id: int) -> bool:
        """Follow a token of a request with a grammar or inside a reasoning; True (status set)
        when that ends it. A token inside the reasoning, the end token included, does not
        reach the grammar."""
        reasoning = request.reasoning
        if reasoning is None:  # ended (maybe earlier in this step's tokens)
            return request.structured is not None and cls._grammar_stops(request, token_id)
        if token_id == reasoning.end_token_id:
            request.reasoning = None  # the grammar, if any, applies from the next token on
        elif reasoning.budget is not None and request.num_output_tokens > reasoning.budget:
            # The row was forced to the end token: only another constraint masking it too
            # (allowed_token_ids, bad words) can have left nothing to sample.
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = (
                f"The reasoning budget forced token {reasoning.end_token_id}, which the request's "
                "other constraints exclude."
            )
            return True
        return False

    @staticmethod
    def _grammar_stops(request: Request, token_id: int) -> bool:
        """Advance the request's matcher; True (status set) when the grammar ends it."""
        structured = request.structured
        assert structured is not None
        if not structured.accept(token_id):
            # The mask makes this impossible unless every token was masked
            # (min_tokens holding back the only end the grammar allows).
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = f"The grammar rejected token {token_id}: no allowed token could be sampled."
            return True
        if structured.is_terminated():
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if len(request.output_token_ids) >= request.sampling_params.max_tokens and structured.only_end_allowed():
            # Cut by max_tokens exactly where the grammar can only end: the output is whole.
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def _check_stop(self, request: Request) -> bool:
        """Set a finished status (and stop_reason) if the last token ends the request."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if num_output >= params.min_tokens:
            last = request.output_token_ids[-1]
            if last == request.eos_token_id and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        if len(request.all_token_ids) >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # ---------------------------------------------------------------- prefix cache

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix. With requests running this is refused
        (False) unless ``reset_running_requests``, which preempts them all
        first; they recompute from scratch when they resume."""
        if self.running:
            if not reset_running_requests:
                return False
            # From the back, so that prepending keeps their order under fcfs.
            while self.running:
                victim = self.running.pop()
                self._preempt_request(victim)
                self.preempted_req_ids.add(victim.request_id)
        return self.kv_cache_manager.reset_prefix_cache()

    # ---------------------------------------------------------------- queries

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_requests(self) -> bool:
        """True while a step is needed: requests to schedule, or finished or
        preempted ones the runner has not been told about yet. Held requests
        need no step, nor does anything while PAUSED_ALL, nor requests whose
        grammar is still compiling (the manager's ``on_ready`` wakes the driver)."""
        if self.waiting_for_fsm:
            self._admit_compiled()
        if self.finished_req_ids or self.preempted_req_ids or self.grammar_errors:
            return True
        if self.pause_state == PauseState.PAUSED_ALL:
            return False
        return bool(self.running) or bool(self.waiting)

    # ---------------------------------------------------------------- pause

    def pause(self, mode: str) -> list[Request]:
        """Stop admitting requests (``core.protocol.PAUSE_MODES``); returns the
        requests that ``"abort"`` finished, held ones included."""
        aborted: list[Request] = []
        if mode == "abort":
            aborted = list(self.requests.values())
            self.finish_requests([r.request_id for r in aborted], RequestStatus.FINISHED_ABORTED)
        elif mode not in ("wait", "keep"):
            raise ValueError(f"unknown pause mode {mode!r}; use abort, wait or keep")
        self.pause_state = PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
        return aborted

    def resume(self) -> None:
        """Schedule again; held requests join the waiting queue in arrival order."""
        self.pause_state = PauseState.UNPAUSED
        for request in self.held.values():
            self._enqueue(request)
        self.held = {}

    @property
    def paused(self) -> bool:
        return self.pause_state != PauseState.UNPAUSED

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting), held requests and those compiling a grammar counted as waiting."""
        return len(self.running), len(self.waiting) + len(self.held) + len(self.waiting_for_fsm)

    def make_stats(self) -> SchedulerStats:
        """A snapshot; the prefix cache and preemption counters are cumulative."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.held) + len(self.waiting_for_fsm),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
            num_preemptions=self.num_preemptions,
            spec_decoding=None if self.spec_stats is None else self.spec_stats.snapshot(),
        )
