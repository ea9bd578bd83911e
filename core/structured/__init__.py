"""Structured outputs: grammars that constrain what a request may generate.

``manager`` (the EngineCore's StructuredOutputManager: compile pool, cache,
bitmasks), ``request`` (one request's grammar and matcher), ``xgrammar_backend``
(everything that touches xgrammar, imported on the first structured request).
"""
