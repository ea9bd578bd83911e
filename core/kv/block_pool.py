"""Physical KV cache blocks and the pool that hands them out.

Blocks are reference counted. A block whose count drops to zero goes to the
tail of the free queue and new blocks are taken from its head, so the queue
is ordered by how long ago a block was freed. That is the order an LRU
eviction policy needs once prefix caching keeps the contents of free blocks
reusable: a cache hit then takes its block out of the middle of the queue,
which is why the queue is an intrusive doubly linked list (O(1) removal)
instead of a deque.

Block 0 is reserved as the null block: it is never handed out, so the model
runner can pad block tables with 0 and any stray write through padding lands
in a block no request owns.
"""

from __future__ import annotations

from collections.abc import Iterable

NULL_BLOCK_ID = 0


class KVCacheBlock:
    """Metadata of one physical block; the tensors live in the model runner."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Hash of the full block's tokens (and those before it), set by prefix
        # caching; None while the block is partial or caching is off.
        self.block_hash: int | None = None
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
    """Owns every block; allocation and freeing are O(blocks moved)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV cache blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[NULL_BLOCK_ID + 1 :])

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks off the head of the free queue, each with ref_cnt 1."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
        return blocks

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
