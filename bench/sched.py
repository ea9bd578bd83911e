"""Benchmarks of issue 4: prefix-cache TTFT, scheduler cost per step, async scheduling.

    python -m bench sched [ttft|sched|async|all] [--repeats N] [--torch-threads N]

Every figure is a ratio against a baseline measured in the same run, with
the two sides interleaved, because the machines these run on are shared and
noisy; absolute times are printed for context only.

- ``ttft``: time to first token of a long prompt (1,900 tokens: the
  random-weights test model has max_position_embeddings 2048) when its prefix is in the
  cache vs when the cache was just reset. Offline engine (InprocClient), so
  no HTTP or IPC is counted; max_tokens=1, so the time is prefill + one
  sample.
- ``sched``: CPU time of Scheduler.schedule() + update_from_output() per
  step with 256 running decode requests, the scheduler driven alone with a
  fake ModelRunnerOutput (a micro-benchmark: no model, no runner). Also
  shows that the cost follows the requests scheduled, not the requests
  waiting or the blocks in the pool.
- ``async``: offline generation throughput (output tokens/s) with
  --async-scheduling on vs off.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

from core.config import EngineArgs
from core.protocol import SamplingParams
from core.request import Request
from core.sched.output import ModelRunnerOutput
from core.sched.scheduler import Scheduler

TTFT_PROMPT_LEN = 1900
TTFT_MAX_MODEL_LEN = 2048


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _prompt(n: int, seed: int) -> list[int]:
    """Token ids in the byte range of the random model's vocabulary."""
    return [(seed * 7919 + i * 131) % 250 + 3 for i in range(n)]


# --------------------------------------------------------------------------- ttft


def bench_ttft(repeats: int) -> dict[str, float]:
    from app.llm import LLM
    from core.models.random_model import ensure_random_model

    llm = LLM(ensure_random_model(), max_model_len=TTFT_MAX_MODEL_LEN, max_num_batched_tokens=TTFT_MAX_MODEL_LEN, seed=0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cold: list[float] = []
    warm: list[float] = []
    cached_tokens = 0
    try:
        llm.generate([_prompt(64, 1)], params)  # first-call costs out of the way
        for r in range(repeats):
            prompt = _prompt(TTFT_PROMPT_LEN, 100 + r)
            assert llm.reset_prefix_cache()
            start = time.perf_counter()
            miss = llm.generate([prompt], params)[0]
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            hit = llm.generate([prompt], params)[0]
            warm.append(time.perf_counter() - start)
            assert miss.num_cached_tokens == 0 and hit.token_ids == miss.token_ids
            cached_tokens = hit.num_cached_tokens
    finally:
        llm.shutdown()
    result = {
        "prompt_tokens": TTFT_PROMPT_LEN,
        "cached_tokens": cached_tokens,
        "ttft_uncached_ms": _median_ms(cold),
        "ttft_cached_ms": _median_ms(warm),
        "ttft_uncached_best_ms": min(cold) * 1e3,
        "ttft_cached_best_ms": min(warm) * 1e3,
    }
    result["speedup"] = result["ttft_uncached_ms"] / result["ttft_cached_ms"]
    result["speedup_best"] = result["ttft_uncached_best_ms"] / result["ttft_cached_best_ms"]
    print(
        f"ttft: {TTFT_PROMPT_LEN}-token prompt (random model, max_model_len {TTFT_MAX_MODEL_LEN}), "
        f"{repeats} runs each: uncached median {result['ttft_uncached_ms']:.1f} ms (best "
        f"{result['ttft_uncached_best_ms']:.1f}), cached ({cached_tokens} tokens hit) median "
        f"{result['ttft_cached_ms']:.1f} ms (best {result['ttft_cached_best_ms']:.1f}) -> "
        f"{result['speedup']:.1f}x lower by medians, {result['speedup_best']:.1f}x by bests (target >= 5x)"
    )
    return result


# --------------------------------------------------------------------------- sched


def _decode_scheduler(
    num_running: int, num_waiting: int = 0, num_blocks: int = 16384, prefix_caching: bool = True
) -> Scheduler:
    """A scheduler with ``num_running`` requests past their prefill, decoding."""
    config = EngineArgs(
        model="unused",
        max_model_len=4096,
        max_num_seqs=num_running,
        max_num_batched_tokens=8192,
        block_size=16,
        enable_prefix_caching=prefix_caching,
    ).resolve()
    scheduler = Scheduler(config, num_blocks)
    params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    for i in range(num_running + num_waiting):
        scheduler.add_request(Request(f"req-{i}", _prompt(128, i), params, eos_token_id=2))
    while len(scheduler.running) < num_running or any(r.num_output_tokens == 0 for r in scheduler.running):
        _fake_step(scheduler)
    return scheduler


def _fake_output(so) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, [[7] for _ in req_ids])


def _fake_step(scheduler: Scheduler) -> None:
    so = scheduler.schedule()
    scheduler.update_from_output(so, _fake_output(so))


def _time_steps(scheduler: Scheduler, steps: int) -> tuple[float, float, float]:
    """Median CPU seconds per step of schedule(), update_from_output(), and both."""
    sched_t: list[float] = []
    update_t: list[float] = []
    clock = time.thread_time
    gc.collect()
    for _ in range(steps):
        t0 = clock()
        so = scheduler.schedule()
        t1 = clock()
        runner_output = _fake_output(so)  # not the scheduler's cost
        t2 = clock()
        scheduler.update_from_output(so, runner_output)
        t3 = clock()
        sched_t.append(t1 - t0)
        update_t.append(t3 - t2)
    both = [a + b for a, b in zip(sched_t, update_t)]
    return statistics.median(sched_t), statistics.median(update_t), statistics.median(both)


def bench_sched(steps: int) -> dict[str, float]:
    result: dict[str, float] = {}
    scheduler = _decode_scheduler(256)
    assert len(scheduler.running) == 256
    s, u, both = _time_steps(scheduler, steps)
    assert len(scheduler.running) == 256, "requests finished during the measurement"
    result.update(schedule_ms=s * 1e3, update_ms=u * 1e3, step_ms=both * 1e3)
    print(
        f"sched: 256 running decodes, prefix caching on, median of {steps} steps (CPU time): "
        f"schedule {s * 1e3:.3f} ms + update_from_output {u * 1e3:.3f} ms = {both * 1e3:.3f} ms per step "
        f"({both * 1e6 / 256:.2f} us per request; target <= 0.5 ms per step)"
    )
    # Cost follows the requests scheduled: same step with many waiting requests
    # (held back by max_num_seqs), with a 10x larger pool, and at 512 running.
    _, _, off = _time_steps(_decode_scheduler(256, prefix_caching=False), steps)
    _, _, waiting = _time_steps(_decode_scheduler(256, num_waiting=2000), steps)
    _, _, big_pool = _time_steps(_decode_scheduler(256, num_blocks=163840), steps)
    _, _, double = _time_steps(_decode_scheduler(512, num_blocks=32768), steps)
    result.update(
        ratio_prefix_caching_off=off / both,
        ratio_2000_waiting=waiting / both,
        ratio_10x_blocks=big_pool / both,
        ratio_512_running=double / both,
    )
    print(
        "sched: per-step cost relative to the case above: prefix caching off "
        f"{off / both:.2f}x, +2000 waiting requests {waiting / both:.2f}x, 10x blocks in the pool "
        f"{big_pool / both:.2f}x, 512 running {double / both:.2f}x (linear would be 2.00x)"
    )
    return result


# --------------------------------------------------------------------------- async


def bench_async(repeats: int) -> dict[str, float]:
    from app.llm import LLM

    num_prompts, prompt_len, max_tokens = 32, 96, 64
    prompts = [_prompt(prompt_len, 1000 + i) for i in range(num_prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engines = {
        mode: LLM(max_model_len=TTFT_MAX_MODEL_LEN, seed=0, async_scheduling=(mode == "async"))
        for mode in ("sync", "async")
    }
    rates: dict[str, list[float]] = {"sync": [], "async": []}
    try:
        outputs = {mode: llm.generate(prompts[:2], params) for mode, llm in engines.items()}  # warm-up
        assert [r.token_ids for r in outputs["sync"]] == [r.token_ids for r in outputs["async"]]
        for _ in range(repeats):
            for mode, llm in engines.items():
                llm.reset_prefix_cache()
                start = time.perf_counter()
                results = llm.generate(prompts, params)
                elapsed = time.perf_counter() - start
                rates[mode].append(sum(len(r.token_ids) for r in results) / elapsed)
    finally:
        for llm in engines.values():
            llm.shutdown()
    result = {f"{mode}_tok_s": statistics.median(v) for mode, v in rates.items()}
    result.update({f"{mode}_best_tok_s": max(v) for mode, v in rates.items()})
    result["speedup"] = result["async_tok_s"] / result["sync_tok_s"]
    result["speedup_best"] = result["async_best_tok_s"] / result["sync_best_tok_s"]
    print(
        f"async: {num_prompts} prompts x {prompt_len} tokens -> {max_tokens} tokens each, offline, {repeats} "
        f"runs each, interleaved: sync median {result['sync_tok_s']:.0f} tok/s (best "
        f"{result['sync_best_tok_s']:.0f}), async median {result['async_tok_s']:.0f} tok/s (best "
        f"{result['async_best_tok_s']:.0f}) -> {result['speedup']:.2f}x by medians, "
        f"{result['speedup_best']:.2f}x by bests"
    )
    return result


BENCHES: dict[str, Callable[[argparse.Namespace], dict[str, float]]] = {
    "ttft": lambda a: bench_ttft(a.repeats),
    "sched": lambda a: bench_sched(a.steps),
    "async": lambda a: bench_async(a.repeats),
}


HELP = "scheduler and KV cache: prefix-cache TTFT, scheduler cost per step, async scheduling"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("which", nargs="?", default="all", choices=[*BENCHES, "all"])
    parser.add_argument("--repeats", type=int, default=5, help="runs per side for ttft and async")
    parser.add_argument("--steps", type=int, default=200, help="scheduler steps measured per case")
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="torch intra-op threads (default: torch's own); 1 is steadier when other processes "
        "share the cores, since spinning OMP workers then stall every small op",
    )


def run(args: argparse.Namespace) -> int:
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    names = list(BENCHES) if args.which == "all" else [args.which]
    for name in names:
        BENCHES[name](args)
    return 0
