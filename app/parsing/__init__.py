"""What a chat model wrote, taken apart: its reasoning, its answer, its tool calls.

Each family writes these in its own syntax; a parser per syntax turns the
text (whole, or streamed delta by delta) into the parts every API returns:
chat's ``reasoning_content``/``content``/``tool_calls``, Responses' reasoning,
message and function_call items, Messages' thinking, text and tool_use
blocks. ``output.OutputParser`` chains a reasoning parser (reasoning.py) and a
tool-call parser (tool_calls.py); a whole output is parsed as one final delta,
so a streamed output and a whole one always come apart the same way.
"""
