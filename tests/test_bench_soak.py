"""python -m bench soak, briefly, against a real server it starts (stories260K)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import main as bench_main

pytestmark = pytest.mark.slow


def test_bench_soak_reports_no_errors_and_draws_its_curves(tmp_path: Path) -> None:
    prefix = tmp_path / "soak"
    code = bench_main(["soak", "--duration", "2", "--concurrency", "8", "--settle", "0.5", "--output", str(prefix)])
    assert code == 0
    result = json.loads(prefix.with_suffix(".json").read_text())
    assert result["errors"] == 0 and result["completed"] > 0 and result["disconnected"] > 0
    assert result["engine_stats_after"]["num_running_reqs"] == 0
    last = result["samples"][-1]
    assert last["frontend_rss"] > 0 and last["frontend_fds"] > 0 and last["engine_rss"] > 0
    assert prefix.with_suffix(".png").stat().st_size > 10_000
