"""``python -m bench throughput``: offline generation, our ``LLM`` against transformers ``generate``.

Both run in this process, on the same model, the same prompts (the very same
token ids) and the same output lengths: greedy decoding, EOS ignored (ours:
``ignore_eos``; transformers: ``min_new_tokens = max_new_tokens``). Ours gets
every prompt at once and lets its scheduler batch them; transformers gets
batches of ``--hf-max-batch-size``. Each side first runs a small warmup
generation, outside the timing. Reported: requests/s, output and total tokens/s
of both, the ratio, and how many greedy outputs agree token for token (a
sanity check: float rounding can legitimately split long greedy runs).
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--model", help="local model directory (default: the embedded model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per prompt")
    parser.add_argument("--hf-max-batch-size", type=int, help="transformers batch size (default: all prompts)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, help="ours: most sequences per step")
    parser.add_argument("--max-num-batched-tokens", type=int, help="ours: token budget per step")
    parser.add_argument("--max-model-len", type=int, help="ours: context length")
    parser.add_argument("--skip-hf", action="store_true", help="measure ours only")
    parser.add_argument("--output-json", help="write the numbers to this JSON file")


def run_ours(
    model: str, prompts: list[list[int]], output_len: int, args: argparse.Namespace
) -> tuple[SystemRun, list[list[int]]]:
    from app.llm import LLM
    from core.protocol import SamplingParams

    engine_args: dict[str, Any] = {"dtype": args.dtype, "seed": args.seed}
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if getattr(args, name) is not None:
            engine_args[name] = getattr(args, name)
    llm = LLM(model, **engine_args)
    try:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    outputs = [r.token_ids for r in results]
    run = SystemRun("ringllm LLM", elapsed, len(prompts), sum(map(len, prompts)), sum(map(len, outputs)))
    return run, outputs


def run_transformers(
    model: str, prompts: list[list[int]], output_len: int, batch_size: int, dtype: str, pad_id: int
) -> tuple[SystemRun, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype), local_files_only=True).eval()

    def generate(batch: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(map(len, batch))  # left padding keeps every prompt's end aligned
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=pad_id, use_cache=True,
            )
        return out[:, width:].tolist()

    generate(prompts[:1], WARMUP_TOKENS)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outputs += generate(prompts[i : i + batch_size], output_len)
    elapsed = time.perf_counter() - start
    run = SystemRun("transformers generate", elapsed, len(prompts), sum(map(len, prompts)), sum(map(len, outputs)))
    return run, outputs


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
        from core.models.default_model import ensure_default_model

        model = ensure_default_model()
    tokenizer = load_tokenizer(model)
    prompts = random_token_ids(tokenizer, args.num_prompts, args.input_len, args.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    import torch

    print(
        f"model {model}: {args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out; "
        f"dtype {args.dtype}; torch threads {torch.get_num_threads()}"
    )
    summary: dict[str, Any] = {
        "model": model, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "dtype": args.dtype, "seed": args.seed,
    }
    ours, our_outputs = run_ours(model, prompts, args.output_len, args)
    runs = [ours]
    comparison = []
    if not args.skip_hf:
        batch = args.hf_max_batch_size or args.num_prompts
        hf, hf_outputs = run_transformers(model, prompts, args.output_len, batch, args.dtype, pad_id)
        runs.append(hf)
        same = sum(a == b for a, b in zip(our_outputs, hf_outputs, strict=True))
        ratio = ours.output_tokens_per_s / hf.output_tokens_per_s
        summary.update(hf_max_batch_size=batch, ratio_output_tokens_per_s=ratio, identical_outputs=same)
        comparison = [
            f"ratio ours / transformers (output tokens/s): {ratio:.2f}x",
            f"greedy outputs identical token for token: {same} of {len(prompts)}",
        ]
    print("\n".join([format_table(runs), *comparison]))
    summary["runs"] = [
        {**asdict(r), "requests_per_s": r.requests_per_s, "output_tokens_per_s": r.output_tokens_per_s,
         "total_tokens_per_s": r.total_tokens_per_s}
        for r in runs
    ]
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(summary, indent=1))
        print(f"saved to {args.output_json}")
    return 0
