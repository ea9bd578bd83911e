"""The OpenAI endpoints, one module per family over a shared base, as vLLM splits its serving classes.

``base`` (the engine handle, request decoding, engine requests, outputs),
``completions``, ``chat``, ``tokenize`` (vLLM's /tokenize and /detokenize),
and ``sse`` (server-sent events and the client-disconnect watcher).
"""
