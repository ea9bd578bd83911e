"""``python -m bench lora``: what serving LoRA adapters costs against the base model alone.

``make-adapters`` writes seeded random PEFT adapters of a base checkpoint (every projection,
rank ``--rank``), as a trained adapter is saved: speed depends on shapes, not values.

``compare`` starts two servers on the same model: one plain, one with ``--enable-lora`` and
the adapters as ``--lora-modules`` (``--max-loras`` their count), ``--restarts`` times. After
each start, in each of ``--rounds`` rounds it measures, in a rotating order, the same loads (greedy, ``--input-len`` random prompt tokens,
``--output-len`` tokens each, every stream one request started at once):

- ``base``: ``--streams`` streams on the plain server;
- ``lora-server base``: the same on the LoRA server, naming the base model (a step without
  adapters);
- ``adapters``: ``--streams`` streams on the LoRA server spread evenly over the adapters;
- ``one base`` / ``one adapter``: a single stream, for its time per output token.

It prints medians with their spread and, as the median of each round's ratio, the ratios the
issue set goals for: adapters' output tok/s over the base's, and one stream's TPOT on an
adapter over the base's.

    python -m bench lora make-adapters --model ~/.cache/ringllm-peer/models/llama50M --out /tmp/adapters
    python -m bench lora compare --model ~/.cache/ringllm-peer/models/llama50M --adapters /tmp/adapters/*
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import tempfile
from pathlib import Path

from app.launcher import ManagedServer
from bench.client import RequestResult, make_http_client, stream_request

HELP = "LoRA adapters' throughput and TPOT against the base model alone"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    make = sub.add_parser("make-adapters", help="seeded random PEFT adapters of a base checkpoint")
    make.add_argument("--model", required=True, help="the base checkpoint (a Hugging Face directory)")
    make.add_argument("--out", required=True, help="directory that receives adapter0, adapter1, ...")
    make.add_argument("--count", type=int, default=4)
    make.add_argument("--rank", type=int, default=16)
    compare = sub.add_parser("compare", help="base model alone vs adapters, on two servers taking turns")
    compare.add_argument("--model", required=True)
    compare.add_argument("--adapters", nargs="+", required=True, help="PEFT adapter directories")
    compare.add_argument("--streams", type=int, default=16)
    compare.add_argument("--input-len", type=int, default=128)
    compare.add_argument("--output-len", type=int, default=128)
    compare.add_argument("--rounds", type=int, default=5, help="rounds per server start")
    compare.add_argument("--restarts", type=int, default=2, help="server starts (fresh servers, in turns)")
    compare.add_argument("--server-args", default="--dtype float32", help="flags both servers get")


def make_adapters(model_dir: str, out: str, count: int, rank: int) -> list[str]:
    import peft
    import torch
    import transformers

    paths = []
    for i in range(count):
        torch.manual_seed(100 + i)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        adapted = peft.get_peft_model(
            model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        )
        path = Path(out) / f"adapter{i}"
        adapted.save_pretrained(path)
        paths.append(str(path))
        print(path)
    return paths


def _vocab_size(model_dir: str) -> int:
    import json

    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


async def _load(base_url: str, models: list[str], prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Every prompt as one streamed request at once (request i names ``models[i % len]``):
    output tok/s over the wall time, and the median time per output token."""
    url = base_url + "/v1/completions"
    async with make_http_client(len(prompts)) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        results: list[RequestResult] = await asyncio.gather(*(
            stream_request(client, url, {
                "model": models[i % len(models)], "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            }, len(prompt))
            for i, prompt in enumerate(prompts)
        ))
        wall = loop.time() - start
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    tokens = sum(r.output_tokens or 0 for r in results)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in results if (r.output_tokens or 0) > 1]
    return {"tok_s": tokens / wall, "tpot_ms": statistics.median(tpots) * 1000}


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})"


def compare(args: argparse.Namespace) -> int:
    names = [f"adapter{i}" for i in range(len(args.adapters))]
    common = ["--model", args.model, "--served-model-name", "base", *args.server_args.split()]
    lora = ["--enable-lora", "--max-loras", str(len(names)), "--max-lora-rank", "64",
            "--lora-modules", *(f"{n}={p}" for n, p in zip(names, args.adapters))]
    rng = random.Random(0)
    vocab = _vocab_size(args.model)
    logs = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    loads: list[tuple[str, str, list[str], int]] = [  # label, server, models, streams
        ("base", "plain", ["base"], args.streams),
        ("lora-server base", "lora", ["base"], args.streams),
        ("adapters", "lora", names, args.streams),
        ("one base", "plain", ["base"], 1),
        ("one adapter", "lora", names[:1], 1),
    ]
    measured: dict[str, list[dict[str, float]]] = {label: [] for label, *_ in loads}

    def prompts(streams: int) -> list[list[int]]:
        return [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(streams)]

    round_ = 0
    for start in range(args.restarts):
        # Fresh servers for each block of rounds, started one after the other in turns: a
        # server's start-up choices (which weights keep a packed copy, timed as they load)
        # vary from one start to the next, and would otherwise favour one side throughout.
        order = [("plain", common), ("lora", common + lora)]
        if start % 2:
            order.reverse()
        with contextlib.ExitStack() as stack:
            servers = {
                name: stack.enter_context(ManagedServer(flags, logs / f"{name}{start}.log")) for name, flags in order
            }
            for _ in range(args.rounds):
                shift = round_ % len(loads)
                for label, server, models, streams in loads[shift:] + loads[:shift]:
                    url = servers[server].base_url
                    asyncio.run(_load(url, models, prompts(streams), 4))  # untimed: wakes the engine's threads
                    result = asyncio.run(_load(url, models, prompts(streams), args.output_len))
                    measured[label].append(result)
                    print(f"round {round_ + 1} {label:18s} {result['tok_s']:8.1f} tok/s  "
                          f"TPOT {result['tpot_ms']:.2f} ms", flush=True)
                round_ += 1
    print(f"\n{round_} rounds ({args.restarts} server starts); {args.streams} streams, {args.input_len} -> "
          f"{args.output_len} tokens, {len(names)} adapters; medians (min-max)")
    for label in measured:
        print(f"{label:18s} tok/s {_summary([m['tok_s'] for m in measured[label]])}   "
              f"TPOT ms {_summary([m['tpot_ms'] for m in measured[label]])}")

    def ratio(what: str, over: str, key: str = "tok_s") -> str:
        """The median (and range) of the rounds' ratios: each round's loads ran minutes apart at most."""
        per_round = [a[key] / b[key] for a, b in zip(measured[what], measured[over])]
        return _summary(per_round).strip() + "x"

    print(f"adapters / base model alone, output tok/s:       {ratio('adapters', 'base')} (goal >= 0.8)")
    print(f"adapters / base model, the same (LoRA) server:   {ratio('adapters', 'lora-server base')}")
    print(f"LoRA server's base model / plain server, tok/s:  {ratio('lora-server base', 'base')}")
    print(f"one stream TPOT, adapter / base:                 {ratio('one adapter', 'one base', 'tpot_ms')} "
          f"(goal <= 1.15)")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "make-adapters":
        make_adapters(args.model, args.out, args.count, args.rank)
        return 0
    return compare(args)
