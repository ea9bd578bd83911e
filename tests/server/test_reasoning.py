"""Reasoning on chat, end to end with the official openai client: Qwen3's ``<think>`` block.

A random-weights model with Qwen's real vocabulary (``</think>`` is one
token, as in Qwen3) and Qwen3's published chat template
(tests/support/chat_models.py), served with no parser flag: the reasoning
parser is read from the template. The engine is made to close the thinking
after ``max_thinking_tokens`` and a grammar then forces the answer, which must
come back split into ``reasoning_content`` and ``content``, whole and streamed
alike; with thinking off the template closes the block in the prompt and
there is no reasoning.
"""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio

from tests.support.chat_models import QWEN_THINK_END, TEMPLATES, cached_chat_model
from tests.support.http import MODEL, make_engine, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

if not TEMPLATES.is_dir():
    pytest.skip("../shared/chat-formats is not beside this checkout", allow_module_level=True)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return cached_chat_model(tmp_path_factory, "qwen3", "Qwen-Qwen3-0.6B.jinja")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def qwen3(qwen3_dir):
    engine = make_engine(qwen3_dir, chat_template=None, max_model_len=2048)
    async with running_server(engine) as (client, base):
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as oai:
            yield client, oai


async def test_reasoning_then_the_answer(qwen3) -> None:
    """Thinking on (the default): random reasoning, cut by max_thinking_tokens, then the answer the
    grammar forces from the end of the thinking on; split apart whole and streamed alike."""
    _, oai = qwen3
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, logprobs=True,
                extra_body={"structured_outputs": {"regex": r"The answer is 4[0-9]\."}, "max_thinking_tokens": 6})
    out = await oai.chat.completions.create(**body)
    message = out.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.model_extra["reasoning"] == reasoning and "</think>" not in reasoning
    assert message.content is not None and message.content.startswith("The answer is 4")
    # The budget: six tokens of reasoning, then </think> (forced), then the answer.
    tokens = [t.token for t in out.choices[0].logprobs.content]
    assert tokens[6] == "</think>" and "".join(tokens[:6]).removeprefix("<think>") == reasoning
    assert "".join(tokens[7:]).startswith(message.content)
    streamed = {"reasoning_content": "", "content": ""}
    async for chunk in await oai.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        streamed["content"] += delta.content or ""
        streamed["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == {"reasoning_content": reasoning, "content": message.content}


async def test_thinking_off_has_no_reasoning(qwen3) -> None:
    _, oai = qwen3
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        out = await oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
            extra_body={"structured_outputs": {"regex": r"Fine\."}, **extra},
        )
        message = out.choices[0].message
        assert message.content == "Fine." and message.model_extra.get("reasoning_content") is None, extra


async def test_tokenize_renders_the_tools_as_transformers_does(qwen3, qwen3_dir) -> None:
    import transformers

    client, _ = qwen3
    reference = transformers.AutoTokenizer.from_pretrained(qwen3_dir)
    expected = reference.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    ids = reference(expected, add_special_tokens=False)["input_ids"]
    r = await client.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == ids and len(ids) > 100  # the tool list is in the prompt
    assert QWEN_THINK_END not in ids


async def test_a_request_template_brings_its_own_parsers(qwen3) -> None:
    """A request's own chat_template decides the parsers: under Qwen2.5's (no <think> in it) the
    same output is all content; under the model's own Qwen3 template it is reasoning, then content."""
    _, oai = qwen3
    regex = r"<think>\nHm\.\n</think>\n\nFine\."
    qwen25 = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    plain = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"regex": regex}, "chat_template": qwen25},
    )
    message = plain.choices[0].message
    assert message.content == "<think>\nHm.\n</think>\n\nFine." and message.model_extra["reasoning_content"] is None
    own = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"regex": regex}, "max_thinking_tokens": 3},
    )
    # Under Qwen3's template the output starts in the reasoning and the engine holds the grammar
    # until </think> (forced after three tokens): the regex's text is then all answer.
    message = own.choices[0].message
    assert message.model_extra["reasoning_content"] and message.content == "<think>\nHm.\n</think>\n\nFine."


async def test_reasoning_parser_none_keeps_the_block_in_the_content(qwen3_dir) -> None:
    """--reasoning-parser none on a thinking model: no reasoning parsed, and no engine switch
    either (the grammar binds from the first token)."""
    engine = make_engine(qwen3_dir, chat_template=None, max_model_len=2048)
    async with running_server(engine, reasoning_parser="none") as (_, base):
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as oai:
            out = await oai.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                extra_body={"structured_outputs": {"regex": r"<think>\nHm\.\n</think>\n\nFine\."}},
            )
    message = out.choices[0].message
    assert message.content == "<think>\nHm.\n</think>\n\nFine." and message.model_extra["reasoning_content"] is None
