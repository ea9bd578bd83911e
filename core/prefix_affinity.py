"""Which data-parallel engine was last sent each prompt prefix (prefix-cache-aware routing).

A client that routes by load alone spreads requests sharing a long prefix (a
system prompt, a document asked several questions) over every engine, and each
engine then computes and caches that prefix: with many such prefixes, every
engine's cache holds all of them and evicts them sooner. This map remembers,
per block-aligned prefix of the prompts this client routed, the engine that got
it, so that a request can follow its longest known prefix to the engine that
probably still caches it, as long as that engine is not much busier than the
least loaded one (``core.dp_client``).

It is the client's guess, kept without asking the engines: the engine may
have evicted the blocks since. Keys are chained hashes of whole blocks of
token ids (as the engines' prefix cache hashes them, but with Python's hash:
nothing leaves this process). The map is bounded (least recently used keys go
first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_CAPACITY = 200_000  # block keys remembered (a few tens of MB at most)


class PrefixAffinity:
    def __init__(self, block_size: int, capacity: int = DEFAULT_CAPACITY) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._engine_of: OrderedDict[int, int] = OrderedDict()

    def keys(self, token_ids: Sequence[int], salt: str | None = None) -> list[int]:
        """One key per whole block of the prompt; key i stands for blocks 0..i. Prompts
        with different cache salts share no cached blocks, so no keys either."""
        size = self.block_size
        keys = []
        key = hash(salt) if salt is not None else 0
        for start in range(0, len(token_ids) - size + 1, size):
            key = hash((key, tuple(token_ids[start : start + size])))
            keys.append(key)
        return keys

    def lookup(self, keys: Sequence[int]) -> tuple[int, int]:
        """(engine, blocks) of the longest known prefix; (-1, 0) when none is known."""
        engine_of = self._engine_of
        found, blocks = -1, 0
        for i, key in enumerate(keys):
            engine = engine_of.get(key)
            if engine is None:
                break
            found, blocks = engine, i + 1
        return found, blocks

    def record(self, keys: Sequence[int], engine: int) -> None:
        """``engine`` got a prompt with these keys: it will cache these blocks."""
        engine_of = self._engine_of
        for key in keys:
            engine_of[key] = engine
            engine_of.move_to_end(key)
        while len(engine_of) > self.capacity:
            engine_of.popitem(last=False)

    def forget_engine(self, engine: int) -> None:
        """The engine died or restarted: its cache is gone."""
        for key in [k for k, e in self._engine_of.items() if e == engine]:
            del self._engine_of[key]

    def __len__(self) -> int:
        return len(self._engine_of)
