"""Which tool-call and reasoning syntax a model writes, read from its chat template.

A chat template shows the model its tools and writes its past calls back in
the syntax it was trained on, so that text names the parser (as llama-server
picks its chat format from the template). The markers, first match wins:

==========================================  ===============
template text                               tool-call parser
==========================================  ===============
``<tool_call>`` and ``<function=``          qwen3_coder
``<tool_call>``                             hermes
``[TOOL_CALLS]``                            mistral
``<|python_tag|>`` or Llama 3's JSON         llama3_json
prompt (``"parameters": dictionary of``)
anything else                               none
==========================================  ===============

Reasoning: a template that mentions ``<think>`` belongs to a model that
thinks; ``deepseek_r1`` where it is DeepSeek's (``<｜Assistant｜>``), ``qwen3``
otherwise (Qwen3, SmolLM3). A template with no known syntax gets no parser:
tool_choice "auto" then answers in plain text.
"""

from __future__ import annotations

import functools

TOOL_CALL_CHOICES = ("auto", "hermes", "llama3_json", "mistral", "qwen3_coder")
REASONING_CHOICES = ("auto", "none", "qwen3", "deepseek_r1")

_LLAMA3_JSON_PROMPT = '"parameters": dictionary of argument name'


@functools.lru_cache(maxsize=64)
def detect_tool_call_parser(template: str | None) -> str | None:
    """The tool-call parser a template's model needs, or None when it shows no syntax built here."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "qwen3_coder" if "<function=" in template else "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or _LLAMA3_JSON_PROMPT in template:
        return "llama3_json"
    return None


@functools.lru_cache(maxsize=64)
def detect_reasoning_parser(template: str | None) -> str | None:
    """The reasoning parser a template's model needs, or None for a model that does not think."""
    if not template or "<think>" not in template:
        return None
    return "deepseek_r1" if "<｜Assistant｜>" in template else "qwen3"


def resolve(setting: str | None, detected: str | None) -> str | None:
    """A --tool-call-parser / --reasoning-parser setting made a parser name (None: no parser):
    "auto" (or unset) takes what the template shows, "none" takes nothing."""
    if setting in (None, "auto"):
        return detected
    return None if setting == "none" else setting
