"""What logprobs and penalties cost a decode step (issue 13).

    python -m bench sampling [--requests 64] [--steps 48] [--rounds 5] [--torch-threads N]

An EngineCore in this process (no IPC) runs ``--requests`` decoding requests
on stories260K; one engine step is timed together with the encoding of its
outputs for the wire (what the output thread does), since the logprob arrays
are part of what a step produces. Four cases share everything but the
fields below, and take turns round by round on the same engine, each round
restarting its requests from the same prompts, so that every case sees the
same context lengths and the shared machine's noise falls on all of them:

- ``off``: temperature 1.0, nothing else;
- ``logprobs``: + logprobs=5 (top 5 alternatives of every sampled token);
- ``penalties``: + presence 0.5, frequency 0.5, repetition 1.1;
- ``both``: the two together.

Reported: the median wall time per step of each case and its ratio to ``off``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from core.protocol import EngineCoreRequest, SamplingParams

HELP = "decode step cost with logprobs and penalties on vs off"
MAX_MODEL_LEN = 512

CASES = {
    "off": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "both": {"logprobs": 5, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=64, help="decoding requests in every step")
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per case and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the cases take turns in each")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--torch-threads", type=int, help="torch intra-op threads (default: torch's own)")


def _prompts(n: int, length: int) -> list[list[int]]:
    """Token ids inside stories260K's vocabulary, a different prompt per request."""
    return [[1] + [(i * 7919 + j * 131) % 500 + 3 for j in range(length - 1)] for i in range(n)]


def _run_case(core, encoder, prompts: list[list[int]], extra: dict, steps: int, tag: str) -> list[float]:
    """Start the requests, finish their prefill, time ``steps`` decode steps, abort them."""
    params = SamplingParams(max_tokens=MAX_MODEL_LEN - len(prompts[0]), temperature=1.0, ignore_eos=True, **extra)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts):
        core.add_request(core.preprocess_add_request(
            EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt, sampling_params=params, eos_token_id=2)
        ))
    scheduler = core.scheduler
    while len(scheduler.running) < len(prompts) or any(r.num_output_tokens == 0 for r in scheduler.running):
        core.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        outputs, _ = core.step()
        for message in outputs.values():
            encoder.encode(message)
        times.append(time.perf_counter() - start)
    assert len(scheduler.running) == len(prompts), "a request finished during the measurement"
    core.abort_requests(ids)
    while scheduler.has_requests():
        core.step()
    return times


def run(args: argparse.Namespace) -> int:
    import torch

    from core.config import EngineConfig
    from core.engine_core import EngineCore
    from core.models.default_model import default_model_dir
    from shm.serial import MsgpackEncoder

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    config = EngineConfig(
        model=default_model_dir(), max_num_seqs=args.requests, max_model_len=MAX_MODEL_LEN, seed=0,
        enable_prefix_caching=False,
    )
    core = EngineCore(config)
    encoder = MsgpackEncoder()
    prompts = _prompts(args.requests, args.prompt_len)
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    try:
        for name, extra in CASES.items():  # warm-up: first-call costs out of the way
            _run_case(core, encoder, prompts, extra, 4, f"warm-{name}")
        for r in range(args.rounds):
            for name, extra in CASES.items():
                samples[name] += _run_case(core, encoder, prompts, extra, args.steps, f"{name}-{r}")
    finally:
        core.shutdown()
    base = statistics.median(samples["off"])
    print(
        f"sampling: stories260K, {args.requests} decoding requests, {args.rounds} rounds x {args.steps} steps "
        f"per case, torch threads {torch.get_num_threads()}; engine step + output encoding, median wall time"
    )
    for name, times in samples.items():
        median = statistics.median(times)
        print(f"  {name:10s} {median * 1e3:7.3f} ms/step  {median / base:5.3f}x off  {CASES[name] or ''}")
    return 0
