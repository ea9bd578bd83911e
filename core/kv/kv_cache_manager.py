"""Which KV cache blocks each request holds, and which prefixes are cached.

The layers of a model fall into KV cache groups (core/kv/kv_groups.py): one for a model
with one kind of layer; for Gemma's interleaved local and global layers, groups of each
kind. Every group gives each request its own block table, and all of them draw from one
pool; the manager keeps them in step, so that a request is admitted, grows, hits the
prefix cache and is freed in all of them at once.

A request's block list only grows while it runs (one more block each time its token
count crosses a block boundary) and is released whole when it finishes or is
preempted. The manager never touches tensors: block ids are all the model runner
needs to find the slots.

With prefix caching a request starts from the longest run of its leading full blocks
whose hashes are registered (``get_computed_blocks``); those blocks are shared,
reference counted, and never written again, since only full blocks are registered and
a request writes only past its computed tokens. Blocks are registered as soon as the
tokens filling them are scheduled: the runner executes batches in order and, within a
batch, every layer writes the whole batch's keys and values before attending, so a
later reader never sees a block before its contents exist. Each group registers its
blocks under keys of its own (the hash for the first group, the group and the hash for
the others), so one pool keeps every group's prefixes apart.

In a sliding window's group, a request's blocks wholly before the window of its next
query are read by no layer again: they go back to the pool as the request advances
(cached ones stay findable until evicted), and the null block takes their place in its
table. A prefix hit there needs only the blocks of the window before the hit: the
earlier ones may be long evicted. The attention kernels never read a position before
a query's window, so a table that still names such a block elsewhere (the runner's
copy) is never read there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from core.kv.block_hash import BlockHash
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


# Blocks per group: what get_computed_blocks finds and allocate_slots hands out.
GroupBlocks = list[list[KVCacheBlock]]
_NO_BLOCKS: GroupBlocks = []
_NO_HITS: tuple[KVCacheBlock, ...] = ()


class _GroupKeys(Sequence):
    """A request's block hashes as one group's cache keys: (group, hash) for every group but
    the first, whose keys are the hashes themselves."""

    __slots__ = ("hashes", "group")

    def __init__(self, hashes: Sequence[BlockHash], group: int) -> None:
        self.hashes, self.group = hashes, group

    def __getitem__(self, i):  # type: ignore[override]
        return (self.group, self.hashes[i])

    def __len__(self) -> int:
        return len(self.hashes)


class _Group:
    """One KV cache group: each request's block table in it, drawn from the shared pool."""

    def __init__(self, pool: BlockPool, index: int, block_size: int, window: int) -> None:
        self.pool = pool
        self.index = index
        self.block_size = block_size
        self.window = window  # 0: the group's layers read the whole context
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Per request: how many of its leading blocks are registered in the cache.
        self.num_cached_block: dict[str, int] = {}
        # Per request (a window's group): how many of its leading blocks are the null block now.
        self.num_skipped: dict[str, int] = {}

    def keys(self, block_hashes: Sequence[BlockHash]) -> Sequence:
        return block_hashes if self.index == 0 else _GroupKeys(block_hashes, self.index)

    def first_kept(self, position: int) -> int:
        """How many leading blocks the query at ``position`` does not read (it sees keys from
        ``position - window + 1`` on)."""
        return max(0, position - self.window + 1) // self.block_size if self.window else 0

    def longest_hit(self, keys: Sequence, limit: int) -> int:
        """The most leading blocks (at most ``limit``) this group can start a request from:
        every block the next query reads is cached."""
        lookup = self.pool.cached_block_hash_to_block.get
        run = best = 0  # cached blocks ending at block i; the longest hit so far
        for i in range(limit):
            run = run + 1 if lookup(keys[i]) is not None else 0
            if run == 0 and not self.window:
                break  # the whole context's hits are one unbroken run from the start
            if run >= i + 1 - self.first_kept((i + 1) * self.block_size):
                best = i + 1
        return best

    def hit_blocks(self, keys: Sequence, num_blocks: int) -> list[KVCacheBlock]:
        """The table of a hit of ``num_blocks`` blocks: the null block where the window has passed."""
        skipped = self.first_kept(num_blocks * self.block_size)
        lookup = self.pool.cached_block_hash_to_block.__getitem__
        return [self.pool.null_block] * skipped + [lookup(keys[i]) for i in range(skipped, num_blocks)]

    def num_to_allocate(self, req_id: str, total: int, computed: Sequence[KVCacheBlock]) -> int:
        """New blocks to hold ``total`` tokens after adopting ``computed``."""
        blocks = self.req_to_blocks.get(req_id)
        return cdiv(total, self.block_size) - (len(blocks) if blocks else 0) - len(computed)

    def pool_change(self, req_id: str, computed: Sequence[KVCacheBlock], num_computed: int) -> int:
        """Free blocks this request's step takes from the pool besides its new ones (hits on
        free blocks leave the free queue), less those it gives back (blocks leaving its window
        before the query at ``num_computed``)."""
        change = 0
        if computed:
            null = self.pool.null_block
            change += sum(1 for b in computed if b.ref_cnt == 0 and b is not null)
        blocks = self.req_to_blocks.get(req_id)
        if self.window and blocks:
            leaving = blocks[self.num_skipped.get(req_id, 0) : self.first_kept(num_computed)]
            change -= sum(1 for b in leaving if b.ref_cnt == 1)
        return change

    def adopt(self, req_id: str, computed: Sequence[KVCacheBlock], num_computed: int) -> list[KVCacheBlock]:
        """Take the hits in, and give back what left the window: the request's table."""
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
        if computed:
            null = self.pool.null_block
            skipped = sum(1 for b in computed if b is null)  # the leading ones: out of the window
            self.pool.touch(computed[skipped:])
            blocks.extend(computed)
            self.num_cached_block[req_id] = len(blocks)
            if skipped:
                self.num_skipped[req_id] = skipped
        if self.window:
            self._skip_out_of_window(req_id, blocks, num_computed)
        return blocks

    def grow(self, request: Request, blocks: list[KVCacheBlock], total: int, num_needed: int) -> list[KVCacheBlock]:
        """Add the new blocks, and register the full ones in the cache."""
        pool = self.pool
        if num_needed > 0:
            new_blocks = pool.get_new_blocks(num_needed)
            blocks.extend(new_blocks)
        else:
            new_blocks = []
        if pool.enable_caching:
            # Only known tokens have hashes: a placeholder's block is not full yet.
            num_full = min(total, request.num_tokens) // self.block_size
            num_cached = self.num_cached_block.get(request.request_id, 0)
            if num_full > num_cached:
                pool.cache_full_blocks(blocks, self.keys(request.block_hashes), num_cached, num_full)
                self.num_cached_block[request.request_id] = num_full
        return new_blocks

    def _skip_out_of_window(self, req_id: str, blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Free the blocks wholly before the window of the query at ``num_computed`` (the first
        position this step computes)."""
        first_kept = self.first_kept(num_computed)
        skipped = self.num_skipped.get(req_id, 0)
        if first_kept <= skipped:
            return
        pool, null = self.pool, self.pool.null_block
        pool.free_blocks(blocks[i] for i in range(skipped, first_kept))
        blocks[skipped:first_kept] = [null] * (first_kept - skipped)
        self.num_skipped[req_id] = first_kept

    def free(self, req_id: str) -> None:
        """Release every block of the request, the tail first: a prompt's last blocks are the
        least likely to be shared, so they are evicted first."""
        self.num_cached_block.pop(req_id, None)
        skipped = self.num_skipped.pop(req_id, 0)
        blocks = self.req_to_blocks.pop(req_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks[skipped:]))


class KVCacheManager:
    """The block tables of every request in every KV cache group, all drawn from one pool of
    ``num_blocks`` blocks of ``block_size`` tokens; group g's layers see ``windows[g]``
    positions (0: all)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = False, windows: Sequence[int] = (0,),
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.groups = [_Group(self.block_pool, g, block_size, w) for g, w in enumerate(windows)]
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Cached blocks holding the longest prefix of the request's tokens that every group
        can start from, per group, and how many tokens they cover (a multiple of the block size).

        At least one token is always left to compute, since the step that
        computes it is the one that samples the next token: a prompt cached
        whole recomputes its last block (blocks are shared whole, never
        partly rewritten). Nothing is reference counted yet; pass the blocks
        to ``allocate_slots``.
        """
        if not self.enable_caching or (
            request.sampling_params.prompt_logprobs is not None and not request.output_token_ids
        ):
            return _NO_BLOCKS, 0  # prompt logprobs (not delivered yet) need the logits of every prompt position
        hashes = request.block_hashes
        num_blocks = min((request.num_tokens - 1) // self.block_size, len(hashes))
        keys = [group.keys(hashes) for group in self.groups]
        # A window's group may start from a hit of n blocks but not from a shorter one (its
        # window there was evicted): shorten until every group agrees.
        agreed = False
        while num_blocks and not agreed:
            agreed = True
            for group, group_keys in zip(self.groups, keys):
                hit = group.longest_hit(group_keys, num_blocks)
                agreed &= hit == num_blocks
                num_blocks = hit
        if not num_blocks:
            return _NO_BLOCKS, 0
        blocks = [group.hit_blocks(group_keys, num_blocks) for group, group_keys in zip(self.groups, keys)]
        return blocks, num_blocks * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks = _NO_BLOCKS,
        num_new_computed_tokens: int = 0,
    ) -> GroupBlocks | None:
        """Make room for ``num_new_tokens`` after the request's computed tokens
        (``request.num_computed_tokens`` plus ``num_new_computed_tokens`` found
        in the cache as ``new_computed_blocks``, per group).

        Returns the newly allocated blocks per group (often none: the last block still
        has room), or None when the pool cannot supply them; the request's tables are
        then unchanged and the caller must free memory (preempt) or wait. Full blocks
        among the tokens now scheduled are registered in the prefix cache.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        req_id = request.request_id
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens
        groups = self.groups
        free = self.block_pool.free_block_queue.num_free_blocks
        if len(groups) == 1:  # most models: no per-group lists on the way
            group = groups[0]
            hits = new_computed_blocks[0] if new_computed_blocks else _NO_HITS
            num_needed = group.num_to_allocate(req_id, total, hits)
            if (num_needed > 0 or hits) and max(num_needed, 0) + group.pool_change(req_id, hits, num_computed) > free:
                return None
            return [group.grow(request, group.adopt(req_id, hits, num_computed), total, num_needed)]
        computed = new_computed_blocks or [_NO_HITS] * len(groups)
        needed = [group.num_to_allocate(req_id, total, hits) for group, hits in zip(groups, computed)]
        if any(n > 0 for n in needed) or new_computed_blocks:  # (the common decode: no new block anywhere)
            taken = sum(n for n in needed if n > 0) + sum(
                group.pool_change(req_id, hits, num_computed) for group, hits in zip(groups, computed)
            )
            if taken > free:
                return None
        # Every group takes its hits and gives back what left its window before any takes new blocks.
        tables = [group.adopt(req_id, hits, num_computed) for group, hits in zip(groups, computed)]
        return [
            group.grow(request, blocks, total, num_needed)
            for group, blocks, num_needed in zip(groups, tables, needed)
        ]

    def free(self, request: Request) -> None:
        """Release every block of the request (a no-op when it holds none). Cached blocks
        keep their hash in the free queue until they are reused."""
        for group in self.groups:
            group.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()

    def holds_requests(self) -> bool:
        """Whether any request holds blocks or registered-block counts."""
        return any(group.req_to_blocks or group.num_cached_block for group in self.groups)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return [group.req_to_blocks.get(request_id, []) for group in self.groups]

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table in each group."""
        return [[block.block_id for block in group.req_to_blocks.get(request_id, ())] for group in self.groups]
