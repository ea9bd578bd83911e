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

Reported per case: the median wall time and the median CPU time of the
process (all its threads) per step, each with its ratio to ``off``. On a
shared machine the CPU time is the steadier of the two: time spent waiting
for a core is not in it. ``--torch-threads 1`` keeps torch's intra-op
threads from waiting for each other when another process holds a core.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.step_engine import MAX_MODEL_LEN, stories_engine
from core.protocol import EngineCoreRequest, SamplingParams

HELP = "decode step cost with logprobs and penalties on vs off"

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


def _run_case(
    core, encoder, prompts: list[list[int]], extra: dict, steps: int, tag: str
) -> list[tuple[float, float]]:
    """Start the requests, finish their prefill, time ``steps`` decode steps
    (wall, process CPU), abort them."""
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
        start, start_cpu = time.perf_counter(), time.process_time()
        outputs, _ = core.step()
        for message in outputs.values():
            encoder.encode(message)
        times.append((time.perf_counter() - start, time.process_time() - start_cpu))
    assert len(scheduler.running) == len(prompts), "a request finished during the measurement"
    core.abort_requests(ids)
    while scheduler.has_requests():
        core.step()
    return times


def run(args: argparse.Namespace) -> int:
    import torch

    from shm.serial import MsgpackEncoder

    core = stories_engine(args.requests, args.torch_threads)
    encoder = MsgpackEncoder()
    prompts = _prompts(args.requests, args.prompt_len)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
    try:
        for name, extra in CASES.items():  # warm-up: first-call costs out of the way
            _run_case(core, encoder, prompts, extra, 4, f"warm-{name}")
        for r in range(args.rounds):
            for name, extra in CASES.items():
                samples[name] += _run_case(core, encoder, prompts, extra, args.steps, f"{name}-{r}")
    finally:
        core.shutdown()
    def medians(times: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)

    base_wall, base_cpu = medians(samples["off"])
    print(
        f"sampling: stories260K, {args.requests} decoding requests, {args.rounds} rounds x {args.steps} steps "
        f"per case, torch threads {torch.get_num_threads()}; engine step + output encoding, medians"
    )
    for name, times in samples.items():
        wall, cpu = medians(times)
        print(
            f"  {name:10s} wall {wall * 1e3:7.3f} ms/step {wall / base_wall:5.3f}x   "
            f"CPU {cpu * 1e3:7.3f} ms/step {cpu / base_cpu:5.3f}x   {CASES[name] or ''}"
        )
    return 0
