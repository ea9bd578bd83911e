"""bench/gpu.py: refuses to run without a GPU, and its measuring code
runs end to end on the CPU with tiny shapes (the figures are meaningless
there; the point is that the benchmark itself works before a GPU is lent)."""

from __future__ import annotations

import pytest
import torch

from bench import gpu as gpu_bench
from bench.__main__ import main as bench_main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_without_a_gpu_it_says_so_and_measures_nothing(capsys):
    assert bench_main(["gpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_measuring_code_runs_on_cpu_with_tiny_shapes():
    args = gpu_bench.BenchArgs(
        shape="tiny", dtype="float32", device="cpu", batch_sizes=[1, 3], prompt_len=16, prefill_requests=4,
        decode_prompt_len=8, decode_steps=4, profile_steps=2, max_num_batched_tokens=64, max_model_len=128,
        ipc=False, repeats=1,
    )
    results = gpu_bench.measure(args)
    assert set(results["modes"]) == {"cuda_graphs", "eager"}
    for figures in results["modes"].values():
        assert figures["prefill_tokens_per_s"] > 0
        for batch, d in figures["decode"].items():
            # Every measured step decoded the whole batch: batch * steps tokens.
            assert d["tokens_per_s"] * d["step_ms"] / 1e3 == pytest.approx(batch)
            assert d["schedule_ms"] > 0 and d["enqueue_ms"] > 0 and d["update_ms"] > 0
    assert "prefill" in gpu_bench.format_table(results)


def test_spawned_engine_decodes_whole_batches_and_times_them(tmp_path):
    args = gpu_bench.BenchArgs(
        shape="tiny", dtype="float32", device="cpu", batch_sizes=[2, 1], decode_prompt_len=8, decode_steps=3,
        max_num_batched_tokens=64, max_model_len=128,
    )
    model_dir = gpu_bench.write_model_dir(tmp_path / "tiny", "tiny", 128, "float32")
    timings = gpu_bench.measure_mp_decode(model_dir, args, enforce_eager=True, vocab=512)
    assert set(timings) == {1, 2}
    for batch, timing in timings.items():
        assert timing["tokens_per_step"] == batch  # each timed step decoded every request of the batch
        assert timing["step_ms"] > 0
