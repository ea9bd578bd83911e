"""Which KV cache blocks each request holds, and which prefixes are cached.

A request's block list only grows while it runs (one more block each time its
token count crosses a block boundary) and is released whole when it finishes
or is preempted. The manager never touches tensors: block ids are all the
model runner needs to find the slots.

With prefix caching a request starts from the longest run of its leading full
blocks whose hashes are registered (``get_computed_blocks``); those blocks are
shared, reference counted, and never written again, since only full blocks
are registered and a request writes only past its computed tokens. Blocks are
registered as soon as the tokens filling them are scheduled: the runner
executes batches in order and, within a batch, every layer writes the whole
batch's keys and values before attending, so a later reader never sees a
block before its contents exist.

With a sliding window in every layer (``sliding_window``), a request's blocks
wholly before the window of its next query are read by no layer again: they
go back to the pool as the request advances (cached ones stay findable until
evicted), and the null block takes their place in its table. The attention
kernels never read a position before a query's window, so a table that still
names such a block elsewhere (the runner's copy) is never read there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from core.kv.block_pool import BlockPool, KVCacheBlock
from core.request import Request
from core.utils import cdiv


@dataclass
class PrefixCacheStats:
    """Cumulative lookups, counted in tokens as vLLM does: ``hits / queries``
    is the fraction of admitted tokens that did not need computing. One
    lookup per admission (a request held back and retried is counted once;
    a preempted request counts again when it resumes)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens


_NO_BLOCKS: tuple[KVCacheBlock, ...] = ()


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = False, sliding_window: int | None = None
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # Per request (sliding window): how many of its leading blocks are the null block now.
        self.num_skipped: dict[str, int] = {}
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Per request: how many of its leading blocks are registered in the cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Cached blocks holding the longest prefix of the request's tokens, and
        how many tokens they cover (a multiple of the block size).

        At least one token is always left to compute, since the step that
        computes it is the one that samples the next token: a prompt cached
        whole recomputes its last block (blocks are shared whole, never
        partly rewritten). Nothing is reference counted yet; pass the blocks
        to ``allocate_slots``.
        """
        if not self.enable_caching or (
            request.sampling_params.prompt_logprobs is not None and not request.output_token_ids
        ):
            return [], 0  # prompt logprobs (not delivered yet) need the logits of every prompt position
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        lookup = self.block_pool.cached_block_hash_to_block.get
        hits: list[KVCacheBlock] = []
        for block_hash in islice(request.block_hashes, max_hit_blocks):
            block = lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = _NO_BLOCKS,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` after the request's computed tokens
        (``request.num_computed_tokens`` plus ``num_new_computed_tokens`` found
        in the cache as ``new_computed_blocks``).

        Returns the newly allocated blocks (often none: the last block still
        has room), or None when the pool cannot supply them; the request's
        table is then unchanged and the caller must free memory (preempt) or
        wait. Full blocks among the tokens now scheduled are registered in
        the prefix cache.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
        bs = self.block_size
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = cdiv(total, bs) - len(blocks) - len(new_computed_blocks)
        pool = self.block_pool
        if new_computed_blocks:
            # Hits on free blocks take them out of the free queue: they are
            # not available as new blocks any more.
            num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if num_needed > pool.free_block_queue.num_free_blocks - num_revived:
                return None
            pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_block[req_id] = len(blocks)
        elif num_needed > pool.free_block_queue.num_free_blocks:
            return None
        if self.sliding_window is not None:
            self._skip_out_of_window(req_id, blocks, request.num_computed_tokens + num_new_computed_tokens)
        if num_needed > 0:
            new_blocks = pool.get_new_blocks(num_needed)
            blocks.extend(new_blocks)
        else:
            new_blocks = []
        if self.enable_caching:
            # Only known tokens have hashes: a placeholder's block is not full yet.
            num_full = min(total, request.num_tokens) // bs
            num_cached = self.num_cached_block.get(req_id, 0)
            if num_full > num_cached:
                pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full)
                self.num_cached_block[req_id] = num_full
        return new_blocks

    def _skip_out_of_window(self, req_id: str, blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Free the blocks wholly before the window of the query at ``num_computed`` (the first
        position this step computes: it sees keys from ``num_computed - window + 1`` on)."""
        first_kept = max(0, num_computed - self.sliding_window + 1) // self.block_size
        skipped = self.num_skipped.get(req_id, 0)
        if first_kept <= skipped:
            return
        pool, null = self.block_pool, self.block_pool.null_block
        pool.free_blocks(blocks[i] for i in range(skipped, first_kept))
        blocks[skipped:first_kept] = [null] * (first_kept - skipped)
        self.num_skipped[req_id] = first_kept

    def free(self, request: Request) -> None:
        """Release every block of the request (a no-op when it holds none).

        The tail goes back to the pool first: a prompt's last blocks are the
        least likely to be shared, so they are evicted first. Cached blocks
        keep their hash in the free queue until they are reused.
        """
        self.num_cached_block.pop(request.request_id, None)
        skipped = self.num_skipped.pop(request.request_id, 0)
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks[skipped:]))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]
