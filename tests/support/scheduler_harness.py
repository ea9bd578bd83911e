"""The scheduler driven step by step by a bookkeeping-only model runner (``Harness``).

``FakeRunner`` applies SchedulerOutputs exactly as the real runner's
persistent batch does (new/resumed requests replace state, cached ones get
block deltas, a sampled token is appended to the runner's own copy so that
a pipelined next batch can decode it) and checks every invariant the real
runner relies on: the counts it is told match what it computed, the block
table covers every slot written, and a resumed request comes back with the
tokens it had. It also simulates the KV cache itself: every slot written
records which token prefix it holds, and every position a request attends
to must hold exactly that request's prefix. That is what makes prefix
sharing checkable: blocks may be shared only if they really hold the same
prefix (and only registered cached blocks may be shared at all). Its
"model" is a fixed function of (request, position), so recomputation after
preemption must reproduce the same outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from core.config import EngineArgs, EngineConfig
from core.kv.block_pool import BlockPool
from core.model_config import ModelConfig
from core.protocol import (
    EngineCoreEventType,
    EngineCoreOutput,
    FinishReason,
    SamplingParams,
)
from core.request import Request
from core.sched.output import ModelRunnerOutput, SchedulerOutput
from core.sched.scheduler import Scheduler

TokenFn = Callable[[str, int], int]


def default_token(req_id: str, position: int) -> int:
    """The fake model: the token sampled for ``req_id`` at ``position``."""
    return 1000 + 7 * position + len(req_id)


@dataclass
class RunnerState:
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    prefix_keys: list[int] = field(default_factory=list)  # prefix_keys[q] names token_ids[: q + 1]

    def prefix_key(self, position: int) -> int:
        keys = self.prefix_keys
        while len(keys) <= position:
            keys.append(hash((keys[-1] if keys else None, self.token_ids[len(keys)])))
        return keys[position]


class FakeRunner:
    def __init__(
        self, block_size: int, token_fn: TokenFn = default_token, pool: BlockPool | None = None
    ) -> None:
        self.block_size = block_size
        self.token_fn = token_fn
        self.pool = pool
        self.reqs: dict[str, RunnerState] = {}
        self.history: dict[str, list[int]] = {}  # survives preemption
        self.kv: dict[tuple[int, int], int] = {}  # (block, offset) -> prefix key written there
        # Sync mode: a resumed request must bring back exactly what it had. A
        # pipelined run may have sampled one more token it threw away.
        self.strict_resume = True

    def slot(self, state: RunnerState, position: int) -> tuple[int, int]:
        return state.block_ids[position // self.block_size], position % self.block_size

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, "a live request was sent as new"
            if new.req_id in self.history:  # resumed: nothing may be lost
                had = self.history[new.req_id]
                assert new.token_ids == (had if self.strict_resume else had[: len(new.token_ids)])
            self.reqs[new.req_id] = RunnerState(list(new.token_ids), new.num_computed_tokens, list(new.block_ids[0]))
        cached = so.scheduled_cached_reqs
        for req_id, blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.reqs[req_id]
            assert state.num_computed_tokens == computed
            state.block_ids += blocks[0] if blocks else []  # the one KV cache group of its models

        live_blocks = [b for s in self.reqs.values() for b in s.block_ids]
        assert 0 not in live_blocks, "the null block was handed out"
        if len(live_blocks) != len(set(live_blocks)):
            assert self.pool is not None and self.pool.enable_caching, "a block is shared without prefix caching"
            shared = {b for b in live_blocks if live_blocks.count(b) > 1}
            assert all(self.pool.blocks[b].block_hash is not None for b in shared), "an uncached block is shared"
        assert set(so.num_scheduled_tokens) == {n.req_id for n in so.scheduled_new_reqs} | set(cached.req_ids)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())

        # Every layer writes the whole batch's keys and values, then attends.
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            assert 0 < n <= len(state.token_ids) - state.num_computed_tokens
            assert len(state.block_ids) * self.block_size >= state.num_computed_tokens + n
            for p in range(state.num_computed_tokens, state.num_computed_tokens + n):
                self.kv[self.slot(state, p)] = state.prefix_key(p)
        sampled: list[list[int]] = []
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            state.num_computed_tokens += n
            for q in range(state.num_computed_tokens):
                assert self.kv.get(self.slot(state, q)) == state.prefix_key(q), (
                    f"{req_id} attends to a slot that does not hold its prefix at position {q}"
                )
            if state.num_computed_tokens == len(state.token_ids):
                token = self.token_fn(req_id, len(state.token_ids))
                state.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])
            self.history[req_id] = list(state.token_ids)
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEventType] = field(default_factory=list)


# The scheduler never looks at the model: a small stand-in architecture.
NO_MODEL = ModelConfig.from_hf({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 1024,
})


def make_config(**overrides) -> EngineConfig:
    """Prefix caching off unless asked: most tests here pin down exact block
    accounting, and their requests share prompts (tests/engine/test_prefix_caching.py
    covers the scheduler with it on)."""
    values = dict(
        model="unused", max_model_len=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
        enable_prefix_caching=False, served_model_name="unused", tokenizer="unused",
    )
    values.update(overrides)
    return EngineArgs(**values).for_architecture(NO_MODEL)


def make_request(req_id: str, num_prompt_tokens: int, client_index: int = 0, eos: int | None = None, **params) -> Request:
    return Request(
        req_id,
        [(7 * i + 3) % 50 for i in range(num_prompt_tokens)],
        SamplingParams(**params),
        eos_token_id=eos,
        client_index=client_index,
    )


class Harness:
    """One scheduler + fake runner, with every step's output recorded."""

    def __init__(self, config: EngineConfig, num_blocks: int, token_fn: TokenFn = default_token) -> None:
        self.config = config
        self.scheduler = Scheduler(config, num_blocks)
        self.runner = FakeRunner(config.cache_config.block_size, token_fn, self.scheduler.kv_cache_manager.block_pool)
        self.steps: list[SchedulerOutput] = []
        self.results: dict[str, Result] = {}
        self.client_of: dict[str, int] = {}
        self.admits_after_preemption = False

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.results[request.request_id] = Result()
        self.client_of[request.request_id] = request.client_index

    def schedule(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        self.steps.append(so)
        assert so.total_num_scheduled_tokens <= self.config.scheduler_config.max_num_batched_tokens
        assert len(self.scheduler.running) <= self.config.scheduler_config.max_num_seqs
        if self.config.scheduler_config.scheduling_policy == "fcfs" and not self.admits_after_preemption:
            # Memory just ran out: admitting anyone now would only thrash.
            assert not (so.preempted_req_ids and so.scheduled_new_reqs)
        return so

    def step(self) -> list[EngineCoreOutput]:
        so = self.schedule()
        return self.update(so, self.runner.execute(so))

    def update(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(so, runner_output)
        flat = []
        assert 0 in outputs and outputs[0].scheduler_stats is not None  # every step's snapshot goes to client 0
        for client, eco in outputs.items():
            assert client == 0 or eco.scheduler_stats is None
            for out in eco.outputs:
                assert self.client_of[out.request_id] == client
                self.record(out)
                flat.append(out)
        return flat

    def record(self, out: EngineCoreOutput) -> None:
        result = self.results[out.request_id]
        assert result.finish_reason is None, "output after the request finished"
        result.token_ids += out.new_token_ids
        result.finish_reason = out.finish_reason
        result.stop_reason = out.stop_reason
        result.events += [e.type for e in out.events or ()]

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def run_pipelined(self, max_steps: int = 1000) -> None:
        """EngineCore.step_with_batch_queue's order: schedule (and run) batch
        N+1 before batch N's tokens are fed back to the scheduler."""
        self.runner.strict_resume = False
        in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and in_flight is None:
                return
            batch = None
            if self.scheduler.has_requests():
                so = self.schedule()
                batch = (so, self.runner.execute(so))
            if in_flight is not None:
                self.update(*in_flight)
            in_flight = batch
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def assert_no_leak(self) -> None:
        pool = self.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_usable_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert not self.scheduler.kv_cache_manager.holds_requests()


def expected_outputs(req_id: str, num_prompt_tokens: int, n: int) -> list[int]:
    return [default_token(req_id, num_prompt_tokens + i) for i in range(n)]


# ------------------------------------------------------------------ budget
