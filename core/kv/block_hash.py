"""Content hashes of full KV cache blocks, chained so that a hash names a whole prefix.

A block's hash covers its parent's hash, its own token ids and its extra keys,
so two requests get the same hash for block ``i`` only if everything up to
and including block ``i`` is the same: one dictionary lookup per block then
answers "is this prefix cached?".

Choice of hash: SHA-256 over a msgpack encoding of
``(parent_hash, token_ids, extra_keys)``. A hit hands one request another's
KV cache without comparing tokens, so a collision would silently corrupt an
output and, across tenants, leak one's prompt into another's answer; a
cryptographic hash makes that practically impossible, even for prompts
chosen by an adversary, where Python's 64-bit ``hash()`` would need a token
comparison on every hit. The cost is about a microsecond per block (16
tokens), paid once per block: prompts are hashed when the request arrives
and generated tokens one block at a time as they fill (never the whole
sequence again).

Extra keys hold what besides token ids decides a block's keys and values
for isolation: the request's ``cache_salt`` goes into the first block, and
since every later hash chains from it, salted and unsalted requests (or two
tenants' salts) never share anything. LoRA adapters and multimodal inputs
would add their own keys here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NewType

import msgspec

if TYPE_CHECKING:
    from core.request import Request

BlockHash = NewType("BlockHash", bytes)

_encode = msgspec.msgpack.Encoder().encode

# Parent of every request's first block: a fixed value, so hashes are stable
# across processes and runs (the frontend could route by them later).
NONE_HASH = BlockHash(hashlib.sha256(b"ringllm/prefix-cache/root").digest())


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None = None
) -> BlockHash:
    """Hash of one full block, given its parent's hash (NONE_HASH for the first)."""
    return BlockHash(hashlib.sha256(_encode((parent_hash, token_ids, extra_keys))).digest())


def block_extra_keys(request: Request, block_index: int) -> tuple[Any, ...] | None:
    """Keys other than token ids that block ``block_index`` of ``request`` depends on."""
    if block_index == 0 and request.cache_salt is not None:
        return (request.cache_salt,)
    return None


class RequestBlockHasher:
    """Appends the hashes of a request's newly full blocks, and only those.

    Called when a request is created (its prompt) and after tokens are
    appended; ``len(request.block_hashes)`` says where the last call stopped,
    so each block is hashed exactly once.
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size

    def __call__(self, request: Request) -> list[BlockHash]:
        bs = self.block_size
        hashes = request.block_hashes
        start = len(hashes)
        end = len(request.all_token_ids) // bs
        if end <= start:
            return []
        parent = hashes[-1] if hashes else NONE_HASH
        tokens = request.all_token_ids
        new: list[BlockHash] = []
        for i in range(start, end):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], block_extra_keys(request, i))
            new.append(parent)
        return new
