"""Each family's tool-call parser on outputs written as its own chat template writes calls.

The outputs come from the published templates themselves: an assistant turn
with tool calls (and text before them), rendered by transformers' jinja
renderer, is exactly what the model was trained to write; the parser must
give back the calls that were rendered. Each output is also fed in two
pieces at every split point and one character at a time: the content and
the joined argument fragments equal the whole output's, the first fragment
of each call carries its id and name, and no tag reaches the content.
Hand-written outputs cover what templates do not show: Llama's several calls
separated by ``;``, ``<|python_tag|>``, and calls that are no calls.
"""

from __future__ import annotations

import json
import re

import pytest

from app.parsing.output import OutputParser
from app.parsing.reasoning import ReasoningTokens, ThinkStream
from app.parsing.tool_parsers import TOOL_CALL_PARSERS
from tests.support.chat_models import TEMPLATES

transformers = pytest.importorskip("transformers")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

if not TEMPLATES.is_dir():
    pytest.skip("../shared/chat-formats is not beside this checkout", allow_module_level=True)

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
        "exact": {"type": "boolean"}, "options": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "zip": {"type": "string"},
    }},
    "get_time": {"type": "object", "properties": {"zone": {"type": ["string", "null"]}}},
}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"The {n[4:]}", "parameters": p}}
         for n, p in SCHEMAS.items()]
NESTED = {"city": "Zürich \"Altstadt\" \\ 北京", "days": 3, "ratio": 0.5, "exact": True,
          "options": {"unit": "c", "levels": [1, {"deep": None}]}, "tags": ["a", "b"], "zip": "8001"}
# Hermes 3's template cannot print an array parameter nor a list of types (it recurses on
# ``json_spec|items`` and on the letters of "null"): its system prompt gets the tools without
# them (the calls still carry them).
HERMES_TOOLS = [{"type": "function", "function": {**t["function"], "parameters": {
    "type": "object", "properties": {k: v for k, v in t["function"]["parameters"]["properties"].items()
                                     if v.get("type") not in ("array", None) and isinstance(v["type"], str)}}}}
                for t in TOOLS]
CALLS = [("get_weather", NESTED), ("get_time", {"zone": "CET"})]

# template -> (parser, where the assistant turn starts, where it ends, several calls in one turn); Qwen3's
# turn opens with its (empty) reasoning block, read by the reasoning parser first, as the server does.
FAMILIES = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("hermes", "<|im_start|>assistant\n", "<|im_end|>", True),
    "Qwen-Qwen3-0.6B.jinja": ("hermes", "<|im_start|>assistant\n", "<|im_end|>", True),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": ("hermes", "<|im_start|>assistant\n", "<|im_end|>", True),
    "Qwen3-Coder.jinja": ("qwen3_coder", "<|im_start|>assistant\n", "<|im_end|>", True),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": (
        "llama3_json", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", False),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": (
        "llama3_json", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", False),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("mistral", "[/INST]", "</s>", True),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("mistral", "[/INST]", "</s>", True),
}
TAGS = re.compile(r"<tool_call>|</tool_call>|<function=|\[TOOL_CALLS\]|\[ARGS\]|<\|python_tag\|>")


def template_output(name: str, content: str, calls: list[tuple[str, dict]]) -> str:
    """The assistant turn the template writes for ``content`` followed by ``calls``."""
    _, start, end, _ = FAMILIES[name]
    tool_calls = [{"id": f"call{i:05d}", "type": "function", "function": {"name": n, "arguments": a}}
                  for i, (n, a) in enumerate(calls)]
    conversation = [{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": content, "tool_calls": tool_calls}]
    rendered, *_ = render_jinja_template(
        [conversation], tools=HERMES_TOOLS if name.startswith("NousResearch") else TOOLS, chat_template=(TEMPLATES / name).read_text(), bos_token="<s>",
        eos_token="</s>",
    )
    text = rendered[0]
    turn = text[text.rindex(start) + len(start):]
    return turn[: turn.rindex(end)] if end in turn else turn


def parse(parser: str, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list]:
    """(content, [(name, arguments)], every tool-call fragment) of an output fed in ``pieces``
    (an output that opens with ``<think>`` has its reasoning read first)."""
    thinks = "".join(pieces).startswith("<think>")
    out = OutputParser(ThinkStream() if thinks else None, TOOL_CALL_PARSERS[parser](SCHEMAS))
    fragments = []
    for k, piece in enumerate(pieces):
        fragments += out.feed(piece, k == len(pieces) - 1).tool_calls
    parsed = out.parsed()
    return parsed.content, [(c.function.name, c.function.arguments) for c in parsed.tool_calls], fragments


def check_streams(parser: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The whole output's (content, calls), having checked that every way of streaming it
    gives the same, with id, type and name in each call's first fragment only."""
    content, calls, fragments = parse(parser, [text])
    if calls:  # no tag of the calls is left in the answer
        assert not TAGS.search(content or ""), content
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        got_content, got_calls, fragments = parse(parser, pieces)
        assert (got_content, got_calls) == (content, calls), pieces
        seen: set[int] = set()
        for fragment in fragments:
            first = fragment.index not in seen
            seen.add(fragment.index)
            assert (fragment.id is not None) == first and (fragment.type == "function") == first
            assert (fragment.function.name is not None) == first
    return content, calls


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_calls_written_as_the_template_writes_them(name: str) -> None:
    parser, _, _, several = FAMILIES[name]
    calls = CALLS if several else CALLS[:1]
    text = template_output(name, "", calls)
    content, parsed = check_streams(parser, text)
    assert content is None, (text, content)
    assert [n for n, _ in parsed] == [n for n, _ in calls], text
    for (_, arguments), (_, wanted) in zip(parsed, calls):
        assert json.loads(arguments) == wanted  # Qwen3-Coder's text values typed back by the schema


@pytest.mark.parametrize("name", [n for n in sorted(FAMILIES) if FAMILIES[n][0] in ("hermes", "qwen3_coder")])
def test_text_before_the_calls_is_the_content(name: str) -> None:
    parser = FAMILIES[name][0]
    text = template_output(name, "Let me look that up: \"weather\" ✓.", CALLS)
    if "Let me" not in text:
        pytest.skip("this template drops the text of a turn that calls tools")
    content, parsed = check_streams(parser, text)
    assert content == "Let me look that up: \"weather\" ✓."
    assert [n for n, _ in parsed] == ["get_weather", "get_time"]


def test_qwen3_coder_values_take_the_declared_types() -> None:
    text = template_output("Qwen3-Coder.jinja", "", CALLS[:1])
    assert "<parameter=days>\n3\n</parameter>" in text and "<parameter=zip>\n8001\n</parameter>" in text
    _, [(_, arguments)] = check_streams("qwen3_coder", text)
    # "8001" is declared a string: it stays one; 3 an integer, true a boolean, the object an object.
    assert json.loads(arguments) == NESTED
    loose = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=exact>\nFalse\n</parameter>\n</function>\n</tool_call>"
    _, [(_, arguments)] = check_streams("qwen3_coder", loose)
    assert json.loads(arguments) == {"days": "three", "exact": False}  # unreadable as a number: kept as text


LLAMA_SEVERAL = (
    '{"name": "get_weather", "parameters": ' + json.dumps(NESTED, ensure_ascii=False)
    + '}; {"name": "get_time", "parameters": {"zone": "CET"}}'
)


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("llama3_json", LLAMA_SEVERAL, None, CALLS),
        ("llama3_json", "<|python_tag|>" + LLAMA_SEVERAL, None, CALLS),
        ("llama3_json", 'Checking.<|python_tag|>{"name": "get_time", "arguments": {"zone": "CET"}}', "Checking.",
         CALLS[1:]),
        ("llama3_json", "The answer is {x} and more.", "The answer is {x} and more.", []),
        ("llama3_json", '{"name": "launch", "parameters": {}}', '{"name": "launch", "parameters": {}}', []),
        ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
        ("hermes", '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
         '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', []),
        ("hermes", 'a < b, <tool_ca', "a < b, <tool_ca", []),
        ("mistral", "[TOOL_CALLS]launch[ARGS]{}", "[TOOL_CALLS]launch[ARGS]{}", []),
        ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]', "Sure.", CALLS[1:]),
        ("mistral", "Arrays [1, 2] are fine.", "Arrays [1, 2] are fine.", []),
        ("qwen3_coder", "<tool_call>\n<function=launch>\n</function>\n</tool_call>",
         "<tool_call>\n<function=launch>\n</function>\n</tool_call>", []),
        ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=zone>\nUT", None, [("get_time", {"zone": "UT"})]),
    ],
    ids=["llama-several", "llama-python-tag", "llama-text-then-tag", "llama-text", "llama-unknown-tool",
         "hermes-not-json", "hermes-unknown-tool", "hermes-not-a-tag", "mistral-unknown-tool",
         "mistral-array", "mistral-text", "qwen3-coder-unknown-tool", "qwen3-coder-cut"],
)
def test_written_outputs(parser: str, text: str, content: str | None, calls: list[tuple[str, dict]]) -> None:
    """Outputs the templates do not show: several Llama calls, its python tag, text that is
    no call (left as content), calls of unknown tools (content), outputs cut mid-call."""
    got_content, got_calls = check_streams(parser, text)
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in got_calls] == calls


def test_a_cut_call() -> None:
    """An output cut inside a call's arguments keeps the call, its arguments as far as they were
    written (as OpenAI returns a cut call); cut before its arguments began, it is no call."""
    text = '{"name": "get_time", "parameters": {"zone": "CE'
    assert check_streams("llama3_json", text) == (None, [("get_time", '{"zone": "CE')])
    assert check_streams("hermes", "<tool_call>\n" + text) == (None, [("get_time", '{"zone": "CE')])
    early = '{"name": "get_time", "param'
    assert check_streams("llama3_json", early) == (early, [])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_arguments_stream_as_they_are_written(name: str) -> None:
    """Fed a character at a time, each call's arguments come in many fragments, not at its end
    (Qwen3-Coder's a parameter at a time)."""
    parser, _, _, several = FAMILIES[name]
    text = template_output(name, "", CALLS if several else CALLS[:1])
    _, _, fragments = parse(parser, list(text))
    pieces = [f for f in fragments if f.index == 0 and f.function.arguments]
    assert len(pieces) >= (len(NESTED) if parser == "qwen3_coder" else 20), pieces


def test_mistral_ids_are_what_its_templates_accept() -> None:
    text = template_output("Mistral-Small-3.2-24B-Instruct-2506.jinja", "", CALLS)
    _, _, fragments = parse("mistral", [text])
    ids = [f.id for f in fragments if f.id is not None]
    assert len(ids) == 2 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)


@pytest.mark.parametrize(
    ("text", "reasoning", "content", "calls"),
    [
        ("<think>\nWhich tool? </think>\n\nSure.", "\nWhich tool? ", "Sure.", []),
        ("Prompt opened it.</think>\n\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}\n"
         "</tool_call>", "Prompt opened it.", None, CALLS[1:]),
        ("<think>Maybe <tool_call> here?</think>No.", "Maybe <tool_call> here?", "No.", []),
        ("Cut before the end </thi", "Cut before the end </thi", None, []),
    ],
    ids=["model-opens", "prompt-opened-then-call", "tags-inside-reasoning", "cut"],
)
def test_reasoning_comes_first(text: str, reasoning: str, content: str | None, calls: list) -> None:
    """The reasoning block is read before the calls (a tag inside it is reasoning), an
    output cut inside it is all reasoning, streamed at every split point alike."""
    wanted = None
    for cut in range(len(text) + 1):
        out = OutputParser(ThinkStream(), TOOL_CALL_PARSERS["hermes"](SCHEMAS))
        out.feed(text[:cut], False)
        out.feed(text[cut:], True)
        parsed = out.parsed()
        got = (parsed.reasoning, parsed.content, [(c.function.name, json.loads(c.function.arguments))
                                                  for c in parsed.tool_calls])
        wanted = wanted or got
        assert got == wanted == (reasoning, content, calls), cut


def test_reasoning_tokens_are_counted_to_the_end_token() -> None:
    """Every token up to and including </think> (151668 in Qwen3), whichever deltas bring them;
    none without a reasoning parser."""
    end = 151668
    out = OutputParser(ThinkStream(), None, ReasoningTokens(end))
    out.feed("a", False, [1])
    out.feed("b</think>c", False, [2, end, 3])
    out.feed("d", True, [4])
    assert out.parsed().reasoning_tokens == 3 and out.parsed().content == "cd"
    plain = OutputParser()
    plain.feed("abc", True, [1, 2, 3])
    assert plain.parsed().reasoning_tokens == 0
    assert OutputParser(ThinkStream()).parsed().reasoning_tokens is None  # </think> not one token: unknown
