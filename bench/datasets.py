"""Benchmark prompts: ``random``, ``sharegpt`` and ``prefix_repetition``, as in ``vllm bench serve``,
and ``copy``, whose continuations repeat spans of the prompt (n-gram speculation's workload).

Random prompts are made as vLLM makes them: random token ids decoded to text.
Text does not always re-tokenize to the ids it came from (byte pieces that
are not valid UTF-8 on their own, BPE merges across the joins), so the text is
re-encoded, cut or topped up, and decoded again until it holds exactly the
wanted number of tokens; the recorded prompt length is what the tokenizer
counts for the final text (without special tokens such as BOS, which the
server may add). Ids are drawn from tokens whose own text re-encodes to
themselves, which makes the count exact in practice.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATASETS = ("random", "sharegpt", "prefix_repetition", "copy")
# The copy dataset's passages unless --dataset-path gives a text file (one passage a line): plain
# sentences that even a tiny story model continues when it has seen them repeated.
COPY_PASSAGES = (
    "The little dog ran to the park and found a red ball under the big tree.",
    "Mia likes to bake cakes with her dad when it rains outside.",
    "Ben saw a bird in the garden, and the bird sang a happy song for him.",
    "Every morning the old cat sleeps in the sun by the kitchen door.",
    "Sam and Lily built a tall tower of blocks, and then it fell down.",
    "The boat went out on the blue sea, and the children waved from the shore.",
    "Grandma gave Tom a warm hat, and he wore it all winter long.",
    "A small frog jumped from the pond onto a green leaf and sat still.",
)
MAX_FIXUP_ROUNDS = 10

# ShareGPT filters, vLLM's defaults: too short to be meaningful, or too long to fit.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass
class SampleRequest:
    """One benchmark request: the prompt text, its length in tokens, and how many tokens to ask for."""

    prompt: str
    prompt_len: int
    expected_output_len: int


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", help="ShareGPT JSON file (sharegpt), or a text file of passages, one a line (copy)")
    g.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (random dataset)")
    g.add_argument("--random-output-len", type=int, default=128, help="tokens to generate (random dataset)")
    g.add_argument(
        "--random-range-ratio", type=float, default=0.0,
        help="lengths drawn uniformly from [len*(1-r), len*(1+r)], 0 <= r < 1",
    )
    g.add_argument("--random-prefix-len", type=int, default=0, help="tokens of one prefix shared by all prompts")
    g.add_argument("--sharegpt-output-len", type=int, help="output length for every ShareGPT request")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--copy-input-len", type=int, default=256,
                   help="copy dataset: prompt tokens, a passage repeated and cut inside its last repeat")
    g.add_argument("--copy-output-len", type=int, default=128)


def load_tokenizer(path: str) -> Any:
    """The Hugging Face tokenizer of a local directory (never the network)."""
    from transformers import AutoTokenizer  # heavy import: only when a dataset needs it

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class TokenTextSampler:
    """Random text of an exact token count for one tokenizer."""

    def __init__(self, tokenizer: Any, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.candidate_ids = stable_token_ids(tokenizer)
        self.mismatched = 0  # prompts whose final length missed the target

    def random_ids(self, n: int) -> list[int]:
        return self.rng.choice(self.candidate_ids, size=n).tolist() if n > 0 else []

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, num_tokens: int) -> tuple[str, int]:
        """Text of ``num_tokens`` random tokens, and the count the tokenizer gives it."""
        return self.fit(self.random_ids(num_tokens), num_tokens)

    def fit(self, ids: list[int], target: int) -> tuple[str, int]:
        """Decode ``ids``, then re-encode, cut or top up until the text is ``target`` tokens."""
        text = self.tokenizer.decode(ids)
        for _ in range(MAX_FIXUP_ROUNDS):
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == target:
                return text, target
            ids = ids[:target] if len(ids) > target else ids + self.random_ids(target - len(ids))
            text = self.tokenizer.decode(ids)
        actual = self.count(text)
        self.mismatched += actual != target
        return text, actual


def stable_token_ids(tokenizer: Any) -> np.ndarray:
    """Ids of the non-special tokens whose decoded text encodes back to that one id."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids])
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    stable = [i for i, enc in zip(ids, encoded) if enc == [i]]
    if not stable:  # an odd tokenizer: fall back to every ordinary token
        stable = ids
    return np.asarray(stable, dtype=np.int64)


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    low, high = int(mean * (1 - ratio)), int(mean * (1 + ratio))
    return rng.integers(low, high + 1, size=n)


def sample_random(
    tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
    range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0,
) -> list[SampleRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    sampler = TokenTextSampler(tokenizer, rng)
    input_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = np.maximum(_lengths(rng, output_len, range_ratio, num_prompts), 1)
    prefix, _ = sampler.text(prefix_len) if prefix_len > 0 else ("", 0)
    requests = []
    for in_len, out_len in zip(input_lens.tolist(), output_lens.tolist()):
        body, _ = sampler.text(max(int(in_len), 1))
        prompt = prefix + body
        requests.append(SampleRequest(prompt, sampler.count(prompt), int(out_len)))
    _warn_mismatch(sampler)
    return requests


def sample_prefix_repetition(
    tokenizer: Any, num_prompts: int, prefix_len: int, suffix_len: int,
    num_prefixes: int, output_len: int, seed: int = 0,
) -> list[SampleRequest]:
    """``num_prefixes`` prefixes, each followed by ``num_prompts / num_prefixes`` suffixes, shuffled."""
    if num_prefixes < 1 or num_prompts % num_prefixes:
        raise ValueError(
            f"--num-prompts ({num_prompts}) must be a multiple of "
            f"--prefix-repetition-num-prefixes ({num_prefixes})"
        )
    rng = np.random.default_rng(seed)
    sampler = TokenTextSampler(tokenizer, rng)
    requests = []
    for _ in range(num_prefixes):
        prefix, _ = sampler.text(prefix_len)
        for _ in range(num_prompts // num_prefixes):
            suffix, _ = sampler.text(suffix_len)
            prompt = prefix + suffix
            requests.append(SampleRequest(prompt, sampler.count(prompt), output_len))
    random.Random(seed).shuffle(requests)
    _warn_mismatch(sampler)
    return requests


def sample_copy(
    tokenizer: Any, num_prompts: int, input_len: int, output_len: int, passages: list[str] | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts that repeat one passage (``passages``, default COPY_PASSAGES) as often as
    ``input_len`` tokens hold, then start it once more and stop at a random point: the
    natural continuation copies the rest of the passage and goes on repeating it."""
    passages = list(passages or COPY_PASSAGES)
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_prompts):
        passage = tokenizer.encode(" " + passages[int(rng.integers(len(passages)))].strip(), add_special_tokens=False)
        whole = max((input_len - 1) // len(passage), 1)  # copies before the cut one
        cut = int(rng.integers(1, max(min(len(passage), input_len - whole * len(passage) + 1), 2)))
        ids = passage * whole + passage[:cut]
        prompt = tokenizer.decode(ids)
        requests.append(SampleRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), output_len))
    return requests


def sample_sharegpt(
    tokenizer: Any, path: str, num_prompts: int, output_len: int | None = None, seed: int = 0
) -> list[SampleRequest]:
    """First human turn as the prompt; the reply's length as the output length, unless fixed.

    Conversations are shuffled with the seed; too short or too long ones are
    skipped (vLLM's limits); if too few remain, some are repeated.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    conversations = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(conversations)
    requests: list[SampleRequest] = []
    for conv in conversations:
        if len(requests) == num_prompts:
            break
        prompt, reply = conv[0]["value"], conv[1]["value"]
        prompt_len = len(tokenizer(prompt).input_ids)
        out_len = output_len if output_len is not None else len(tokenizer(reply).input_ids)
        too_short = prompt_len < SHAREGPT_MIN_LEN or (output_len is None and out_len < SHAREGPT_MIN_LEN)
        too_long = prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + out_len > SHAREGPT_MAX_TOTAL_LEN
        if not (too_short or too_long):
            requests.append(SampleRequest(prompt, prompt_len, out_len))
    if not requests:
        raise ValueError(f"{path}: no usable conversation (need two turns within the length limits)")
    if len(requests) < num_prompts:
        print(f"note: {path} has {len(requests)} usable conversations; repeating some to make {num_prompts}")
        requests += random.Random(seed).choices(requests, k=num_prompts - len(requests))
    return requests


def sample_requests(
    args: argparse.Namespace, tokenizer: Any, num_prompts: int | None = None, seed: int | None = None,
) -> list[SampleRequest]:
    """The requests that the dataset options describe (``num_prompts`` and ``seed`` in place of
    the options' when given)."""
    num_prompts = args.num_prompts if num_prompts is None else num_prompts
    seed = args.seed if seed is None else seed
    if args.dataset_name == "random":
        return sample_random(
            tokenizer, num_prompts, args.random_input_len, args.random_output_len,
            args.random_range_ratio, args.random_prefix_len, seed,
        )
    if args.dataset_name == "prefix_repetition":
        return sample_prefix_repetition(
            tokenizer, num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len, seed,
        )
    if args.dataset_name == "copy":
        passages = None
        if args.dataset_path:
            passages = [line for line in Path(args.dataset_path).read_text(encoding="utf-8").splitlines() if line.strip()]
        return sample_copy(tokenizer, num_prompts, args.copy_input_len, args.copy_output_len, passages, seed)
    if args.dataset_name == "sharegpt":
        if not args.dataset_path or not Path(args.dataset_path).is_file():
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT JSON file)")
        return sample_sharegpt(tokenizer, args.dataset_path, num_prompts, args.sharegpt_output_len, seed)
    raise ValueError(f"unknown dataset {args.dataset_name!r}")


def random_token_ids(tokenizer: Any, num_prompts: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """Prompts given as token ids (offline benchmarks: both systems see the very same ids)."""
    rng = np.random.default_rng(seed)
    candidates = stable_token_ids(tokenizer)
    return [rng.choice(candidates, size=input_len).tolist() for _ in range(num_prompts)]


def _warn_mismatch(sampler: TokenTextSampler) -> None:
    if sampler.mismatched:
        print(f"note: {sampler.mismatched} prompts re-tokenize to a length other than asked for")

