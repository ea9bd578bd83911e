"""OpenAI API request and response shapes, as msgspec Structs, one module per endpoint family.

``common`` (usage, ids, /v1/models), ``sampling`` (the fields completions and
chat share, structured outputs), ``completions``, ``chat`` and ``tokenize``.
Requests are decoded straight from the JSON body with type checking (a wrong
type becomes a 400); unknown fields are ignored, as OpenAI clients send many
optional ones. Options this server does not implement are refused with a 400
that says so, rather than silently ignored: see ``check_supported``.
"""
