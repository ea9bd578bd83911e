"""ReasoningParams through the whole engine (stories260K, greedy, float32).

A request's output starts inside the model's reasoning: its grammar applies
only from the token after ``end_token_id``, and a budget forces that token.
The oracles are the unconstrained greedy run (the reasoning must equal it up
to the end token), Python's ``re`` and ``jsonschema`` (the text after the end
must match the grammar), and the same requests without speculation, without
preemption, without async scheduling (equal token for token).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import jsonschema
import msgspec
import pytest
import transformers

from app.llm import LLM
from core.config import SpeculativeConfig
from core.protocol import EngineCoreRequest, ReasoningParams, SamplingParams, StructuredOutputsParams
from core.validation import InvalidRequestError, ModelLimits, validate_request
from shm.serial import MsgpackDecoder, MsgpackEncoder

MAX_TOKENS = 60
PATTERN = r"(cat|dog|bird)( (cat|dog|bird)){2,5}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
REGEX = StructuredOutputsParams(regex=PATTERN)
JSON = StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True)
TEXTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play with her ball.",
    "Tom had a red car. Tom liked his red car. One day, Tom",
    "The sun was hot. The cat was sleepy. The dog was",
    "Sam and Mia went to the park. Sam and Mia",
]
ENGINE = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=32, max_model_len=128)
SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(autouse=True)
def _draft_at_every_step(monkeypatch) -> None:
    """Drafts wherever there are some, whatever this machine measures (core/spec_decode/spec_gate.py)."""
    monkeypatch.setenv("RINGLLM_SPEC_DECODE_GATE", "0")


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(stories_dir)
    eos = transformers.GenerationConfig.from_pretrained(stories_dir).eos_token_id
    tokenizer.model_eos_ids = set(eos) if isinstance(eos, list) else {eos}
    return tokenizer


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def llm(stories_dir):
    engine = LLM(stories_dir, **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def free(llm, prompts) -> list[list[int]]:
    """The unconstrained greedy outputs: what the reasoning must be."""
    return [r.token_ids for r in llm.generate(prompts, _greedy())]


def _greedy(**fields) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, **fields})


def _absent_token(*outputs: list[int]) -> int:
    """A token the model does not write in these outputs (so that only a budget can end the reasoning)."""
    seen = {t for out in outputs for t in out}
    return next(t for t in range(300, 512) if t not in seen)


def _text_after(tokenizer, tokens: list[int], end_index: int) -> str:
    """The text after the end token, without the model's end of sequence (the grammar's end)."""
    tail = tokens[end_index + 1 :]
    if tail and tail[-1] in tokenizer.model_eos_ids:
        tail = tail[:-1]
    return tokenizer.decode(tail)


def test_reasoning_params_travel_over_the_wire_and_are_checked(stories_dir) -> None:
    params = _greedy(structured_outputs=REGEX, reasoning=ReasoningParams(end_token_id=426, budget=7))
    request = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=params)
    decoded = MsgpackDecoder(EngineCoreRequest).decode([bytes(f) for f in MsgpackEncoder().encode(request)])
    assert decoded == request and decoded.sampling_params.reasoning == ReasoningParams(end_token_id=426, budget=7)
    # The field is the last one: the array a frontend built before it existed still decodes.
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(params))
    assert fields[-1] == [426, 7]
    older = msgspec.msgpack.decode(msgspec.msgpack.encode(fields[:-1]), type=SamplingParams)
    assert older.reasoning is None and older.structured_outputs == REGEX

    limits = ModelLimits(max_model_len=128, vocab_size=512, hidden_size=64)

    def check(reasoning: ReasoningParams) -> None:
        validate_request(
            EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=_greedy(reasoning=reasoning)),
            limits,
        )

    check(ReasoningParams(end_token_id=511, budget=0))
    for bad, message in [
        (ReasoningParams(end_token_id=512), "Token id 512 in reasoning is out of vocabulary"),
        (ReasoningParams(end_token_id=-1), "Token id -1 in reasoning is out of vocabulary"),
        (ReasoningParams(end_token_id=5, budget=-1), "reasoning budget must be at least 0"),
    ]:
        with pytest.raises(InvalidRequestError, match=message) as caught:
            check(bad)
        assert caught.value.param == "reasoning"


def test_the_grammar_starts_after_the_end_token_the_model_samples(llm, prompts, free, tokenizer) -> None:
    """No budget: the model itself writes the end token (the token at index 8 of the free run,
    which it had not written before); up to there the output is the free run's, after it the
    grammar's."""
    cuts = []
    for out in free:
        m = next(i for i in range(8, len(out)) if out[i] not in out[:i])
        cuts.append(m)
    for grammar in (REGEX, JSON):
        params = [
            _greedy(structured_outputs=grammar, reasoning=ReasoningParams(end_token_id=out[m]))
            for out, m in zip(free, cuts)
        ]
        for result, out, m in zip(llm.generate(prompts, params), free, cuts):
            tokens = result.token_ids
            assert tokens[: m + 1] == out[: m + 1]
            assert tokens[m + 1 :] != out[m + 1 : len(tokens)]
            assert result.finish_reason == "stop"
            text = _text_after(tokenizer, tokens, m)
            if grammar is REGEX:
                assert re.fullmatch(PATTERN, text), text
            else:
                jsonschema.validate(json.loads(text), SCHEMA)
    # The same grammar without reasoning constrains the output from its first token.
    constrained = llm.generate(prompts[:1], _greedy(structured_outputs=REGEX))[0]
    assert re.fullmatch(PATTERN, _text_after(tokenizer, constrained.token_ids, -1))


@pytest.mark.parametrize("budget", [0, 1, 6, 17])
def test_a_budget_forces_the_end_token_at_exactly_its_index(llm, prompts, free, tokenizer, budget) -> None:
    end = _absent_token(*free)
    reasoning = ReasoningParams(end_token_id=end, budget=budget)
    # Without a grammar: the free run, the end token at index ``budget``, then what the model
    # writes after that prefix (the free run of the prompt extended by it).
    forced = llm.generate(prompts, _greedy(reasoning=reasoning, ignore_eos=True))
    extended = [p + out[:budget] + [end] for p, out in zip(prompts, free)]
    after = llm.generate(extended, _greedy(ignore_eos=True, max_tokens=MAX_TOKENS - budget - 1))
    for result, out, cont in zip(forced, free, after):
        assert result.token_ids == out[:budget] + [end] + cont.token_ids
    for grammar in (REGEX, JSON):
        results = llm.generate(prompts, _greedy(structured_outputs=grammar, reasoning=reasoning))
        for result, out in zip(results, free):
            tokens = result.token_ids
            assert tokens[:budget] == out[:budget] and tokens[budget] == end
            text = _text_after(tokenizer, tokens, budget)
            if grammar is REGEX:
                assert re.fullmatch(PATTERN, text), text
            else:
                jsonschema.validate(json.loads(text), SCHEMA)


def test_a_budget_other_constraints_contradict_finishes_with_an_error(llm, prompts, free) -> None:
    """allowed_token_ids without the end token leave nothing to sample where the budget forces
    it: the request ends there with an error, as one whose grammar allows nothing."""
    allowed = sorted(set(free[0][:3]))
    params = _greedy(allowed_token_ids=allowed, reasoning=ReasoningParams(end_token_id=_absent_token(*free), budget=3))
    result = llm.generate(prompts[:1], params)[0]
    assert result.finish_reason == "error" and len(result.token_ids) == 4
    assert set(result.token_ids[:3]) <= set(allowed)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_end_token_the_model_writes_lifts_the_budget(llm, stories_dir, prompts, free, async_scheduling) -> None:
    """The model writes the end token itself at index m, the last one the budget leaves it: no
    token is forced after it (with async scheduling the next step is scheduled before that
    token is known: the request waits for it). Without a grammar nor a budget, the request is
    the free run."""
    m = 5
    assert all(out[m] not in out[:m] for out in free)
    params = [_greedy(reasoning=ReasoningParams(end_token_id=out[m], budget=m + 1)) for out in free]
    unbounded = [_greedy(reasoning=ReasoningParams(end_token_id=_absent_token(*free))) for _ in free]
    engine = LLM(stories_dir, **ENGINE, async_scheduling=True) if async_scheduling else llm
    try:
        assert [r.token_ids for r in engine.generate(prompts, params)] == free
        assert [r.token_ids for r in engine.generate(prompts, unbounded)] == free
    finally:
        if engine is not llm:
            engine.shutdown()


def _variants(free: list[list[int]]) -> list[SamplingParams]:
    """A mixed batch: reasoning ended by the model ('.', a token the n-gram drafts carry, accepted in
    some draft runs and rejected in others) or by budgets, with a regex, a JSON schema or no grammar;
    a grammar without reasoning; and free requests."""
    absent = _absent_token(*free)
    return [
        _greedy(structured_outputs=REGEX, reasoning=ReasoningParams(end_token_id=426)),
        _greedy(structured_outputs=REGEX, reasoning=ReasoningParams(end_token_id=337, budget=6)),
        _greedy(structured_outputs=JSON, reasoning=ReasoningParams(end_token_id=346, budget=10)),
        _greedy(structured_outputs=JSON, reasoning=ReasoningParams(end_token_id=absent, budget=4)),
        _greedy(reasoning=ReasoningParams(end_token_id=266, budget=9), ignore_eos=True),
        _greedy(reasoning=ReasoningParams(end_token_id=absent, budget=13), ignore_eos=True),
        _greedy(structured_outputs=REGEX),
        _greedy(ignore_eos=True),
    ]


@dataclass
class Run:
    tokens: list[list[int]]
    preemptions: int
    all_blocks_free: bool
    # End tokens that drafts carried while their request was still reasoning: accepted, rejected.
    end_drafts: list[int] = field(default_factory=lambda: [0, 0])
    # Preemptions of requests with ReasoningParams: inside the reasoning, after it (under a grammar).
    preempted: list[int] = field(default_factory=lambda: [0, 0])


def _run(path: str, prompts, params: list[SamplingParams], **engine_args) -> Run:
    llm = LLM(path, **{**ENGINE, **engine_args})
    scheduler = llm.engine.engine_core.scheduler
    run = Run([], 0, False)
    update = scheduler.update_from_output

    def observed(so, runner_output):
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            request, i = scheduler.requests.get(req_id), runner_output.req_id_to_index.get(req_id)
            if request is None or request.reasoning is None or i is None:
                continue
            end = request.reasoning.end_token_id
            if end in drafts:
                accepted = drafts.index(end) < len(runner_output.sampled_token_ids[i]) - 1
                run.end_drafts[0 if accepted else 1] += 1
        return update(so, runner_output)

    preempt = scheduler._preempt_request

    def preempted(request):
        if request.sampling_params.reasoning is not None and request.num_output_tokens:
            run.preempted[0 if request.reasoning is not None else 1] += request.structured is not None
        return preempt(request)

    scheduler.update_from_output = observed
    scheduler._preempt_request = preempted
    try:
        run.tokens = [r.token_ids for r in llm.generate(prompts, params)]
        pool = scheduler.kv_cache_manager.block_pool
        run.all_blocks_free = pool.get_num_free_blocks() == pool.num_usable_blocks
        run.preemptions = scheduler.num_preemptions
    finally:
        llm.shutdown()
    return run


@pytest.fixture(scope="module")
def batch(prompts, free):
    """Each variant on the first two prompts, 56 tokens at most."""
    variants = [msgspec.structs.replace(v, max_tokens=56) for v in _variants(free)]
    return [p for p in prompts[:2] for _ in variants], [v for _ in prompts[:2] for v in variants]


@pytest.fixture(scope="module")
def reference(stories_dir, batch, tokenizer, free) -> list[list[int]]:
    """The mixed batch in a roomy cache, no speculation, synchronous: checked against its oracles."""
    prompts, params = batch
    run = _run(stories_dir, prompts, params)
    for tokens, p, out in zip(run.tokens, params, [o for o in free for _ in _variants(free)], strict=False):
        reasoning = p.reasoning
        if reasoning is None:
            continue
        end_index = tokens.index(reasoning.end_token_id)
        assert tokens[:end_index] == out[:end_index]
        assert reasoning.budget is None or end_index <= reasoning.budget
        if p.structured_outputs is REGEX:
            assert re.fullmatch(PATTERN, _text_after(tokenizer, tokens, end_index))
        elif p.structured_outputs is JSON:
            jsonschema.validate(json.loads(_text_after(tokenizer, tokens, end_index)), SCHEMA)
    return run.tokens


def test_speculative_decoding_gives_the_outputs_without_it(stories_dir, batch, reference) -> None:
    prompts, params = batch
    run = _run(stories_dir, prompts, params, speculative_config=SPEC)
    assert run.tokens == reference and run.all_blocks_free
    accepted, rejected = run.end_drafts
    assert accepted > 0 and rejected > 0  # the switch inside a verified run, and a draft end thrown away


@pytest.mark.parametrize(
    "engine_args",
    [dict(), dict(async_scheduling=True), dict(speculative_config=SPEC)],
    ids=["sync", "async", "speculative"],
)
def test_preemption_keeps_the_outputs(stories_dir, batch, reference, engine_args) -> None:
    """A cache far too small for the batch: requests are preempted and recomputed, some inside
    their reasoning, some after it, their grammars' matchers kept."""
    prompts, params = batch
    run = _run(stories_dir, prompts, params, num_gpu_blocks_override=40, max_num_batched_tokens=64, **engine_args)
    assert run.tokens == reference and run.all_blocks_free
    inside, after = run.preempted
    assert inside > 0 and after > 0
