"""``python -m bench throughput``: offline generation, our ``LLM`` against transformers ``generate``.

Both run in this process, on the same model, the same prompts (the very same
token ids) and the same output lengths: greedy decoding, EOS ignored (ours:
``ignore_eos``; transformers: no EOS token id). Ours gets
every prompt at once and lets its scheduler batch them (at most
``--max-num-seqs`` at a time, by default the transformers batch size);
transformers gets batches of ``--hf-max-batch-size`` (default: all prompts). Each side first runs a small warmup
generation, outside the timing; with ``--repeats N`` the timed runs alternate
between the two and the median (or, ``--aggregate best``, the shortest) time
is reported. Reported: requests/s, output and
total tokens/s of both, the ratio, and how many greedy outputs agree token for
token (a sanity check: float rounding can legitimately split long greedy runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.datasets import load_tokenizer, random_token_ids

HELP = "offline throughput: our LLM class vs transformers generate, same model and prompts"
WARMUP_TOKENS = 8


@dataclass
class SystemRun:
    name: str
    elapsed_s: float
    num_requests: int
    input_tokens: int
    output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="local model directory (default: the random-weights test model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per prompt")
    parser.add_argument("--hf-max-batch-size", type=int, help="transformers batch size (default: all prompts)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, help="ours: most sequences per step (default: the HF batch size)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="ours: token budget per step")
    parser.add_argument("--max-model-len", type=int, help="ours: context length")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each system, alternating")
    parser.add_argument("--aggregate", choices=["median", "best"], default="median",
                        help="over the repeats: the median time, or the shortest (least disturbed) one")
    parser.add_argument("--skip-hf", action="store_true", help="measure ours only")
    parser.add_argument("--output-json", help="write the numbers to this JSON file")


class OursOffline:
    """Our offline ``LLM``: every prompt submitted at once, batched by the scheduler."""

    name = "ringllm LLM"

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        from app.llm import LLM

        # As many sequences at once as transformers gets in one batch, unless told otherwise.
        engine_args: dict[str, Any] = {
            "dtype": args.dtype, "seed": args.seed, "max_num_seqs": args.hf_max_batch_size or args.num_prompts,
        }
        for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(args, key) is not None:
                engine_args[key] = getattr(args, key)
        self.llm = LLM(model, **engine_args)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        from core.protocol import SamplingParams

        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        return [r.token_ids for r in self.llm.generate(prompts, params)]

    def close(self) -> None:
        self.llm.shutdown()


class TransformersOffline:
    """transformers ``generate`` in batches of ``batch_size``, greedy, with no end-of-sequence token
    (as ``ignore_eos``: an EOS may be generated, it just does not stop the sequence)."""

    name = "transformers generate"

    def __init__(self, model: str, args: argparse.Namespace, pad_id: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            model, dtype=getattr(torch, args.dtype), local_files_only=True
        ).eval()
        self.batch_size = args.hf_max_batch_size or args.num_prompts
        self.pad_id = pad_id

    def _batch(self, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(map(len, batch))  # left padding keeps every prompt's end aligned
        ids = self.torch.tensor([[self.pad_id] * (width - len(p)) + p for p in batch])
        mask = self.torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with self.torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=self.pad_id, use_cache=True,
            )
        return out[:, width:].tolist()

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        outputs: list[list[int]] = []
        for i in range(0, len(prompts), self.batch_size):
            outputs += self._batch(prompts[i : i + self.batch_size], new_tokens)
        return outputs

    def close(self) -> None:
        pass


def timed(system: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = system.generate(prompts, new_tokens)
    return time.perf_counter() - start, outputs


def format_table(runs: list[SystemRun]) -> str:
    header = f"{'system':<24}{'elapsed s':>11}{'req/s':>10}{'output tok/s':>15}{'total tok/s':>14}"
    lines = [header, "-" * len(header)]
    for r in runs:
        lines.append(
            f"{r.name:<24}{r.elapsed_s:>11.2f}{r.requests_per_s:>10.2f}"
            f"{r.output_tokens_per_s:>15.1f}{r.total_tokens_per_s:>14.1f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    model = args.model
    if model is None:
        from core.models.random_model import ensure_random_model

        model = ensure_random_model()
    tokenizer = load_tokenizer(model)
    prompts = random_token_ids(tokenizer, args.num_prompts, args.input_len, args.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    import torch

    print(
        f"model {model}: {args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out; "
        f"dtype {args.dtype}; torch threads {torch.get_num_threads()}; {args.aggregate} of {args.repeats} run(s)"
    )
    systems: list[Any] = [OursOffline(model, args)]
    if not args.skip_hf:
        systems.append(TransformersOffline(model, args, pad_id))
    try:
        for system in systems:
            system.generate(prompts[:1], WARMUP_TOKENS)
        times: list[list[float]] = [[] for _ in systems]
        outputs: list[list[list[int]]] = [[] for _ in systems]
        for _ in range(args.repeats):  # alternate, so that a drifting load hits both alike
            for i, system in enumerate(systems):
                elapsed, outputs[i] = timed(system, prompts, args.output_len)
                times[i].append(elapsed)
    finally:
        for system in systems:
            system.close()
    pick = min if args.aggregate == "best" else statistics.median
    runs = [
        SystemRun(system.name, pick(t), len(prompts), sum(map(len, prompts)), sum(map(len, out)))
        for system, t, out in zip(systems, times, outputs, strict=True)
    ]
    summary: dict[str, Any] = {
        "model": model, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "dtype": args.dtype, "seed": args.seed, "repeats": args.repeats,
        "aggregate": args.aggregate,
        "torch_threads": torch.get_num_threads(),
    }
    lines = [format_table(runs)]
    if len(runs) == 2:
        ratio = runs[0].output_tokens_per_s / runs[1].output_tokens_per_s
        same = sum(a == b for a, b in zip(outputs[0], outputs[1], strict=True))
        summary.update(
            hf_max_batch_size=systems[1].batch_size, ratio_output_tokens_per_s=ratio, identical_outputs=same
        )
        lines.append(f"ratio ours / transformers (output tokens/s): {ratio:.2f}x")
        lines.append(f"greedy outputs identical token for token: {same} of {len(prompts)}")
    print("\n".join(lines))
    summary["runs"] = [
        {**asdict(r), "all_elapsed_s": t, "requests_per_s": r.requests_per_s,
         "output_tokens_per_s": r.output_tokens_per_s, "total_tokens_per_s": r.total_tokens_per_s}
        for r, t in zip(runs, times, strict=True)
    ]
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(summary, indent=1))
        print(f"saved to {args.output_json}")
    return 0
