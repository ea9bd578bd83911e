"""``bench sweep``'s configurations: server arguments, and another source tree's app."""

from __future__ import annotations

import argparse

import pytest

from app.launcher import REPO
from bench.sweep import parse_config


def test_a_config_names_its_arguments_and_optionally_a_tree(tmp_path) -> None:
    assert parse_config("shm=--transport shm") == ("shm", ["--transport", "shm"], None)
    assert parse_config(f"before@{REPO}=--seed 1") == ("before", ["--seed", "1"], REPO)
    for bad in ("noargs", "=--seed 1", f"x@{tmp_path}=--seed 1"):  # the last: no app/ there
        with pytest.raises(argparse.ArgumentTypeError):
            parse_config(bad)
