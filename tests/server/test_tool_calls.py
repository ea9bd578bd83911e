"""Tool calling on chat: forced calls through a grammar, the parsers, streamed deltas.

Over HTTP with the official openai client: on the embedded stories260K (the
in-process engine) under a made-up template with an explicitly chosen
parser, and on random models with each family's real vocabulary and
published template, the parser read from the template (the end of this
file). The parsers alone: tests/unit/test_tool_parsers.py.
"""

from __future__ import annotations

import json

import jsonschema
import msgspec
import openai
import pytest

from app.protocol.chat import ChatCompletionRequest
from app.parsing.tool_calls import (
    RequiredCallStream,
    forced_call_constraint,
    parse_forced,
)
from core.models.default_model import DEFAULT_MODEL_DIR
from tests.support.chat_models import TEMPLATES, cached_chat_model
from tests.support.http import MODEL, assert_openai_error, make_engine, running_server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# A template that shows tools, calls and results, as tool-aware templates do.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<call {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments.city }}>{% endfor %}\n"
    "{% elif m.role == 'tool' %}<result {{ m.tool_call_id }}>{{ m.content }}\n"
    "{% else %}<{{ m.role }}>{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
async def served():
    engine = make_engine(str(DEFAULT_MODEL_DIR), chat_template=TOOL_TEMPLATE, max_model_len=256)
    async with running_server(engine, tool_call_parser="hermes") as (client, base):
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as oai:
            yield client, oai


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), PARAMS[name])


async def test_required_tool_choice_always_gives_a_valid_call(served) -> None:
    _, oai = served
    out = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        n=6, temperature=1.0, seed=2, max_tokens=100,
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message.content
        (call,) = choice.message.tool_calls
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        _check_call(call.function.name, call.function.arguments)
    assert len({c.message.tool_calls[0].id for c in out.choices}) == 6


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
async def test_streamed_tool_calls_reassemble_to_the_same_calls(served, tool_choice) -> None:
    _, oai = served
    # One call each (the model would go on adding calls to the array until max_tokens).
    body = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=11,
                max_tokens=120, parallel_tool_calls=False)
    whole = await oai.chat.completions.create(**body)
    calls = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert calls and whole.choices[0].finish_reason == "tool_calls", whole.choices[0]
    streamed: dict[int, dict] = {}
    finish = None
    async for chunk in await oai.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or ():
            entry = streamed.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or part.id
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(e["name"], e["arguments"]) for _, e in sorted(streamed.items())] == calls
    assert all(e["id"] for e in streamed.values())
    for name, arguments in calls:
        _check_call(name, arguments)
        if isinstance(tool_choice, dict):
            assert name == "get_weather"


async def test_auto_tool_choice_parses_hermes_calls(served) -> None:
    """The model is steered into a Hermes block by a regex (it was never trained to
    call tools); the parser turns it into tool_calls, whole and streamed."""
    _, oai = served
    block = r'Let me check\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,5}", "unit": "c"\}\}</tool_call>'
    body = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=190,
                extra_body={"structured_outputs": {"regex": block}})
    out = await oai.chat.completions.create(**body)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    _check_call("get_weather", call.function.arguments)
    content, parts = "", []
    async for chunk in await oai.chat.completions.create(**body, stream=True):
        content += chunk.choices[0].delta.content or ""
        parts += chunk.choices[0].delta.tool_calls or []
    # The name first, then the arguments in pieces as the model writes them.
    assert content.strip() == "Let me check." and [p.function.name for p in parts if p.function.name] == ["get_weather"]
    assert parts[0].id and len(parts) > 2
    arguments = "".join(p.function.arguments or "" for p in parts)
    _check_call("get_weather", arguments)


async def test_tool_choice_none_and_auto_without_a_parser(served) -> None:
    """tool_choice none never calls; with no parser for the template (a made-up one, no
    flag given) tool_choice auto is answered in plain text, not refused."""
    client, oai = served
    out = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls
    engine = make_engine(str(DEFAULT_MODEL_DIR), chat_template=TOOL_TEMPLATE, max_model_len=256)
    async with running_server(engine) as (plain, _):
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 8, "temperature": 0}
        r = await plain.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == out.choices[0].message.content and not choice["message"]["tool_calls"]
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "nope"}},
    })
    assert_openai_error(r, 400, "BadRequestError", "not among the tools")


async def test_tool_calls_and_results_reach_the_template(served) -> None:
    client, _ = served
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = await client.post("/tokenize", json={"model": MODEL, "messages": messages, "return_token_strs": True})
    text = "".join(r.json()["token_strs"])
    assert "<call call_1 get_weather Paris>" in text.replace("\u2581", " ")
    assert "<result call_1>sunny" in text.replace("\u2581", " ")
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": TOOLS,
                                                       "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ the parsers alone


def test_required_stream_splits_the_array_into_calls() -> None:
    text = '[{"name":"f","parameters":{"s":"a}],{\\""}},{"name":"g","parameters":{}}]'
    stream, deltas = RequiredCallStream(), []
    for ch in text:
        deltas += stream.feed(ch, False)[1]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("f", {"s": 'a}],{"'}), ("g", {})]


def test_forced_constraint_schema_accepts_exactly_the_calls() -> None:
    req = msgspec.convert({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}, ChatCompletionRequest)
    schema = json.loads(forced_call_constraint(req).json)
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "utc"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "x", "unit": "c"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)


async def test_required_calls_cut_by_max_tokens_keep_the_complete_ones(served) -> None:
    """Parallel calls allowed, the model goes on adding calls until max_tokens: the answer
    has the calls completed before the cut, finish_reason "length", and no raw JSON,
    whole and streamed alike."""
    _, oai = served
    body = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=90)
    choice = (await oai.chat.completions.create(**body)).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert calls
    for name, arguments in calls:
        _check_call(name, arguments)
    finish, content, streamed = None, "", []
    async for chunk in await oai.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        streamed += [(part.function.name, part.function.arguments) for part in delta.tool_calls or ()]
        finish = chunk.choices[0].finish_reason or finish
    assert (finish, content, streamed) == ("length", "", calls)


def test_a_cut_forced_output_keeps_its_complete_calls() -> None:
    required = msgspec.convert({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}, ChatCompletionRequest)
    text = '[{"name":"get_time","parameters":{"zone":"utc"}},{"name":"get_weather","parameters":{"city":"Pa'
    calls = parse_forced(required, text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_time", {"zone": "utc"})]
    assert parse_forced(required, "[") == []
    named = msgspec.convert(
        {"messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        ChatCompletionRequest,
    )
    (call,) = parse_forced(named, '{"zone":"u')  # as far as it got, as OpenAI returns a cut call
    assert (call.function.name, call.function.arguments) == ("get_time", '{"zone":"u')


# ------------------------------------------------ each family's own syntax, real vocabularies and templates

FAMILY_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]},
}}]
FAMILY_MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CITY = "[A-Z][a-z]{2,6}"

# family -> (arch, template, the family's syntax as a regex (after "Checking. " where the
# syntax allows text first), what the parser is expected to be, content expected)
FAMILIES = {
    "hermes": ("qwen3", "Qwen-Qwen3-0.6B.jinja",
               r'Checking\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "' + CITY
               + r'", "days": [1-9]\}\}\n</tool_call>', "Checking."),
    "qwen3_coder": ("qwen2", "Qwen3-Coder.jinja",
                    r"Checking\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n" + CITY
                    + r"\n</parameter>\n<parameter=days>\n[1-9]\n</parameter>\n</function>\n</tool_call>",
                    "Checking."),
    "llama3_json": ("llama", "meta-llama-Llama-3.1-8B-Instruct.jinja",
                    r'\{"name": "get_weather", "parameters": \{"city": "' + CITY + r'", "days": [1-9]\}\}',
                    None),
    "mistral": ("llama", "Mistral-Small-3.2-24B-Instruct-2506.jinja",
                r'Checking\. \[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "' + CITY + r'", "days": [1-9]\}',
                "Checking."),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_the_family_syntax_becomes_tool_calls(family: str, tmp_path_factory) -> None:
    """A random model with the family's real vocabulary and template, served with no parser
    flag (the parser is read from the template), its output forced by a regex into the
    family's syntax as its template shows calls: tool_calls, whole and streamed alike."""
    if not TEMPLATES.is_dir():
        pytest.skip("../shared/chat-formats is not beside this checkout")
    arch, template, regex, content = FAMILIES[family]
    engine = make_engine(cached_chat_model(tmp_path_factory, arch, template), chat_template=None, max_model_len=2048)
    async with running_server(engine) as (_, base):
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as oai:
            body = dict(model=MODEL, messages=FAMILY_MESSAGES, tools=FAMILY_TOOLS, max_tokens=300, temperature=0,
                        extra_body={"structured_outputs": {"regex": regex},
                                    "chat_template_kwargs": {"enable_thinking": False}})
            out = await oai.chat.completions.create(**body)
            choice = out.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content == content
            (call,) = choice.message.tool_calls
            arguments = json.loads(call.function.arguments)
            assert call.function.name == "get_weather" and set(arguments) == {"city", "days"}
            assert isinstance(arguments["days"], int)  # Qwen3-Coder's text value typed by the schema
            if family == "mistral":
                assert len(call.id) == 9 and call.id.isalnum()
            else:
                assert call.id.startswith("chatcmpl-tool-")
            streamed_content, calls, finish = "", {}, None
            async for chunk in await oai.chat.completions.create(**body, stream=True):
                delta = chunk.choices[0].delta
                streamed_content += delta.content or ""
                for part in delta.tool_calls or ():
                    entry = calls.setdefault(part.index, {"name": None, "arguments": ""})
                    if part.function.name is not None:
                        assert entry["name"] is None and part.id and part.type == "function"
                        entry["name"] = part.function.name
                    entry["arguments"] += part.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            assert finish == "tool_calls" and streamed_content.strip() == (content or "")
            assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
