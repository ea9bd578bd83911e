"""``bench sweep``'s configurations (server arguments, another source tree's app) and its repeats' prompts."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from app.launcher import REPO, ManagedServer, free_port
from bench.datasets import load_tokenizer, sample_requests
from bench.sweep import ConfigRun, add_arguments, parse_config, serve_args_for


def test_a_config_names_its_arguments_and_optionally_a_tree(tmp_path) -> None:
    assert parse_config("shm=--transport shm") == ("shm", ["--transport", "shm"], None)
    assert parse_config(f"before@{REPO}=--seed 1") == ("before", ["--seed", "1"], REPO)
    for bad in ("noargs", "=--seed 1", f"x@{tmp_path}=--seed 1"):  # the last: no app/ there
        with pytest.raises(argparse.ArgumentTypeError):
            parse_config(bad)


def test_each_repeat_draws_prompts_no_other_repeat_or_warm_up_sent(random_model_dir: str) -> None:
    """A sweep keeps each server across its repeats: a repeat that sent an earlier one's prompts
    again would have its prefills served from the prefix cache."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--random-input-len", "16", "--num-prompts", "4", "--num-warmups", "2"])
    config = ConfigRun("a", [], server=ManagedServer([], Path(os.devnull)))
    tokenizer = load_tokenizer(random_model_dir)
    sent: list[set[str]] = []
    for repeat in range(3):
        ns = serve_args_for(args, config, random_model_dir, "t", repeat)
        run = {r.prompt for r in sample_requests(ns, tokenizer)}
        warmups = {r.prompt for r in sample_requests(ns, tokenizer, num_prompts=ns.num_warmups, seed=ns.seed + 1)}
        assert len(run) == 4 and len(warmups) == 2
        sent.append(run | warmups)
    assert all(not (sent[i] & sent[j]) for i in range(3) for j in range(i + 1, 3))


def test_free_port_never_hands_out_a_port_twice() -> None:
    """Servers launched side by side each get their own port: the kernel offers a just-closed
    probe's port again often enough (several times in 200 probes here) that two servers of one
    sweep once bound the same one, and every request went to the server that listened first."""
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
