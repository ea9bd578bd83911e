"""schemathesis, as a library, drives a real server from its own /openapi.json: bodies
that fit the schema (positive) and bodies that break it (negative) for the completion,
chat, models, tokenize, detokenize, pooling, Responses and Messages routes. No answer may be a
5xx, every error must be in OpenAI's shape (Anthropic's on /v1/messages), and the server must stay healthy. A fixed seed (derandomize) and
a bounded number of examples per route keep the run deterministic and short."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

pytestmark = pytest.mark.slow

EXAMPLES = {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 40}
# The pooling routes answer a generative model with 400s: fuzzed all the same.
ROUTES = {
    "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
    "/v1/embeddings", "/pooling", "/score", "/rerank", "/classify", "/v1/responses", "/v1/messages",
}


def _check(case, response) -> None:  # type: ignore[no-untyped-def]
    label = f"{case.method} {case.path} {str(case.body)[:300]!r}"
    assert response.status_code < 500, f"{label}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 400 and case.path == "/v1/messages":  # Anthropic's API, Anthropic's shape
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, label
    elif response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, label
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code, label


@pytest.fixture(scope="module")
def server(module_server_factory):
    return module_server_factory(["--max-model-len", "64"])


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
def test_schemathesis_finds_no_5xx_and_only_openai_shaped_errors(server, mode: GenerationMode) -> None:
    document = httpx.get(server.base_url + "/openapi.json", timeout=10).json()
    assert ROUTES <= set(document["paths"])
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} == ROUTES
    statuses: Counter[tuple[str, int]] = Counter()
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # nothing to break: no body, no parameters

        @settings(
            max_examples=EXAMPLES[mode], derandomize=True, deadline=None, database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case) -> None:  # type: ignore[no-untyped-def]
            response = case.call(base_url=server.base_url, timeout=60)
            statuses[operation.path, response.status_code] += 1
            _check(case, response)

        run()
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200, operation.label
    print(mode.value, sorted(statuses.items()))
    if mode is GenerationMode.POSITIVE:
        # Some bodies got through to generation, not only to 400s.
        assert statuses["/v1/completions", 200] and statuses["/v1/chat/completions", 200], statuses
        assert statuses["/tokenize", 200] and statuses["/detokenize", 200], statuses
