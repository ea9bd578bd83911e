"""Tiny seeded random decoders with real vocabularies and real chat templates.

What a test of chat formats needs from a model is its tokenizer (the
family's real vocabulary, so that ``<tool_call>``, ``</think>`` or
``<|python_tag|>`` are the tokens they are in the published models) and its
chat template (the publisher's, from ``../shared/chat-formats/templates``);
the weights may be random. The tokenizer is built from the tokenizer-only
GGUF files of ``../shared/chat-formats/vocab`` by ringllm's own metadata
reader (core/models/gguf_metadata.py, milliseconds; transformers' GGUF
conversion takes ~25 s a vocabulary). The Qwen vocabulary file keeps
placeholders (``[PAD151646]`` ...) where Qwen2.5/Qwen3's tokenizers have their
added tokens: they are put back at their ids, special or not as Qwen has them
(``<tool_call>``, ``<think>`` ... decode as text), so ``</think>`` is token
151668 as in Qwen3. The Llama file gets Llama 3.1's ``<|eom_id|>`` and
``<|python_tag|>`` at 128008 and 128010.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from app.protocol.chat import ChatCompletionRequest

from core.models.gguf_header import GGUFHeader
from core.models.gguf_metadata import write_tokenizer

if TYPE_CHECKING:
    from app.tokenizer import Tokenizer

CHAT_FORMATS = Path(__file__).resolve().parents[3] / "shared" / "chat-formats"
TEMPLATES = CHAT_FORMATS / "templates"
VOCABS = CHAT_FORMATS / "vocab"

_CONTROL, _USER_DEFINED = 3, 4
# Qwen2.5 / Qwen3's added tokens from 151646 on: (text, special).
_QWEN_ADDED = [
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
QWEN_IM_END, QWEN_THINK_END = 151645, 151668
LLAMA_EOT = 128009


class _Fields:
    """A GGUF header's fields with some replaced: what write_tokenizer reads."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields


def _qwen_fields(header: GGUFHeader) -> dict[str, Any]:
    tokens = header.fields["tokenizer.ggml.tokens"].tolist()
    types = np.array(header.fields["tokenizer.ggml.token_type"])
    for offset, (text, special) in enumerate(_QWEN_ADDED):
        tokens[151646 + offset] = text
        types[151646 + offset] = _CONTROL if special else _USER_DEFINED
    return {**header.fields, "tokenizer.ggml.tokens": _Strings(tokens), "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.eos_token_id": QWEN_IM_END}


def _llama_fields(header: GGUFHeader) -> dict[str, Any]:
    tokens = header.fields["tokenizer.ggml.tokens"].tolist()
    tokens[128008], tokens[128010] = "<|eom_id|>", "<|python_tag|>"
    return {**header.fields, "tokenizer.ggml.tokens": _Strings(tokens), "tokenizer.ggml.eos_token_id": LLAMA_EOT,
            "tokenizer.ggml.add_bos_token": True}


class _Strings(list):
    """A list with the StringArray's ``tolist``."""

    def tolist(self) -> list[str]:
        return list(self)


VOCAB_FIELDS = {"qwen2": _qwen_fields, "llama-bpe": _llama_fields}


def write_vocabulary(vocab: str, template: str | None, out: Path) -> Path:
    """``out`` with tokenizer.json, tokenizer_config.json and the named template (a file of
    TEMPLATES) as chat_template.jinja."""
    out.mkdir(parents=True, exist_ok=True)
    header = GGUFHeader(str(VOCABS / f"ggml-vocab-{vocab}.gguf"), tensors=False)
    assert write_tokenizer(_Fields(VOCAB_FIELDS[vocab](header)), out)  # type: ignore[arg-type]
    if template is not None:
        (out / "chat_template.jinja").write_text((TEMPLATES / template).read_text())
    return out


def write_chat_model(out: Path, arch: str, template: str, seed: int = 0, layers: int = 1) -> Path:
    """A random seeded ``arch`` decoder ("qwen2", "qwen3", "llama": hidden 32, float32) with its
    family's real vocabulary and the chat template named ``template``."""
    import torch
    import transformers

    vocab = "llama-bpe" if arch == "llama" else "qwen2"
    write_vocabulary(vocab, template, out)
    classes = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[arch]
    eos = LLAMA_EOT if arch == "llama" else QWEN_IM_END
    config = classes[0](
        vocab_size=128256 if arch == "llama" else 151936, hidden_size=32, intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=128000 if arch == "llama" else None, eos_token_id=eos, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = classes[1](config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else 0.08 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


def cached_chat_model(tmp_path_factory: Any, arch: str, template: str, seed: int = 3) -> str:
    """``write_chat_model``'s directory, made once per test session (under the session's base
    temporary directory, so test modules share it)."""
    path = tmp_path_factory.getbasetemp() / "chat-models" / f"{arch}-{Path(template).stem}-{seed}"
    if not (path / "model.safetensors").exists():
        write_chat_model(path, arch, template, seed)
    return str(path)


# A conversation with tools, a call, its result, reasoning and a new question: what the template tests render.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city, e.g. Zürich"},
        "days": {"type": "integer"},
        "options": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}},
    },
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather \"now\" in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]
ARGUMENTS = {"city": "Zürich", "days": 2, "options": {"unit": "c"}}
CALL_ID = "call12345"  # nine letters and digits: Mistral's templates accept no other id


def conversation(arguments: object, system: bool = True) -> list[dict]:
    messages = [{"role": "system", "content": "You are terse."}] if system else []
    return [
        *messages,
        {"role": "user", "content": "Weather in Zürich, and say \"hi\"?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
        ]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temperature": 21, "sky": "clear"}'},
        {"role": "assistant", "content": "21 degrees, clear. Hi!", "reasoning_content": "The tool said 21."},
        {"role": "user", "content": "And tomorrow?"},
    ]


def render_as_chat_request(tokenizer: Tokenizer, template: str, kwargs: dict) -> str:
    """The test conversation as a chat request sends it (arguments as JSON text, through the
    protocol types) rendered by ringllm's tokenizer with ``template``."""
    req = msgspec.convert(
        {"messages": conversation(json.dumps(ARGUMENTS, ensure_ascii=False)), "tools": TOOLS,
         "chat_template_kwargs": kwargs or None},
        ChatCompletionRequest,
    )
    req.check_supported()
    messages = [m.to_template_dict() for m in req.messages]
    tools = [t.to_template_dict() for t in req.tools or ()]
    rendered = tokenizer.apply_chat_template(
        messages, chat_template=template, tools=tools, add_generation_prompt=True, tokenize=False,
        **req.template_kwargs(),
    )
    assert isinstance(rendered, str)
    return rendered
