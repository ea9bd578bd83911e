"""The tool-call syntaxes of model families, one stream parser each (``--tool-call-parser``).

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, Qwen3);
- ``llama3_json``: ``{"name": ..., "parameters": {...}}``, after ``<|python_tag|>`` or as the
  whole answer, ``;`` between calls (Llama 3.1/3.2);
- ``mistral``: ``[TOOL_CALLS][{...}, ...]`` (Nemo) or ``[TOOL_CALLS]name[ARGS]{...}`` (Small 3.2);
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=K>v</parameter></function></tool_call>``.

Forced calls (tool_choice "required" or named) are not read here: app/parsing/tool_calls.py.
"""

from __future__ import annotations

from app.parsing.tool_parsers.base import IdFactory, ToolCallStream, new_mistral_call_id, new_tool_call_id
from app.parsing.tool_parsers.hermes import HermesStream
from app.parsing.tool_parsers.llama3_json import Llama3JsonStream
from app.parsing.tool_parsers.mistral import MistralStream
from app.parsing.tool_parsers.qwen3_coder import Qwen3CoderStream

# --tool-call-parser name -> the stream class (one new stream per choice, given the request's tools).
TOOL_CALL_PARSERS: dict[str, type[ToolCallStream]] = {
    "hermes": HermesStream,
    "llama3_json": Llama3JsonStream,
    "mistral": MistralStream,
    "qwen3_coder": Qwen3CoderStream,
}


def call_ids_of(parser: str | None) -> IdFactory:
    """How a server whose model writes ``parser``'s syntax names its calls, forced ones
    included: Mistral's templates accept nine letters and digits only."""
    return new_mistral_call_id if parser == "mistral" else new_tool_call_id
