"""bench structured runs its three cases and its TTFT comparison end to end (tiny sizes: no timing is checked)."""

from __future__ import annotations

from bench.__main__ import make_parser


def test_bench_structured_runs_every_case(capsys) -> None:
    args = make_parser().parse_args(
        ["structured", "--requests", "4", "--steps", "2", "--rounds", "1", "--ttft-trials", "1"]
    )
    assert args.run(args) == 0
    out = capsys.readouterr().out
    for case in ("0%", "50%", "100%"):
        assert f"  {case} " in out
    assert "fresh schema" in out and "cached" in out
