"""The whole engine (real model runner, real KV cache tensors) with prefix
caching, preemption, priority and async scheduling, greedy in float32:
every mode must produce exactly the tokens of the plainest run and of
transformers itself."""

from __future__ import annotations

import threading

import pytest

from app.llm import LLM
from core.client import InprocClient
from core.config import EngineArgs
from core.protocol import EngineCoreRequest, FinishReason, SamplingParams
from tests.support.engines import BASE, CHUNKED, MAX_NEW, generate, greedy, tokens


def test_prefix_caching_on_and_off_give_identical_greedy_outputs(llama, reference) -> None:
    _, path = llama
    prompts, expected = reference
    (off,), off_sched = generate(path, prompts, enable_prefix_caching=False, **CHUNKED)
    (first, second), on_sched = generate(path, prompts, passes=2, enable_prefix_caching=True, **CHUNKED)
    assert tokens(off) == tokens(first) == tokens(second) == expected
    assert sum(r.num_cached_tokens for r in off) == 0 and off_sched.make_stats().prefix_cache_hits == 0
    # First pass: later prompts reuse blocks that earlier ones computed.
    assert sum(r.num_cached_tokens for r in first) > 0
    # Second pass: every prompt is cached up to the rule that one token is computed.
    assert [r.num_cached_tokens for r in second] == [48, 52, 28, 24, 28, 44]
    stats = on_sched.make_stats()
    assert stats.prefix_cache_hits >= sum(r.num_cached_tokens for r in first + second)
    assert stats.prefix_cache_queries >= sum(len(p) for p in prompts) * 2


def test_cache_salt_keeps_identical_prompts_apart(llama, reference) -> None:
    _, path = llama
    prompts, expected = reference
    llm = LLM(path, **BASE, **CHUNKED)
    try:
        salted = llm.generate(prompts[:1], greedy(), cache_salt="tenant-a")
        other = llm.generate(prompts[:1], greedy(), cache_salt="tenant-b")
        same = llm.generate(prompts[:1], greedy(), cache_salt="tenant-a")
        plain = llm.generate(prompts[:1], greedy())
        assert [r.num_cached_tokens for r in salted + other + same + plain] == [0, 0, 48, 0]
        assert tokens(salted + other + same + plain) == [expected[0]] * 4
        assert llm.reset_prefix_cache()
        assert llm.generate(prompts[:1], greedy(), cache_salt="tenant-a")[0].num_cached_tokens == 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tiny_kv_cache_preempts_yet_every_output_equals_the_unpreempted_run(
    llama, reference, async_scheduling: bool
) -> None:
    _, path = llama
    prompts, expected = reference
    tiny = dict(max_model_len=80, num_gpu_blocks_override=28, max_num_batched_tokens=48)
    (roomy,), roomy_sched = generate(path, prompts, **tiny | {"num_gpu_blocks_override": None})
    (cramped,), sched = generate(path, prompts, async_scheduling=async_scheduling, **tiny)
    assert roomy_sched.num_preemptions == 0
    assert sched.num_preemptions > 0
    assert tokens(cramped) == tokens(roomy) == expected


def test_priority_policy_under_preemption_keeps_outputs_exact(llama, reference) -> None:
    _, path = llama
    prompts, expected = reference
    llm = LLM(
        path, **BASE | dict(max_model_len=80), num_gpu_blocks_override=28, max_num_batched_tokens=48,
        scheduling_policy="priority",
    )
    try:
        results = llm.generate(prompts, greedy(), priority=[3, 0, 2, 1, 0, 5])
        assert tokens(results) == expected
        assert llm.engine.engine_core.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_async_scheduling_gives_the_same_outputs_as_sync(llama, reference, caching: bool) -> None:
    _, path = llama
    prompts, expected = reference
    # Stop tokens taken from the sync outputs end some requests early, at
    # different steps, so async mode must drop the decodes it scheduled past them.
    stops = [expected[1][3], expected[3][6]]
    params = greedy(stop_token_ids=stops)
    (sync,), _ = generate(path, prompts, params, enable_prefix_caching=caching, **CHUNKED)
    (asynch, again), sched = generate(
        path, prompts, params, passes=2, enable_prefix_caching=caching, async_scheduling=True, **CHUNKED
    )
    assert tokens(sync) == tokens(asynch) == tokens(again)
    assert [r.finish_reason for r in sync] == [r.finish_reason for r in asynch]
    assert {r.finish_reason for r in sync} == {"stop", "length"}
    for got, want in zip(tokens(sync), expected):
        assert got == want[: len(got)]
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.get_num_free_blocks() == sched.kv_cache_manager.block_pool.num_usable_blocks


def test_async_engine_aborts_with_a_batch_in_flight_and_drains(llama, reference) -> None:
    _, path = llama
    prompts, expected = reference
    client = InprocClient(EngineArgs(model=path, async_scheduling=True, **BASE, **CHUNKED).resolve())
    engine = client.engine_core
    try:
        assert engine.batch_queue_size == 2
        for i, prompt in enumerate(prompts):
            client.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=greedy()))
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        finished: dict[str, FinishReason] = {}
        aborted = False
        while len(finished) < len(prompts):
            for out in client.get_output().outputs:
                got[out.request_id] += out.new_token_ids
                if out.finished:
                    finished[out.request_id] = out.finish_reason
            if not aborted and len(got["r2"]) >= 3:
                assert engine.has_batches_in_flight()
                # The batch in flight runs on the executor's own thread.
                assert any(t.name.startswith("ModelRunner") for t in threading.enumerate())
                client.abort_requests(["r2"])
                finished["r2"] = FinishReason.ABORT
                aborted = True
        while engine.has_batches_in_flight():
            assert client.get_output().outputs == []  # only the aborted request's leftovers
        assert aborted and len(got["r2"]) < MAX_NEW
        assert got["r2"] == expected[2][: len(got["r2"])]
        for i in (0, 1, 3, 4, 5):
            assert got[f"r{i}"] == expected[i]
        pool = engine.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_usable_blocks
    finally:
        client.shutdown()
    assert client.engine_core.model_executor._worker is None


def test_cli_flags_reach_the_engine_config() -> None:
    from app.cli import build_engine_args, parse_args

    defaults = build_engine_args(parse_args(["--model", "/m"]))
    assert (defaults.enable_prefix_caching, defaults.async_scheduling, defaults.scheduling_policy) == (
        True, False, "fcfs"
    )
    config = build_engine_args(
        parse_args(
            ["--model", "/m", "--async-scheduling", "--scheduling-policy", "priority", "--no-enable-prefix-caching"]
        )
    )
    assert (config.enable_prefix_caching, config.async_scheduling, config.scheduling_policy) == (
        False, True, "priority"
    )


def test_seeded_sampling_is_unchanged_by_preemption(llama, reference) -> None:
    """A preempted request keeps its generator: after recompute it continues the
    random stream instead of replaying it from the seed."""
    _, path = llama
    prompts, greedy_tokens = reference
    tiny = dict(max_model_len=80, num_gpu_blocks_override=28, max_num_batched_tokens=48)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    (roomy,), roomy_sched = generate(path, prompts, params, **tiny | {"num_gpu_blocks_override": None})
    (cramped,), sched = generate(path, prompts, params, **tiny)
    assert roomy_sched.num_preemptions == 0 and sched.num_preemptions > 0
    assert tokens(cramped) == tokens(roomy)
    assert all(s != g for s, g in zip(tokens(roomy), greedy_tokens))  # really sampled
