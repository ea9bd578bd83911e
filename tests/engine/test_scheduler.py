"""The scheduler step by step against the bookkeeping runner of tests/support/scheduler_harness.py."""

from __future__ import annotations

import pytest

from core.config import EngineConfig
from core.protocol import EngineCoreEventType, FinishReason
from core.request import RequestStatus
from core.sched.scheduler import Scheduler
from tests.support.scheduler_harness import (
    Harness,
    Result,
    TokenFn,
    expected_outputs,
    make_config,
    make_request,
)


def test_budget_and_seq_cap_hold_every_step_and_all_requests_finish() -> None:
    config = make_config(max_num_batched_tokens=24, max_num_seqs=3)
    h = Harness(config, num_blocks=200)
    specs = {f"r{i}": (3 + (11 * i) % 40, 1 + (5 * i) % 9) for i in range(10)}
    for req_id, (prompt, max_tokens) in specs.items():
        h.add(make_request(req_id, prompt, max_tokens=max_tokens))
    h.run()
    for req_id, (prompt, max_tokens) in specs.items():
        assert h.results[req_id].token_ids == expected_outputs(req_id, prompt, max_tokens)
        assert h.results[req_id].finish_reason == FinishReason.LENGTH
    assert max(len(s.num_scheduled_tokens) for s in h.steps) == 3
    assert max(s.total_num_scheduled_tokens for s in h.steps) == 24
    assert not h.scheduler.has_unfinished_requests()
    h.assert_no_leak()


def test_chunked_prefill_splits_a_long_prompt_and_mixes_it_with_decodes() -> None:
    h = Harness(make_config(max_num_batched_tokens=16), num_blocks=40)
    h.add(make_request("short", 5, max_tokens=10))
    h.step()  # short: whole prompt, first token
    h.add(make_request("long", 40, max_tokens=2))
    chunks = []
    while not h.results["long"].token_ids:
        h.step()
        so = h.steps[-1]
        assert so.num_scheduled_tokens["short"] == 1  # a decode every step
        chunks.append(so.num_scheduled_tokens["long"])
    assert chunks == [15, 15, 10]
    first, second = h.steps[1], h.steps[2]
    assert [n.req_id for n in first.scheduled_new_reqs] == ["long"]
    assert first.scheduled_new_reqs[0].num_computed_tokens == 0
    assert second.scheduled_cached_reqs.req_ids == ["short", "long"]
    assert second.scheduled_cached_reqs.num_computed_tokens == [6, 15]
    h.run()
    assert h.results["long"].token_ids == expected_outputs("long", 40, 2)
    assert h.results["short"].token_ids == expected_outputs("short", 5, 10)
    h.assert_no_leak()


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole() -> None:
    config = make_config(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    h = Harness(config, num_blocks=40)
    h.add(make_request("a", 4, max_tokens=3))
    h.step()
    h.add(make_request("b", 32, max_tokens=1))  # 32 + a's decode > 32
    h.step()
    assert "b" not in h.steps[-1].num_scheduled_tokens
    h.run()
    assert [s.num_scheduled_tokens.get("b") for s in h.steps if "b" in s.num_scheduled_tokens] == [32]
    assert h.results["b"].token_ids == expected_outputs("b", 32, 1)
    h.assert_no_leak()


def test_max_num_seqs_keeps_extra_requests_waiting() -> None:
    h = Harness(make_config(max_num_seqs=2), num_blocks=40)
    for i in range(3):
        h.add(make_request(f"r{i}", 4, max_tokens=2))
    h.step()
    assert set(h.steps[-1].num_scheduled_tokens) == {"r0", "r1"}
    assert h.scheduler.get_request_counts() == (2, 1)
    h.step()  # r0 and r1 finish this step
    h.step()
    assert [n.req_id for n in h.steps[-1].scheduled_new_reqs] == ["r2"]
    assert h.steps[-1].finished_req_ids == {"r0", "r1"}
    h.run()
    h.assert_no_leak()


# ------------------------------------------------------------------ preemption


def test_running_request_preempts_the_last_admitted_one() -> None:
    # block_size 4, 4 usable blocks; both prompts fill 2 blocks each.
    h = Harness(make_config(max_model_len=16, max_num_seqs=2), num_blocks=5)
    h.add(make_request("a", 8, max_tokens=2))
    h.add(make_request("b", 8, max_tokens=3))
    h.add(make_request("c", 3, max_tokens=1))  # kept waiting by max_num_seqs
    h.step()
    assert h.scheduler.kv_cache_manager.get_num_free_blocks() == 0
    h.step()  # a needs a third block: b (last admitted) is evicted
    so = h.steps[-1]
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in h.scheduler.waiting] == ["b", "c"]  # back in front
    assert h.scheduler.waiting.peek_request().status == RequestStatus.PREEMPTED
    h.run()
    resumed = [n for s in h.steps[2:] for n in s.scheduled_new_reqs if n.req_id == "b"]
    assert len(resumed) == 1
    assert resumed[0].token_ids == make_request("b", 8).prompt_token_ids + expected_outputs("b", 8, 1)
    assert resumed[0].num_computed_tokens == 0
    assert h.results["b"].token_ids == expected_outputs("b", 8, 3)
    assert h.results["b"].events.count(EngineCoreEventType.PREEMPTED) == 1
    assert h.results["b"].events.count(EngineCoreEventType.SCHEDULED) == 2
    assert h.scheduler.make_stats().num_preemptions == 1
    h.assert_no_leak()


def test_a_request_that_cannot_grow_preempts_itself() -> None:
    h = Harness(make_config(max_model_len=16), num_blocks=5)
    h.add(make_request("a", 7, max_tokens=2))  # its decode still fits in block 2
    h.add(make_request("b", 8, max_tokens=2))  # its decode needs a third block
    h.step()
    h.step()
    so = h.steps[-1]
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    assert h.results["a"].finish_reason == FinishReason.LENGTH
    h.run()
    assert h.results["b"].token_ids == expected_outputs("b", 8, 2)
    h.assert_no_leak()


def test_many_requests_in_a_tiny_pool_all_finish_through_preemption() -> None:
    config = make_config(max_model_len=24, block_size=2, max_num_batched_tokens=10, max_num_seqs=6)
    h = Harness(config, num_blocks=13)  # 12 usable blocks = 24 tokens in all
    specs = {f"r{i}": (2 + (3 * i) % 7, 3 + (5 * i) % 8) for i in range(8)}
    for req_id, (prompt, max_tokens) in specs.items():
        h.add(make_request(req_id, prompt, max_tokens=max_tokens))
    h.run()
    assert sum(len(s.preempted_req_ids) for s in h.steps) > 0
    for req_id, (prompt, max_tokens) in specs.items():
        assert h.results[req_id].token_ids == expected_outputs(req_id, prompt, max_tokens)
    assert h.scheduler.make_stats().num_preemptions == sum(len(s.preempted_req_ids) for s in h.steps)
    h.assert_no_leak()


def test_pool_too_small_for_one_full_length_request_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot hold one request"):
        Scheduler(make_config(max_model_len=17, block_size=4), num_gpu_blocks=5)


# ------------------------------------------------------------------ stop conditions


def scripted(tokens: list[int], prompt_len: int) -> TokenFn:
    """A model that emits ``tokens`` in order after a prompt of ``prompt_len``."""
    return lambda _req_id, position: tokens[position - prompt_len]


def finish(num_prompt: int, script: list[int], config: EngineConfig | None = None, **kwargs) -> Result:
    h = Harness(config or make_config(), num_blocks=40, token_fn=scripted(script, num_prompt))
    h.add(make_request("r", num_prompt, **kwargs))
    h.run()
    h.assert_no_leak()
    return h.results["r"]


EOS = 2
SCRIPT = [10, 11, EOS, 12, 13, 14, 15, 16, 17, 18, 19, 20]


def test_max_tokens_finishes_with_length() -> None:
    result = finish(4, SCRIPT, max_tokens=2, eos=EOS)
    assert result.token_ids == [10, 11]
    assert result.finish_reason == FinishReason.LENGTH


def test_eos_finishes_with_stop_and_keeps_the_eos_token() -> None:
    result = finish(4, SCRIPT, max_tokens=10, eos=EOS)
    assert result.token_ids == [10, 11, EOS]
    assert (result.finish_reason, result.stop_reason) == (FinishReason.STOP, None)


def test_ignore_eos_runs_to_max_tokens() -> None:
    result = finish(4, SCRIPT, max_tokens=6, eos=EOS, ignore_eos=True)
    assert result.token_ids == SCRIPT[:6]
    assert result.finish_reason == FinishReason.LENGTH


def test_eos_before_min_tokens_is_ignored() -> None:
    result = finish(4, [EOS, EOS, 5, EOS, 6], max_tokens=5, eos=EOS, min_tokens=3)
    assert result.token_ids == [EOS, EOS, 5, EOS]
    assert result.finish_reason == FinishReason.STOP


def test_stop_token_ids_finish_with_that_id_as_stop_reason() -> None:
    result = finish(4, SCRIPT, max_tokens=10, stop_token_ids=[13, 99], ignore_eos=True)
    assert result.token_ids == [10, 11, EOS, 12, 13]
    assert (result.finish_reason, result.stop_reason) == (FinishReason.STOP, 13)


def test_stop_token_before_min_tokens_is_ignored() -> None:
    result = finish(4, [13, 10, 13, 11], max_tokens=4, stop_token_ids=[13], min_tokens=2)
    assert result.token_ids == [13, 10, 13]
    assert (result.finish_reason, result.stop_reason) == (FinishReason.STOP, 13)


def test_max_model_len_caps_prompt_plus_output() -> None:
    result = finish(10, SCRIPT, config=make_config(max_model_len=14), max_tokens=12)
    assert result.token_ids == SCRIPT[:4]
    assert result.finish_reason == FinishReason.LENGTH


# ------------------------------------------------------------------ aborts and outputs


def test_abort_frees_blocks_at_once_and_is_idempotent() -> None:
    h = Harness(make_config(max_num_seqs=1), num_blocks=40)
    h.add(make_request("run", 9, max_tokens=20))
    h.add(make_request("wait", 4, max_tokens=20))
    h.step()
    assert h.scheduler.get_request_counts() == (1, 1)
    assert h.scheduler.kv_cache_manager.get_block_ids("run") == [[1, 2, 3]]
    h.scheduler.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    h.scheduler.finish_requests(["run", "never-seen"], RequestStatus.FINISHED_ABORTED)
    h.scheduler.finish_requests("wait", RequestStatus.FINISHED_ABORTED)
    h.assert_no_leak()
    assert h.scheduler.get_request_counts() == (0, 0)
    assert not h.scheduler.has_unfinished_requests()
    assert h.scheduler.has_requests()  # the runner still has to drop "run"
    h.step()
    assert h.steps[-1].finished_req_ids == {"run", "wait"}
    assert h.steps[-1].total_num_scheduled_tokens == 0
    assert not h.scheduler.has_requests()


def test_request_aborted_between_schedule_and_update_gets_nothing() -> None:
    h = Harness(make_config(), num_blocks=40)
    h.add(make_request("a", 4, max_tokens=5))
    h.add(make_request("b", 4, max_tokens=5))
    so = h.scheduler.schedule()
    runner_output = h.runner.execute(so)
    h.scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    outputs = h.scheduler.update_from_output(so, runner_output)
    assert [o.request_id for o in outputs[0].outputs] == ["b"]
    assert h.scheduler.kv_cache_manager.get_num_free_blocks() == 39 - 1  # only b's block is held
    assert h.scheduler.get_num_unfinished_requests() == 1
    assert h.scheduler.unfinished_request_ids() == ["b"]


def test_abort_all_with_none() -> None:
    h = Harness(make_config(), num_blocks=40)
    for i in range(3):
        h.add(make_request(f"r{i}", 5, max_tokens=5))
    h.step()
    h.add(make_request("late", 5))
    h.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert not h.scheduler.has_unfinished_requests()
    h.assert_no_leak()
    with pytest.raises(ValueError):
        h.scheduler.finish_requests(["r0"], RequestStatus.RUNNING)


def test_partial_prefill_yields_no_output_and_outputs_go_to_their_client() -> None:
    h = Harness(make_config(max_num_batched_tokens=8), num_blocks=40)
    h.add(make_request("long", 12, client_index=1, max_tokens=1))
    h.add(make_request("x", 1, client_index=0, max_tokens=1))
    so = h.scheduler.schedule()
    outputs = h.scheduler.update_from_output(so, h.runner.execute(so))
    assert so.num_scheduled_tokens == {"long": 8}
    assert list(outputs) == [0] and outputs[0].outputs == []  # stats only
    assert outputs[0].scheduler_stats.num_running_reqs == 1
    assert outputs[0].scheduler_stats.num_waiting_reqs == 1
    flat = h.step()
    assert {o.request_id for o in flat} == {"long", "x"}
    first = next(o for o in flat if o.request_id == "long")
    assert [e.type for e in first.events] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    assert first.num_cached_tokens == 0
    h.assert_no_leak()


def test_duplicate_request_id_is_rejected() -> None:
    scheduler = Scheduler(make_config(), 40)
    scheduler.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="already"):
        scheduler.add_request(make_request("a", 3))


def test_stats_report_usage_and_counts() -> None:
    h = Harness(make_config(), num_blocks=41)
    h.add(make_request("a", 8, max_tokens=3))
    h.step()
    stats = h.scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 0)
    assert stats.kv_cache_usage == pytest.approx(2 / 40)  # 8 prompt tokens in blocks of 4
    h.step()  # the first sampled token's slot opens a third block
    assert h.scheduler.make_stats().kv_cache_usage == pytest.approx(3 / 40)


def test_request_status_helpers() -> None:
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_LENGTH_CAPPED) == FinishReason.LENGTH
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_STOPPED) == FinishReason.STOP
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_ABORTED) == FinishReason.ABORT
    assert RequestStatus.get_finished_reason(RequestStatus.RUNNING) is None
