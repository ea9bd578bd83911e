"""Speculative decoding (n-gram drafts) through the whole engine.

Greedy output must be the output without speculation, token for token, and
transformers' (the oracle); random sampling must keep the target's
distribution, tested against transformers' own probabilities; a request
preempted or aborted with drafts in flight must give back every KV block.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import numpy as np
import pytest
import torch
import transformers

from app.llm import LLM
from core.config import EngineArgs, SpeculativeConfig
from core.engine_core import EngineCore
from core.protocol import EngineCoreRequest, SamplingParams
from core.spec_decode.ngram_proposer import NgramProposer
from core.spec_decode.rejection_sampler import rejection_sample
from core.spec_decode.spec_gate import (
    CLOSED_STEPS,
    STEPS_BEFORE_A_PLAIN_MEASURE,
    SpeculationGate,
)
from core.worker.sampler import TargetDistribution
from core.worker.sampling_batch import sampling_metadata
from tests.support.engines import BASE, hf_greedy


@pytest.fixture(autouse=True)
def _draft_at_every_step(monkeypatch) -> None:
    """Drafts wherever there are some, whatever this machine measures (core/spec_decode/spec_gate.py):
    the assertions below count them."""
    monkeypatch.setenv("RINGLLM_SPEC_DECODE_GATE", "0")


SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
MAX_NEW = 40


def _proposer(k: int = 3, low: int = 1, high: int = 3) -> NgramProposer:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=low, prompt_lookup_max=high)
    return NgramProposer(config.resolved())


def test_ngram_proposer_takes_the_longest_then_most_recent_match() -> None:
    propose = _proposer().propose
    # "7 8" occurs twice: the longer match "6 7 8" (at the start) wins over the later "9 7 8".
    assert propose(np.array([6, 7, 8, 1, 2, 3, 9, 7, 8, 4, 5, 6, 7, 8])).tolist() == [1, 2, 3]
    # Equal lengths: the most recent occurrence that k tokens follow.
    assert propose(np.array([5, 1, 2, 5, 3, 4, 5])).tolist() == [3, 4, 5]
    # Fewer than k tokens follow the match.
    assert propose(np.array([1, 2, 3, 1, 2])).tolist() == [3, 1, 2]
    assert propose(np.array([1, 2, 3, 4])).tolist() == []  # no earlier occurrence of the last token
    assert _proposer(low=2).propose(np.array([9, 1, 2, 3, 1])).tolist() == []  # a match shorter than the minimum
    # A run of one token: the most recent longest match that k tokens follow.
    assert propose(np.array([4, 4, 4, 4, 4, 4]), k=2).tolist() == [4, 4]
    assert propose(np.array([4, 4, 4, 4]), k=2).tolist() == [4]  # the only longest match is the last


def test_the_gate_closes_while_drafting_is_slower_and_measures_again() -> None:
    gate = SpeculationGate()
    for _ in range(STEPS_BEFORE_A_PLAIN_MEASURE - 1):  # drafts at every step: no plain rate yet
        gate.observe(True, 3, 0.01)
    assert gate.open
    gate.observe(True, 3, 0.01)
    assert not gate.open  # closed, to measure plain steps
    for _ in range(CLOSED_STEPS):
        gate.observe(False, 1, 0.002)  # 500 tokens/s without drafts, against 300 with them
    assert gate.open and gate.rates[True] is None  # drafts get a fresh measure
    for closed_for in (CLOSED_STEPS, 2 * CLOSED_STEPS):  # still slower: closed again, longer each time
        gate.observe(True, 3, 0.01)
        for _ in range(closed_for):
            assert not gate.open
            gate.observe(False, 1, 0.002)
        assert gate.open
    for _ in range(4 * CLOSED_STEPS):
        gate.observe(False, 1, 0.01)  # plain decoding got slower (a larger model's load, say)
    gate.observe(True, 3, 0.01)
    assert gate.open and gate.penalty == CLOSED_STEPS  # drafts pay again
    disabled = SpeculationGate(enabled=False)
    for _ in range(100):
        disabled.observe(True, 1, 1.0)
        disabled.observe(False, 100, 1.0)
    assert disabled.open


def test_speculative_config_is_checked(stories_dir) -> None:
    def resolve(**fields):
        return SpeculativeConfig(**{"method": "ngram", "num_speculative_tokens": 3, **fields}).resolved()

    assert (resolve().prompt_lookup_min, resolve().prompt_lookup_max) == (2, 5)
    assert (resolve(prompt_lookup_max=1).prompt_lookup_min, resolve(prompt_lookup_min=4).prompt_lookup_max) == (1, 4)
    for bad, message in [
        (dict(method="eagle"), "speculative method"),
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
        (dict(disable_by_batch_size=1), "disable_by_batch_size"),
        (dict(method="draft_model"), "needs \"model\""),
        (dict(method="draft_model", model="/x", prompt_lookup_max=3), "for the ngram method"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve(**bad)
    with pytest.raises(ValueError, match="async-scheduling"):
        EngineArgs(model=stories_dir, speculative_config=SPEC, async_scheduling=True).resolve()


def _run(path: str, prompts, params, spec: SpeculativeConfig | None, **engine_args):
    """Token ids per prompt, the speculative decoding totals, and whether every KV block came back."""
    llm = LLM(path, **{**BASE, "max_num_seqs": 16, "speculative_config": spec, **engine_args})
    try:
        results = llm.generate(prompts, params)
        scheduler = llm.engine.engine_core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        all_free = pool.get_num_free_blocks() == pool.num_usable_blocks
        return [r.token_ids for r in results], scheduler.spec_stats, scheduler.num_preemptions, all_free, results
    finally:
        llm.shutdown()


def _copy_heavy_prompts(vocab: int, count: int) -> list[list[int]]:
    """Prompts that repeat a span: the continuation often copies it, as n-gram speculation expects."""
    g = torch.Generator().manual_seed(21)
    prompts = []
    for i in range(count):
        span = torch.randint(3, vocab, (6 + i % 5,), generator=g).tolist()
        prompts.append(span * 3 + span[:2])
    return prompts


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def copy_heavy(llama):
    """``copy_heavy(n)``: n copy-heavy prompts and transformers' greedy continuations of them,
    computed once per n: the reference of every engine configuration below."""
    model, _ = llama

    @functools.cache
    def prompts_and_greedy(count: int) -> tuple[list[list[int]], list[list[int]]]:
        prompts = _copy_heavy_prompts(model.config.vocab_size, count)
        return prompts, [hf_greedy(model, p, MAX_NEW) for p in prompts]

    return prompts_and_greedy


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(),
        # 16 requests x (1 + 4 drafts) exceed a 24-token budget: drafts are cut, prompts chunked.
        dict(max_num_batched_tokens=24),
        # A cache too small for everyone: requests are preempted with drafts scheduled.
        dict(num_gpu_blocks_override=48),
        dict(enable_prefix_caching=False),
    ],
    ids=["default", "budget-cuts-drafts", "preempting", "no-prefix-cache"],
)
@pytest.mark.parametrize("streams", [1, 16])
def test_greedy_equals_transformers_and_no_speculation(llama, copy_heavy, engine_args, streams) -> None:
    _, path = llama
    prompts, expected = copy_heavy(streams)
    without, *_ = _run(path, prompts, GREEDY, None, **engine_args)
    with_spec, stats, preemptions, all_free, _ = _run(path, prompts, GREEDY, SPEC, **engine_args)
    assert with_spec == without == expected
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert all_free
    if "num_gpu_blocks_override" in engine_args and streams > 1:
        assert preemptions > 0


@pytest.mark.parametrize("streams", [1, 16])
def test_stories_greedy_unchanged_by_speculation(stories_dir, streams) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(stories_dir)
    texts = [
        "Once upon a time, there was a little girl named Lily. She loved to play with her ball.",
        "Tom had a red car. Tom liked his red car. One day, Tom",
        "The sun was hot. The cat was sleepy. The dog was",
        "Sam and Mia went to the park. Sam and Mia",
    ]
    prompts = [tokenizer.encode(texts[i % len(texts)])[: 12 + i] for i in range(streams)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    without, *_ = _run(stories_dir, prompts, params, None, max_model_len=256)
    with_spec, stats, _, all_free, _ = _run(stories_dir, prompts, params, SPEC, max_model_len=256)
    assert with_spec == without
    assert stats.num_accepted_tokens > 0 and all_free


def test_prefix_cache_blocks_filled_by_verifications_are_reused_exactly(llama) -> None:
    """A second pass over the same prompts plus their first outputs starts from blocks that
    verification steps filled (accepted drafts' KV among them): hits, and the same tokens."""
    model, path = llama
    prompts = _copy_heavy_prompts(model.config.vocab_size, 6)
    llm = LLM(path, **{**BASE, "max_num_seqs": 16, "speculative_config": SPEC})
    try:
        first = [r.token_ids for r in llm.generate(prompts, GREEDY)]
        scheduler = llm.engine.engine_core.scheduler
        hits = scheduler.kv_cache_manager.prefix_cache_stats.hits
        assert scheduler.spec_stats.num_accepted_tokens > 0
        longer = [p + out[:20] for p, out in zip(prompts, first)]
        second = [r.token_ids for r in llm.generate(longer, SamplingParams(max_tokens=20, temperature=0.0,
                                                                           ignore_eos=True))]
        # Blocks past the prompts hold tokens that were drafts when computed.
        assert scheduler.kv_cache_manager.prefix_cache_stats.hits - hits > sum(len(p) for p in prompts)
    finally:
        llm.shutdown()
    assert second == [out[20:40] for out in first]


def test_constraints_and_logprobs_apply_to_every_verified_position(llama) -> None:
    """Penalties (folded with each draft the row follows), logit bias, min_tokens and
    bad words on greedy rows: the same tokens and logprobs as one token at a time."""
    model, path = llama
    prompts = _copy_heavy_prompts(model.config.vocab_size, 6)
    variants = [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.4, presence_penalty=0.2),
        dict(logit_bias={prompts[0][1]: 3.0, prompts[1][2]: -5.0}),
        dict(min_tokens=30, stop_token_ids=[prompts[2][0]], ignore_eos=False),
        dict(bad_words_token_ids=[prompts[3][:2], [prompts[4][4]]]),
        dict(logprobs=3),
    ]
    for fields in variants:
        params = SamplingParams(**{"max_tokens": 30, "temperature": 0.0, "ignore_eos": True, **fields})
        without, _, _, _, plain = _run(path, prompts, params, None)
        with_spec, stats, _, all_free, spec = _run(path, prompts, params, SPEC)
        assert with_spec == without, fields
        assert stats.num_drafts > 0 and all_free
        if "logprobs" in fields:
            for a, b in zip(plain, spec):
                assert len(b.logprobs) == len(b.token_ids) == 30
                assert b.logprobs.token_ids == a.logprobs.token_ids and b.logprobs.ranks == a.logprobs.ranks
                assert np.allclose(b.logprobs.logprobs, a.logprobs.logprobs, atol=1e-5)


def test_stop_and_max_tokens_cut_an_accepted_run(llama) -> None:
    model, path = llama
    prompts = _copy_heavy_prompts(model.config.vocab_size, 4)
    reference, *_ = _run(path, prompts, GREEDY, None)
    for max_tokens in (1, 2, 7, 13):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        got, *_ = _run(path, prompts, params, SPEC)
        assert got == [r[:max_tokens] for r in reference]
    # A stop id that a verification accepts in the middle of its run ends the output there.
    stops = [r[9] for r in reference]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, stop_token_ids=stops)
    got, stats, *_ = _run(path, prompts, params, SPEC)
    for tokens, ref in zip(got, reference):
        first = min(ref.index(s) for s in stops if s in ref)
        assert tokens == ref[: first + 1]


def test_seeded_sampling_is_reproducible(llama) -> None:
    model, path = llama
    prompts = _copy_heavy_prompts(model.config.vocab_size, 4)
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=100 + i, ignore_eos=True) for i in range(4)]
    first, stats, *_ = _run(path, prompts, params, SPEC)
    second, *_ = _run(path, prompts[::-1], params[::-1], SPEC)  # other neighbours, other rows
    assert first == second[::-1]
    assert stats.num_drafts > 0


def _chi_square_critical(df: int, alpha: float) -> float:
    """The chi-square quantile 1 - alpha (Wilson-Hilferty: accurate to a few percent for df >= 3)."""
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1.0 - alpha)).item()
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi_square(observed: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """The statistic and its degrees of freedom, over the cells of positive probability."""
    n = observed.sum()
    cells = probs > 0
    assert not observed[~cells].any(), "a token of probability zero was emitted"
    expected = probs[cells] * n
    return float(((observed[cells] - expected) ** 2 / expected).sum()), int(cells.sum()) - 1


def test_rejection_sampler_emits_the_target_distribution() -> None:
    """20,000 verifications of the drafts (2, 4) against fixed targets p0, p1, p2: the first
    token emitted follows p0, the second (where the first was the draft 2) p1, the bonus
    token (both drafts accepted) p2; chi-square at significance 0.001 each."""
    p = np.array([
        [0.10, 0.05, 0.40, 0.25, 0.20, 0.00],  # p0: draft 2 accepted 40% of the time
        [0.30, 0.20, 0.00, 0.10, 0.30, 0.10],  # p1: draft 4 accepted 30%
        [0.05, 0.15, 0.20, 0.20, 0.10, 0.30],  # p2: the bonus token
    ])
    n, drafts = 20_000, (2, 4)
    probs = torch.tensor(np.tile(p, (n, 1)), dtype=torch.float32)
    logits = probs.log()
    target = TargetDistribution(logits, logits.argmax(-1), logits, probs)
    md = sampling_metadata([SamplingParams(temperature=1.0)] * (3 * n), 6)
    starts = np.arange(n) * 3
    draft_ids = np.tile([*drafts, -1], n)
    torch.manual_seed(0)
    emitted = rejection_sample(target, md, starts, np.full(n, 2), draft_ids).token_ids
    assert all(1 <= len(t) <= 3 for t in emitted)
    positions = [
        [t[0] for t in emitted],
        [t[1] for t in emitted if t[0] == drafts[0]],
        [t[2] for t in emitted if t[:2] == list(drafts)],
    ]
    for j, tokens in enumerate(positions):
        statistic, df = _chi_square(np.bincount(tokens, minlength=6), p[j])
        assert statistic < _chi_square_critical(df, 0.001), (j, statistic)
    # Greedy rows: the drafts while they are the argmax, then the argmax.
    md = sampling_metadata([SamplingParams(temperature=0.0)] * 3, 6)
    target = TargetDistribution(logits[:3], logits[:3].argmax(-1), None, None)
    assert rejection_sample(target, md, np.array([0]), np.array([2]), np.array([2, 4, -1])).token_ids == [[2, 0]]
    assert rejection_sample(target, md, np.array([0]), np.array([2]), np.array([2, 0, -1])).token_ids == [[2, 0, 5]]


def test_random_sampling_keeps_the_target_distribution(stories_dir) -> None:
    """The first three tokens after a repetitive prompt (of four: the last two drafts of the
    verification after the first token are then both checked), sampled 3000 times with n-gram
    speculation at temperature 1.5, top-k 6 and repetition penalty 1.1, against the exact
    probabilities of those sequences under transformers with the same processors:
    chi-square goodness of fit at significance 0.001 (a false alarm once in a thousand
    runs; the seeds are fixed, so the outcome is the same on every machine)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(stories_dir)
    prompt = tokenizer.encode("Once upon a time, there was a little girl. Once upon a time, there was a little")
    n, temperature, top_k = 3000, 1.5, 6
    params = [
        SamplingParams(
            max_tokens=4, temperature=temperature, top_k=top_k, repetition_penalty=1.1, seed=i, ignore_eos=True
        )
        for i in range(n)
    ]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=4)
    got, stats, _, all_free, _ = _run(
        stories_dir, [prompt] * n, params, spec, max_num_seqs=64, max_model_len=64, block_size=16
    )
    accepted_per_pos = stats.num_accepted_tokens_per_pos
    assert min(accepted_per_pos) > n / 20 and stats.num_draft_tokens > stats.num_accepted_tokens and all_free
    observed = Counter(tuple(t[:3]) for t in got)

    model = transformers.AutoModelForCausalLM.from_pretrained(stories_dir, torch_dtype=torch.float32).eval()
    processors = transformers.LogitsProcessorList([
        transformers.RepetitionPenaltyLogitsProcessor(1.1),
        transformers.TemperatureLogitsWarper(temperature),
        transformers.TopKLogitsWarper(top_k),
    ])

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([prompt + p for p in prefixes])
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float()
        return processors(ids, logits).softmax(-1)

    expected: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        prefixes = list(expected)
        probs = next_probs([list(p) for p in prefixes])
        expected = {
            (*p, t): expected[p] * probs[i, t].item()
            for i, p in enumerate(prefixes) for t in torch.nonzero(probs[i] > 0).flatten().tolist()
        }
    assert set(observed) <= set(expected)
    # Cells expected fewer than 5 times are pooled into one.
    big = {seq: p for seq, p in expected.items() if p * n >= 5}
    cells = [(observed.get(seq, 0), p * n) for seq, p in big.items()]
    rest = n - sum(o for o, _ in cells)
    cells.append((rest, n * (1 - sum(big.values()))))
    statistic = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    assert statistic < _chi_square_critical(len(cells) - 1, 0.001), (statistic, len(cells))


def _engine(path: str, **config) -> EngineCore:
    args = dict(model=path, max_model_len=128, max_num_seqs=8, block_size=4, speculative_config=SPEC)
    return EngineCore(EngineArgs(**{**args, **config}).resolve())


def _add(engine: EngineCore, request_id: str, prompt: list[int], max_tokens: int = 60) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params)
    engine.add_request(engine.preprocess_add_request(request))
    return request


def test_abort_during_a_verification_step_frees_every_block(llama) -> None:
    model, path = llama
    engine = _engine(path)
    try:
        for i, prompt in enumerate(_copy_heavy_prompts(model.config.vocab_size, 4)):
            _add(engine, f"r{i}", prompt)
        pool = engine.scheduler.kv_cache_manager.block_pool
        for _ in range(50):  # until a step is about to verify drafts
            if any(r.spec_token_ids for r in engine.scheduler.running):
                break
            engine.step()
        drafted = [r.request_id for r in engine.scheduler.running if r.spec_token_ids]
        assert drafted
        # Aborted while the step runs: the engine drops them before their tokens are appended.
        engine.aborts_queue.put(drafted)
        outputs, _ = engine.step()
        reported = {o.request_id for outs in outputs.values() for o in outs.outputs if o.new_token_ids}
        assert not reported & set(drafted)
        while engine.scheduler.has_requests():
            engine.step()
        assert pool.get_num_free_blocks() == pool.num_usable_blocks
    finally:
        engine.shutdown()


def test_spec_decode_metrics_and_stats_line(llama) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from app.metrics import FrontendMetrics
    from app.stats_logger import StatsLogger

    model, path = llama
    engine = _engine(path)
    metrics = FrontendMetrics("m", 128, {}, lambda: None)
    try:
        for i, prompt in enumerate(_copy_heavy_prompts(model.config.vocab_size, 4)):
            metrics.add_request(_add(engine, f"r{i}", prompt, max_tokens=30))
        logger = StatsLogger(metrics, interval=1.0)
        while engine.scheduler.has_requests():
            outputs, _ = engine.step()
            for out in outputs.values():
                metrics.record(out)
        stats = engine.scheduler.spec_stats
        metrics.flush()
        lines = logger.log()
    finally:
        engine.shutdown()

    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples if s.name.startswith("vllm:spec_decode")
    }
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == stats.num_drafts > 0
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == stats.num_draft_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == stats.num_accepted_tokens
    per_pos = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(4)]
    assert per_pos == stats.num_accepted_tokens_per_pos and sum(per_pos) == stats.num_accepted_tokens
    line = next(line for line in lines if "SpecDecoding" in line)
    assert f"Mean acceptance length: {1 + stats.num_accepted_tokens / stats.num_drafts:.2f}" in line


# ---------------------------------------------------------------- draft model


@pytest.fixture(scope="module")
def draft_dir(llama, tmp_path_factory) -> str:
    """A one-layer random Llama with the target's vocabulary and tokenizer: a weak draft."""
    from core.models.random_model import write_tokenizer

    model, _ = llama
    torch.manual_seed(99)
    config = transformers.LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": 1, "hidden_size": 32,
                                         "intermediate_size": 48, "num_attention_heads": 2, "num_key_value_heads": 1,
                                         "head_dim": 16})
    path = tmp_path_factory.mktemp("draft")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    write_tokenizer(path)
    return str(path)


def _draft_spec(path: str, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=path, num_speculative_tokens=k)


@pytest.mark.parametrize("draft", ["itself", "weak"])
@pytest.mark.parametrize("engine_args", [dict(), dict(max_num_batched_tokens=24), dict(num_gpu_blocks_override=48)],
                         ids=["default", "budget-cuts-drafts", "preempting"])
def test_draft_model_greedy_equals_transformers(llama, copy_heavy, draft_dir, draft, engine_args) -> None:
    _, path = llama
    prompts, expected = copy_heavy(16)
    spec = _draft_spec(path if draft == "itself" else draft_dir)
    got, stats, _, all_free, _ = _run(path, prompts, GREEDY, spec, **engine_args)
    assert got == expected and all_free
    assert stats.num_drafts > 0
    if draft == "itself":  # the target drafting for itself: every draft is its own argmax
        assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_draft_model_sampling_is_seeded_and_drafts_are_drawn(llama) -> None:
    model, path = llama
    prompts = _copy_heavy_prompts(model.config.vocab_size, 4)
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=7 + i, ignore_eos=True) for i in range(4)]
    first, stats, _, all_free, _ = _run(path, prompts, params, _draft_spec(path))
    second, *_ = _run(path, prompts, params, _draft_spec(path))
    assert first == second and all_free
    # Drawn from the target's own distribution, drafts are accepted with probability min(1, p/q) = 1.
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_rejection_sampler_with_draft_distributions() -> None:
    """Drafts drawn from q0, q1 (as a draft model draws them), verified against p0, p1, p2:
    the tokens emitted follow p, position by position (chi-square at significance 0.001)."""
    p = np.array([
        [0.10, 0.05, 0.40, 0.25, 0.20, 0.00],
        [0.30, 0.20, 0.00, 0.10, 0.30, 0.10],
        [0.05, 0.15, 0.20, 0.20, 0.10, 0.30],
    ])
    q = np.array([
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
        [0.05, 0.05, 0.50, 0.10, 0.20, 0.10],
    ])
    n = 20_000
    g = torch.Generator().manual_seed(1)
    drafts = np.stack([torch.multinomial(torch.tensor(q[j]), n, replacement=True, generator=g).numpy() for j in (0, 1)], 1)
    probs = torch.tensor(np.tile(p, (n, 1)), dtype=torch.float32)
    logits = probs.log()
    target = TargetDistribution(logits, logits.argmax(-1), logits, probs)
    draft_probs = torch.tensor(np.tile(np.vstack([q, np.zeros(6)]), (n, 1)), dtype=torch.float32)
    md = sampling_metadata([SamplingParams(temperature=1.0)] * (3 * n), 6)
    draft_ids = np.concatenate([drafts, np.full((n, 1), -1)], 1).reshape(-1)
    torch.manual_seed(0)
    emitted = rejection_sample(target, md, np.arange(n) * 3, np.full(n, 2), draft_ids, draft_probs).token_ids
    first = np.array([t[0] for t in emitted])
    statistic, df = _chi_square(np.bincount(first, minlength=6), p[0])
    assert statistic < _chi_square_critical(df, 0.001), statistic
    # The second token given the first: only where the first was the draft and was accepted...
    second = [t[1] for t, d in zip(emitted, drafts) if len(t) > 1]
    # ...which, with the first token fixed, is p1 again (the draft d1 was drawn independently).
    statistic, df = _chi_square(np.bincount(second, minlength=6), p[1])
    assert statistic < _chi_square_critical(df, 0.001), statistic


def test_a_draft_with_another_vocabulary_is_refused(llama, tmp_path) -> None:
    model, path = llama
    torch.manual_seed(5)
    config = transformers.LlamaConfig(vocab_size=model.config.vocab_size + 8, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary"):
        EngineArgs(model=path, speculative_config=_draft_spec(str(tmp_path))).resolve()


def test_the_memory_profile_step_has_a_logits_row_per_draft(llama, monkeypatch) -> None:
    """A GPU sizes its KV cache after the largest step (profile_run): with speculation its
    logits and sampling cover every draft row, not one row per request."""
    _, path = llama
    engine = _engine(path, max_num_batched_tokens=64)
    runner = engine.model_executor.runner
    seen: list[int] = []
    compute_logits = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", lambda hidden: seen.append(hidden.shape[0]) or compute_logits(hidden))
    try:
        runner.profile_run()
    finally:
        engine.shutdown()
    assert seen == [min(64, 8 * (SPEC.num_speculative_tokens + 1))]


def test_drafts_under_a_grammar_are_checked_and_masked_at_every_position(llama) -> None:
    """Structured outputs with speculation: the grammar cuts each proposal to what it accepts
    and masks every verified row as it stands after the drafts before; the text is the one
    without speculation, and matches the pattern (Python's re as the judge)."""
    import re

    from app.tokenizer import load_tokenizer
    from core.protocol import StructuredOutputsParams

    model, path = llama
    pattern = r"(cat|dog|bird)( (cat|dog|bird)){5,12}"
    params = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=pattern))
    prompts = _copy_heavy_prompts(model.config.vocab_size, 4)
    without, *_ = _run(path, prompts, params, None)
    with_spec, stats, _, all_free, _ = _run(path, prompts, params, SPEC)
    assert with_spec == without and all_free
    assert stats.num_accepted_tokens > 0
    tokenizer = load_tokenizer(path)
    eos = model.config.eos_token_id
    texts = [tokenizer.decode(t[:-1] if t[-1] == eos else t) for t in with_spec]
    assert all(re.fullmatch(pattern, text) for text in texts), texts
