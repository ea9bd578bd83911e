"""bench sampling runs its four cases end to end (tiny sizes: no timing is checked)."""

from __future__ import annotations

from bench.__main__ import make_parser


def test_bench_sampling_runs_every_case(capsys) -> None:
    args = make_parser().parse_args(["sampling", "--requests", "3", "--steps", "2", "--rounds", "1"])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    for case in ("off", "logprobs", "penalties", "both"):
        assert f"  {case} " in out
