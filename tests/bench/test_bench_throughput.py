"""bench throughput: both systems run on the same prompts and produce the same number of tokens."""

from __future__ import annotations

import json
from pathlib import Path

from bench.__main__ import main as bench_main


def test_throughput_runs_ours_and_transformers(stories_dir: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "throughput.json"
    rc = bench_main([
        "throughput", "--model", stories_dir, "--num-prompts", "3", "--input-len", "8",
        "--output-len", "4", "--repeats", "2", "--output-json", str(out),
    ])
    assert rc == 0
    assert "ratio ours / transformers" in capsys.readouterr().out
    summary = json.loads(out.read_text())
    ours, hf = summary["runs"]
    assert ours["output_tokens"] == hf["output_tokens"] == 3 * 4  # EOS ignored on both sides
    assert ours["input_tokens"] == hf["input_tokens"] == 3 * 8
    assert len(ours["all_elapsed_s"]) == len(hf["all_elapsed_s"]) == 2
    # Greedy float32 on a trained model: both systems write the same tokens.
    assert summary["identical_outputs"] == 3 and summary["ratio_output_tokens_per_s"] > 0
