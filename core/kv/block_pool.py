"""Physical KV cache blocks and the pool that hands them out.

Blocks are reference counted. A block whose count drops to zero goes to the
tail of the free queue and new blocks are taken from its head, so the queue
is ordered by how long ago a block was freed. With prefix caching a freed
block keeps its hash and contents: it stays findable through the
hash -> block map until ``get_new_blocks`` takes it off the head of the
queue for someone else, which is what makes eviction least-recently-used.
A cache hit on a free block takes it out of the middle of the queue, which
is why the queue is an intrusive doubly linked list (O(1) removal) instead
of a deque.

Block 0 is reserved as the null block: it is never handed out, so the model
runner can pad block tables with 0 and any stray write through padding lands
in a block no request owns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from core.kv.block_hash import BlockHash

NULL_BLOCK_ID = 0


class KVCacheBlock:
    """Metadata of one physical block; the tensors live in the model runner."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Hash of the full block's tokens (and those before it), set by prefix
        # caching; None while the block is partial, uncached or caching is off.
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None while the block is not in it.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    Two sentinel nodes bound the list so that no operation needs a special
    case for an empty list or an end node.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Take the block that has been free the longest."""
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue, in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head first (O(n): for tests and debugging)."""
        out = []
        block = self._head.next_free_block
        while block is not self._tail:
            assert block is not None
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """Owns every block; allocation, freeing and lookups are O(blocks moved).

    ``cached_block_hash_to_block`` maps the hash of a full block's prefix to
    the one block holding it. When two requests compute the same block at
    once (neither could hit the other's), the first to register it wins and
    the second keeps a private, unhashed copy: a hash never names two blocks.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV cache blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[NULL_BLOCK_ID + 1 :])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks off the head of the free queue, each with ref_cnt 1.

        The head holds the least recently used blocks; a cached one among
        them is evicted (its hash forgotten) since its contents are about to
        be overwritten.
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            if block.block_hash is not None:
                self.evict(block)
            block.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding the prefix named by ``block_hash``, in use or free."""
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` of one request
        under the matching ``block_hashes``; those before are registered already."""
        table = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block is self.null_block:
                continue  # a prefix hit (registered by whoever computed it), or out of the window
            block_hash = block_hashes[i]
            if block_hash not in table:
                block.block_hash = block_hash
                table[block_hash] = block

    def evict(self, block: KVCacheBlock) -> bool:
        """Forget a block's hash so no lookup finds it; True if it was cached."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        block.block_hash = None
        if self.cached_block_hash_to_block.get(block_hash) is block:
            del self.cached_block_hash_to_block[block_hash]
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is in use:
        the manager's per-request count of registered blocks would no longer
        match the pool, and the caller wants a cache that is really empty."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block = {}
        return True

    def get_num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take another reference to blocks, reviving free ones out of the queue.

        This is how a prefix-cache hit shares a block: it may be in use by
        another request (only the count grows) or free but still holding
        valid contents (it leaves the free queue, wherever it is).
        """
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching zero join the queue's
        tail in the given order, so pass the ones to evict first, first."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
