"""Stored responses: the SQLite store on its own (bounds, two handles on one file, reopening),
and real servers: a response stored through one API server process of ``--api-server-count 2``
continued through the other, and after a restart on the same ``--responses-store`` file."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from app import responses_store
from app.responses_store import ResponsesStore
from tests.support.waiting import DEADLINE_S

MODEL = "stories260K"


def _run(coroutine):
    return asyncio.run(coroutine)


async def _put(store: ResponsesStore, name: str) -> None:
    await store.put(name, b'{"id": "%s"}' % name.encode(), b"[1]", b"[]")


def test_a_file_of_another_layout_is_made_again(tmp_path: Path) -> None:
    """A store written by an older ringllm (its table lacked a column) is dropped and made
    again, not a 500 on the first request that stores (the fuzz of /openapi.json found it)."""
    path = tmp_path / "store.sqlite3"
    with sqlite3.connect(path) as old:
        old.execute("CREATE TABLE responses (seq INTEGER PRIMARY KEY, id TEXT, created_at REAL, response BLOB)")
        old.execute("INSERT INTO responses (id, created_at, response) VALUES ('resp_old', 0, x'7b7d')")

    async def scenario() -> None:
        store = ResponsesStore(path)
        try:
            assert await store.get("resp_old") is None
            await _put(store, "resp_new")
        finally:
            store.close()
        again = ResponsesStore(path)  # this layout now: kept as it is
        try:
            assert await again.get("resp_new") is not None
        finally:
            again.close()

    _run(scenario())


def test_put_get_delete_and_the_count_bound(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = ResponsesStore(tmp_path / "store.sqlite3", max_count=3)
        try:
            assert await store.get("resp_a") is None
            for name in ("resp_a", "resp_b", "resp_c", "resp_d"):
                await _put(store, name)
            assert await store.count() == 3 and await store.get("resp_a") is None  # the oldest went
            kept = await store.get("resp_b")
            assert kept is not None and kept.response == b'{"id": "resp_b"}'
            assert (kept.input_items, kept.conversation) == (b"[1]", b"[]")
            assert await store.delete("resp_b") and not await store.delete("resp_b")
            assert await store.get("resp_b") is None and await store.count() == 2
        finally:
            store.close()

    _run(scenario())


def test_the_age_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows older than max_age are not found, and are evicted by the next put (the clock is
    the module's, set by the test)."""
    clock = [1_000_000.0]
    monkeypatch.setattr(responses_store.time, "time", lambda: clock[0])

    async def scenario() -> None:
        store = ResponsesStore(tmp_path / "store.sqlite3", max_age_s=60)
        try:
            await _put(store, "resp_old")
            clock[0] += 61
            assert await store.get("resp_old") is None and not await store.delete("resp_old")
            assert await store.count() == 1  # still there until a put evicts it
            await _put(store, "resp_new")
            assert await store.count() == 1 and await store.get("resp_new") is not None
        finally:
            store.close()

    _run(scenario())


def test_two_handles_share_one_file_and_it_survives_reopening(tmp_path: Path) -> None:
    """As two API server processes do: each its own connection; what one writes the other reads."""
    path = tmp_path / "deeper" / "store.sqlite3"  # the directory is made

    async def scenario() -> None:
        one, two = ResponsesStore(path), ResponsesStore(path)
        try:
            await _put(one, "resp_1")
            await _put(two, "resp_2")
            assert await two.get("resp_1") is not None and await one.get("resp_2") is not None
            assert await one.delete("resp_2") and await two.get("resp_2") is None
        finally:
            one.close()
            two.close()
        again = ResponsesStore(path)
        try:
            assert (await again.get("resp_1")).response == b'{"id": "resp_1"}'
        finally:
            again.close()

    _run(scenario())


def test_bounds_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ResponsesStore(tmp_path / "x", max_count=0)
    with pytest.raises(ValueError):
        ResponsesStore(tmp_path / "x", max_age_s=0)


# ------------------------------------------------------------------ real servers


def _create(base: str, **body) -> tuple[str, dict]:
    """POST /v1/responses on a new connection: (the API server that answered, the response)."""
    with httpx.Client(base_url=base, timeout=60) as client:  # a connection of its own
        r = client.post("/v1/responses", json={"model": MODEL, "temperature": 0, "max_output_tokens": 4, **body})
        assert r.status_code == 200, r.text
        return r.headers.get("x-ringllm-api-server", "").split(" ")[0], r.json()


def _text(response: dict) -> str:
    (message,) = response["output"]
    return message["content"][0]["text"]


def _chat_prompt_tokens(base: str, messages: list[dict]) -> int:
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def _get(base: str, response_id: str) -> tuple[str, int]:
    with httpx.Client(base_url=base, timeout=60) as client:
        r = client.get(f"/v1/responses/{response_id}")
        return r.headers.get("x-ringllm-api-server", "").split(" ")[0], r.status_code


def _until_answered_by_other(attempt, first: str):
    """Repeat ``attempt`` on new connections until the other API server answers it."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        server, result = attempt()
        if server != first:
            return result
    raise AssertionError(f"timed out after {DEADLINE_S:.0f} s waiting for the API server other than {first}")


@pytest.mark.slow
def test_stored_responses_are_shared_by_api_servers_and_survive_a_restart(server_factory, tmp_path: Path) -> None:
    store = tmp_path / "responses.sqlite3"
    server = server_factory(["--api-server-count", "2", "--responses-store", str(store)])
    base = server.base_url
    first_server, first = _create(base, input="Once upon a time")
    assert first_server in ("0", "1") and first["status"] == "incomplete"
    # Seen and continued through the other process.
    assert _until_answered_by_other(lambda: _get(base, first["id"]), first_server) == 200
    second = _until_answered_by_other(
        lambda: _create(base, input="And then?", previous_response_id=first["id"]), first_server
    )
    assert second["previous_response_id"] == first["id"]
    # The continuation's prompt is chat's prompt of the whole conversation.
    conversation = [{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": _text(first)},
                    {"role": "user", "content": "And then?"}]
    assert second["usage"]["input_tokens"] == _chat_prompt_tokens(base, conversation)
    server.stop()

    # A restart on the same file, now keeping two responses: both are there until a third comes.
    server = server_factory(["--responses-store", str(store), "--responses-store-max-count", "2"])
    base = server.base_url
    assert _get(base, first["id"])[1] == 200 and _get(base, second["id"])[1] == 200
    _, third = _create(base, input="The end.", previous_response_id=second["id"])
    conversation += [{"role": "assistant", "content": _text(second)}, {"role": "user", "content": "The end."}]
    assert third["usage"]["input_tokens"] == _chat_prompt_tokens(base, conversation)
    assert _get(base, first["id"])[1] == 404  # the oldest, evicted
    assert _get(base, second["id"])[1] == 200 and _get(base, third["id"])[1] == 200
