"""Stored responses (``store: true`` on /v1/responses): an SQLite database every API server shares.

A response is kept so that a later request can continue from it
(``previous_response_id``) and so that ``GET /v1/responses/{id}`` (and its
``/input_items``) can show it. Each row holds the response as it was returned,
its own input items, and the conversation it ended:
the input items of every response before it in the chain, its own input and
its output items (function calls included), so a continuation is one lookup
however long the chain, and survives its ancestors' eviction.

The database is one file (``--responses-store``, by default in the cache
directory) in WAL mode: the API server processes of ``--api-server-count``
each open it and see each other's rows at once, and it survives restarts.
It is bounded by count and age, the oldest rows evicted when a row is added;
an expired row is not found even before it is evicted. Every statement runs
on one worker thread per process, which owns the connection, so the event
loop never waits on the disk or on another process's write lock.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from app.frontend_config import DEFAULT_RESPONSES_STORE_MAX_AGE_S as DEFAULT_MAX_AGE_S
from app.frontend_config import DEFAULT_RESPONSES_STORE_MAX_COUNT as DEFAULT_MAX_COUNT
from core import envs

T = TypeVar("T")
logger = logging.getLogger("ringllm.responses")

BUSY_TIMEOUT_S = 10.0  # how long a write waits for another process's

# The rows' layout: a file written by another layout (an older ringllm) has its table dropped
# and made again: stored responses are a convenience for continuing conversations, not records.
SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL,
    response BLOB NOT NULL,
    input_items BLOB NOT NULL,
    conversation BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
"""


def _ensure_schema(conn: sqlite3.Connection, path: Path) -> None:
    """The table in this layout; one of another layout is dropped first (in one transaction,
    so that another API server opening the file at once sees either layout whole)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        has_table = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'responses'").fetchone() is not None
        if has_table and version != SCHEMA_VERSION:
            logger.warning("%s: stored responses of another layout (version %d) dropped", path, version)
            conn.execute("DROP TABLE responses")
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def default_store_path() -> Path:
    return Path(envs.RINGLLM_CACHE) / "responses.sqlite3"


@dataclass(frozen=True)
class StoredResponse:
    response: bytes  # the response object's JSON, as it was returned
    input_items: bytes  # JSON list of its own input items (ids given)
    conversation: bytes  # JSON list of the input items that continue from it


class ResponsesStore:
    """``path`` None: the default file in the cache directory. Nothing is opened before
    the first use, so a server that never stores a response creates no file."""

    def __init__(
        self, path: str | Path | None = None, max_count: int = DEFAULT_MAX_COUNT, max_age_s: float = DEFAULT_MAX_AGE_S
    ) -> None:
        if max_count < 1:
            raise ValueError(f"the responses store must hold at least one response, got max_count={max_count}")
        if max_age_s <= 0:
            raise ValueError(f"the responses store's max age must be positive, got {max_age_s}")
        self.path = Path(path) if path is not None else default_store_path()
        self.max_count = max_count
        self.max_age_s = max_age_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="responses-store")
        self._conn: sqlite3.Connection | None = None  # owned by the worker thread

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: work(self._connection()))

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")  # durable across crashes of the process; WAL keeps it whole
            _ensure_schema(conn, self.path)
            self._conn = conn
        return self._conn

    def _oldest_kept(self) -> float:
        return time.time() - self.max_age_s

    async def put(self, response_id: str, response: bytes, input_items: bytes, conversation: bytes) -> None:
        """Keep a response, evicting what is over the age and count bounds."""

        def put(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute(
                    "INSERT OR REPLACE INTO responses (id, created_at, response, input_items, conversation) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (response_id, time.time(), response, input_items, conversation),
                )
                conn.execute("DELETE FROM responses WHERE created_at < ?", (self._oldest_kept(),))
                conn.execute(
                    "DELETE FROM responses WHERE seq <= "
                    "(SELECT seq FROM responses ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                    (self.max_count,),
                )
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

        await self._run(put)

    async def get(self, response_id: str) -> StoredResponse | None:
        def get(conn: sqlite3.Connection) -> StoredResponse | None:
            row = conn.execute(
                "SELECT response, input_items, conversation FROM responses WHERE id = ? AND created_at >= ?",
                (response_id, self._oldest_kept()),
            ).fetchone()
            return None if row is None else StoredResponse(*(bytes(column) for column in row))

        return await self._run(get)

    async def delete(self, response_id: str) -> bool:
        """Whether there was such a response (expired ones count as gone)."""

        def delete(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "DELETE FROM responses WHERE id = ? AND created_at >= ?", (response_id, self._oldest_kept())
            )
            return cursor.rowcount > 0

        return await self._run(delete)

    async def count(self) -> int:
        return await self._run(lambda conn: conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        """Close the connection (checkpointing the WAL) and stop the worker thread."""

        def close() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        self._executor.submit(close).result()
        self._executor.shutdown()
