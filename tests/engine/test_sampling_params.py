"""Penalties, min_p, logit_bias, allowed_token_ids, bad words and min_tokens.

The sampler against a plain reference implementation over a fixed logits
tensor (all in one batch, neighbours with other parameters); repetition
penalty against transformers' generate; the others through the whole engine;
and rows that get exactly what they would get alone, with the GPU path's
deferred tokens too.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
import transformers

from app.llm import LLM
from core.protocol import SamplingParams
from core.worker.sampler import Sampler
from core.worker.sampling_batch import SamplingBatch, _fold_tokens, sampling_metadata
from tests.support.gpu_paths import take_gpu_paths
from tests.support.oracle import load_hf

VOCAB = 40
ENGINE = dict(dtype="float32", kv_cache_dtype="float32", device="cpu", block_size=4, max_num_seqs=8, max_model_len=128, max_num_batched_tokens=32)


def reference_logits(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """What a row's logits become before sampling, written plainly token by token:
    bias, repetition (HF: divide positive, multiply negative), frequency and
    presence (OpenAI), temperature, then min_p."""
    x = logits.double().clone()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    for token in set(prompt) | set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token, count in collections.Counter(output).items():
        x[token] -= p.frequency_penalty * count + p.presence_penalty
    if p.greedy:
        return x.float()
    x = x / p.temperature
    if p.min_p:
        probs = x.softmax(-1)
        x[probs < p.min_p * probs.max()] = float("-inf")
    return x.float()


ROWS = [
    SamplingParams(temperature=0.0, presence_penalty=0.8),
    SamplingParams(temperature=0.0, frequency_penalty=0.6),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
    SamplingParams(temperature=0.0, repetition_penalty=0.7),
    SamplingParams(temperature=0.8, min_p=0.2, seed=1),
    SamplingParams(
        temperature=1.3, min_p=0.05, presence_penalty=-0.5, frequency_penalty=1.1, repetition_penalty=1.2,
        logit_bias={3: 2.5, 7: -4.0}, seed=2,
    ),
    SamplingParams(temperature=0.0),  # a plain neighbour
    SamplingParams(temperature=1.0, frequency_penalty=-1.5, seed=3),
]


def test_penalties_and_min_p_equal_the_reference() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(ROWS), VOCAB, generator=g) * 3
    history = [torch.randint(0, VOCAB, (12,), generator=g).tolist() for _ in ROWS]
    prompt_len = 5
    params = [SamplingParams(**{**_fields(p), "logprobs": VOCAB}) for p in ROWS]
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    md = sampling_metadata(
        params, VOCAB, gens, history, [prompt_len] * len(ROWS), processed_logprobs=True
    )
    original = logits.clone()
    out = Sampler()(logits, md)
    assert torch.equal(logits, original)  # the caller's logits are left alone
    assert out.logprobs is not None
    for i, (p, h) in enumerate(zip(params, history)):
        expected = reference_logits(logits[i], p, h[:prompt_len], h[prompt_len:]).log_softmax(-1)
        got = out.logprobs.logprobs[i, 1:]  # the whole vocabulary, most likely first
        torch.testing.assert_close(got, expected.sort(descending=True).values, atol=1e-5, rtol=0)
        torch.testing.assert_close(expected[out.logprobs.token_ids[i, 1:].long()], got, atol=1e-5, rtol=0)
        token = int(out.token_ids[i])
        if p.greedy:
            assert token == int(expected.argmax())
        else:
            assert expected[token].isfinite()  # never a token that min_p cut
    assert int(out.token_ids[6]) == int(logits[6].argmax())


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__struct_fields__}


def test_penalty_state_updated_by_deltas_equals_one_built_from_the_history() -> None:
    """Sampled tokens are folded into a request's penalty rows one at a time;
    the rows must equal those built from scratch from the same history (which
    is what a request resumed after preemption gets)."""
    g = torch.Generator().manual_seed(1)
    history = torch.randint(0, VOCAB, (30,), generator=g).tolist()
    prompt_len = 10
    params = SamplingParams(presence_penalty=0.4, frequency_penalty=-0.3, repetition_penalty=1.7)
    stepped = SamplingBatch(4, VOCAB, torch.device("cpu"))
    stepped.add(2, SamplingParams(), [1, 2], 2, None, None)  # a neighbour without penalties
    stepped.add(0, params, history[:prompt_len], prompt_len, None, None)
    rows = np.array([2, 0])
    for token in history[prompt_len:]:
        stepped.record_sampled(rows, torch.tensor([5, token]))
    fresh = SamplingBatch(4, VOCAB, torch.device("cpu"))
    fresh.add(0, params, history, prompt_len, None, None)
    for name in ("planes", "seen"):
        got = stepped.penalty_table[name][int(stepped.penalty_slot[0])]
        torch.testing.assert_close(got, fresh.penalty_table[name][int(fresh.penalty_slot[0])], atol=1e-6, rtol=0)


def test_folding_tokens_with_torch_equals_numpy() -> None:
    """A CPU folds sampled tokens in numpy; a GPU does the same with torch."""
    g = torch.Generator().manual_seed(2)
    planes = torch.rand(6, 3, VOCAB, generator=g)
    seen = torch.rand(6, VOCAB, generator=g).round()
    slots, tokens = torch.tensor([0, 3, 5]), torch.tensor([7, 7, 30])
    p = torch.rand(3, 4, generator=g)
    before = planes.clone(), seen.clone()
    by_numpy = planes.clone(), seen.clone()
    _fold_tokens(by_numpy[0].view(-1).numpy(), by_numpy[1].view(-1).numpy(), slots.numpy(), tokens.numpy(), VOCAB, p.numpy())
    _fold_tokens(planes.view(-1), seen.view(-1), slots, tokens, VOCAB, p)
    assert torch.equal(planes, by_numpy[0]) and torch.equal(seen, by_numpy[1])
    assert not torch.equal(planes, before[0]) and seen[3, 7] == 1


@pytest.fixture(scope="module", params=["stories260K", "tiny-llama"])
def model(request, stories_dir, llama):
    if request.param == "stories260K":
        return load_hf(stories_dir), stories_dir
    return llama


def test_repetition_penalty_greedy_equals_transformers(model) -> None:
    hf, path = model
    g = torch.Generator().manual_seed(9)
    prompts = [[1, *torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()] for n in (4, 30)]
    new = 24
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                repetition_penalty=1.3, eos_token_id=None, pad_token_id=0,
                generation_config=transformers.GenerationConfig(),
            )
        expected.append(out[0, len(prompt):].tolist())
    llm = LLM(path, **ENGINE)
    try:
        params = SamplingParams(max_tokens=new, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
        plain = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        results = llm.generate(prompts + prompts, [params, params, plain, plain])
    finally:
        llm.shutdown()
    assert [r.token_ids for r in results[:2]] == expected
    assert [r.token_ids for r in results[2:]] != expected  # the penalty changed something


def test_presence_and_frequency_greedy_equal_the_reference_on_transformers_logits(model) -> None:
    """Greedy decoding with presence, frequency and repetition penalties and a
    logit bias: at every step the engine's token is the argmax of the
    reference penalties applied to transformers' logits for the same history."""
    hf, path = model
    prompt = [1, 45, 90, 45, 7, 90, 12]
    params = SamplingParams(
        max_tokens=20, temperature=0.0, presence_penalty=0.9, frequency_penalty=0.7, repetition_penalty=1.1,
        logit_bias={prompt[1]: 1.5}, ignore_eos=True,
    )
    llm = LLM(path, **ENGINE)
    try:
        (result,) = llm.generate([prompt], params)
    finally:
        llm.shutdown()
    output: list[int] = []
    for token in result.token_ids:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, -1].float()
        expected = reference_logits(logits, params, prompt, output)
        top2 = expected.topk(2).values
        assert token == int(expected.argmax()) or top2[0] - top2[1] < 1e-4
        output.append(token)
    assert len(set(output)) > 5


@pytest.fixture(scope="module")
def stories_llm(stories_dir):
    llm = LLM(stories_dir, **ENGINE)
    yield llm
    llm.shutdown()


def test_logit_bias_allowed_tokens_and_min_tokens(stories_llm) -> None:
    prompt = stories_llm.tokenizer.encode("Once upon a time")
    eos = stories_llm.tokenizer.eos_token_id
    allowed = [300, 301, 302, 303, 304]
    biased, restricted, held, base = stories_llm.generate(
        [prompt] * 4,
        [
            SamplingParams(max_tokens=10, temperature=0.0, logit_bias={123: 100.0}, ignore_eos=True),
            SamplingParams(max_tokens=30, temperature=1.0, seed=4, allowed_token_ids=allowed, ignore_eos=True),
            # EOS is the only likely token; min_tokens holds it back for 4 tokens.
            SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=4),
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        ],
    )
    assert biased.token_ids == [123] * 10
    assert set(restricted.token_ids) <= set(allowed) and len(set(restricted.token_ids)) > 1
    assert held.token_ids[:4] == base.token_ids[:4] and held.token_ids[4:] == [eos]
    assert held.finish_reason == "stop"


def test_bad_words_of_one_and_several_tokens(stories_llm) -> None:
    tokenizer = stories_llm.tokenizer
    prompt = tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    (base,) = stories_llm.generate([prompt], params)
    assert "little girl named Lily" in base.text
    single = tokenizer.encode("Lily", add_special_tokens=False)
    pair = tokenizer.encode("little girl", add_special_tokens=False)
    assert len(single) == 1 and len(pair) > 2
    no_lily, no_pair = stories_llm.generate(
        [prompt, prompt],
        [
            SamplingParams(**{**_fields(params), "bad_words_token_ids": [single]}),
            SamplingParams(**{**_fields(params), "bad_words_token_ids": [pair]}),
        ],
    )
    assert single[0] not in no_lily.token_ids
    assert no_lily.token_ids[: base.token_ids.index(single[0])] == base.token_ids[: base.token_ids.index(single[0])]
    ids, n = no_pair.token_ids, len(pair)
    assert pair[0] in ids and all(ids[i : i + n] != pair for i in range(len(ids)))
    assert "little girl" not in no_pair.text


MIXED = [
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=0.0, repetition_penalty=1.4, ignore_eos=True, logprobs=3),
    SamplingParams(
        max_tokens=14, temperature=1.0, seed=11, presence_penalty=0.7, frequency_penalty=0.3, min_p=0.05,
        ignore_eos=True, logprobs=5,
    ),
    SamplingParams(max_tokens=14, temperature=0.0, logit_bias={300: 3.0}, prompt_logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=0.9, seed=12, top_k=20, top_p=0.9, ignore_eos=True),
    SamplingParams(
        max_tokens=14, temperature=1.0, seed=13, allowed_token_ids=list(range(280, 400)),
        bad_words_token_ids=[[300], [301, 302]], ignore_eos=True,
    ),
]


def _mixed_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(21)
    return [[1, *torch.randint(3, vocab, (n,), generator=g).tolist()] for n in (5, 9, 3, 30, 12, 7)]


def _same_results(together, alone) -> None:
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids
        for x, y in ((a.logprobs, b.logprobs), (a.prompt_logprobs, b.prompt_logprobs)):
            assert (x is None) == (y is None)
            if x is not None:
                # Batched and single matmuls round differently (~1e-6): the values
                # agree to that, and a rank only where that decides a near-tie.
                assert [ids[0] for ids in x.token_ids] == [ids[0] for ids in y.token_ids]
                np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=1e-5, atol=1e-5)
                assert np.abs(np.subtract(x.ranks, y.ranks)).max() <= 2


def test_a_row_gets_what_it_would_get_alone(stories_dir) -> None:
    llm = LLM(stories_dir, **ENGINE)
    try:
        prompts = _mixed_prompts(512)
        together = llm.generate(prompts, MIXED)
        alone = [llm.generate([p], q)[0] for p, q in zip(prompts, MIXED)]
    finally:
        llm.shutdown()
    _same_results(together, alone)
    assert together[1].logprobs is not None and together[0].logprobs is None


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_deferred_gpu_path_gives_the_same_results(stories_dir, monkeypatch, async_scheduling) -> None:
    """Placeholders in the persistent batch (the GPU path, emulated) change nothing:
    penalty counts are updated on the device, bad-word rows read their real ids."""
    prompts = _mixed_prompts(512)
    llm = LLM(stories_dir, **ENGINE)
    try:
        expected = llm.generate(prompts, MIXED)
    finally:
        llm.shutdown()
    take_gpu_paths(monkeypatch)
    llm = LLM(stories_dir, async_scheduling=async_scheduling, **ENGINE)
    try:
        assert llm.engine.engine_core.model_executor.runner.defer_sampled_tokens
        _same_results(llm.generate(prompts, MIXED), expected)
    finally:
        llm.shutdown()
