"""bench serve and bench sweep against real `python -m app` servers on the embedded model."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app.launcher import REPO
from bench.__main__ import main as bench_main
from tests.support.metrics import parse_metrics

pytestmark = pytest.mark.slow

VLLM_KEYS = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency",
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
    "max_output_tokens_per_s", "max_concurrent_requests",
] + [
    f"{stat}_{metric}_ms"
    for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p50", "p90", "p99")
]
NUM_PROMPTS = 6
INPUT_LEN = 24
OUTPUT_LEN = 6


def test_bench_serve_writes_every_key_without_failures(server_factory, random_model_dir: str, tmp_path: Path) -> None:
    server = server_factory(["--model", random_model_dir, "--served-model-name", "ringllm-default"])
    proc = subprocess.run(
        [
            sys.executable, "-m", "bench", "serve", "--base-url", server.base_url,
            "--model", "ringllm-default", "--tokenizer", random_model_dir,
            "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS),
            "--max-concurrency", "3", "--request-rate", "50", "--num-warmups", "1", "--ignore-eos",
            "--goodput", "ttft:60000", "tpot:60000", "--save-result", "--plot",
            "--result-dir", str(tmp_path), "--result-filename", "serve.json", "--disable-tqdm",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    result = json.loads((tmp_path / "serve.json").read_text())
    missing = [k for k in VLLM_KEYS if k not in result]
    assert not missing, missing
    assert result["failed"] == 0 and result["errors"] == [""] * NUM_PROMPTS
    assert result["completed"] == NUM_PROMPTS
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS  # ignore_eos, counted from usage
    assert result["input_lens"] == [INPUT_LEN] * NUM_PROMPTS
    assert result["total_output_tokens"] == OUTPUT_LEN * NUM_PROMPTS
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert all(len(itl) < OUTPUT_LEN for itl in result["itls"]) and all(t > 0 for t in result["ttfts"])
    assert 1 <= result["max_concurrent_requests"] <= NUM_PROMPTS
    assert (tmp_path / "serve-latency-cdf.png").stat().st_size > 0
    assert (tmp_path / "serve-timeline.png").stat().st_size > 0
    # The readiness check and the warm-up share no prompt with the run: none of its prefills came
    # from the prefix cache (every prompt was looked up: the queries cover the run's tokens).
    counters = await_prefix_cache_queries(server.base_url, NUM_PROMPTS * INPUT_LEN)
    assert counters["vllm:prefix_cache_hits_total"] == 0, counters


def await_prefix_cache_queries(base_url: str, at_least: int, timeout: float = 60.0) -> dict[str, float]:
    """The prefix cache counters of /metrics (summed over their labels), once the queries reach ``at_least``."""
    deadline = time.monotonic() + timeout
    while True:
        samples = parse_metrics(httpx.get(base_url + "/metrics", timeout=30).text)
        counters = {name: sum(v for (n, _), v in samples.items() if n == name)
                    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}
        if counters["vllm:prefix_cache_queries_total"] >= at_least or time.monotonic() > deadline:
            return counters
        time.sleep(0.1)


def test_bench_sweep_compares_configs_and_reports_a_broken_one(
    random_model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    rc = bench_main([
        "sweep", "--model", random_model_dir,
        "--config", "seqs4=--max-num-seqs 4", "--config", "seqs8=--max-num-seqs 8",
        "--config", "broken=--max-num-seqs 0",
        "--endpoint", "/v1/chat/completions",
        "--num-prompts", "4", "--max-concurrency", "4", "--repeats", "2", "--aggregate", "best",
        "--random-input-len", "16", "--random-output-len", "4",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "sweep.json",
    ])
    out = capsys.readouterr().out
    assert rc == 1, out  # one configuration failed
    assert "Sweep comparison" in out and "seqs8/seqs4" in out and "broken/seqs4" in out
    assert "seqs4: output tok/s of each run: " in out
    assert "Server RSS after the run (MiB)" in out and "Server PSS after the run (MiB)" in out
    assert "broken: server did not start: server exited with code 2: ... python -m app: error: max_num_seqs and" in out
    summary = json.loads((tmp_path / "sweep.json").read_text())
    by_name = {c["name"]: c for c in summary["configs"]}
    for name in ("seqs4", "seqs8"):
        assert by_name[name]["error"] is None
        assert by_name[name]["completed"] == 4 and by_name[name]["failed"] == 0
        assert by_name[name]["runs"] == 2
        # The RSS of a live server's tree: a frontend and an engine, each a Python process of tens of MB.
        assert by_name[name]["server_rss_mb"] > 40
        # Their shared pages (libpython's, the rings') count once in the PSS, once per process in the RSS.
        assert 20 < by_name[name]["server_pss_mb"] < by_name[name]["server_rss_mb"]
        for run in (1, 2):
            assert json.loads((tmp_path / f"sweep-{summary['date']}-{name}-run{run}.json").read_text())["failed"] == 0
    assert by_name["broken"]["runs"] == 0 and by_name["broken"]["completed"] is None
    assert "max_num_seqs" in by_name["broken"]["error"]


def test_bench_compare_takes_turns_and_saves_where_told(
    random_model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Our server against a second one started from a command line (here our own, as "twin"):
    both measured, the table's ratio set between them, the result under --result-filename."""
    peer = f"{sys.executable} -m app --model {random_model_dir} --port {{port}} --max-num-seqs {{concurrency}}"
    rc = bench_main([
        "compare", "--model", random_model_dir, "--peer-cmd", peer, "--peer-name", "twin",
        "--concurrency", "2", "--repeats", "1", "--num-prompts", "4",
        "--random-input-len", "16", "--random-output-len", "4",
        "--result-dir", str(tmp_path), "--result-filename", "pair.json",
    ])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "### ringllm, 2 streams, run 1" in out and "### twin, 2 streams, run 1" in out
    summary = json.loads((tmp_path / "pair.json").read_text())
    assert (tmp_path / "pair.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pair.json", "pair.png"]
    runs = summary["results"]["2"]
    for name in ("ringllm", "twin"):
        (run,) = runs[name]
        assert run["startup_s"] > 0 and run["server_cpu_ms_per_token"] > 0
        assert 20 < run["server_pss_mb"] < run["server_rss_mb"]
    assert "output tok/s (ringllm / twin)" in summary["table"]
