"""bench.datasets: prompt lengths in tokens, shared prefixes, ShareGPT parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.datasets import (
    COPY_PASSAGES,
    load_tokenizer,
    random_token_ids,
    sample_copy,
    sample_prefix_repetition,
    sample_random,
    sample_sharegpt,
)


@pytest.fixture(scope="module")
def tokenizer(random_model_dir: str):
    return load_tokenizer(random_model_dir)


def count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_random_prompts_have_exactly_the_requested_tokens(tokenizer) -> None:
    requests = sample_random(tokenizer, 20, input_len=50, output_len=7, seed=3)
    assert [r.prompt_len for r in requests] == [50] * 20
    assert all(count(tokenizer, r.prompt) == 50 for r in requests)
    assert {r.expected_output_len for r in requests} == {7}
    assert len({r.prompt for r in requests}) == 20
    again = sample_random(tokenizer, 20, input_len=50, output_len=7, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in requests]


def test_random_range_ratio_and_shared_prefix(tokenizer) -> None:
    requests = sample_random(tokenizer, 40, input_len=40, output_len=10, range_ratio=0.5, prefix_len=12, seed=0)
    prefix = requests[0].prompt[:12]
    assert all(r.prompt.startswith(prefix) for r in requests)
    assert all(12 + 20 <= r.prompt_len <= 12 + 60 for r in requests)
    assert all(5 <= r.expected_output_len <= 15 for r in requests)
    assert len({r.prompt_len for r in requests}) > 1
    assert all(r.prompt_len == count(tokenizer, r.prompt) for r in requests)
    with pytest.raises(ValueError):
        sample_random(tokenizer, 1, 10, 10, range_ratio=1.0)


def test_prefix_repetition_is_n_prefixes_times_m_suffixes(tokenizer) -> None:
    requests = sample_prefix_repetition(
        tokenizer, 12, prefix_len=16, suffix_len=8, num_prefixes=3, output_len=5, seed=0
    )
    assert len(requests) == 12
    prefixes = {r.prompt[:16] for r in requests}  # one byte per token for this tokenizer
    assert len(prefixes) == 3
    assert all(sum(r.prompt.startswith(p) for r in requests) == 4 for p in prefixes)
    assert all(r.prompt_len == 24 and r.expected_output_len == 5 for r in requests)
    with pytest.raises(ValueError):
        sample_prefix_repetition(tokenizer, 10, 16, 8, 3, 5)


def test_copy_prompts_repeat_a_passage_and_stop_inside_it(stories_dir: str) -> None:
    tokenizer = load_tokenizer(stories_dir)
    requests = sample_copy(tokenizer, 10, input_len=100, output_len=9, seed=1)
    for r in requests:
        passage = next(p for p in COPY_PASSAGES if p in r.prompt)
        assert r.prompt.count(passage) >= 2  # repeated whole, then cut inside one more copy
        tail = r.prompt[r.prompt.rindex(passage) + len(passage):].strip()
        assert tail and passage.startswith(tail) and tail != passage
        assert 50 <= r.prompt_len <= 100 and r.prompt_len == count(tokenizer, r.prompt)
        assert r.expected_output_len == 9
    assert len({r.prompt for r in requests}) > 1
    own = sample_copy(tokenizer, 3, input_len=40, output_len=4, passages=["one two three four five six"], seed=0)
    assert all(r.prompt.count("one two three four five six") >= 2 for r in own)


def test_sharegpt_first_turns_filtered_and_repeated(tokenizer, tmp_path: Path) -> None:
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "Tell me a story about a dog."},
                                      {"from": "gpt", "value": "Once upon a time there was a dog."}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "only one turn"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = sample_sharegpt(tokenizer, str(path), num_prompts=3)
    # "Hi" is too short (< 4 tokens); the one-turn conversation is skipped; the dog is repeated.
    assert [r.prompt for r in requests] == ["Tell me a story about a dog."] * 3
    assert requests[0].expected_output_len == len(tokenizer("Once upon a time there was a dog.").input_ids)
    fixed = sample_sharegpt(tokenizer, str(path), num_prompts=1, output_len=9)
    assert fixed[0].expected_output_len == 9


def test_random_token_ids_for_offline_runs(tokenizer) -> None:
    prompts = random_token_ids(tokenizer, 3, 17, seed=1)
    assert [len(p) for p in prompts] == [17, 17, 17]
    assert not set().union(*prompts) & set(tokenizer.all_special_ids)


def test_stories_tokenizer_lengths_are_close(stories_dir: str) -> None:
    stories = load_tokenizer(stories_dir)
    requests = sample_random(stories, 10, input_len=64, output_len=4, seed=0)
    assert all(r.prompt_len == count(stories, r.prompt) for r in requests)
    assert all(abs(r.prompt_len - 64) <= 2 for r in requests)
