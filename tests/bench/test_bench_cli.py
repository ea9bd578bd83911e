"""``python -m bench``: the help of the command and of every subcommand renders (argparse
formats each help string with %, so a stray percent sign breaks ``--help`` for all of them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from app.launcher import REPO
from bench.__main__ import SUBCOMMANDS, make_parser


def test_the_command_help_lists_every_subcommand() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in SUBCOMMANDS:
        assert f"    {name}" in proc.stdout, name


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_subcommand_help_renders(name: str) -> None:
    parser = make_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([name, "--help"])
    assert exit_info.value.code == 0
