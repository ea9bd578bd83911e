"""The published chat templates, with tools, rendered by ringllm as transformers renders them,
and the parsers detected from each.

For each template of ``../shared/chat-formats/templates``: a conversation
with a system prompt, tools, an assistant turn that called one, the tool's
result, an answer and a new question, sent as a chat request would send it
(arguments as JSON text, parsed by app/protocol/chat.py) and rendered by
app/tokenizer.py, equals transformers' ``apply_chat_template(messages,
tools=...)`` on the same template text (with the arguments as the dict
transformers' documentation asks for): the same text, and the same token
ids on the family's real vocabulary (tests/support/chat_models.py). The
parser app/parsing/detect.py picks for each template is the family's.
"""

from __future__ import annotations

import pytest

from app.parsing.detect import detect_reasoning_parser, detect_tool_call_parser
from app.tokenizer import Tokenizer
from tests.support.chat_models import (
    ARGUMENTS,
    TEMPLATES,
    TOOLS,
    conversation,
    render_as_chat_request,
    write_vocabulary,
)

transformers = pytest.importorskip("transformers")

if not TEMPLATES.is_dir():
    pytest.skip("../shared/chat-formats is not beside this checkout", allow_module_level=True)

# template -> (vocabulary, tool-call parser, reasoning parser)
CASES = {
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("llama-bpe", "llama3_json", None),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("llama-bpe", "llama3_json", None),
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("qwen2", "hermes", None),
    "Qwen-Qwen3-0.6B.jinja": ("qwen2", "hermes", "qwen3"),
    "Qwen3-Coder.jinja": ("qwen2", "qwen3_coder", None),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("llama-bpe", "mistral", None),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("llama-bpe", "mistral", None),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": ("llama-bpe", None, "deepseek_r1"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": ("qwen2", None, "deepseek_r1"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": ("llama-bpe", "hermes", None),
    "HuggingFaceTB-SmolLM3-3B.jinja": ("llama-bpe", None, "qwen3"),
    "google-gemma-2-2b-it.jinja": ("llama-bpe", None, None),
}

@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, tuple[Tokenizer, object]]:
    """Each vocabulary as ours and as transformers' fast tokenizer, loaded once."""
    root = tmp_path_factory.mktemp("vocabs")
    out = {}
    for name in ("qwen2", "llama-bpe"):
        path = str(write_vocabulary(name, None, root / name))
        out[name] = (Tokenizer.from_directory(path), transformers.AutoTokenizer.from_pretrained(path))
    return out


@pytest.mark.parametrize("enable_thinking", [None, False], ids=["default", "no-thinking"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_prompt_equals_transformers(name: str, enable_thinking: bool | None, tokenizers) -> None:
    vocab, tool_parser, reasoning = CASES[name]
    if enable_thinking is not None and reasoning is None:
        pytest.skip("enable_thinking means nothing to a template without reasoning")
    if name.startswith("google-gemma"):
        pytest.skip("Gemma 2's template refuses system and tool roles: it has no tool calling to render")
    template = (TEMPLATES / name).read_text()
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ours_tokenizer, theirs_tokenizer = tokenizers[vocab]
    theirs = theirs_tokenizer.apply_chat_template(
        conversation(ARGUMENTS), tools=TOOLS, chat_template=template, add_generation_prompt=True, tokenize=False,
        **kwargs,
    )
    ours = render_as_chat_request(ours_tokenizer, template, kwargs)
    assert ours == theirs
    if tool_parser is not None:  # the tools and the call reached the prompt (SmolLM3's template shows neither)
        assert "get_weather" in ours and "Zürich" in ours
    if not name.startswith("mistralai") and not name.startswith("Mistral"):
        # Same ids too (Mistral's own vocabulary is SentencePiece: its text is compared only).
        assert ours_tokenizer.encode(ours, add_special_tokens=False) == theirs_tokenizer(
            theirs, add_special_tokens=False
        )["input_ids"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_detection_picks_the_family_parsers(name: str) -> None:
    _, tool_parser, reasoning_parser = CASES[name]
    template = (TEMPLATES / name).read_text()
    assert detect_tool_call_parser(template) == tool_parser
    assert detect_reasoning_parser(template) == reasoning_parser


def test_detection_of_no_template_or_a_plain_one() -> None:
    assert detect_tool_call_parser(None) is None and detect_reasoning_parser(None) is None
    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert detect_tool_call_parser(plain) is None and detect_reasoning_parser(plain) is None
