"""Hostile input, a table of it: every request below must get a 4xx in OpenAI's error
shape, and the server (the real app over the real engine in this process) must go on
serving; the edge cases that are valid must get a 200."""

from __future__ import annotations

import json

from tests.support.http import MODEL, make_engine, running_server

C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
BASE = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}
CHAT_BASE = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def with_field(base: dict, name: str, raw: bytes) -> bytes:
    """``base`` as JSON with ``name`` set to the raw JSON text ``raw`` (NaN, bad escapes...)."""
    return json.dumps({**base, name: "@@"}).encode().replace(b'"@@"', raw)


def j(body: object) -> bytes:
    return json.dumps(body).encode()


REFUSED: list[tuple[str, str, bytes]] = [
    # not JSON, not an object, not UTF-8
    ("empty body", C, b""),
    ("not JSON", C, b"{model: stories"),
    ("an array", C, b"[]"),
    ("a string", CHAT, b'"hello"'),
    ("null", TOK, b"null"),
    ("invalid UTF-8 in a string", C, b'{"model": "stories", "prompt": "\xff\xfe\xfd", "max_tokens": 2}'),
    ("invalid UTF-8 outside strings", CHAT, b'{"model"\xc3: 1}'),
    ("truncated", C, j(BASE)[:-3]),
    # wrong types
    ("prompt an object", C, j({**BASE, "prompt": {"a": 1}})),
    ("max_tokens a string", C, j({**BASE, "max_tokens": "ten"})),
    ("temperature a string", C, j({**BASE, "temperature": "hot"})),
    ("n a float", C, j({**BASE, "n": 1.5})),
    ("stream a string", C, j({**BASE, "stream": "yes"})),
    ("stop a number", C, j({**BASE, "stop": 5})),
    ("messages a string", CHAT, j({**CHAT_BASE, "messages": "hi"})),
    ("a message without a role", CHAT, j({**CHAT_BASE, "messages": [{"content": "hi"}]})),
    ("a role that is a number", CHAT, j({**CHAT_BASE, "messages": [{"role": 5, "content": "hi"}]})),
    ("tokens not ids", DETOK, j({"model": MODEL, "tokens": ["a"]})),
    # huge numbers, NaN and infinities
    ("max_tokens 10**30", C, j({**BASE, "max_tokens": 10**30})),
    ("max_tokens 2**63", C, j({**BASE, "max_tokens": 2**63})),
    ("max_tokens 10**9", C, j({**BASE, "max_tokens": 10**9})),
    ("temperature NaN", C, with_field(BASE, "temperature", b"NaN")),
    ("temperature Infinity", C, with_field(BASE, "temperature", b"Infinity")),
    ("temperature 1e999", C, with_field(BASE, "temperature", b"1e999")),
    ("top_p -1e999", C, with_field(BASE, "top_p", b"-1e999")),
    ("top_p 1e308", C, j({**BASE, "top_p": 1e308})),
    ("presence_penalty 1e300", C, j({**BASE, "presence_penalty": 1e300})),
    ("repetition_penalty 0", C, j({**BASE, "repetition_penalty": 0})),
    ("min_p 2", C, j({**BASE, "min_p": 2})),
    ("seed 2**64", C, j({**BASE, "seed": 2**64})),
    ("logit_bias 1e999", C, with_field(BASE, "logit_bias", b'{"1": 1e999}')),
    ("frequency_penalty NaN in chat", CHAT, with_field(CHAT_BASE, "frequency_penalty", b"NaN")),
    # negative and enormous n, max_tokens, top_k, logprobs
    ("n 0", C, j({**BASE, "n": 0})),
    ("n -1", C, j({**BASE, "n": -1})),
    ("n 10**9", C, j({**BASE, "n": 10**9})),
    ("n 10**9 in chat", CHAT, j({**CHAT_BASE, "n": 10**9})),
    ("max_tokens -5", C, j({**BASE, "max_tokens": -5})),
    ("max_tokens -5 in chat", CHAT, j({**CHAT_BASE, "max_tokens": -5})),
    ("max_completion_tokens 10**12", CHAT, j({**CHAT_BASE, "max_completion_tokens": 10**12})),
    ("top_k -5", C, j({**BASE, "top_k": -5})),
    ("top_k 2**40", C, j({**BASE, "top_k": 2**40})),
    ("logprobs -1", C, j({**BASE, "logprobs": -1})),
    ("logprobs 10**9", C, j({**BASE, "logprobs": 10**9})),
    ("top_logprobs 10**6", CHAT, j({**CHAT_BASE, "logprobs": True, "top_logprobs": 10**6})),
    ("top_logprobs -3", CHAT, j({**CHAT_BASE, "logprobs": True, "top_logprobs": -3})),
    ("prompt_logprobs 10**9", C, j({**BASE, "prompt_logprobs": 10**9})),
    ("min_tokens above max_tokens", C, j({**BASE, "min_tokens": 50})),
    ("truncate_prompt_tokens -2", C, j({**BASE, "truncate_prompt_tokens": -2})),
    # deeply nested JSON
    ("a deep prompt", C, with_field(BASE, "prompt", deep(100_000))),
    ("deep chat_template_kwargs", CHAT, with_field(CHAT_BASE, "chat_template_kwargs", b'{"a": ' + deep(100_000) + b"}")),
    ("deep tool parameters", CHAT, with_field(
        CHAT_BASE, "tools", b'[{"type": "function", "function": {"name": "f", "parameters": ' + deep(50_000) + b"}}]")),
    # lone surrogates
    ("a lone surrogate in a prompt", C, with_field(BASE, "prompt", b'"abc \\ud800 def"')),
    ("a lone low surrogate in a prompt", C, with_field(BASE, "prompt", b'"\\udc00"')),
    ("a lone surrogate in a message", CHAT, with_field(
        CHAT_BASE, "messages", b'[{"role": "user", "content": "hi \\udfff"}]')),
    ("a lone surrogate in a stop string", C, with_field(BASE, "stop", b'["\\ud800"]')),
    ("a lone surrogate to tokenize", TOK, with_field({"model": MODEL}, "prompt", b'"\\ud83d"')),
    ("a lone surrogate in bad_words", C, with_field(BASE, "bad_words", b'["\\ud800"]')),
    ("a lone surrogate in a logit_bias key", C, with_field(BASE, "logit_bias", b'{"\\ud800": 1}')),
    # stop lists
    ("a gigantic stop list", C, j({**BASE, "stop": [f"s{i}" for i in range(100_000)]})),
    ("a stop list of empty strings", C, j({**BASE, "stop": ["", ""]})),
    ("stop_token_ids out of vocabulary", C, j({**BASE, "stop_token_ids": [10**9]})),
    # unknown token ids
    ("a prompt id out of vocabulary", C, j({**BASE, "prompt": [10**6]})),
    ("a negative prompt id", C, j({**BASE, "prompt": [1, -1]})),
    ("a prompt id 2**64", C, j({**BASE, "prompt": [2**64]})),
    ("batch prompts with an unknown id", C, j({**BASE, "prompt": [[1, 2], [3, 10**7]]})),
    ("detokenize an unknown id", DETOK, j({"model": MODEL, "tokens": [10**6]})),
    ("detokenize a negative id", DETOK, j({"model": MODEL, "tokens": [-1]})),
    ("logit_bias on an unknown id", C, j({**BASE, "logit_bias": {"999999": 5}})),
    ("logit_bias on a key that is no id", C, j({**BASE, "logit_bias": {"abc": 5}})),
    ("allowed_token_ids out of vocabulary", C, j({**BASE, "allowed_token_ids": [10**9]})),
    # empty and odd shapes
    ("an empty prompt list", C, j({**BASE, "prompt": []})),
    ("no messages", CHAT, j({**CHAT_BASE, "messages": []})),
    ("an unknown model", C, j({**BASE, "model": "gpt-9"})),
    ("tokenize with neither prompt nor messages", TOK, j({"model": MODEL})),
    ("a prompt longer than max_model_len", C, j({**BASE, "prompt": [1] * 10_000})),
    ("an unknown field the server must not ignore", C, j({**BASE, "best_of": 3})),
]

# Edge cases that are valid: the server must answer them.
ACCEPTED: list[tuple[str, str, bytes]] = [
    ("an empty stop list", C, j({**BASE, "stop": []})),
    ("a surrogate pair in a prompt", C, with_field(BASE, "prompt", b'"smile \\ud83d\\ude00"')),
    ("a surrogate pair in a message", CHAT, with_field(CHAT_BASE, "messages", b'[{"role": "user", "content": "\\ud83d\\ude00"}]')),
    ("an emoji stop string", C, j({**BASE, "stop": ["\U0001f600"]})),
    ("unicode to tokenize", TOK, j({"model": MODEL, "prompt": "caf\u00e9 \u2603 \U0001f600"})),
    ("max_tokens absent in chat", CHAT, j({k: v for k, v in CHAT_BASE.items() if k != "max_tokens"})),
    ("top_k -1 (all tokens)", C, j({**BASE, "top_k": -1})),
    ("temperature 0 with a seed", C, j({**BASE, "temperature": 0, "seed": 2**63 - 1})),
    ("a JSON schema 400 deep", C, j({**BASE, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": json.loads(b'{"type": "array", "items": ' * 400 + b"{}" + b"}" * 400)}}})),
    ("128 stop strings", C, j({**BASE, "stop": [f"s{i}" for i in range(128)]})),
]


def _is_openai_error(body: object, status: int) -> bool:
    if not isinstance(body, dict) or set(body) != {"error"}:
        return False
    error = body["error"]
    return (
        set(error) == {"message", "type", "param", "code"}
        and error["code"] == status
        and isinstance(error["message"], str) and error["message"]
    )


async def test_hostile_requests_get_4xx_in_openai_shape_and_the_server_keeps_serving(stories_dir) -> None:
    async with running_server(make_engine(stories_dir, max_model_len=128)) as (client, _):
        await _check_table(client)


async def _check_table(client) -> None:
    failures = []
    for name, path, body in REFUSED:
        response = await client.post(path, content=body, headers={"Content-Type": "application/json"})
        try:
            payload = response.json()
        except ValueError:
            payload = None
        if not 400 <= response.status_code < 500 or not _is_openai_error(payload, response.status_code):
            failures.append(f"{name}: {response.status_code} {response.text[:200]}")
        health = await client.get("/health")
        assert health.status_code == 200, f"after {name}: {health.text}"
    assert not failures, "\n".join(failures)
    for name, path, body in ACCEPTED:
        response = await client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 200, f"{name}: {response.text[:300]}"
    ok = await client.post(C, json={**BASE, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
