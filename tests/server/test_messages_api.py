"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) against the official
anthropic client, on the embedded stories260K served in this process.

The oracles: the anthropic client (it decodes every response and error into its own types,
and rebuilds a streamed message from the events); /v1/chat/completions for the same
conversation (greedy text); transformers' rendering of the same conversation as chat
messages (token counts); jsonschema (forced tool inputs, structured outputs).
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import jsonschema
import msgspec
import openai
import pytest
import pytest_asyncio
from anthropic.lib.streaming._messages import accumulate_event
from transformers import AutoTokenizer

from app.errors import StreamTimeoutError
from app.parsing.output import OutputDelta
from app.protocol.chat import DeltaFunctionCall, DeltaToolCall
from app.protocol.messages import (
    ContentBlockStart,
    ContentBlockStop,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
    StopDelta,
    Usage,
)
from app.serving.messages import MessageAssembler, paced
from core.models.default_model import DEFAULT_MODEL_DIR
from tests.support.chat_models import write_chat_model
from tests.support.http import MODEL, make_engine, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "sk-messages-test"
# Shows the system prompt, the tools, the calls and their results, as tool-aware templates do.
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.tool_calls %}<assistant>{{ m.content }}{% for c in m.tool_calls %}<call {{ c.id }} "
    "{{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}\n"
    "{% elif m.role == 'tool' %}<result {{ m.tool_call_id }}>{{ m.content }}\n"
    "{% else %}<{{ m.role }}>{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                          "required": ["zone"]}},
]
SYSTEM = "You tell short stories."
TURNS = [
    {"role": "user", "content": "Once upon a time"},
    {"role": "assistant", "content": "there was a little girl."},
    {"role": "user", "content": "What did she do?"},
]
GREEDY = {"temperature": 0}  # the current client no longer has the argument: sent as an extra


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served():
    engine = make_engine(str(DEFAULT_MODEL_DIR), chat_template=TEMPLATE, max_model_len=512)
    async with running_server(engine, api_key=KEY, enable_auto_tool_choice=True, tool_call_parser="hermes") as (
        client, base
    ):
        async with (
            anthropic.AsyncAnthropic(base_url=base, api_key=KEY, max_retries=0) as claude,
            openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0) as oai,
        ):
            yield client, claude, oai


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))


def _text(message: anthropic.types.Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _sse_names(body: str) -> list[str]:
    return [line.removeprefix("event: ") for line in body.splitlines() if line.startswith("event: ")]


async def test_greedy_text_equals_chat_completions(served) -> None:
    _, claude, oai = served
    for max_tokens in (12, 400):
        message = await claude.messages.create(
            model=MODEL, system=SYSTEM, messages=TURNS, max_tokens=max_tokens, extra_body=GREEDY
        )
        chat = await oai.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *TURNS], max_tokens=max_tokens, temperature=0
        )
        choice = chat.choices[0]
        assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
        assert message.model == MODEL
        assert _text(message) == choice.message.content
        assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
        assert message.stop_sequence is None
        usage = message.usage
        assert usage.output_tokens == chat.usage.completion_tokens
        assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
        assert usage.cache_creation_input_tokens == 0
        # Run again, the prompt is in the prefix cache, as it was for the chat request:
        # input_tokens counts only what was not read from it.
        again = await claude.messages.create(
            model=MODEL, system=SYSTEM, messages=TURNS, max_tokens=max_tokens, extra_body=GREEDY
        )
        cached = chat.usage.prompt_tokens_details.cached_tokens
        assert cached > 0 and again.usage.cache_read_input_tokens == cached
        assert again.usage.input_tokens == chat.usage.prompt_tokens - cached
    # System as text blocks, turns as text blocks: the same prompt.
    blocks = await claude.messages.create(
        model=MODEL, system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in TURNS],
        max_tokens=400, extra_body=GREEDY, metadata={"user_id": "u1"}, service_tier="auto",
    )
    assert _text(blocks) == _text(message)


async def test_stream_adds_up_to_the_whole_message(served) -> None:
    client, claude, _ = served
    body = dict(model=MODEL, system=SYSTEM, messages=TURNS, max_tokens=40, extra_body=GREEDY)
    whole = await claude.messages.create(**body)
    async with claude.messages.stream(**body) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == _text(whole)
    assert final.model_dump(exclude={"id", "usage"}) == whole.model_dump(exclude={"id", "usage"})
    assert final.usage.output_tokens == whole.usage.output_tokens
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt
    # The events as sent: message_start, ping, each block opened, filled and closed in
    # turn, message_delta, message_stop.
    raw = await client.post("/v1/messages", headers={"x-api-key": KEY},
                            json={"model": MODEL, "messages": TURNS, "max_tokens": 40, "stream": True, **GREEDY})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    names = _sse_names(raw.text)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    events = [json.loads(line.removeprefix("data: ")) for line in raw.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == names
    open_index, next_index = None, 0
    for event in events[2:-2]:
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == next_index
            open_index, next_index = event["index"], next_index + 1
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index
        else:
            assert event["type"] == "content_block_stop" and event["index"] == open_index
            open_index = None
    assert open_index is None and next_index >= 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_named_tool_choice_gives_a_tool_use_matching_its_schema(served, stream) -> None:
    _, claude, _ = served
    body = dict(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=100, extra_body=GREEDY,
    )
    if stream:
        async with claude.messages.stream(**body) as events:
            message = await events.get_final_message()
    else:
        message = await claude.messages.create(**body)
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER)
    assert message.stop_reason == "tool_use"


async def test_tool_choice_any_without_parallel_use_gives_one_call(served) -> None:
    _, claude, _ = served
    message = await claude.messages.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_tokens=100,
        extra_body={"temperature": 1.0, "top_k": 5},
    )
    (block,) = message.content
    assert block.type == "tool_use" and message.stop_reason == "tool_use"
    schema = {t["name"]: t["input_schema"] for t in TOOLS}[block.name]
    jsonschema.validate(block.input, schema)


def _conversation_with_a_result(call_id: str) -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should look.", "signature": ""},
            {"type": "text", "text": "Let me see."},
            {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {"city": "Paris", "unit": "c"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call_id, "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "And tomorrow?"},
        ]},
    ]


async def test_token_counts_equal_the_template_rendered_by_transformers(served, tokenizer) -> None:
    """count_tokens == the length of the same conversation as chat messages, rendered with
    its tools by transformers' apply_chat_template and tokenized."""
    _, claude, _ = served
    call_id = "toolu_0123"
    chat_messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather",
                                                             "arguments": {"city": "Paris", "unit": "c"}}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    chat_tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}} for t in TOOLS]
    text = tokenizer.apply_chat_template(chat_messages, tools=chat_tools, chat_template=TEMPLATE,
                                         add_generation_prompt=True, tokenize=False)
    assert "<call toolu_0123 get_weather Paris>" in text and "<result toolu_0123>sunny" in text
    expected = len(tokenizer.encode(text, add_special_tokens=False))
    messages = _conversation_with_a_result(call_id)
    counted = await claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages, tools=TOOLS)
    assert counted.input_tokens == expected
    # The beta client (?beta=true, anthropic-beta header) counts the same.
    beta = await claude.beta.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=messages, tools=TOOLS, betas=["token-counting-2024-11-01"]
    )
    assert beta.input_tokens == expected
    # A system turn among the messages (Claude Code's environment, sent last) joins the system prompt.
    environment = [{"role": "user", "content": "Hi"}, {"role": "system", "content": [{"type": "text", "text": "ENV"}]}]
    counted = await claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=environment)
    joined = [{"role": "system", "content": SYSTEM + "\nENV"}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(joined, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False)
    assert counted.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    # And a generation from it reports that prompt (the tools shown under tool_choice none too).
    reply = await claude.messages.create(model=MODEL, system=SYSTEM, messages=messages, tools=TOOLS, max_tokens=5,
                                         tool_choice={"type": "none"}, extra_body=GREEDY)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == expected
    assert reply.stop_reason in ("max_tokens", "end_turn") and all(b.type == "text" for b in reply.content)


async def test_deferred_tools_are_shown_once_a_tool_reference_loads_them(served, tokenizer) -> None:
    """Claude Code's tool search: a tool with defer_loading stays out of the prompt until a
    tool's result holds a tool_reference to it (oracle: transformers' rendering of the
    chat messages with and without that tool)."""
    _, claude, _ = served
    tools = [TOOLS[0], {**TOOLS[1], "defer_loading": True}]
    asked = [{"role": "user", "content": "What time is it?"}]
    searched = [
        *asked,
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "time", "unit": "c"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": [
            {"type": "text", "text": "found"}, {"type": "tool_reference", "tool_name": "get_time"}]}]},
    ]

    def rendered(messages: list[dict], names: list[str]) -> int:
        shown = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
                 for t in TOOLS if t["name"] in names]
        text = tokenizer.apply_chat_template(messages, tools=shown, chat_template=TEMPLATE,
                                             add_generation_prompt=True, tokenize=False)
        return len(tokenizer.encode(text, add_special_tokens=False))

    before = await claude.beta.messages.count_tokens(model=MODEL, messages=asked, tools=tools)
    assert before.input_tokens == rendered(asked, ["get_weather"])
    after = await claude.beta.messages.count_tokens(model=MODEL, messages=searched, tools=tools)
    call = {"id": "toolu_9", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "time", "unit": "c"}}}
    chat = [*asked, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_9", "content": "found\nTool get_time loaded."}]
    assert after.input_tokens == rendered(chat, ["get_weather", "get_time"])
    wrong = [*searched[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": [
        {"type": "tool_reference", "tool_name": "teleport"}]}]}]
    with pytest.raises(anthropic.BadRequestError, match="teleport"):
        await claude.beta.messages.count_tokens(model=MODEL, messages=wrong, tools=tools)


async def test_tool_result_continuation_through_the_beta_client(served) -> None:
    """A forced call, its result sent back (as the client's to_param gives it), and the next turn."""
    _, claude, _ = served
    first = await claude.messages.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=100, extra_body=GREEDY,
    )
    (call,) = first.content
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        first.to_param(),
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny",
                                      "is_error": False}]},
    ]
    second = await claude.beta.messages.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, extra_body=GREEDY,
        betas=["interleaved-thinking-2025-05-14"], context_management={"edits": []}, mcp_servers=[],
    )
    assert second.stop_reason in ("max_tokens", "end_turn", "tool_use")
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > first.usage.input_tokens


async def test_stop_sequences_and_max_tokens(served) -> None:
    _, claude, _ = served
    body = dict(model=MODEL, system=SYSTEM, messages=TURNS, extra_body=GREEDY)
    free = await claude.messages.create(**body, max_tokens=60)
    text = _text(free)
    words = text.split()
    stop = words[len(words) // 2]
    cut = await claude.messages.create(**body, max_tokens=60, stop_sequences=["zzzq", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == text[: text.index(stop)]
    short = await claude.messages.create(**body, max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    async with claude.messages.stream(**body, max_tokens=60, stop_sequences=[stop]) as stream:
        streamed = await stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, _text(streamed)) == ("stop_sequence", stop, _text(cut))


async def test_max_tokens_beyond_the_window_is_cut_to_the_room_left(served) -> None:
    _, claude, _ = served
    message = await claude.messages.create(model=MODEL, messages=TURNS, max_tokens=20000,
                                           extra_body={**GREEDY, "top_k": 1})
    prompt = message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert prompt + message.usage.output_tokens <= 512
    assert message.stop_reason in ("end_turn", "model_context_window_exceeded")


async def test_structured_output_follows_the_schema(served) -> None:
    _, claude, _ = served
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    message = await claude.messages.create(
        model=MODEL, messages=TURNS, max_tokens=80, output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(_text(message)), schema)


async def test_server_tools_are_ignored_and_thinking_is_accepted(served) -> None:
    _, claude, _ = served
    message = await claude.messages.create(
        model=MODEL, messages=TURNS, max_tokens=5, extra_body=GREEDY,
        tools=[{"type": "web_search_20250305", "name": "web_search"}, {"type": "bash_20250124", "name": "bash"}],
        tool_choice={"type": "auto"}, thinking={"type": "disabled"},
    )
    assert message.content and message.content[0].type == "text"
    adaptive = await claude.messages.create(model=MODEL, messages=TURNS, max_tokens=5, extra_body=GREEDY,
                                            thinking={"type": "adaptive"})
    assert adaptive.stop_reason in ("max_tokens", "end_turn")


async def test_api_key_by_header_or_bearer(served) -> None:
    client, _, _ = served
    base = str(client.base_url)
    body = dict(model=MODEL, messages=TURNS, max_tokens=2)
    async with anthropic.AsyncAnthropic(base_url=base, auth_token=KEY, api_key=None, max_retries=0) as bearer:
        assert (await bearer.messages.create(**body)).type == "message"
        assert (await bearer.messages.count_tokens(model=MODEL, messages=TURNS)).input_tokens > 0
    async with anthropic.AsyncAnthropic(base_url=base, api_key="wrong", max_retries=0) as wrong:
        for call in (wrong.messages.create(**body), wrong.messages.count_tokens(model=MODEL, messages=TURNS)):
            with pytest.raises(anthropic.AuthenticationError) as caught:
                await call
            assert caught.value.status_code == 401
            assert caught.value.body["type"] == "error"
            assert caught.value.body["error"]["type"] == "authentication_error"
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def _bad(**changes) -> dict:
    body = {"model": MODEL, "messages": TURNS, "max_tokens": 5, **changes}
    return {k: v for k, v in body.items() if v is not None}


BAD_REQUESTS = {
    "max_tokens missing": (_bad(max_tokens=None), "max_tokens"),
    "unknown field": (_bad(frequency_of_cats=3), "frequency_of_cats"),
    "unknown block type": (_bad(messages=[{"role": "user", "content": [{"type": "hologram", "text": "x"}]}]),
                           "messages[0].content[0].type"),
    "image block": (_bad(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]),
        "messages[0].content[0]"),
    "tool_result for no tool_use": (_bad(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]), "tool_use_id"),
    "tool schema not an object": (_bad(tools=[{"name": "f", "input_schema": {"type": "string"}}]),
                                  "tools[0].input_schema"),
    "tool schema properties malformed": (_bad(tools=[{"name": "f", "input_schema": {"type": "object",
                                                                                    "properties": [1]}}]),
                                         "tools[0].input_schema"),
    "tool without input_schema": (_bad(tools=[{"name": "f"}]), "input_schema"),
    "unknown tool type": (_bad(tools=[{"type": "teleport", "name": "f"}]), "tools[0].type"),
    "named tool not among the tools": (_bad(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "nope"),
    "tool_choice any without tools": (_bad(tool_choice={"type": "any"}), "tool_choice"),
    "thinking without a budget": (_bad(thinking={"type": "enabled"}), "thinking.budget_tokens"),
    "prefilled assistant turn": (_bad(messages=[*TURNS, {"role": "assistant", "content": "She"}]), "prefill"),
    "unknown model": (_bad(model="claude-nonexistent"), "claude-nonexistent"),
    "mcp servers": (_bad(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}]), "mcp_servers"),
    "output format not json_schema": (_bad(output_config={"format": {"type": "xml", "schema": {}}}),
                                      "output_config.format.type"),
    "max_tokens zero": (_bad(max_tokens=0), "max_tokens"),
    "unknown role": (_bad(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    "unknown tool_choice": (_bad(tools=TOOLS, tool_choice={"type": "sometimes"}), "tool_choice.type"),
    "unknown thinking type": (_bad(thinking={"type": "deep"}), "thinking.type"),
    "tool_use in a user turn": (_bad(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}]), "messages[0].content[0]"),
    "tool_reference outside a result": (_bad(messages=[{"role": "user", "content": [
        {"type": "tool_reference", "tool_name": "get_time"}]}]), "messages[0].content[0].type"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
async def test_bad_requests_are_4xx_in_anthropics_shape(served, name) -> None:
    _, claude, _ = served
    body, needle = BAD_REQUESTS[name]
    expected = anthropic.NotFoundError if name == "unknown model" else anthropic.BadRequestError
    for stream in (False, True):
        with pytest.raises(expected) as caught:
            await claude.post("/v1/messages", body={**body, "stream": stream}, cast_to=anthropic.types.Message)
        error = caught.value.body
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
        assert error["error"]["type"] == ("not_found_error" if name == "unknown model" else "invalid_request_error")
        assert needle in error["error"]["message"], error


async def test_a_grammar_the_engine_refuses_is_a_400_before_the_stream(served) -> None:
    client, _, _ = served
    body = {"model": MODEL, "messages": TURNS, "max_tokens": 5, "stream": True,
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "minProperties": "x"}}}}
    r = await client.post("/v1/messages?beta=true", json=body, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


async def test_malformed_bodies_are_400(served) -> None:
    client, _, _ = served
    for content in (b"{not json", b'{"model": 3}', b"[]"):
        r = await client.post("/v1/messages", content=content, headers={"x-api-key": KEY})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = await client.post("/v1/messages/count_tokens", content=b'{"model": "stories"}', headers={"x-api-key": KEY})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


# ------------------------------------------------------------------ a thinking model


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def qwen3(tmp_path_factory):
    """A random Qwen3 with Qwen3's vocabulary and template: ``</think>`` is one token, so
    budget_tokens caps the reasoning in the engine."""
    model_dir = write_chat_model(tmp_path_factory.mktemp("qwen3"), "qwen3", "Qwen-Qwen3-0.6B.jinja")
    engine = make_engine(str(model_dir), chat_template=None, max_model_len=512, dtype="float32")
    async with running_server(engine) as (client, base):
        async with (
            anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as claude,
            openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as oai,
        ):
            yield claude, oai, AutoTokenizer.from_pretrained(str(model_dir))


async def test_thinking_blocks_equal_chats_reasoning(qwen3) -> None:
    """Greedy, budget_tokens as chat's max_thinking_tokens: the thinking block is chat's
    reasoning_content, the text block its content; streamed, the same message."""
    claude, oai, _ = qwen3
    question = [{"role": "user", "content": "Why is the sky blue?"}]
    for budget in (4, 12):
        body = dict(model=MODEL, messages=question, max_tokens=30, thinking={"type": "enabled", "budget_tokens": budget},
                    extra_body=GREEDY)
        message = await claude.messages.create(**body)
        chat = await oai.chat.completions.create(
            model=MODEL, messages=question, max_tokens=30, temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}, "max_thinking_tokens": budget},
        )
        reply = chat.choices[0].message
        thinking = [b for b in message.content if b.type == "thinking"]
        assert thinking and thinking[0] is message.content[0] and thinking[0].signature == ""
        assert thinking[0].thinking == reply.model_extra["reasoning_content"]
        assert _text(message) == (reply.content or "")
        async with claude.messages.stream(**body) as stream:
            final = await stream.get_final_message()
        assert final.model_dump(exclude={"id", "usage"}) == message.model_dump(exclude={"id", "usage"})
    off = await claude.messages.create(model=MODEL, messages=question, max_tokens=10, thinking={"type": "disabled"},
                                       extra_body=GREEDY)
    assert [b.type for b in off.content] == ["text"]
    omitted = await claude.messages.create(
        model=MODEL, messages=question, max_tokens=10, extra_body=GREEDY,
        thinking={"type": "enabled", "budget_tokens": 4, "display": "omitted"},
    )
    assert omitted.content[0].type == "thinking" and omitted.content[0].thinking == ""


async def test_thinking_sent_back_reaches_the_template(qwen3) -> None:
    """A tool loop's assistant turn keeps its thinking, which Qwen3's template writes back
    after the last user query: count_tokens == transformers' rendering with reasoning_content."""
    claude, _, tokenizer = qwen3
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Paris", "unit": "c"}}}
    chat_messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {"name": t["name"], **({"description": t["description"]} if
                                                                     "description" in t else {}),
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    text = tokenizer.apply_chat_template(chat_messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "I should look." in text
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should look.", "signature": ""},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}},
        ]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    counted = await claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages, tools=TOOLS)
    assert counted.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))


# ------------------------------------------------------------------ pings and stalls


class _Gate:
    """An async generator that yields 1 and 2 once opened, and records being closed."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.closed = False

    async def items(self):
        try:
            await self.opened.wait()
            yield 1
            yield 2
        finally:
            self.closed = True


async def test_paced_pings_while_the_source_waits_and_ends_with_it() -> None:
    gate, seen = _Gate(), []
    async for item in paced(gate.items(), ping_every=0.01):
        seen.append(item)
        if seen.count(None) == 2:
            gate.opened.set()
    assert seen[:2] == [None, None] and [x for x in seen if x is not None] == [1, 2] and gate.closed


async def test_paced_ends_a_stalled_source_and_closes_it() -> None:
    gate = _Gate()
    with pytest.raises(StreamTimeoutError):
        async for _ in paced(gate.items(), ping_every=0.01, stall_timeout=0.05):
            pass
    assert gate.closed
    gate = _Gate()
    stream = paced(gate.items(), ping_every=0.01)
    assert await stream.__anext__() is None
    await stream.aclose()  # the client left while the source waited
    assert gate.closed


async def test_a_waiting_stream_is_opened_and_pinged(monkeypatch) -> None:
    """While the engine is paused the request waits: the stream has already sent
    message_start (its usage the prompt's whole, no cache known yet) and pings; once
    resumed the message completes, and its final usage replaces the first."""
    import app.serving.messages as serving_messages

    monkeypatch.setattr(serving_messages, "PING_INTERVAL_S", 0.02)
    engine = make_engine(str(DEFAULT_MODEL_DIR), chat_template=TEMPLATE, max_model_len=256)
    async with running_server(engine) as (client, _):
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
        names, data = [], []
        body = {"model": MODEL, "messages": TURNS, "max_tokens": 8, "stream": True, **GREEDY}
        async with client.stream("POST", "/v1/messages", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    names.append(line.removeprefix("event: "))
                    if names.count("ping") == 2:
                        assert (await client.post("/resume")).status_code == 200
                elif line.startswith("data: "):
                    data.append(json.loads(line.removeprefix("data: ")))
    assert names[:3] == ["message_start", "ping", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start, final = data[0]["message"]["usage"], data[-2]["usage"]
    assert start["cache_read_input_tokens"] == 0 and start["output_tokens"] == 0
    assert final["input_tokens"] + final["cache_read_input_tokens"] == start["input_tokens"]
    assert final["output_tokens"] == 8 and data[-2]["delta"]["stop_reason"] == "max_tokens"


async def test_a_fault_mid_stream_ends_it_with_an_error_event(monkeypatch) -> None:
    """The engine's model step raises mid-stream (test-only fault injection): after the
    message's first events, an ``error`` event, which the client raises."""
    from core.worker.faults import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "step:6")
    engine = make_engine(str(DEFAULT_MODEL_DIR), chat_template=TEMPLATE, max_model_len=256)
    async with running_server(engine) as (_, base):
        async with anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as claude:
            stream = await claude.messages.create(model=MODEL, messages=TURNS, max_tokens=40, stream=True,
                                                  extra_body=GREEDY)
            seen = []
            with pytest.raises(anthropic.APIStatusError) as caught:
                async for event in stream:
                    seen.append(event.type)
    assert seen[:2] == ["message_start", "content_block_start"] and "message_stop" not in seen
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "api_error"


# ------------------------------------------------------------------ blocks from parsed deltas


def _call(index: int, name: str | None = None, arguments: str | None = None) -> DeltaToolCall:
    first = name is not None
    return DeltaToolCall(index=index, id=f"call_{index}" if first else None, type="function" if first else None,
                         function=DeltaFunctionCall(name=name, arguments=arguments))


@pytest.mark.parametrize(("deltas", "kinds"), [
    # Reasoning, an answer, two calls in pieces, whitespace after them.
    ([OutputDelta(reasoning="Let me"), OutputDelta(reasoning=" think."), OutputDelta(content="\n"),
     OutputDelta(content="Checking. "), OutputDelta(tool_calls=[_call(0, "get_weather", '{"city": "Pa')]),
     OutputDelta(tool_calls=[_call(0, arguments='ris", "unit": "c"}')]),
     OutputDelta(content="\n", tool_calls=[_call(1, "get_time", "{}")]), OutputDelta(content=" \n")],
    ["thinking", "text", "tool_use", "tool_use"]),
    # Only whitespace around a call: no text block.
    ([OutputDelta(content=" \n"), OutputDelta(tool_calls=[_call(0, "get_time", '{"zone":')]),
      OutputDelta(tool_calls=[_call(0, arguments=' "utc"}')]), OutputDelta(content="\n")], ["tool_use"]),
    # Only whitespace and no call: that is the answer.
    ([OutputDelta(content=" "), OutputDelta(content="\n")], ["text"]),
    # Text after a call opens a new text block.
    ([OutputDelta(tool_calls=[_call(0, "get_time", '{"zone": "cet"}')]), OutputDelta(content=" and more")],
     ["tool_use", "text"]),
], ids=["everything", "whitespace-around-a-call", "whitespace-only", "text-after-a-call"])
async def test_the_events_add_up_to_the_blocks_in_the_clients_accumulator(deltas, kinds) -> None:
    """The anthropic client's own accumulator, fed the events, rebuilds the assembler's blocks."""
    assembler = MessageAssembler()
    start = MessageStart(Message("msg_1", MODEL, [], None, None, Usage(3, 0)))
    events = [start]
    for delta in deltas:
        events += assembler.feed(delta)
    events += assembler.finish()
    events += [MessageDelta(StopDelta("end_turn", None), Usage(3, 9)), MessageStop()]
    snapshot, json_bufs = None, {}
    for event in events:
        raw = json.loads(msgspec.json.encode(event))
        snapshot = accumulate_event(event=raw, current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot.model_dump(exclude_none=True)["content"] == msgspec.to_builtins(assembler.blocks)
    indices = [e.index for e in events if isinstance(e, (ContentBlockStart, ContentBlockStop))]
    assert indices == [i for i in range(len(assembler.blocks)) for _ in (0, 1)]  # each opened, then closed
    assert [b.type for b in snapshot.content] == kinds
    for block in snapshot.content:
        if block.type == "tool_use":
            assert block.id.startswith("toolu_") and isinstance(block.input, dict)
