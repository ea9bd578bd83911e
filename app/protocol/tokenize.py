"""vLLM's /tokenize and /detokenize."""

from __future__ import annotations

from typing import Any

import msgspec

from app.protocol.chat import ChatMessage, ToolDefinition


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None  # shown to the template, as chat shows them
    return_token_strs: bool = False


    def template_kwargs(self) -> dict[str, Any]:
        return dict(self.chat_template_kwargs or {})


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str
