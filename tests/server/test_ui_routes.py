"""The chat page's routes and model aliases, over the real engine in process.

What a browser needs from the server without a browser: the page, its files,
whether to ask for an API key, and nothing when the page is disabled.
"""

from __future__ import annotations

import pytest

from app.ui import STATIC_DIR
from tests.support.http import MODEL, assert_openai_error, make_engine, running_server

PAGE_FILES = ("/", "/static/chat.js", "/static/chat.css")


@pytest.fixture
def engine(stories_dir):
    return make_engine(stories_dir)


async def test_page_and_files_need_no_key_but_the_api_does(engine) -> None:
    async with running_server(engine, api_key="sekret") as (client, _):
        for path in PAGE_FILES:
            response = await client.get(path)
            assert response.status_code == 200, path
            assert response.headers["x-content-type-options"] == "nosniff"
        assert (await client.get("/ui/config")).json() == {"api_key_required": True}
        assert_openai_error(await client.get("/v1/models"), 401, "AuthenticationError", "API key")
        page = (await client.get("/")).text
        assert page == (STATIC_DIR / "index.html").read_text()
        assert 'id="api-key"' in page and 'for="api-key"' in page


async def test_no_key_configured(engine) -> None:
    async with running_server(engine) as (client, _):
        assert (await client.get("/ui/config")).json() == {"api_key_required": False}
        assert_openai_error(await client.get("/static/missing.js"), 404, "NotFoundError", "/static/missing.js")


async def test_disable_frontend_ui(engine) -> None:
    async with running_server(engine, enable_ui=False) as (client, _):
        for path in (*PAGE_FILES, "/ui/config"):
            assert_openai_error(await client.get(path), 404, "NotFoundError", path)
        assert (await client.get("/v1/models")).status_code == 200


async def test_aliases_are_accepted_not_listed(engine) -> None:
    async with running_server(engine, model_aliases=["old-name"]) as (client, _):
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [MODEL]
        r = await client.post("/v1/completions", json={"model": "old-name", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == MODEL
        r = await client.post("/v1/completions", json={"model": "other", "prompt": "x", "max_tokens": 2})
        assert_openai_error(r, 404, "NotFoundError", "`other` does not exist")
