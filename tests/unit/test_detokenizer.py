"""IncrementalDetokenizer against the oracle ``decode(prompt + out) - decode(prompt)``.

Two real tokenizers: stories260K (sentencepiece-style: byte fallback, a
leading space dropped by the decoder) and a byte-level BPE trained here with
the ``tokenizers`` library (GPT-2 style). Both split CJK characters and emoji
over several tokens.
"""

from __future__ import annotations

import random

import pytest

from app.detokenizer import IncrementalDetokenizer
from core.models.default_model import DEFAULT_MODEL_DIR as STORIES_DIR
from tests.support.tokenizers import CORPUS, build_byte_level_tokenizer


@pytest.fixture(scope="module")
def byte_level():
    return build_byte_level_tokenizer()


@pytest.fixture(scope="module")
def stories():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(STORIES_DIR))


@pytest.fixture(params=["byte_level", "stories"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


def oracle(tokenizer, prompt: list[int], out: list[int], skip_special_tokens: bool = True) -> tuple[str, str]:
    """(continuation text, full text) as one full decode sees it."""
    full = tokenizer.decode(prompt + out, skip_special_tokens=skip_special_tokens)
    head = tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)
    # Only invalid UTF-8 can make the prompt's text change when ids follow it
    # (byte fallback turns a whole run of bytes into U+FFFD when one is bad).
    assert full.startswith(head) or "\ufffd" in full
    return full[len(head):], full


def stream(tokenizer, prompt, out, chunks=None, skip_special_tokens=True) -> list[str]:
    """Deltas from feeding ``out`` in ``chunks`` (default: one token at a time), then flush."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    deltas, i = [], 0
    for size in chunks or [1] * len(out):
        deltas.append(detok.update(out[i : i + size]))
        i += size
    deltas.append(detok.flush())
    assert detok.output_token_ids == out
    return deltas


def random_case(tokenizer, rng: random.Random, wellformed: bool) -> tuple[list[int], list[int]]:
    """A text prompt and an output of either encoded text pieces or arbitrary ids."""
    prompt = tokenizer.encode(rng.choice(CORPUS)[: rng.randint(1, 40)])
    if wellformed:
        out: list[int] = []
        while len(out) < 12:
            text = rng.choice(CORPUS)
            start = rng.randrange(len(text))
            out += tokenizer.encode(text[start : start + rng.randint(1, 12)], add_special_tokens=False)
    else:
        out = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 16))]
    return prompt, out


def test_matches_full_decode_on_wellformed_text(tokenizer) -> None:
    rng = random.Random(1234)
    for _ in range(400):
        prompt, out = random_case(tokenizer, rng, wellformed=True)
        expected, full = oracle(tokenizer, prompt, out)
        assert "\ufffd" not in full
        deltas = stream(tokenizer, prompt, out)
        assert "".join(deltas) == expected, (prompt, out)
        assert not any("\ufffd" in d for d in deltas)


def test_matches_full_decode_on_random_ids(tokenizer) -> None:
    """Arbitrary ids (special tokens, stray bytes): exact whenever the decode is valid text."""
    rng = random.Random(99)
    checked = 0
    for _ in range(1500):
        prompt, out = random_case(tokenizer, rng, wellformed=False)
        expected, full = oracle(tokenizer, prompt, out)
        deltas = stream(tokenizer, prompt, out)
        if "\ufffd" not in full:
            checked += 1
            assert "".join(deltas) == expected, (prompt, out)
            assert not any("\ufffd" in d for d in deltas)
    assert checked > 100


def test_byte_level_is_exact_even_for_invalid_utf8(byte_level) -> None:
    """Byte-level BPE decodes the byte string as a whole, so invalid UTF-8 matches too."""
    rng = random.Random(7)
    seen_invalid = False
    for _ in range(800):
        prompt, out = random_case(byte_level, rng, wellformed=False)
        expected, full = oracle(byte_level, prompt, out)
        seen_invalid |= "\ufffd" in expected
        assert "".join(stream(byte_level, prompt, out)) == expected
    assert seen_invalid


def test_chunked_updates_give_the_same_text(tokenizer) -> None:
    rng = random.Random(5)
    for _ in range(200):
        prompt, out = random_case(tokenizer, rng, wellformed=True)
        chunks, left = [], len(out)
        while left:
            chunks.append(min(left, rng.randint(1, 4)))
            left -= chunks[-1]
        assert "".join(stream(tokenizer, prompt, out, chunks)) == oracle(tokenizer, prompt, out)[0]


# Characters the byte-level tokenizer never saw in training: raw byte tokens.
@pytest.mark.parametrize("text", ["猫咪很可爱！", " 🐍🦀 ok", " jalapeño 🌶️ done", "Ελληνικά λέξεις"])
def test_multibyte_characters_appear_whole_and_once(tokenizer, text) -> None:
    prompt = tokenizer.encode("Once upon a time")
    out = tokenizer.encode(text, add_special_tokens=False)
    expected, _ = oracle(tokenizer, prompt, out)
    deltas = stream(tokenizer, prompt, out)
    assert "".join(deltas) == expected
    assert all("\ufffd" not in d for d in deltas)
    # At least one character really was split over tokens, and was held back.
    assert len(out) > len(expected.strip())
    assert "" in deltas[:-1]


def test_leading_space_of_the_continuation_is_kept(stories) -> None:
    prompt = stories.encode("Once upon a time")
    out = stories.encode("Once upon a time there was", add_special_tokens=False)[-2:]  # "▁there", "▁was"
    deltas = stream(stories, prompt, out)
    assert deltas[:2] == [" there", " was"]


def test_prompt_of_only_bos_drops_the_first_space_like_decode(stories) -> None:
    out = stories.encode("Hello world", add_special_tokens=False)
    deltas = stream(stories, [stories.bos_token_id], out)
    full = stories.decode([stories.bos_token_id] + out, skip_special_tokens=True)
    assert "".join(deltas) == "Hello world" == full


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_inside_the_output(tokenizer, skip) -> None:
    eos = tokenizer.eos_token_id
    words = tokenizer.encode(" and then the end", add_special_tokens=False)
    prompt = tokenizer.encode("Once upon a time")
    out = [eos] + words[:2] + [eos, eos] + words[2:]
    expected, _ = oracle(tokenizer, prompt, out, skip_special_tokens=skip)
    assert "".join(stream(tokenizer, prompt, out, skip_special_tokens=skip)) == expected


def test_incomplete_character_at_the_end_is_flushed_like_decode(tokenizer) -> None:
    prompt = tokenizer.encode("Hi")
    emoji = tokenizer.encode(" 😀", add_special_tokens=False)
    out = emoji[:-1]  # the last byte never comes
    detok = IncrementalDetokenizer(tokenizer, prompt)
    held = "".join(detok.update([t]) for t in out)
    assert "\ufffd" not in held
    assert held + detok.flush() == oracle(tokenizer, prompt, out)[0]


def test_prompt_ending_in_special_tokens_keeps_the_space(tokenizer) -> None:
    """The first window must reach back past tokens that decode to nothing."""
    prompt = tokenizer.encode("Once upon a time") + [tokenizer.eos_token_id] * 8
    out = tokenizer.encode(" there was", add_special_tokens=False)
    expected, _ = oracle(tokenizer, prompt, out)
    assert expected.startswith(" there")
    assert "".join(stream(tokenizer, prompt, out)) == expected
