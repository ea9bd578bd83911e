"""JSON strings under a schema allow no raw control characters, bounded or not.

xgrammar (0.2.8) compiles a string with ``maxLength``/``minLength`` to a character class that
lets bytes 0x00-0x1f through, which JSON forbids unescaped: an output then fails to parse
(seen with a mixture-of-experts model sampling 0x07 inside a name). core/structured narrows the
class; here a byte-level vocabulary (one token per byte) is walked into each kind of string and
the mask is read for every control byte and a few printable ones.
"""

from __future__ import annotations

import json

import pytest

from core.model_config import ModelConfig
from core.structured.request import GrammarKey
from core.structured.xgrammar_backend import XgrammarBackend

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def backend(random_model_dir: str) -> XgrammarBackend:
    return XgrammarBackend(random_model_dir, ModelConfig.from_dir(random_model_dir))


@pytest.mark.parametrize("bounds", [{}, {"maxLength": 8}, {"minLength": 2, "maxLength": 5}, {"minLength": 1}])
@pytest.mark.parametrize("any_whitespace", [False, True])
def test_string_characters_exclude_control_bytes(backend: XgrammarBackend, bounds, any_whitespace: bool) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", **bounds}}, "required": ["name"]}
    compiled = backend.compile(GrammarKey("json", json.dumps(schema), any_whitespace, None))
    matcher = backend.matcher(compiled)
    for byte in b'{"name": "':  # token i is byte i in this vocabulary
        assert matcher.accept_token(byte), chr(byte)
    mask = backend.bitmask([matcher])[0]
    allowed = {t for t in range(256) if int(mask[t // 32]) >> (t % 32) & 1}
    assert not allowed & set(range(0x20)), sorted(allowed & set(range(0x20)))
    assert {ord(c) for c in "aZ9 -"} <= allowed
