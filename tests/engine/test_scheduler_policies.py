"""Scheduling policies (fcfs, priority) and pipelined scheduling, driven
through the same Harness and FakeRunner as tests/engine/test_scheduler.py."""

from __future__ import annotations

import pytest

from core.protocol import EngineCoreEventType, FinishReason, SamplingParams
from core.request import Request, RequestStatus
from core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
)
from tests.support.scheduler_harness import (
    Harness,
    default_token,
    expected_outputs,
    make_config,
)


def req(req_id: str, n: int, priority: int = 0, arrival: float = 0.0, eos: int | None = None, **params) -> Request:
    tokens = [(7 * i + 3 + 11 * len(req_id)) % 50 for i in range(n)]
    return Request(req_id, tokens, SamplingParams(**params), eos_token_id=eos, arrival_time=arrival, priority=priority)


def priority_config(**overrides):
    return make_config(scheduling_policy="priority", **overrides)


# ------------------------------------------------------------------ queues


def test_priority_queue_orders_by_priority_then_arrival_then_insertion() -> None:
    q = PriorityRequestQueue()
    for r in [req("late-hi", 1, 0, 5.0), req("lo", 1, 3, 0.0), req("early-hi", 1, 0, 1.0), req("tie", 1, 0, 5.0)]:
        q.add_request(r)
    assert [r.request_id for r in q] == ["early-hi", "late-hi", "tie", "lo"]
    assert q.peek_request().request_id == "early-hi"
    q.remove_requests([r for r in q if r.request_id == "late-hi"])
    assert [q.pop_request().request_id for _ in range(len(q))] == ["early-hi", "tie", "lo"]
    assert not q
    with pytest.raises(IndexError):
        q.peek_request()


def test_preempted_request_returns_to_its_priority_place_not_the_front() -> None:
    q = PriorityRequestQueue()
    q.add_request(req("urgent", 1, priority=0, arrival=9.0))
    q.prepend_request(req("preempted", 1, priority=2, arrival=1.0))
    q.add_request(req("newer", 1, priority=2, arrival=5.0))
    assert [r.request_id for r in q] == ["urgent", "preempted", "newer"]


def test_queue_factory() -> None:
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        create_request_queue("lifo")


# ------------------------------------------------------------------ priority


def test_saturated_engine_admits_higher_priority_first_and_preempts_a_lower_one() -> None:
    h = Harness(priority_config(max_num_seqs=2), num_blocks=40)
    h.add(req("lo1", 5, priority=5, arrival=1.0, max_tokens=6))
    h.add(req("lo2", 5, priority=5, arrival=2.0, max_tokens=6))
    h.step()
    h.step()
    h.add(req("mid", 5, priority=3, arrival=3.0, max_tokens=3))
    h.add(req("hi", 5, priority=0, arrival=4.0, max_tokens=3))
    h.step()
    so = h.steps[-1]
    # hi first: it takes the slot of the lowest priority, latest arrival (lo2).
    assert [n.req_id for n in so.scheduled_new_reqs] == ["hi"]
    assert so.preempted_req_ids == {"lo2"}
    h.step()
    assert h.steps[-1].preempted_req_ids == {"lo1"}  # mid outranks lo1 too
    assert [n.req_id for n in h.steps[-1].scheduled_new_reqs] == ["mid"]
    h.run()
    first_token_step = {
        rid: next(i for i, s in enumerate(h.steps) if rid in s.num_scheduled_tokens) for rid in ("hi", "mid")
    }
    assert first_token_step["hi"] < first_token_step["mid"]
    for rid, n, m in [("lo1", 5, 6), ("lo2", 5, 6), ("mid", 5, 3), ("hi", 5, 3)]:
        assert h.results[rid].token_ids == expected_outputs(rid, n, m)
    assert EngineCoreEventType.PREEMPTED in h.results["lo1"].events
    assert EngineCoreEventType.PREEMPTED in h.results["lo2"].events
    assert EngineCoreEventType.PREEMPTED not in h.results["hi"].events
    h.assert_no_leak()


def test_equal_priority_never_preempts_and_fcfs_never_preempts_for_admission() -> None:
    for config in (priority_config(max_num_seqs=1), make_config(max_num_seqs=1)):
        h = Harness(config, num_blocks=40)
        h.add(req("first", 4, priority=1, arrival=1.0, max_tokens=4))
        h.step()
        priority = 1 if config.scheduler_config.scheduling_policy == "priority" else -9
        h.add(req("second", 4, priority=priority, arrival=2.0))
        h.step()
        assert not h.steps[-1].preempted_req_ids
        assert h.steps[-1].num_scheduled_tokens == {"first": 1}
        h.run()
        assert h.scheduler.num_preemptions == 0
        h.assert_no_leak()


@pytest.mark.parametrize("policy, victim", [("fcfs", "hi"), ("priority", "lo")])
def test_out_of_blocks_preempts_the_lowest_priority_not_the_last_admitted(policy: str, victim: str) -> None:
    # 4 usable blocks of 4. lo (admitted first) and hi fill 2 each by step 2;
    # at step 3 lo's decode needs a third block. fcfs takes it from the last
    # admitted (hi); priority from the lowest priority (lo itself).
    h = Harness(make_config(scheduling_policy=policy, max_model_len=16), num_blocks=5)
    h.add(req("lo", 7, priority=9, arrival=1.0, max_tokens=3))
    h.step()
    h.add(req("hi", 8, priority=0, arrival=2.0, max_tokens=3))
    h.step()
    assert h.scheduler.kv_cache_manager.get_num_free_blocks() == 0
    h.step()
    assert h.steps[-1].preempted_req_ids == {victim}
    h.run()
    assert h.results["lo"].token_ids == expected_outputs("lo", 7, 3)
    assert h.results["hi"].token_ids == expected_outputs("hi", 8, 3)
    h.assert_no_leak()


def test_a_victim_already_scheduled_this_step_is_unscheduled() -> None:
    # 6 usable blocks of 4. Running order: hi_a, lo, hi_b, two blocks each.
    # At step 3 only hi_b (last) needs a new block; the victim is lo, whose
    # decode was already scheduled earlier in the same step.
    h = Harness(priority_config(max_model_len=16), num_blocks=7)
    h.add(req("hi_a", 6, priority=0, arrival=1.0, max_tokens=4))
    h.add(req("lo", 5, priority=9, arrival=2.0, max_tokens=4))
    h.step()
    h.add(req("hi_b", 8, priority=0, arrival=3.0, max_tokens=4))
    h.step()
    assert h.scheduler.kv_cache_manager.get_num_free_blocks() == 0
    h.step()
    so = h.steps[-1]
    assert so.preempted_req_ids == {"lo"}
    assert so.num_scheduled_tokens == {"hi_a": 1, "hi_b": 1}
    assert so.scheduled_cached_reqs.req_ids == ["hi_a", "hi_b"]
    assert h.scheduler.requests["lo"].num_computed_tokens == 0
    h.run()
    for rid, n in [("hi_a", 6), ("lo", 5), ("hi_b", 8)]:
        assert h.results[rid].token_ids == expected_outputs(rid, n, 4)
    h.assert_no_leak()


def test_waiting_higher_priority_request_preempts_for_blocks() -> None:
    # No sequence cap in the way: the blocks are what the low ones hold.
    h = Harness(priority_config(max_model_len=16), num_blocks=9)  # 8 usable
    for i in range(4):
        h.add(req(f"lo{i}", 7, priority=5, arrival=float(i), max_tokens=9))  # 2 blocks each
    h.step()
    assert h.scheduler.kv_cache_manager.get_num_free_blocks() == 0
    h.add(req("hi", 12, priority=0, arrival=9.0, max_tokens=2))  # needs 3 blocks
    h.step()
    so = h.steps[-1]
    assert [n.req_id for n in so.scheduled_new_reqs] == ["hi"]
    assert so.num_scheduled_tokens["hi"] == 12
    # The latest-arriving low ones go, and their decodes of this step are taken back.
    assert so.preempted_req_ids == {"lo3", "lo2"}
    assert so.num_scheduled_tokens == {"lo0": 1, "lo1": 1, "hi": 12}
    h.run()
    for i in range(4):
        assert h.results[f"lo{i}"].token_ids == expected_outputs(f"lo{i}", 7, 9)
    assert h.results["hi"].token_ids == expected_outputs("hi", 12, 2)
    h.assert_no_leak()


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_priority_in_a_tiny_pool_all_finish(caching: bool) -> None:
    config = priority_config(
        max_model_len=24, block_size=2, max_num_batched_tokens=10, max_num_seqs=4, enable_prefix_caching=caching
    )
    h = Harness(config, num_blocks=13)
    specs = {f"r{i}": (2 + (3 * i) % 7, 3 + (5 * i) % 8, (i * 5) % 3) for i in range(9)}
    for i, (rid, (n, m, prio)) in enumerate(specs.items()):
        h.add(req(rid, n, priority=prio, arrival=float(i), max_tokens=m))
        if i % 3 == 2:
            h.step()  # later arrivals find the engine busy
    h.run()
    assert h.scheduler.num_preemptions > 0
    for rid, (n, m, _) in specs.items():
        assert h.results[rid].token_ids == expected_outputs(rid, n, m)
    h.assert_no_leak()


# ------------------------------------------------------------------ pipelined (async) scheduling

EOS = 2


def stopping_token(req_id: str, position: int) -> int:
    """A model that sometimes says EOS, at a request-dependent position."""
    return EOS if (position + 3 * len(req_id)) % 9 == 0 else default_token(req_id, position)


def run_both(config, num_blocks: int, specs, token_fn=default_token) -> tuple[Harness, Harness]:
    harnesses = []
    for pipelined in (False, True):
        h = Harness(config, num_blocks, token_fn)
        for rid, (n, m) in specs.items():
            h.add(req(rid, n, eos=EOS, max_tokens=m))
        h.run_pipelined() if pipelined else h.run()
        h.assert_no_leak()
        harnesses.append(h)
    return harnesses[0], harnesses[1]


@pytest.mark.parametrize(
    "overrides, num_blocks",
    [
        (dict(max_num_batched_tokens=16), 200),  # chunked prefill, no memory pressure
        (dict(max_model_len=24, block_size=2, max_num_batched_tokens=10, max_num_seqs=6), 13),  # preemption
        (dict(max_num_batched_tokens=12, enable_prefix_caching=True), 60),  # shared prompts, cache hits
    ],
    ids=["chunked", "preempting", "prefix-cache"],
)
def test_pipelined_scheduling_gives_the_same_outputs_as_sync(overrides, num_blocks: int) -> None:
    specs = {f"r{i}": (2 + (5 * i) % 19, 2 + (3 * i) % 11) for i in range(12)}
    if "max_model_len" in overrides:
        specs = {rid: (min(n, 9), m) for rid, (n, m) in specs.items()}
    sync, pipelined = run_both(make_config(**overrides), num_blocks, specs, stopping_token)
    for rid in specs:
        assert pipelined.results[rid].token_ids == sync.results[rid].token_ids
        assert pipelined.results[rid].finish_reason == sync.results[rid].finish_reason
    assert {r.finish_reason for r in sync.results.values()} == {FinishReason.STOP, FinishReason.LENGTH}
    if "max_model_len" in overrides:
        assert pipelined.scheduler.num_preemptions > 0


def test_pipelined_steps_overlap_and_never_schedule_past_max_tokens() -> None:
    h = Harness(make_config(), num_blocks=40)
    h.add(req("one", 5, max_tokens=1))
    h.add(req("four", 5, max_tokens=4))
    h.run_pipelined()
    # "four": prefill, then 3 decodes each scheduled while the previous token
    # was still in flight; "one" never again after its prefill.
    assert [s.num_scheduled_tokens.get("one") for s in h.steps] == [5] + [None] * (len(h.steps) - 1)
    assert [s.num_scheduled_tokens["four"] for s in h.steps if "four" in s.num_scheduled_tokens] == [5, 1, 1, 1]
    # Step 1 was scheduled before step 0's tokens were fed back: it decodes the in-flight token.
    assert h.steps[1].num_scheduled_tokens == {"four": 1}
    assert h.steps[1].scheduled_cached_reqs.num_computed_tokens == [5]
    assert h.results["four"].token_ids == expected_outputs("four", 5, 4)
    assert h.results["one"].token_ids == expected_outputs("one", 5, 1)


def test_tokens_of_a_batch_scheduled_before_a_preemption_are_dropped() -> None:
    """Preempted while its batch is in flight and resumed before that batch's
    output arrives: the stale token must not be appended."""
    h = Harness(make_config(enable_prefix_caching=True), num_blocks=40)
    h.admits_after_preemption = True
    h.runner.strict_resume = False
    h.add(req("a", 6, max_tokens=3))
    so1 = h.schedule()
    out1 = h.runner.execute(so1)
    assert h.scheduler.reset_prefix_cache(reset_running_requests=True)
    so2 = h.schedule()
    assert "a" in so2.preempted_req_ids and [n.req_id for n in so2.scheduled_new_reqs] == ["a"]
    out2 = h.runner.execute(so2)
    assert h.update(so1, out1) == []  # stale
    assert h.scheduler.requests["a"].num_output_tokens == 0
    h.update(so2, out2)
    h.run_pipelined()
    assert h.results["a"].token_ids == expected_outputs("a", 6, 3)
    h.assert_no_leak()


def test_abort_while_in_flight_drops_the_tokens_and_frees_at_once() -> None:
    h = Harness(make_config(), num_blocks=40)
    h.add(req("a", 6, max_tokens=8))
    h.add(req("b", 6, max_tokens=8))
    so1 = h.schedule()
    out1 = h.runner.execute(so1)
    so2 = h.schedule()
    out2 = h.runner.execute(so2)
    h.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert h.scheduler.kv_cache_manager.get_block_ids("a") == [[]]
    assert [o.request_id for o in h.update(so1, out1)] == ["b"]
    assert [o.request_id for o in h.update(so2, out2)] == ["b"]
    h.run_pipelined()
    assert h.results["b"].token_ids == expected_outputs("b", 6, 8)
    assert h.results["a"].token_ids == []
    h.assert_no_leak()
