"""python -m bench soak, briefly, against a real server it starts (stories260K)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import main as bench_main
from bench.__main__ import make_parser
from bench.soak import client_keepalive_expiry

pytestmark = pytest.mark.slow


def test_bench_soak_reports_no_errors_and_draws_its_curves(tmp_path: Path) -> None:
    prefix = tmp_path / "soak"
    code = bench_main(["soak", "--duration", "2", "--concurrency", "8", "--settle", "0.5", "--output", str(prefix)])
    assert code == 0
    result = json.loads(prefix.with_suffix(".json").read_text())
    assert result["errors"] == 0 and result["completed"] > 0 and result["disconnected"] > 0
    assert result["error_kinds"] == {} and result["client_keepalive_expiry_s"] == 2.5
    assert result["engine_stats_after"]["num_running_reqs"] == 0
    last = result["samples"][-1]
    assert last["frontend_rss"] > 0 and last["frontend_fds"] > 0 and last["engine_rss"] > 0
    assert prefix.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("flags", "expiry"),
    [
        ([], 2.5),  # half the server's default 5 s
        (["--server-arg=--keep-alive-timeout", "--server-arg=60"], 30.0),
        (["--server-arg=--keep-alive-timeout=8"], 4.0),
        (["--server-arg=--keep-alive-timeout=8", "--keepalive-expiry", "1"], 1.0),
    ],
)
def test_the_client_drops_idle_connections_before_the_server_does(flags: list[str], expiry: float) -> None:
    args = make_parser().parse_args(["soak", *flags])
    assert client_keepalive_expiry(args) == expiry
