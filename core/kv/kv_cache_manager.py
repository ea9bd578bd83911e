"""Which KV cache blocks each request holds.

A request's block list only grows while it runs (one more block each time its
token count crosses a block boundary) and is released whole when it finishes
or is preempted. The manager never touches tensors: block ids are all the
model runner needs to find the slots.
"""

from __future__ import annotations

from core.kv.block_pool import BlockPool, KVCacheBlock
from core.sched.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if enable_caching:
            # Refuse rather than pretend: hit counts and reuse would be fake.
            raise NotImplementedError("prefix caching is not implemented yet; run without it")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Blocks already holding a prefix of the request's tokens, and how many
        tokens they cover. Without prefix caching nothing is ever reusable."""
        return [], 0

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` after the request's computed tokens.

        Returns the blocks added to the request's table (often none: the last
        block still has room), or None when the pool cannot supply them; the
        request's table is then unchanged and the caller must free memory
        (preempt) or wait.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
        if num_needed <= 0:
            return []
        if num_needed > self.block_pool.get_num_free_blocks():
            return None
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        blocks.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release every block of the request (a no-op when it holds none).

        The tail goes back to the pool first: under prefix caching a prompt's
        last blocks are the least likely to be shared, so they are evicted first.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]
