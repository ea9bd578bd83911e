"""The OpenAI surface clients rely on, over HTTP with the official openai client.

Logprobs (completions and chat, streamed and not) and echo against
transformers on stories260K; n with seeds, interleaved streams and
disconnects; batch prompts; sampling fields end to end; /tokenize,
/detokenize, /version; and no request field that is silently ignored.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgspec
import openai
import pytest
import torch

from app.protocol.chat import ChatCompletionRequest
from app.protocol.completions import CompletionRequest
from tests.support.http import MODEL, assert_openai_error, make_engine, running_server
from tests.support.oracle import ATOL, check_entry, hf_logprobs, load_hf
from tests.support.waiting import wait_until

PROMPT = "Once upon a time"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def hf(stories_dir):
    return load_hf(stories_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(stories_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(stories_dir)


@pytest.fixture
async def engine(stories_dir):
    return make_engine(stories_dir, max_model_len=256, kv_cache_dtype="float32")


@pytest.fixture
async def served(engine):
    async with running_server(engine) as (client, base):
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as oai:
            yield client, oai


def _token_id(text: str) -> int:
    assert text.startswith("token_id:"), text
    return int(text.removeprefix("token_id:"))


def _piece_text(hf_tokenizer, token_id: int) -> str:
    """transformers' own piece for a token, as text (sentencepiece's word mark as a space)."""
    return hf_tokenizer.convert_ids_to_tokens(token_id).replace("\u2581", " ")


def _check_completion_position(token: str, token_logprob: float, top: dict[str, float], row: torch.Tensor, k: int):
    token_id = _token_id(token)
    alternatives = sorted(((_token_id(t), lp) for t, lp in top.items() if _token_id(t) != token_id), key=lambda x: -x[1])
    ids = [token_id] + [t for t, _ in alternatives]
    values = [token_logprob] + [lp for _, lp in alternatives]
    # The token itself may be one of the top k: then it is listed once.
    if len(ids) == k:
        top_ids = row.topk(k).indices.tolist()
        assert token_id in top_ids
        ids.insert(1 + top_ids.index(token_id), token_id)
        values.insert(1 + top_ids.index(token_id), token_logprob)
    check_entry(token_id, ids, values, None, row, k)


# ------------------------------------------------------------------ logprobs


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_completion_logprobs_match_transformers(served, hf, hf_tokenizer, stream) -> None:
    _, oai = served
    k, n = 5, 12
    results = {}
    for as_ids in (True, False):
        body = dict(model=MODEL, prompt=PROMPT, max_tokens=n, logprobs=k, stream=stream, temperature=0,
                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": as_ids})
        response = await oai.completions.create(**body)
        if stream:
            chunks = [c async for c in response]
            text = "".join(c.choices[0].text for c in chunks)
            lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for c in chunks:
                for key in lp:
                    lp[key] += getattr(c.choices[0].logprobs, key)
        else:
            text = response.choices[0].text
            lp = response.choices[0].logprobs.model_dump()
        results[as_ids] = text, lp
    text, lp = results[True]
    ids = [_token_id(t) for t in lp["tokens"]]
    prompt = hf_tokenizer.encode(PROMPT)
    rows = hf_logprobs(hf, prompt + ids)[len(prompt) - 1 : -1]
    assert len(ids) == n and text == hf_tokenizer.decode(prompt + ids)[len(hf_tokenizer.decode(prompt)) :]
    for i in range(n):
        _check_completion_position(lp["tokens"][i], lp["token_logprobs"][i], lp["top_logprobs"][i], rows[i], k)
    # As text: transformers' pieces, which put together are the completion, at their offsets.
    text, lp = results[False]
    assert lp["tokens"] == [_piece_text(hf_tokenizer, t) for t in ids]
    assert "".join(lp["tokens"]) == text
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(n)]
    assert lp["token_logprobs"] == pytest.approx(results[True][1]["token_logprobs"], abs=ATOL)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_chat_logprobs_match_transformers(served, hf, hf_tokenizer, stream) -> None:
    client, oai = served
    k, n = 5, 10
    messages = [{"role": "user", "content": "Hello"}]
    results = {}
    for as_ids in (True, False):
        response = await oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=n, logprobs=True, top_logprobs=k, stream=stream,
            temperature=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": as_ids},
        )
        if stream:
            chunks = [c async for c in response]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        else:
            content = response.choices[0].message.content
            entries = response.choices[0].logprobs.content
        assert len(entries) == n
        assert b"".join(bytes(e.bytes) for e in entries).decode() == content
        results[as_ids] = entries, content
    entries, content = results[False]
    assert "".join(e.token for e in entries) == content
    entries, _ = results[True]
    prompt = (await client.post("/tokenize", json={"model": MODEL, "messages": messages})).json()["tokens"]
    ids = [_token_id(e.token) for e in entries]
    # (The second request reads its prompt from the prefix cache: same values to rounding.)
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in results[False][0]], abs=ATOL)
    rows = hf_logprobs(hf, prompt + ids)[len(prompt) - 1 : -1]
    for entry, token_id, row in zip(entries, ids, rows):
        assert abs(entry.logprob - row[token_id].item()) < ATOL
        assert len(entry.top_logprobs) == k
        torch.testing.assert_close(
            torch.tensor([t.logprob for t in entry.top_logprobs]), row.topk(k).values, atol=ATOL, rtol=0
        )
    for entry in results[False][0]:
        assert all(bytes(t.bytes).decode() == t.token for t in entry.top_logprobs)


async def test_echo_with_logprobs_is_what_lm_eval_sends(served, hf, hf_tokenizer) -> None:
    """lm-evaluation-harness scores a continuation with echo, logprobs=1 and one token,
    token prompts in a batch: the prompt's text, then a logprob per prompt token (the
    first null) and its greedy alternative, matching transformers."""
    _, oai = served
    prompts = [hf_tokenizer.encode(PROMPT), hf_tokenizer.encode("Lily saw a big dog")]
    for max_tokens in (1, 0):
        response = await oai.completions.create(
            model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0,
        )
        assert [c.index for c in response.choices] == [0, 1]
        for prompt, choice in zip(prompts, response.choices):
            lp = choice.logprobs
            assert choice.text.startswith(hf_tokenizer.decode(prompt, skip_special_tokens=True))
            assert len(lp.tokens) == len(prompt) + max_tokens
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            rows = hf_logprobs(hf, prompt)
            for i in range(1, len(prompt)):
                assert abs(lp.token_logprobs[i] - rows[i - 1, prompt[i]].item()) < ATOL
                assert abs(max(lp.top_logprobs[i].values()) - rows[i - 1].max().item()) < ATOL
                assert len(lp.top_logprobs[i]) <= 2
            if max_tokens == 0:
                assert choice.text == hf_tokenizer.decode(prompt, skip_special_tokens=True)
                assert choice.finish_reason == "length"
        expected_completion = 2 * max_tokens
        assert response.usage.completion_tokens == expected_completion
        assert response.usage.prompt_tokens == sum(map(len, prompts))


async def test_prompt_logprobs_extension(served, hf, hf_tokenizer) -> None:
    client, _ = served
    prompt = hf_tokenizer.encode(PROMPT)
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 3}
    )
    assert r.status_code == 200, r.text
    positions = r.json()["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(prompt)
    rows = hf_logprobs(hf, prompt)
    for i, position in enumerate(positions[1:], start=1):
        entry = position[str(prompt[i])]
        assert abs(entry["logprob"] - rows[i - 1, prompt[i]].item()) < ATOL
        ranked = sorted(position.items(), key=lambda kv: kv[1]["rank"])
        assert ranked[0][1]["rank"] == 1 and int(ranked[0][0]) == int(rows[i - 1].argmax())
        assert entry["decoded_token"] == _piece_text(hf_tokenizer, prompt[i])


# ------------------------------------------------------------------ n and batches


async def test_n_choices_are_reproducible_with_a_seed(served) -> None:
    _, oai = served
    common = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, n=4, extra_body={"ignore_eos": True})
    first = await oai.completions.create(seed=42, **common)
    again = await oai.completions.create(seed=42, **common)
    other = await oai.completions.create(seed=43, **common)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert texts != [c.text for c in other.choices]
    assert len(set(texts)) > 1  # each choice samples on its own
    assert first.usage.completion_tokens == 64 and first.usage.prompt_tokens == 5
    # Choice i of seed s is the one choice of seed s + i.
    single = await oai.completions.create(**{**common, "n": 1, "seed": 44})
    assert single.choices[0].text == texts[2]


async def test_a_stream_interleaves_the_choices(served) -> None:
    _, oai = served
    stream = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, n=4, stream=True,
        temperature=1.0, seed=5, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    order, texts, finished = [], ["", "", "", ""], []
    async for chunk in stream:
        for choice in chunk.choices:
            order.append(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.append(len(order) - 1)
        if chunk.usage:
            assert chunk.usage.completion_tokens == 48
    assert order[:4] == [0, 1, 2, 3]  # each choice opens with its role
    # Every choice has sent text before the first one finishes: they run side by side.
    assert set(order[4 : finished[0]]) == {0, 1, 2, 3} and order[4:] != sorted(order[4:])
    assert sorted(order[i] for i in finished) == [0, 1, 2, 3] and all(texts)


async def test_a_disconnect_aborts_every_choice(stories_dir) -> None:
    engine = make_engine(stories_dir, max_model_len=512)
    core = engine.engine_core.engine_core
    async with running_server(engine) as (_, base):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 400, "n": 4, "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                for _ in range(8):
                    await anext(lines)
                assert core.scheduler.get_num_unfinished_requests() == 4
        await wait_until(lambda: not core.scheduler.has_unfinished_requests(), "the engine to drop the requests")
        assert core.step_counter < 400  # all four aborted, none run to the end
        assert not engine.output_processor.has_unfinished_requests()


async def test_a_batch_of_prompts_gives_one_choice_each_in_order(served) -> None:
    _, oai = served
    prompts = ["Once upon a time", "Lily saw", "The sun"]
    alone = [(await oai.completions.create(model=MODEL, prompt=p, max_tokens=8, **GREEDY)) for p in prompts]
    batch = await oai.completions.create(model=MODEL, prompt=prompts, max_tokens=8, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 24 and batch.usage.total_tokens == batch.usage.prompt_tokens + 24
    # Times n: choice p * n + i is sample i of prompt p.
    both = await oai.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=8, n=2, **GREEDY)
    assert [c.text for c in both.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[1].usage.prompt_tokens


async def test_continuous_usage_stats(served) -> None:
    _, oai = served
    stream = await oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, stream=True, temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 6 and all(c.usage.prompt_tokens == 5 for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 11


# ------------------------------------------------------------------ sampling fields


async def test_logit_bias_penalties_and_bad_words_through_the_api(served, hf_tokenizer) -> None:
    _, oai = served
    target = hf_tokenizer.convert_tokens_to_ids("\u2581play")
    biased = await oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, logit_bias={str(target): 100}, **GREEDY
    )
    assert biased.choices[0].text == " play" * 6
    base = await oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, **GREEDY)
    assert "Lily" in base.choices[0].text
    banned = await oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True, "bad_words": ["Lily"]}
    )
    assert "Lily" not in banned.choices[0].text
    penalised = await oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, presence_penalty=1.5, frequency_penalty=1.0,
        temperature=0, extra_body={"ignore_eos": True, "repetition_penalty": 1.2, "min_p": 0.1},
    )
    assert penalised.choices[0].text != base.choices[0].text


async def test_min_p_reaches_the_sampler(served) -> None:
    """min_p near 1 keeps only the most likely token: sampling at temperature 1 is then greedy."""
    _, oai = served
    base = await oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, **GREEDY)
    kept = await oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True, "min_p": 0.999},
    )
    free = await oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=3, extra_body={"ignore_eos": True}
    )
    assert kept.choices[0].text == base.choices[0].text
    assert free.choices[0].text != base.choices[0].text  # without min_p the same seed wanders off


async def test_request_id_names_the_response(served) -> None:
    client, oai = served
    out = await oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"request_id": "abc"})
    assert out.id == "cmpl-abc"
    # Two requests with the same id at once are two engine requests, each answered in full.
    twice = await asyncio.gather(*(
        oai.chat.completions.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}], extra_body={"request_id": "x", **GREEDY["extra_body"]},
            temperature=0,
        ) for _ in range(2)
    ))
    assert [c.id for c in twice] == ["chatcmpl-x"] * 2
    assert [c.usage.completion_tokens for c in twice] == [8, 8]


async def test_limits_across_fields_are_400s(served) -> None:
    client, _ = served
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 33, "n": 4, "max_tokens": 1})
    assert_openai_error(r, 400, "BadRequestError", "n times the number of prompts")
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "max_tokens": 1,
    })
    assert_openai_error(r, 400, "BadRequestError", "Tool calling needs tools")
    assert r.json()["error"]["param"] == "tool_choice"


# ------------------------------------------------------------------ small routes


async def test_tokenize_detokenize_and_version(served, hf_tokenizer) -> None:
    client, _ = served
    r = (await client.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True})).json()
    assert r["tokens"] == hf_tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256 and r["token_strs"] == ["<s>", " Once", " upon", " a", " time"]
    r = (await client.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "add_special_tokens": False})).json()
    assert r["tokens"] == hf_tokenizer.encode(PROMPT, add_special_tokens=False)
    chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})).json()
    assert chat["tokens"] == hf_tokenizer.encode("<user>Hi\n<assistant>", add_special_tokens=False)
    r = (await client.post("/detokenize", json={"model": MODEL, "tokens": hf_tokenizer.encode(PROMPT)})).json()
    assert r == {"prompt": PROMPT}
    assert_openai_error(await client.post("/detokenize", json={"tokens": [10**6]}), 400, "BadRequestError", "vocabulary")
    assert_openai_error(await client.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404, "NotFoundError", "nope")
    version = (await client.get("/version")).json()["version"]
    assert version.count(".") == 2


# ------------------------------------------------------------------ no silent ignores

# Request fields of OpenAI's API and vLLM's extensions that touch sampling or
# what is generated. Each must be a declared field of our model (or msgspec
# would drop it unseen), and either implemented or refused with a 400.
KNOWN_COMMON = {
    "model", "frequency_penalty", "logit_bias", "max_tokens", "n", "presence_penalty", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "user", "response_format", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "allowed_token_ids", "prompt_logprobs", "bad_words", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "priority",
    "logits_processors", "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
    "logprobs", "add_special_tokens", "echo", "safety_identifier", "prompt_cache_key", "request_id",
    "return_token_ids", "mm_processor_kwargs",
}
KNOWN_COMPLETION = KNOWN_COMMON | {"prompt", "best_of", "suffix", "prompt_embeds"}
KNOWN_CHAT = KNOWN_COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "reasoning_effort", "modalities", "audio", "prediction", "functions", "function_call", "web_search_options",
    "store", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents", "metadata", "service_tier", "verbosity",
}
# A value each refused field is refused with.
REFUSED_VALUES: dict[str, Any] = {
    "use_beam_search": True, "length_penalty": 0.5, "spaces_between_special_tokens": False,
    "logits_processors": ["my.processor"], "guided_json": {"type": "object"}, "guided_regex": "a+",
    "guided_choice": ["a", "b"], "guided_grammar": "root ::= 'a'", "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "vllm_xargs": {"x": 1}, "kv_transfer_params": {"x": 1},
    "suffix": "the end", "best_of": 2, "echo": True, "continue_final_message": True, "documents": [{"text": "d"}],
    "reasoning_effort": "high", "modalities": ["text", "audio"],
    "audio": {"voice": "alloy"}, "prediction": {"type": "content", "content": "x"},
    "functions": [{"name": "f"}], "function_call": "auto", "web_search_options": {}, "store": True,
    "return_token_ids": True, "mm_processor_kwargs": {"x": 1}, "metadata": {"k": "v"}, "service_tier": "flex",
    "verbosity": "low",
}


@pytest.mark.parametrize("model_type,known", [(CompletionRequest, KNOWN_COMPLETION), (ChatCompletionRequest, KNOWN_CHAT)])
def test_every_known_field_is_implemented_or_refused(model_type, known) -> None:
    fields = set(model_type.__struct_fields__)
    assert known <= fields, f"declare these or they are silently ignored: {sorted(known - fields)}"
    assert model_type.implemented.isdisjoint(model_type.refused)
    assert fields == model_type.implemented | set(model_type.refused), (
        f"neither implemented nor refused: {sorted(fields - model_type.implemented - set(model_type.refused))}"
    )
    assert set(model_type.refused) <= set(REFUSED_VALUES)


async def test_refused_fields_are_400s_that_name_them(served) -> None:
    client, _ = served
    for path, model_type, base in (
        ("/v1/completions", CompletionRequest, {"model": MODEL, "prompt": "x", "max_tokens": 1}),
        ("/v1/chat/completions", ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ):
        for name in model_type.refused:
            r = await client.post(path, json={**base, name: REFUSED_VALUES[name]})
            assert_openai_error(r, 400, "BadRequestError", name)
            assert r.json()["error"]["param"] == name
        # Their neutral values pass.
        neutral = {name: accepted[-1] for name, (accepted, _) in model_type.refused.items()}
        r = await client.post(path, content=msgspec.json.encode({**base, **neutral}))
        assert r.status_code == 200, r.text
