"""/v1/responses with the official openai client and the OpenAI Agents SDK as oracles.

Over HTTP on the embedded stories260K (the in-process engine), with a toy template
that shows tools, calls and results. Greedy text through Responses equals
/v1/chat/completions for the same conversation; the stream's final response equals
the whole one; forced calls come back as function_call items and continue with their
outputs, from items or from a stored response; bad input is a 4xx naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
import pytest_asyncio

from app.responses_store import ResponsesStore
from core.models.default_model import DEFAULT_MODEL_DIR
from tests.support.http import MODEL, make_engine, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

# Tools, calls and results as tool-aware templates show them; thinking off shows a mark.
TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.tool_calls %}<assistant>{{ m.content }}{% for c in m.tool_calls %}<call {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}>{% endfor %}\n"
    "{% elif m.role == 'tool' %}<result {{ m.tool_call_id }}>{{ m.content }}\n"
    "{% else %}<{{ m.role }}>{% if m.reasoning_content %}[reasoning: {{ m.reasoning_content }}]{% endif %}"
    "{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER,
     "strict": True},
    {"type": "web_search"},  # Codex and agents send tools this server cannot run: left out
    {"type": "mcp", "server_label": "x", "server_url": "http://localhost:1"},
]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": WEATHER, "strict": True}}]
STORY = {"type": "object", "properties": {"hero": {"type": "string", "maxLength": 12}}, "required": ["hero"],
         "additionalProperties": False}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    engine = make_engine(str(DEFAULT_MODEL_DIR), chat_template=TEMPLATE, max_model_len=256)
    store = ResponsesStore(tmp_path_factory.mktemp("responses") / "store.sqlite3")
    async with running_server(
        engine, enable_auto_tool_choice=True, tool_call_parser="hermes", responses_store=store
    ) as (client, base):
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as oai:
            yield client, oai, store


# A template that opens the model's reasoning in the prompt (Qwen3's way), closed when thinking is off.
THINK_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}{% endif %}"
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def thinking(tmp_path_factory):
    """A server whose template shows a reasoning model (the reasoning parser is picked from it)."""
    engine = make_engine(str(DEFAULT_MODEL_DIR), chat_template=THINK_TEMPLATE, max_model_len=256)
    store = ResponsesStore(tmp_path_factory.mktemp("responses") / "store.sqlite3")
    async with running_server(engine, responses_store=store) as (_, base):
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as oai:
            yield oai


async def _chat(oai: openai.AsyncOpenAI, messages: list[dict], **body: Any) -> Any:
    return await oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, **body)


CONVERSATIONS = [
    # (Responses input, instructions, the same conversation as chat messages)
    ("Once upon a time", "Tell a story.",
     [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Once upon a time"}]),
    ([
        {"role": "developer", "content": "Be kind."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                         {"type": "input_text", "text": " there"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello!", "annotations": [], "logprobs": []}]},
        "Tell me about a cat.",
    ], None, [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Tell me about a cat."},
    ]),
]


@pytest.mark.parametrize("case", range(len(CONVERSATIONS)), ids=["string", "items"])
async def test_greedy_text_equals_chat(served, case) -> None:
    _, oai, _ = served
    given, instructions, messages = CONVERSATIONS[case]
    if isinstance(given, list):  # a bare string in the list stands for an easy user message
        given = [{"role": "user", "content": x} if isinstance(x, str) else x for x in given]
    kwargs = {"instructions": instructions} if instructions else {}
    response = await oai.responses.create(model=MODEL, input=given, temperature=0, max_output_tokens=16, **kwargs)
    chat = await _chat(oai, messages, max_tokens=16)
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "incomplete"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, 16)
    assert usage.total_tokens == usage.input_tokens + 16 and usage.output_tokens_details.reasoning_tokens == 0
    counted = await oai.responses.input_tokens.count(model=MODEL, input=given, **kwargs)
    assert counted.input_tokens == chat.usage.prompt_tokens


async def test_reasoning_items_reach_the_template_with_their_assistant_turn(served) -> None:
    _, oai, _ = served
    items = [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Be nice."}]},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "x"}],
         "encrypted_content": "opaque"},  # nothing readable: dropped
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": "Bye"},
    ]
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "Be nice."},
                {"role": "user", "content": "Bye"}]
    counted = await oai.responses.input_tokens.count(model=MODEL, input=items)
    chat = await _chat(oai, messages, max_tokens=1)
    without = await _chat(oai, [{**m, "reasoning_content": None} for m in messages], max_tokens=1)
    assert counted.input_tokens == chat.usage.prompt_tokens > without.usage.prompt_tokens


async def test_cached_tokens_come_from_the_prefix_cache(served) -> None:
    _, oai, _ = served
    body = dict(model=MODEL, input="A long time ago, in a small town by the sea, there lived a girl named Lily. " * 2,
                temperature=0, max_output_tokens=2)
    await oai.responses.create(**body)
    again = await oai.responses.create(**body)
    assert again.usage.input_tokens_details.cached_tokens > 0


def _check_events(events: list[Any]) -> None:
    """Sequence numbers 0, 1, 2...; created and in_progress first, a terminal event last; each
    output item added, its content between its part's added and done, then done; the
    item ids of every event those of the items they belong to."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    open_item, index, part_open = None, -1, False
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert open_item is None and e.output_index == index + 1
            open_item, index = e.item, e.output_index
        elif e.type == "response.output_item.done":
            assert open_item is not None and e.item.id == open_item.id and not part_open
            open_item = None
        elif e.type == "response.content_part.added":
            assert open_item is not None and not part_open
            part_open = True
        elif e.type == "response.content_part.done":
            assert part_open
            part_open = False
        else:
            assert open_item is not None and e.item_id == open_item.id and e.output_index == index, e
            if e.type.startswith(("response.output_text", "response.reasoning_text")):
                assert part_open, e
    assert open_item is None


async def _streamed(oai: openai.AsyncOpenAI, **body: Any) -> tuple[list[Any], Any]:
    async with oai.responses.stream(**body) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
    return events, final


def _items(response: Any) -> list[tuple]:
    return [(i.type, i.status, getattr(i, "name", None), getattr(i, "arguments", None),
             [c.text for c in getattr(i, "content", None) or ()]) for i in response.output]


async def test_stream_final_response_equals_the_whole_one(served) -> None:
    _, oai, _ = served
    body = dict(model=MODEL, input="Who is the hero?", temperature=0, max_output_tokens=60,
                text={"format": {"type": "json_schema", "name": "story", "schema": STORY, "strict": True}})
    whole = await oai.responses.create(**body)
    assert whole.status == "completed" and whole.incomplete_details is None
    jsonschema.validate(json.loads(whole.output_text), STORY)
    events, final = await _streamed(oai, **body)
    _check_events(events)
    assert final.status == "completed" and _items(final) == _items(whole)
    assert final.usage.output_tokens == whole.usage.output_tokens
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    # Cut by max_output_tokens: response.incomplete, and the text so far.
    cut = dict(model=MODEL, input="Once upon a time", temperature=0, max_output_tokens=12)
    events, final = await _streamed(oai, **cut)
    _check_events(events)
    assert events[-1].type == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert _items(final) == _items(await oai.responses.create(**cut))


async def test_required_tool_choice_gives_a_function_call_whole_and_streamed(served) -> None:
    _, oai, _ = served
    body = dict(model=MODEL, input="What is the weather in Paris?", tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, temperature=0, max_output_tokens=150)
    whole = await oai.responses.create(**body)
    assert whole.status == "completed"
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    assert call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert [t.name for t in whole.tools] == ["get_weather"]  # the others were left out
    events, final = await _streamed(oai, **body)
    _check_events(events)
    assert _items(final) == _items(whole)
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments
    named = await oai.responses.create(**{**body, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [i.name for i in named.output] == ["get_weather"]
    jsonschema.validate(json.loads(named.output[0].arguments), WEATHER)


async def test_function_call_output_continues_from_items_or_a_stored_response(served) -> None:
    """The call and its result reach the template as chat's assistant tool_calls and tool
    message: the prompt is the chat prompt of the same conversation, token for token."""
    _, oai, _ = served
    first = await oai.responses.create(
        model=MODEL, input="Weather in Paris?", instructions="Use tools.", tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_output_tokens=150,
    )
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    messages = [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    chat = await _chat(oai, messages, tools=CHAT_TOOLS, tool_choice="none", max_tokens=8)
    chat_tools = await _chat(oai, messages, tools=CHAT_TOOLS, tool_choice="auto", max_tokens=8)
    # Continued from the stored response (instructions are not carried over: given again).
    stored = await oai.responses.create(
        model=MODEL, previous_response_id=first.id, input=[result], instructions="Use tools.", tools=TOOLS,
        tool_choice="none", temperature=0, max_output_tokens=8,
    )
    assert stored.usage.input_tokens == chat.usage.prompt_tokens
    assert stored.output_text == chat.choices[0].message.content
    assert stored.previous_response_id == first.id
    # The same conversation as items.
    items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True), result]
    replayed = await oai.responses.input_tokens.count(model=MODEL, input=items, instructions="Use tools.", tools=TOOLS)
    assert replayed.input_tokens == chat_tools.usage.prompt_tokens


async def test_a_chain_of_stored_responses_replays_every_turn(served) -> None:
    _, oai, _ = served
    turns = ["Hi", "Tell me a story.", "And then?"]
    previous, messages = None, []
    for text in turns:
        response = await oai.responses.create(model=MODEL, input=text, previous_response_id=previous,
                                              temperature=0, max_output_tokens=4)
        messages += [{"role": "user", "content": text}]
        chat = await _chat(oai, messages, max_tokens=4)
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.output_text == chat.choices[0].message.content
        messages += [{"role": "assistant", "content": response.output_text}]
        previous = response.id


async def test_retrieve_delete_and_store_false(served) -> None:
    client, oai, store = served
    created = await oai.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=3,
                                         metadata={"user": "7"})
    got = await oai.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump() and got.metadata == {"user": "7"}
    await oai.responses.delete(created.id)
    for call in (oai.responses.retrieve(created.id), oai.responses.delete(created.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    count = await store.count()
    kept_not = await oai.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    assert kept_not.store is False and await store.count() == count
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(kept_not.id)
    r = await client.get("/responses/resp_unknown")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


async def test_input_items_of_a_stored_response(served) -> None:
    _, oai, _ = served
    first = await oai.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=2)
    given = [{"role": "user", "content": "One"}, {"type": "message", "role": "user", "id": "msg_mine",
                                                  "content": [{"type": "input_text", "text": "Two"}]}]
    second = await oai.responses.create(model=MODEL, input=given, previous_response_id=first.id,
                                        temperature=0, max_output_tokens=2)
    page = await oai.responses.input_items.list(second.id, order="asc")
    assert [(i.type, i.role, [c.text for c in i.content]) for i in page.data] == [
        ("message", "user", ["One"]), ("message", "user", ["Two"])]  # its own input, not the first turn's
    assert page.data[1].id == "msg_mine" and page.data[0].id.startswith("msg_") and not page.has_more
    newest = await oai.responses.input_items.list(second.id, limit=1)  # OpenAI's default order: newest first
    assert [i.id for i in newest.data] == ["msg_mine"] and newest.has_more
    rest = await oai.responses.input_items.list(second.id, limit=1, after="msg_mine")
    assert [i.id for i in rest.data] == [page.data[0].id] and not rest.has_more
    with pytest.raises(openai.NotFoundError):
        await oai.responses.input_items.list("resp_unknown")


async def test_reasoning_effort_turns_thinking_on_and_off(served) -> None:
    _, oai, _ = served
    off = await oai.responses.input_tokens.count(model=MODEL, input="Hi", reasoning={"effort": "minimal"})
    on = await oai.responses.input_tokens.count(model=MODEL, input="Hi", reasoning={"effort": "high"})
    messages = [{"role": "user", "content": "Hi"}]
    chat_off = await _chat(oai, messages, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    chat_on = await _chat(oai, messages, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert (off.input_tokens, on.input_tokens) == (chat_off.usage.prompt_tokens, chat_on.usage.prompt_tokens)
    assert off.input_tokens > on.input_tokens


async def test_fields_clients_send_are_accepted(served) -> None:
    """What the openai client, the Agents SDK and Codex send that means nothing here."""
    client, _, _ = served
    body = {
        "model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": True, "stream": False,
        "prompt_cache_key": "k", "prompt_cache_retention": "24h", "service_tier": "auto", "safety_identifier": "s",
        "user": "u", "truncation": "disabled", "background": False, "include": ["reasoning.encrypted_content"],
        "reasoning": {"effort": "low", "summary": "auto"}, "text": {"format": {"type": "text"}, "verbosity": "low"},
        "parallel_tool_calls": True, "tools": TOOLS[1:], "tool_choice": "auto", "top_logprobs": 0,
        "metadata": {"a": "b"},
    }
    r = await client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"a": "b"} and r.json()["tools"] == []


BAD = [
    ({"input": [{"type": "bogus"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, 400, "input[0].call_id"),
    ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input[0].call_id"),
    ({"input": [{"role": "user", "content": 5}]}, 400, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400, "input[0].content[0]"),
    ({"input": [{"role": "wizard", "content": "x"}]}, 400, "input[0].role"),
    ({"input": []}, 400, "input"),
    ({"input": "Hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, 400,
     "tools[0].parameters"),
    ({"input": "Hi", "tools": [{"type": "function", "parameters": {}}]}, 400, "tools[0].name"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": []}]}, 400, "tools[0].parameters"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {"properties": []}}]}, 400,
     "tools[0].parameters.properties"),
    ({"input": "Hi", "nonsense": 1}, 400, "nonsense"),
    ({"input": "Hi", "text": {"format": {"type": "text"}, "colour": "red"}}, 400, "text.colour"),
    ({"input": "Hi", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
    ({"input": "Hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"input": "Hi", "tool_choice": {"type": "web_search"}}, 400, "tool_choice"),
    ({"input": "Hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": "Hi", "background": True}, 400, "background"),
    ({"input": "Hi", "conversation": "conv_1"}, 400, "conversation"),
    ({"input": "Hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": ""}, 400, "input"),
    ({"input": "Hi", "model": "gpt-5"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[b[2] + f"-{i}" for i, b in enumerate(BAD)])
async def test_bad_input_is_a_4xx_naming_the_field(served, body, status, param) -> None:
    client, _, store = served
    count = await store.count()
    for stream in (False, True):
        r = await client.post("/v1/responses", json={"model": MODEL, **body, "stream": stream})
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == status, error
    assert await store.count() == count


async def test_a_grammar_the_engine_refuses_stores_nothing(served) -> None:
    client, _, store = served
    count = await store.count()
    bad_schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}
    for stream in (False, True):
        r = await client.post("/v1/responses", json={
            "model": MODEL, "input": "Hi", "stream": stream, "max_output_tokens": 4,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": bad_schema}},
        })
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
    assert await store.count() == count


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_agents_sdk_runs_a_function_tool_to_a_final_output(served, streamed) -> None:
    """The OpenAI Agents SDK's Responses model: tool_choice required makes the model call
    the tool (the SDK then resets tool_choice to auto), the tool runs, and the run ends with
    the agent's structured output (text.format json_schema). The SDK fails a run on an
    incomplete response, so the call's argument and the answer are enums (greedy
    stories260K would not stop otherwise)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from pydantic import BaseModel

    _, oai, _ = served
    set_tracing_disabled(True)
    calls: list[str] = []

    class Answer(BaseModel):
        weather: Literal["sunny", "rainy"]

    @function_tool
    def get_weather(city: Literal["paris", "rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    agent = Agent(
        name="weather", instructions="Answer with the weather.", tools=[get_weather], output_type=Answer,
        model=OpenAIResponsesModel(model=MODEL, openai_client=oai),
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0),
    )
    if streamed:
        result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert len(calls) == 1 and calls[0] in ("paris", "rome")
    assert isinstance(result.final_output, Answer)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds


async def test_reasoning_comes_back_as_a_reasoning_item(thinking) -> None:
    """The output starts inside the reasoning the template opened: cut before any </think>,
    it is all reasoning, as chat's reasoning_content; with reasoning.effort "none" the
    template closes it and the output is the answer."""
    oai = thinking
    body = dict(model=MODEL, input="Once upon a time", temperature=0, max_output_tokens=12)
    whole = await oai.responses.create(**body)
    chat = await _chat(oai, [{"role": "user", "content": "Once upon a time"}], max_tokens=12)
    reasoning = chat.choices[0].message.model_extra["reasoning_content"]
    (item,) = whole.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.status == "incomplete"
    assert [c.text for c in item.content] == [reasoning] and reasoning
    assert whole.output_text == "" and whole.status == "incomplete"
    events, final = await _streamed(oai, **body)
    _check_events(events)
    assert _items(final) == _items(whole)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    off = await oai.responses.create(**body, reasoning={"effort": "none"})
    chat_off = await _chat(oai, [{"role": "user", "content": "Once upon a time"}], max_tokens=12,
                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [i.type for i in off.output] == ["message"]
    assert off.output_text == chat_off.choices[0].message.content and off.output_text


async def test_a_failure_during_the_stream_ends_it_with_failed_events_and_stores_nothing(
    tmp_path, monkeypatch
) -> None:
    """The engine's model step raises mid-stream (test-only fault injection): the stream
    ends with an error event and response.failed carrying the output so far; nothing is
    stored."""
    from core.worker.faults import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "step:6")
    engine = make_engine(str(DEFAULT_MODEL_DIR), chat_template=TEMPLATE, max_model_len=256)
    store = ResponsesStore(tmp_path / "store.sqlite3")
    async with running_server(engine, responses_store=store) as (_, base):
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as oai:
            stream = await oai.responses.create(model=MODEL, input="Once upon a time", temperature=0,
                                                max_output_tokens=40, stream=True)
            events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].code == "server_error" and events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.message == events[-2].message
    assert [e.type for e in events[:3]] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert failed.output and failed.output[0].type == "message"
    assert await store.count() == 0
