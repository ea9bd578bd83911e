"""Limits in front of the routes (app/limits.py): body size, admission, API key on
every route, CORS, stalled streams; over the real app and engine in this process."""

from __future__ import annotations

from starlette.routing import Route

from app.limits import Admission, ServerLimits
from app.server import build_app
from app.ui import ui_routes
from tests.support.http import MODEL, assert_openai_error, make_engine, running_server
from tests.support.waiting import wait_until

LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True}


def test_the_cli_default_body_limit_is_the_servers() -> None:
    from app import frontend_config, limits

    default = frontend_config.DEFAULT_MAX_REQUEST_BODY_BYTES
    assert default == limits.DEFAULT_MAX_REQUEST_BODY_BYTES == ServerLimits().max_request_body_bytes
    assert frontend_config.FrontendConfig().max_request_body_bytes == default


async def test_a_body_over_the_limit_is_a_413_whether_declared_or_chunked(stories_dir) -> None:
    limits = ServerLimits(max_request_body_bytes=1024)
    async with running_server(make_engine(stories_dir), limits=limits) as (client, _):
        big = {"model": MODEL, "prompt": "x" * 4000, "max_tokens": 1}
        response = await client.post("/v1/completions", json=big)
        assert_openai_error(response, 413, "PayloadTooLargeError", "1024 bytes")

        async def chunks():  # no Content-Length: the limit is counted as the body arrives
            yield b'{"model": "stories", "prompt": "'
            for _ in range(64):
                yield b"y" * 100
            yield b'"}'

        response = await client.post("/v1/chat/completions", content=chunks())
        assert_openai_error(response, 413, "PayloadTooLargeError", "--max-request-body-bytes")
        ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200  # and the server goes on serving


async def test_past_the_waiting_limit_a_request_gets_503_with_retry_after(stories_dir) -> None:
    admission = Admission(max_num_seqs=1, max_num_waiting=1)
    async with running_server(make_engine(stories_dir, max_num_seqs=1), admission=admission) as (client, _):
        # Paused, the engine holds the two streams: they stay in flight until /resume.
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
        async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as first, \
                client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as second:
            assert first.status_code == second.status_code == 200
            assert admission.in_flight == 2 and admission.num_waiting == 1
            refused = await client.post("/v1/completions", json=LONG)
            assert_openai_error(refused, 503, "ServiceUnavailableError", "at capacity")
            assert refused.headers["retry-after"] == "1"
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert (await client.post("/v1/chat/completions", json=chat)).status_code == 503
            assert (await client.post("/tokenize", json={"model": MODEL, "prompt": "hi"})).status_code == 200
            assert (await client.post("/resume")).status_code == 200
            await first.aread()
            await second.aread()
        await _settled(admission)
        assert (await client.post("/v1/completions", json=LONG)).status_code == 200
        await _settled(admission)


async def test_the_admission_count_is_returned_by_requests_that_fail_or_leave(stories_dir) -> None:
    admission = Admission(max_num_seqs=1, max_num_waiting=0)
    async with running_server(make_engine(stories_dir, max_num_seqs=1), admission=admission) as (client, _):
        for _ in range(3):  # clients that hang up mid-stream
            async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
                async for _line in stream.aiter_lines():
                    break
        bad = await client.post("/v1/completions", json={**LONG, "max_tokens": -1})
        assert bad.status_code == 400
        await _settled(admission)
        assert (await client.post("/v1/completions", json=LONG)).status_code == 200


async def _settled(admission: Admission) -> None:
    """The count is back to 0 once the server has seen the last responses end."""
    await wait_until(lambda: admission.in_flight == 0, "the admission count to return to 0")


def _every_route(app) -> list[tuple[str, str]]:
    pairs = []
    for route in app.routes:
        assert isinstance(route, Route)
        path = route.path.replace("{name}", "chat.js")
        pairs += [(method, path) for method in sorted(route.methods or ()) if method != "HEAD"]
    return pairs


async def test_the_api_key_guards_every_route_but_health_and_the_page(stories_dir) -> None:
    engine = make_engine(stories_dir)
    options = dict(enable_sleep_mode=True, enable_dev_endpoints=True)
    routes = _every_route(build_app(engine, MODEL, engine.max_model_len, api_key="sesame", **options))
    public = {"/health"} | {r.path.replace("{name}", "chat.js") for r in ui_routes(api_key_required=True)}
    assert {"/metrics", "/pause", "/sleep", "/collective_rpc", "/openapi.json", "/engine/stats"} <= {p for _, p in routes}
    async with running_server(engine, api_key="sesame", **options) as (client, _):
        for method, path in routes:
            if path in public:
                continue
            for headers in ({}, {"Authorization": "Bearer sesamf"}, {"Authorization": "Bearer sesame-and-more"},
                            {"Authorization": "sesame"}):
                response = await client.request(method, path, headers=headers)
                if path.startswith("/v1/messages"):  # Anthropic's API, in Anthropic's error shape
                    assert response.status_code == 401, (method, path)
                    assert response.json()["error"]["type"] == "authentication_error", (method, path)
                else:
                    assert_openai_error(response, 401, "AuthenticationError", "API key")
            allowed = await client.request(method, path, headers={"Authorization": "Bearer sesame"})
            assert allowed.status_code != 401, (method, path)
        for method, path in routes:
            if path in public:
                assert (await client.request(method, path)).status_code == 200, path


async def test_cors_is_off_by_default_and_allows_only_the_given_origins(stories_dir) -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    async with running_server(make_engine(stories_dir)) as (client, _):
        response = await client.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in response.headers
        response = await client.get("/v1/models", headers={"Origin": "https://app.example"})
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    async with running_server(make_engine(stories_dir), allowed_origins=["https://app.example"]) as (client, _):
        response = await client.options("/v1/completions", headers=preflight)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        response = await client.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert_openai_error(response, 400, "BadRequestError", "Disallowed CORS origin")
        assert "access-control-allow-origin" not in response.headers
        response = await client.get("/v1/models", headers={"Origin": "https://app.example"})
        assert response.headers["access-control-allow-origin"] == "https://app.example"


async def test_a_stalled_stream_ends_with_an_error_event_and_its_request_is_aborted(stories_dir) -> None:
    limits = ServerLimits(stream_stall_timeout=0.5)
    async with running_server(make_engine(stories_dir), limits=limits) as (client, _):
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
        # Paused: the request waits in the engine and its stream has nothing to send.
        async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
            lines = [line async for line in stream.aiter_lines() if line]
        assert len(lines) == 1 and '"TimeoutError"' in lines[0] and "--stream-stall-timeout" in lines[0]
        assert (await client.post("/resume")).status_code == 200
        stats = (await client.get("/engine/stats")).json()
        assert stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0


async def test_the_body_limit_applies_before_routing(stories_dir) -> None:
    limits = ServerLimits(max_request_body_bytes=64)
    async with running_server(make_engine(stories_dir), limits=limits) as (client, _):
        for path in ("/v1/completions", "/openapi.json", "/no/such/route"):
            response = await client.post(path, content=b"{" * 100)
            assert_openai_error(response, 413, "PayloadTooLargeError", "bytes")
