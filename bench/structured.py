"""What structured outputs cost a decode step, and a grammar's time to first token (issue 16).

    python -m bench structured [--requests 64] [--steps 48] [--rounds 5] [--torch-threads N]

An EngineCore in this process (no IPC) runs ``--requests`` decoding requests
on stories260K, a share of them under a JSON schema (a list of digits that
cannot end within the measurement, so every request keeps decoding). The
cases take turns round by round on the same engine, as in ``bench sampling``:

- ``0%``: no request has a schema (the path every plain request takes);
- ``50%``: every other request has one (bitmask rows scattered in the batch);
- ``100%``: all have one.

Reported per case: median wall and process-CPU time per step (engine step
with its bitmask, plus the encoding of its outputs), with the ratio to
``0%``. Then the time to first token of one request with a schema never seen
(compiled on the pool) against the same schema again (cached), medians over
``--ttft-trials``; the very first structured request also loads xgrammar and
its view of the vocabulary, reported on its own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

from bench.step_engine import MAX_MODEL_LEN, stories_engine
from core.protocol import EngineCoreRequest, SamplingParams, StructuredOutputsParams

HELP = "decode step cost with 0/50/100%% JSON-schema requests, and TTFT of a fresh vs a cached schema"
# Hundreds of digits before it may end: no request finishes while it is timed.
LONG_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 600}
CASES = {"0%": 0.0, "50%": 0.5, "100%": 1.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=64, help="decoding requests in every step")
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per case and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the cases take turns in each")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--ttft-trials", type=int, default=5, help="fresh and cached schemas timed")
    parser.add_argument("--torch-threads", type=int, help="torch intra-op threads (default: torch's own)")


def _prompts(n: int, length: int) -> list[list[int]]:
    """Token ids inside stories260K's vocabulary, a different prompt per request."""
    return [[1] + [(i * 7919 + j * 131) % 500 + 3 for j in range(length - 1)] for i in range(n)]


def _params(structured: StructuredOutputsParams | None, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, structured_outputs=structured)


def _add(core, req_id: str, prompt: list[int], params: SamplingParams) -> None:
    core.add_request(core.preprocess_add_request(
        EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt, sampling_params=params, eos_token_id=2)
    ))


def _step(core):
    """One step, or (nothing to run while a grammar compiles) a wait for the pool."""
    if not core.has_work():
        core.structured_output_manager.wait_for_compilation(0.01)
        return {}
    return core.step()[0]


def _run_case(core, encoder, prompts: list[list[int]], share: float, steps: int, tag: str) -> list[tuple[float, float]]:
    """Start the requests (every 1/share-th under the schema), finish their prefill,
    time ``steps`` decode steps (wall, process CPU), abort them."""
    schema = StructuredOutputsParams(json=json.dumps(LONG_SCHEMA), disable_any_whitespace=True)
    every = round(1 / share) if share else 0
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for i, (req_id, prompt) in enumerate(zip(ids, prompts)):
        structured = schema if every and i % every == 0 else None
        _add(core, req_id, prompt, _params(structured, MAX_MODEL_LEN - len(prompt)))
    scheduler = core.scheduler
    while len(scheduler.running) < len(prompts) or any(r.num_output_tokens == 0 for r in scheduler.running):
        _step(core)
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


def _ttft(core, req_id: str, schema: dict) -> float:
    """Seconds from a request's arrival to its first token, alone in the engine."""
    structured = StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)
    start = time.perf_counter()
    _add(core, req_id, _prompts(1, 16)[0], _params(structured, 4))
    while True:
        out = _step(core).get(0)
        if out is not None and any(o.request_id == req_id and o.new_token_ids for o in out.outputs):
            elapsed = time.perf_counter() - start
            break
    core.abort_requests([req_id])
    while core.scheduler.has_requests():
        core.step()
    return elapsed


def _fresh_schema(n: int) -> dict:
    """A small object schema no earlier request used (property names numbered)."""
    return {
        "type": "object",
        "properties": {f"name{n}": {"type": "string", "maxLength": 8}, f"age{n}": {"type": "integer"}},
        "required": [f"name{n}", f"age{n}"],
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from shm.serial import MsgpackEncoder

    core = stories_engine(args.requests, args.torch_threads)
    encoder = MsgpackEncoder()
    prompts = _prompts(args.requests, args.prompt_len)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
    counter = itertools.count()
    try:
        first_load = _ttft(core, "ttft-first", _fresh_schema(next(counter)))
        for name, share in CASES.items():  # warm-up: first-call costs out of the way
            _run_case(core, encoder, prompts, share, 4, f"warm-{name}")
        for r in range(args.rounds):
            for name, share in CASES.items():
                samples[name] += _run_case(core, encoder, prompts, share, args.steps, f"{name}-{r}")
        fresh, cached = [], []
        for t in range(args.ttft_trials):
            schema = _fresh_schema(next(counter))
            fresh.append(_ttft(core, f"ttft-fresh-{t}", schema))
            cached.append(_ttft(core, f"ttft-cached-{t}", schema))
    finally:
        core.shutdown()

    def medians(times: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)

    base_wall, base_cpu = medians(samples["0%"])
    print(
        f"structured: stories260K, {args.requests} decoding requests, {args.rounds} rounds x {args.steps} steps "
        f"per case, torch threads {torch.get_num_threads()}; engine step + output encoding, medians"
    )
    for name, times in samples.items():
        wall, cpu = medians(times)
        print(
            f"  {name:5s} under a JSON schema   wall {wall * 1e3:7.3f} ms/step {wall / base_wall:5.3f}x   "
            f"CPU {cpu * 1e3:7.3f} ms/step {cpu / base_cpu:5.3f}x"
        )
    print(
        f"  TTFT, one request: fresh schema {statistics.median(fresh) * 1e3:.2f} ms, cached "
        f"{statistics.median(cached) * 1e3:.2f} ms (medians of {args.ttft_trials}); the first structured "
        f"request, xgrammar loaded with it: {first_load * 1e3:.1f} ms"
    )
    return 0
