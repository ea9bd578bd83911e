"""``python -m bench kv-quality``: what a float16 or q8_0 KV cache changes against a float32 one.

One engine per KV cache dtype, in this process, one after another, on the same model (a GGUF file
or a Hugging Face directory) and the same prompt: an English passage repeated to ``--prompt-len``
tokens, prefilled in chunks of ``--chunk`` tokens so that later chunks read the earlier ones' keys
and values back from the cache. Reported against float32's run:

- the prompt tokens' log-probabilities: the largest and the mean absolute difference, and where
  the top-1 token of a position differs (``top1_agree``: the share of positions that agree);
- ``--continue`` greedy tokens after the prompt: how many agree before the first difference.

The model's weights are read as the file holds them; only the cache differs between the runs.
Speed is not measured here (a prompt's prefill swamps a few decode steps' difference): use
``bench compare`` with ``--server-args "--kv-cache-dtype q8_0"``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

HELP = "logit deviation of float16 and q8_0 KV caches from float32 (quality, not speed)"

PASSAGE = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, counting each of the "
    "one hundred and twelve steps aloud. At the top he wound the great clockwork that turned the lens, "
    "trimmed the wick, and wrote the weather in a leather book: wind from the north-east, a swell "
    "building, three fishing boats late coming home. "
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a GGUF file or a Hugging Face directory")
    parser.add_argument("--kv-dtypes", default="float16,q8_0", help="compared with float32")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (the passage, repeated)")
    parser.add_argument("--chunk", type=int, default=128, help="prefill chunk (--max-num-batched-tokens)")
    parser.add_argument("--continue", dest="continue_tokens", type=int, default=64, help="greedy tokens after it")
    parser.add_argument("--json", help="also write the results here")


def _run(model: str, kv_cache_dtype: str, prompt: list[int] | str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from app.llm import LLM
    from core.protocol import SamplingParams

    llm = LLM(
        model, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=args.chunk, max_num_seqs=1,
        max_model_len=args.prompt_len + args.continue_tokens + 16, enable_prefix_caching=False,
    )
    try:
        if isinstance(prompt, str):  # the passage, cut to --prompt-len tokens of this tokenizer
            ids = llm.tokenizer.encode(prompt)
            prompt = (ids * (args.prompt_len // max(len(ids), 1) + 1))[: args.prompt_len]
        params = SamplingParams(max_tokens=args.continue_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
        (result,) = llm.generate([prompt], params)
        entries = result.prompt_logprobs
        # Column 0 is the prompt token's own log-probability; column 1 the position's top-1.
        logprobs = torch.tensor([row[0] for row in entries.logprobs])
        top1 = [row[1] if len(row) > 1 else row[0] for row in entries.token_ids]
        return {"prompt": prompt, "logprobs": logprobs, "top1": top1, "tokens": list(result.token_ids)}
    finally:
        llm.shutdown()


def compare(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    diff = (other["logprobs"] - reference["logprobs"]).abs()
    agree = sum(a == b for a, b in zip(reference["top1"], other["top1"])) / len(reference["top1"])
    same = 0
    for a, b in zip(reference["tokens"], other["tokens"]):
        if a != b:
            break
        same += 1
    return {
        "max_abs_logprob_diff": float(diff.max()),
        "mean_abs_logprob_diff": float(diff.mean()),
        "median_abs_logprob_diff": float(statistics.median(diff.tolist())),
        "top1_agree": agree,
        "greedy_tokens_equal_before_first_difference": same,
        "greedy_tokens": len(reference["tokens"]),
    }


def run(args: argparse.Namespace) -> int:
    runs = {"float32": _run(args.model, "float32", PASSAGE, args)}
    prompt = runs["float32"]["prompt"]
    results: dict[str, Any] = {"model": args.model, "prompt_tokens": len(prompt), "chunk": args.chunk}
    for dtype in [d for d in args.kv_dtypes.split(",") if d and d != "float32"]:
        runs[dtype] = _run(args.model, dtype, prompt, args)
        results[dtype] = compare(runs["float32"], runs[dtype])
    print(f"{args.model}: {len(prompt)} prompt tokens in chunks of {args.chunk}, against a float32 KV cache")
    for dtype, figures in results.items():
        if isinstance(figures, dict):
            print(f"  {dtype:>8}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in figures.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0
