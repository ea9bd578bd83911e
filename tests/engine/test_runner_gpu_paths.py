"""The GPU model runner's logic, run on the CPU.

``GpuPathsRunner`` (tests/support/gpu_paths.py) takes what a GPU always does apart
from the device work itself: decode-only steps padded to a CUDA-graph batch
size and run over the static buffers (eagerly: capture and replay are the
GPU-only part), and sampled tokens that reach the persistent batch as
placeholders, fed to the next step from the sampled-ids tensor, and
materialised only when the engine reads the output. Whole engine runs with
and without it must give exactly the same greedy tokens as transformers.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import torch

from core.client import InprocClient
from core.config import EngineArgs
from core.sched.output import ModelRunnerOutput
from core.worker.async_output import (
    AsyncModelRunnerOutput,
    DeferredTokens,
    SampledTokens,
)
from core.worker.cuda_graphs import DecodeGraphs, decode_batch_sizes
from core.worker.executor import OutputFuture
from core.worker.gpu_memory import kv_cache_budget
from core.worker.input_buffers import InputBuffers
from tests.support.engines import BASE, CHUNKED, generate, greedy, tokens
from tests.support.gpu_paths import take_gpu_paths


@pytest.fixture
def spy_gpu_paths(monkeypatch):
    """Take the GPU's paths and record that padding and deferred inputs really happened."""
    take_gpu_paths(monkeypatch)
    seen = {"padded": [], "deferred_inputs": 0}
    fill = InputBuffers.fill_decode_padding
    take = DeferredTokens.take_inputs

    def fill_spy(self, num_reqs, padded):
        seen["padded"].append((num_reqs, padded))
        return fill(self, num_reqs, padded)

    def take_spy(self, *args):
        groups = take(self, *args)
        seen["deferred_inputs"] += sum(len(dst) for _, dst, _ in groups)
        return groups

    monkeypatch.setattr(InputBuffers, "fill_decode_padding", fill_spy)
    monkeypatch.setattr(DeferredTokens, "take_inputs", take_spy)
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_padded_decodes_and_deferred_tokens_give_the_exact_greedy_tokens(
    llama, reference, spy_gpu_paths, async_scheduling  # noqa: F811
):
    _, path = llama
    prompts, expected = reference
    # Stops taken from the reference end two requests early, so decode
    # batches shrink to sizes that need padding (5 -> 8, 3 -> 4).
    stops = [expected[1][3], expected[3][6]]
    (results,), sched = generate(
        path, prompts, greedy(stop_token_ids=stops), async_scheduling=async_scheduling, **CHUNKED
    )
    for got, want in zip(tokens(results), expected):
        assert got == want[: len(got)] and got
    assert {r.finish_reason for r in results} == {"stop", "length"}
    assert any(padded > n for n, padded in spy_gpu_paths["padded"])
    # Every decode after the first token reads its input from the sampled-ids tensor.
    assert spy_gpu_paths["deferred_inputs"] >= sum(len(t) - 1 for t in tokens(results))
    assert not sched.has_unfinished_requests()


def test_deferred_tokens_survive_preemption(llama, reference, spy_gpu_paths):  # noqa: F811
    """A preempted request comes back with real ids; its stale placeholder must not be fed."""
    _, path = llama
    prompts, expected = reference
    tiny = dict(max_model_len=80, num_gpu_blocks_override=28, max_num_batched_tokens=48)
    (results,), sched = generate(path, prompts, async_scheduling=True, **tiny)
    assert sched.num_preemptions > 0
    assert tokens(results) == expected
    assert spy_gpu_paths["deferred_inputs"] > 0


def test_decode_batch_sizes_and_padding_choice():
    assert decode_batch_sizes(64, 2048) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_batch_sizes(20, 2048) == [1, 2, 4, 8, 16, 20]
    assert decode_batch_sizes(256, 6) == [1, 2, 4, 6]  # a decode batch never exceeds the token budget
    assert decode_batch_sizes(1, 8) == [1]
    graphs = DecodeGraphs(decode_batch_sizes(20, 2048))
    assert [graphs.padded_size(n) for n in (1, 3, 5, 8, 9, 17, 20)] == [1, 4, 8, 8, 16, 20, 20]
    assert graphs.padded_size(21) is None
    assert not graphs.captured
    assert graphs.run(4, lambda: torch.ones(4)).sum() == 4  # not captured: runs eagerly


def test_fill_decode_padding_makes_harmless_fillers():
    buffers = InputBuffers(16, 8, 5, torch.device("cpu"))
    buffers.block_tables.np[:] = 7
    buffers.query_start_loc.np[:4] = [0, 1, 2, 3]
    buffers.fill_decode_padding(3, 8)
    assert buffers.slot_mapping.np[3:8].tolist() == [-1] * 5
    assert buffers.seq_lens.np[3:8].tolist() == [1] * 5
    assert buffers.query_start_loc.np[:9].tolist() == list(range(9))
    assert buffers.block_tables.np[3:8, 0].tolist() == [0] * 5 and buffers.block_tables.np[:3, 0].tolist() == [7] * 3
    assert buffers.input_ids.device is buffers.input_ids.host  # CPU: one tensor, no copies


def test_deferred_tokens_feed_only_the_position_being_computed():
    step1 = SampledTokens(torch.tensor([11, 12, 13]), None)
    step2 = SampledTokens(torch.tensor([21]), None)
    deferred = DeferredTokens()
    deferred.add("a", step1, 0, position=10)
    deferred.add("b", step1, 2, position=4)
    deferred.add("c", step2, 0, position=7)
    # a decodes (its position 10 is input row 0); b is mid-chunk short of position 4;
    # c decodes at input row 5 after a 4-token chunk of another request.
    groups = deferred.take_inputs(
        ["a", "b", "x", "c"], computed=np.array([10, 0, 0, 7]), counts=np.array([1, 3, 1, 1]),
        starts=np.array([0, 1, 4, 5]),
    )
    assert [(t is step1, dst, src) for t, dst, src in groups] == [(True, [0], [0]), (False, [5], [0])]
    assert deferred  # b is still waiting
    assert deferred.take_inputs(["b"], np.array([3]), np.array([2]), np.array([0]))[0][1:] == ([1], [2])
    assert not deferred


def test_output_future_materialises_on_result_and_passes_errors():
    inner: Future = Future()
    future = OutputFuture(inner)
    assert not future.done()
    inner.set_result(AsyncModelRunnerOutput(["a", "b", "c"], [0, 2], SampledTokens(torch.tensor([5, 9]), None)))
    assert future.done()
    out = future.result()
    assert isinstance(out, ModelRunnerOutput)
    assert out.sampled_token_ids == [[5], [], [9]] and out.req_id_to_index == {"a": 0, "b": 1, "c": 2}
    failing: Future = Future()
    failed = OutputFuture(failing)
    failing.set_exception(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        failed.result()


def test_kv_cache_budget_follows_vllm_accounting():
    gib = 1 << 30
    # 80 GiB card, 20 GiB in use (weights, context), a 3 GiB peak step, 90%:
    assert kv_cache_budget(80 * gib, 60 * gib, 3 * gib, 0.9) == int(72 * gib) - 20 * gib - 3 * gib
    assert kv_cache_budget(80 * gib, 10 * gib, 3 * gib, 0.5) < 0
    with pytest.raises(ValueError):
        kv_cache_budget(80 * gib, 60 * gib, 0, 1.5)


def test_profile_run_writes_nothing_into_the_kv_cache(llama):  # noqa: F811
    """The profiling step (run on a GPU before the cache exists) on the CPU:
    the largest step's shapes go through the model, sampler included, and
    every slot is -1."""
    _, path = llama
    client = InprocClient(EngineArgs(model=path, **BASE, max_num_batched_tokens=64).resolve())
    try:
        runner = client.engine_core.model_executor.runner
        runner.profile_run()
        assert all(k.count_nonzero() == 0 and v.count_nonzero() == 0 for k, v in runner.kv_caches)
    finally:
        client.shutdown()
