"""GPU benchmark of issue 6: a Llama-shaped dummy model with CUDA graphs on and off.

    python -m bench gpu [--shape 1b|tiny] [--batch-sizes 1,8,32,64] [--async-scheduling] [--json PATH]

Needs a CUDA GPU; without one it says so and exits with status 2. The model
is a generated config.json with Llama 3.2 1B's shapes (16 layers, hidden
2048, 32 query and 8 KV heads of 64, vocabulary 128256) and
``--load-format dummy`` weights, in bfloat16. For each mode (CUDA graphs,
then ``--enforce-eager``):

- prefill: prompt tokens per second over ``--prefill-requests`` prompts of
  ``--prompt-len`` tokens, one output token each (chunked at
  ``--max-num-batched-tokens``);
- decode: output tokens per second of B requests decoding together, in the
  engine's own process (no IPC), and per step where the time goes on the
  host: ``schedule`` (Scheduler.schedule), ``enqueue`` (the model runner
  preparing inputs and launching the step), ``wait`` (waiting for the GPU
  and the sampled-ids copy), ``update`` (Scheduler.update_from_output);
  with ``--async-scheduling`` the runner works on its own thread, so
  ``enqueue`` overlaps the others instead of adding to them;
- GPU time per decode step: the sum of kernel (and copy) durations that the
  CUDA profiler records over the same kind of steps, and the share of the
  step's wall time *not* covered by it ("outside GPU": scheduling, input
  preparation, launches, the sampled-ids copy and Python in between);
- IPC: the same decode through a spawned EngineCore and the shm rings
  (SyncMPClient), whose extra time per step over the in-process engine is
  what the frontend/engine transport costs a step.

Figures are medians over ``--repeats`` runs. Output: a table, and JSON with
``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.config import EngineArgs, EngineConfig
from core.protocol import EngineCoreRequest, SamplingParams

SHAPES: dict[str, dict[str, Any]] = {
    # Llama 3.2 1B.
    "1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
    ),
    # A few MB: for smoke runs of this script's own logic.
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False,
    ),
}


@dataclass
class BenchArgs:
    shape: str = "1b"
    dtype: str = "bfloat16"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    prompt_len: int = 512
    prefill_requests: int = 64
    decode_prompt_len: int = 128
    decode_steps: int = 64
    profile_steps: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.85
    async_scheduling: bool = False
    ipc: bool = True
    repeats: int = 3
    device: str = "cuda"


def write_model_dir(path: Path, shape: str, max_model_len: int, dtype: str) -> str:
    """A Llama config.json (weights come from --load-format dummy)."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "max_position_embeddings": max_model_len, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2, **SHAPES[shape],
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return str(path)


def engine_config(model_dir: str, args: BenchArgs, enforce_eager: bool) -> EngineConfig:
    return EngineArgs(
        model=model_dir, load_format="dummy", device=args.device, dtype=args.dtype,
        enforce_eager=enforce_eager, max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, async_scheduling=args.async_scheduling,
        enable_prefix_caching=False,  # repeated runs must compute, not hit the cache
    ).resolve()


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def _request(req_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt, sampling_params=params)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------ host timing


class HostTimer:
    """Accumulates host seconds spent in the engine's phases, by wrapping them on one engine."""

    PHASES = ("schedule", "enqueue", "wait", "update")

    def __init__(self, engine: Any) -> None:
        from core.worker import async_output

        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        runner = engine.model_executor.runner
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.scheduler, "update_from_output", "update")
        self._wrap(runner, "execute_model", "enqueue")
        # Materialising a deferred output waits for the GPU and the copy.
        original = async_output.AsyncModelRunnerOutput.get_output
        timer = self

        def timed_get_output(output: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(output)
            finally:
                timer.seconds["wait"] += time.perf_counter() - start

        self._restore = (async_output.AsyncModelRunnerOutput, original)
        async_output.AsyncModelRunnerOutput.get_output = timed_get_output

    def _wrap(self, obj: Any, name: str, phase: str) -> None:
        original = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(obj, name, timed)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)

    def close(self) -> None:
        cls, original = self._restore
        cls.get_output = original


# ------------------------------------------------------------------ engine runs


def _drain(engine: Any) -> None:
    engine.abort_requests(list(engine.scheduler.requests))
    while engine.scheduler.has_requests() or engine.has_batches_in_flight():
        engine.step_fn()


def _count_tokens(outputs: dict) -> int:
    return sum(len(o.new_token_ids) for outs in outputs.values() for o in outs.outputs)


def measure_prefill(engine: Any, args: BenchArgs, vocab: int, seed: int) -> float:
    """Prompt tokens per second, all prompts submitted at once, one output token each."""
    prompts = _prompts(args.prefill_requests, args.prompt_len, vocab, seed)
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.preprocess_add_request(_request(f"p{seed}-{i}", prompt, 1)))
    _sync(args.device)
    start = time.perf_counter()
    while engine.scheduler.has_requests() or engine.has_batches_in_flight():
        engine.step_fn()
    _sync(args.device)
    return args.prefill_requests * args.prompt_len / (time.perf_counter() - start)


def _start_decodes(engine: Any, batch: int, args: BenchArgs, vocab: int, seed: int) -> None:
    """Admit ``batch`` requests and step until every one is decoding."""
    budget = 8 + 2 * (args.decode_steps + args.profile_steps)
    for i, prompt in enumerate(_prompts(batch, args.decode_prompt_len, vocab, seed)):
        engine.add_request(engine.preprocess_add_request(_request(f"d{seed}-{i}", prompt, budget)))
    seen: set[str] = set()
    while len(seen) < batch:
        outputs, _ = engine.step_fn()
        seen |= {o.request_id for outs in outputs.values() for o in outs.outputs if o.new_token_ids}
    for _ in range(4):  # settle: every step from here on is a pure decode step
        engine.step_fn()


def measure_decode(engine: Any, timer: HostTimer, batch: int, args: BenchArgs, vocab: int, seed: int) -> dict:
    _start_decodes(engine, batch, args, vocab, seed)
    _sync(args.device)
    timer.reset()
    tokens = 0
    start = time.perf_counter()
    for _ in range(args.decode_steps):
        tokens += _count_tokens(engine.step_fn()[0])
    _sync(args.device)
    wall = time.perf_counter() - start
    result = {
        "tokens_per_s": tokens / wall,
        "step_ms": wall / args.decode_steps * 1e3,
        **{f"{k}_ms": v / args.decode_steps * 1e3 for k, v in timer.seconds.items()},
    }
    if args.device.startswith("cuda"):
        gpu_ms, kernels = gpu_time_per_step(lambda: engine.step_fn(), args.profile_steps)
        result["gpu_ms"] = gpu_ms
        result["kernels_per_step"] = kernels
        result["outside_gpu_share"] = max(0.0, 1.0 - gpu_ms / result["step_ms"])
    _drain(engine)
    return result


def gpu_time_per_step(step: Callable[[], Any], steps: int) -> tuple[float, float]:
    """(milliseconds of GPU activity, activities) per call of ``step``, from the CUDA profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    device_us, count = 0.0, 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            device_us += event.device_time_total
            count += 1
    return device_us / steps / 1e3, count / steps


def measure_mp_decode(model_dir: str, args: BenchArgs, enforce_eager: bool, vocab: int) -> dict[int, dict[str, float]]:
    """Per batch size, through one spawned EngineCore and the shm transport:
    milliseconds per decode step and tokens per step (the batch, when every
    request decoded in every step)."""
    from core.client import SyncMPClient

    client = SyncMPClient(engine_config(model_dir, args, enforce_eager))
    produced: dict[str, int] = {}

    def collect() -> None:
        for o in client.get_output().outputs:
            produced[o.request_id] = produced.get(o.request_id, 0) + len(o.new_token_ids)

    results: dict[int, dict[str, float]] = {}
    try:
        for batch in args.batch_sizes:
            ids = [f"m{batch}-{i}" for i in range(batch)]
            prompts = _prompts(batch, args.decode_prompt_len, vocab, 99 + batch)
            for req_id, prompt in zip(ids, prompts):
                client.add_request(_request(req_id, prompt, 8 + args.decode_steps * 2))
            while min(produced.get(r, 0) for r in ids) < 5:
                collect()
            before = sum(produced[r] for r in ids)
            steps = 0
            start = time.perf_counter()
            while sum(produced[r] for r in ids) - before < args.decode_steps * batch:
                collect()
                steps += 1
            elapsed = time.perf_counter() - start
            tokens = sum(produced[r] for r in ids) - before
            results[batch] = {"step_ms": elapsed / steps * 1e3, "tokens_per_step": tokens / steps}
            client.abort_requests(ids)
    finally:
        client.shutdown()
    return results


def run_mode(model_dir: str, args: BenchArgs, enforce_eager: bool) -> dict:
    from core.engine_core import EngineCore

    vocab = SHAPES[args.shape]["vocab_size"]
    engine = EngineCore(engine_config(model_dir, args, enforce_eager))
    timer = HostTimer(engine)
    try:
        measure_prefill(engine, args, vocab, seed=0)  # warm-up: Triton compiles, allocator settles
        prefill = [measure_prefill(engine, args, vocab, seed=r + 1) for r in range(args.repeats)]
        decode: dict[int, dict] = {}
        for batch in args.batch_sizes:
            runs = [measure_decode(engine, timer, batch, args, vocab, seed=100 * r + batch) for r in range(args.repeats)]
            decode[batch] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    finally:
        timer.close()
        engine.shutdown()
        del engine
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.ipc:
        runs = [measure_mp_decode(model_dir, args, enforce_eager, vocab) for _ in range(args.repeats)]
        for batch in args.batch_sizes:
            mp = statistics.median(r[batch]["step_ms"] for r in runs)
            decode[batch]["mp_step_ms"] = mp
            decode[batch]["ipc_ms"] = mp - decode[batch]["step_ms"]
    return {"prefill_tokens_per_s": statistics.median(prefill), "decode": decode}


def measure(args: BenchArgs) -> dict:
    """Every mode's figures, plus what they ran on."""
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "args": asdict(args),
        "modes": {},
    }
    with tempfile.TemporaryDirectory(prefix="ringllm-gpu-bench-") as tmp:
        model_dir = write_model_dir(Path(tmp) / args.shape, args.shape, args.max_model_len, args.dtype)
        for mode, eager in (("cuda_graphs", False), ("eager", True)):
            results["modes"][mode] = run_mode(model_dir, args, eager)
            # Each mode as it ends: a run cut short by a time limit keeps what it measured.
            print(format_table({**results, "modes": {mode: results["modes"][mode]}}), file=sys.stderr, flush=True)
    return results


def format_table(results: dict) -> str:
    lines = [
        f"device: {results['device']}  torch {results['torch']}  shape {results['args']['shape']} "
        f"{results['args']['dtype']}  async_scheduling={results['args']['async_scheduling']}",
    ]
    for mode, figures in results["modes"].items():
        lines.append(f"\n[{mode}] prefill: {figures['prefill_tokens_per_s']:.0f} prompt tokens/s")
        cols = ["tokens_per_s", "step_ms", "schedule_ms", "enqueue_ms", "wait_ms", "update_ms",
                "gpu_ms", "outside_gpu_share", "mp_step_ms", "ipc_ms"]
        present = [c for c in cols if any(c in d for d in figures["decode"].values())]
        lines.append("  batch " + " ".join(f"{c:>17}" for c in present))
        for batch, d in figures["decode"].items():
            lines.append(f"  {batch:>5} " + " ".join(f"{d[c]:>17.3f}" if c in d else f"{'-':>17}" for c in present))
    return "\n".join(lines)


HELP = "the GPU path: prefill/decode throughput with CUDA graphs on and off (needs a CUDA GPU)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BenchArgs()
    parser.add_argument("--shape", choices=sorted(SHAPES), default=defaults.shape)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=defaults.dtype)
    parser.add_argument("--batch-sizes", default=",".join(map(str, defaults.batch_sizes)))
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len)
    parser.add_argument("--prefill-requests", type=int, default=defaults.prefill_requests)
    parser.add_argument("--decode-steps", type=int, default=defaults.decode_steps)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--no-ipc", action="store_true", help="skip the spawned-engine (shm transport) runs")
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--json", help="also write the results here")


def run(ns: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print(
            "bench gpu measures the GPU path and needs a CUDA GPU; torch.cuda.is_available() "
            "is False on this machine, so nothing was measured.",
            file=sys.stderr,
        )
        return 2
    args = BenchArgs(
        shape=ns.shape, dtype=ns.dtype, batch_sizes=[int(b) for b in ns.batch_sizes.split(",")],
        prompt_len=ns.prompt_len, prefill_requests=ns.prefill_requests, decode_steps=ns.decode_steps,
        max_num_batched_tokens=ns.max_num_batched_tokens, gpu_memory_utilization=ns.gpu_memory_utilization,
        async_scheduling=ns.async_scheduling, ipc=not ns.no_ipc, repeats=ns.repeats,
    )
    results = measure(args)
    print(format_table(results))
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))
    return 0

