"""Block pool, free queue and per-request block bookkeeping (no tensors)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.kv.block_pool import (
    NULL_BLOCK_ID,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)
from core.kv.kv_cache_manager import KVCacheManager
from core.protocol import SamplingParams
from core.request import Request


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def make_request(req_id: str, num_prompt_tokens: int) -> Request:
    return Request(req_id, list(range(num_prompt_tokens)), SamplingParams())


# ------------------------------------------------------------------ free queue


def test_free_queue_pops_in_insertion_order_and_appends_at_tail() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert queue.popleft() is blocks[0]
    assert queue.popleft() is blocks[1]
    queue.append(blocks[0])
    assert ids(queue.get_all_free_blocks()) == [2, 3, 4, 0]
    assert ids(queue.popleft_n(3)) == [2, 3, 4]
    assert ids(queue.get_all_free_blocks()) == [0]


def test_free_queue_removes_from_the_middle_by_relinking_neighbours() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert blocks[1].next_free_block is blocks[3]
    assert blocks[3].prev_free_block is blocks[1]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    queue.remove(blocks[0])  # the head
    queue.remove(blocks[4])  # the tail
    assert ids(queue.get_all_free_blocks()) == [1, 3]
    assert queue.num_free_blocks == 2
    queue.append(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 2]


def test_free_queue_rejects_misuse() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    taken = queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(taken)
    with pytest.raises(ValueError):
        queue.popleft_n(2)
    queue.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pop", "remove", "append"]), st.integers(0, 10**6)), max_size=60))
def test_free_queue_matches_a_list_model(ops: list[tuple[str, int]]) -> None:
    blocks = [KVCacheBlock(i) for i in range(12)]
    queue = FreeKVCacheBlockQueue(blocks)
    model = list(blocks)
    outside: list[KVCacheBlock] = []
    for op, pick in ops:
        if op == "pop" and model:
            assert queue.popleft() is model[0]
            outside.append(model.pop(0))
        elif op == "remove" and model:
            block = model.pop(pick % len(model))
            queue.remove(block)
            outside.append(block)
        elif op == "append" and outside:
            block = outside.pop(pick % len(outside))
            queue.append(block)
            model.append(block)
        assert queue.num_free_blocks == len(model)
    assert queue.get_all_free_blocks() == model


# ------------------------------------------------------------------ block pool


def test_pool_reserves_the_null_block() -> None:
    pool = BlockPool(4)
    assert pool.null_block.block_id == NULL_BLOCK_ID
    assert pool.get_num_free_blocks() == 3
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


def test_pool_ref_counts_and_free_order() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    assert [blk.ref_cnt for blk in a + b] == [1, 1, 1, 1]
    assert pool.get_usage() == pytest.approx(4 / 5)
    pool.free_blocks(reversed(b))  # tail block first: it is evicted first
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [5, 4, 3]
    pool.touch([a[0]])  # shared: only the count grows
    pool.free_blocks(a)
    assert a[0].ref_cnt == 1 and a[1].ref_cnt == 0
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [5, 4, 3, 2]
    pool.free_blocks([a[0]])
    assert pool.get_num_free_blocks() == 5 and pool.get_usage() == 0.0
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a[0]])


def test_touch_revives_a_free_block_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(blocks)
    revived = blocks[2]
    pool.touch([revived])
    assert revived.ref_cnt == 1
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2, 4]
    assert ids(pool.get_new_blocks(3)) == [1, 2, 4]


# ------------------------------------------------------------------ manager


def test_allocate_slots_adds_blocks_only_at_block_boundaries() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a", 6)
    assert ids(manager.allocate_slots(req, 6)[0]) == [1, 2]
    req.num_computed_tokens = 6
    assert manager.allocate_slots(req, 2) == [[]]  # positions 6, 7 fit in block 2
    req.num_computed_tokens = 8
    assert ids(manager.allocate_slots(req, 1)[0]) == [3]
    assert manager.get_block_ids("a")[0] == [1, 2, 3]
    with pytest.raises(ValueError):
        manager.allocate_slots(req, 0)


def test_allocate_slots_returns_none_and_changes_nothing_when_short() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    a, b = make_request("a", 8), make_request("b", 8)
    assert manager.allocate_slots(a, 8) is not None
    assert manager.allocate_slots(b, 8) is None
    assert manager.get_block_ids("b")[0] == []
    assert manager.get_num_free_blocks() == 1
    assert ids(manager.allocate_slots(b, 4)[0]) == [3]


def test_free_returns_every_block_tail_first() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=2)
    a, b = make_request("a", 5), make_request("b", 3)
    manager.allocate_slots(a, 5)  # blocks 1, 2, 3
    manager.allocate_slots(b, 3)  # blocks 4, 5
    manager.free(a)
    manager.free(a)  # a second free is a no-op
    assert manager.get_block_ids("a")[0] == []
    assert ids(manager.block_pool.free_block_queue.get_all_free_blocks()) == [6, 7, 3, 2, 1]
    manager.free(b)
    assert manager.get_num_free_blocks() == 7 and manager.usage == 0.0


def test_a_sliding_window_frees_the_blocks_no_query_will_read_again() -> None:
    """Window 6, blocks of 4: the query at position p reads keys p - 5 .. p, so block i (keys
    4i .. 4i + 3) is freed once the next query starts past 4i + 3 + 5."""
    manager = KVCacheManager(num_blocks=8, block_size=4, windows=(6,))
    req = make_request("a", 10)
    assert ids(manager.allocate_slots(req, 10)[0]) == [1, 2, 3]
    req.num_computed_tokens = 10  # the next query, at 10, reads keys 5..10: block 1 (keys 0..3) is free
    assert manager.allocate_slots(req, 1) == [[]]
    assert manager.get_block_ids("a")[0] == [0, 2, 3] and manager.get_num_free_blocks() == 5
    req.num_computed_tokens = 13  # reads keys 8..13: block 2 (keys 4..7) is free too
    assert ids(manager.allocate_slots(req, 4)[0]) == [4, 5]  # positions 13..16; the freed ones queue behind
    assert manager.get_block_ids("a")[0] == [0, 0, 3, 4, 5]
    assert ids(manager.block_pool.free_block_queue.get_all_free_blocks()) == [6, 7, 1, 2]
    manager.free(req)
    assert manager.get_num_free_blocks() == 7 and manager.usage == 0.0


def test_a_window_group_gives_its_blocks_back_to_the_pool_the_whole_context_group_draws_from() -> None:
    """Gemma's layout: group 0 (global layers) keeps every block, group 1 (window 6) only what
    the next query reads, both from one pool; a step that needs more than the pool has fails
    whole, changing nothing."""
    manager = KVCacheManager(num_blocks=10, block_size=4, windows=(0, 6))
    req = make_request("a", 10)
    assert [ids(group) for group in manager.allocate_slots(req, 10)] == [[1, 2, 3], [4, 5, 6]]
    req.num_computed_tokens = 13  # the next query reads keys 8..13: group 1's first two blocks leave its window
    # Group 1 gives blocks 4 and 5 back before anyone takes new ones: group 0 then takes 7 and 8, group 1 9 and 4.
    assert [ids(group) for group in manager.allocate_slots(req, 4)] == [[7, 8], [9, 4]]
    assert manager.get_block_ids("a") == [[1, 2, 3, 7, 8], [0, 0, 6, 9, 4]]
    other = make_request("b", 12)
    assert manager.allocate_slots(other, 12) is None  # six blocks needed, one free
    assert manager.get_block_ids("b") == [[], []] and manager.get_num_free_blocks() == 1
    manager.free(req)
    assert manager.get_num_free_blocks() == 9 and manager.usage == 0.0 and not manager.holds_requests()


def test_a_prefix_hit_in_a_window_group_needs_only_the_window_before_it() -> None:
    """Blocks of 4, window 6: a hit of n blocks is usable when group 0 holds all n and group 1
    the blocks the next query (at 4n) reads; earlier ones may have been evicted, and the hit's
    table names the null block there. The groups cache the same hashes under keys of their own."""
    from core.kv.block_hash import RequestBlockHasher

    def request(req_id: str, n: int) -> Request:
        return Request(req_id, list(range(n)), SamplingParams(), block_hasher=RequestBlockHasher(4))

    manager = KVCacheManager(num_blocks=32, block_size=4, windows=(0, 6), enable_caching=True)
    first = request("a", 21)
    assert [ids(group) for group in manager.allocate_slots(first, 21)] == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    manager.free(first)
    pool = manager.block_pool
    assert pool.get_num_cached_blocks() == 10  # five full blocks in each group
    for block_id in (7, 8):  # group 1's first two blocks are evicted (keys 0..7)
        pool.evict(pool.blocks[block_id])
    blocks, num_computed = manager.get_computed_blocks(request("b", 21))
    assert num_computed == 20  # the query at 20 reads keys 15..20: group 1 needs its blocks 3 and 4 only
    assert [ids(group) for group in blocks] == [[1, 2, 3, 4, 5], [0, 0, 0, 10, 11]]
    pool.evict(pool.blocks[10])  # keys 12..15: now a hit of 5 misses key 15 in group 1
    assert manager.get_computed_blocks(request("c", 21))[1] == 0  # and no shorter hit has its window either
    second = request("d", 21)
    blocks, num_computed = manager.get_computed_blocks(second)
    assert manager.allocate_slots(second, 21 - num_computed, blocks, num_computed) is not None


def test_layers_fall_into_groups_of_equal_size_that_share_the_cache_tensors() -> None:
    """Gemma 3 1B's layout (a global layer after every five local ones, 26 layers): groups as
    large as the smallest kind (its 4 global layers), the 22 local layers in six groups, the
    last half empty; the i-th layer of every group uses cache tensor i."""
    from core.kv.kv_groups import KVCacheGroups
    from core.model_config import ModelConfig

    types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(26)]
    config = ModelConfig.from_hf(_gemma3_config(types))
    groups = KVCacheGroups.of(config)
    assert groups.windows == (0, 512, 512, 512, 512, 512, 512) and groups.num_slots == 4
    assert [i for i, g in enumerate(groups.layer_group) if g == 0] == [5, 11, 17, 23]
    assert [i for i, g in enumerate(groups.layer_group) if g == 6] == [24, 25]
    for group in range(groups.num_groups):  # no two layers of a group share a tensor
        slots = [s for s, g in zip(groups.layer_slot, groups.layer_group) if g == group]
        assert slots == list(range(len(slots)))
    # One request alone to 32k tokens, in steps of 2,048: every block of its context in the global
    # group, and in each local group its window, a block either side and a step's tokens.
    assert groups.least_blocks(16, 2048, 32768) == 2048 + 6 * (-(-(511 + 2048) // 16) + 1)
    every_layer_global = ModelConfig.from_hf(_gemma3_config(["full_attention"] * 26))
    assert KVCacheGroups.of(every_layer_global).windows == (0,) and KVCacheGroups.of(every_layer_global).num_slots == 26


def _gemma3_config(layer_types: list[str]) -> dict:
    return {
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 1024, "sliding_window": 512, "layer_types": layer_types,
        "query_pre_attn_scalar": 16,
    }


def test_without_prefix_caching_nothing_is_computed() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    assert manager.get_computed_blocks(make_request("a", 9)) == ([], 0)


def test_the_default_cpu_budget_holds_at_least_one_full_length_request(stories_dir, monkeypatch) -> None:
    """A long-context model (GGUF files say 32k and more) starts with the default budget: the
    cache then holds one request of max_model_len. An explicit budget too small still refuses."""
    from core.config import EngineArgs
    from core.worker import kv_budget
    from core.worker.model_runner import ModelRunner

    runner = ModelRunner(EngineArgs(model=stories_dir, max_model_len=512, block_size=16).resolve())
    monkeypatch.setattr(kv_budget, "default_cpu_kv_budget", lambda: runner.kv_bytes_per_block())
    assert runner.determine_num_blocks() == 512 // 16 + 1
    small = ModelRunner(EngineArgs(model=stories_dir, max_model_len=512, block_size=16,
                                   kv_cache_memory=10 * runner.kv_bytes_per_block()).resolve())
    with pytest.raises(ValueError, match="KV cache too small"):
        small.determine_num_blocks()


def test_the_default_cpu_budget_follows_the_memory_available(monkeypatch, tmp_path) -> None:
    """vLLM's 4 GiB where a quarter of the available memory allows it, else that quarter, never
    below 256 MiB; /proc/meminfo as the kernel writes it."""
    from core.worker import kv_budget

    real_open = open
    for available_kib, expected in [(64 << 20, 4 << 30), (8 << 20, 2 << 30), (512 << 10, 256 << 20)]:
        meminfo = tmp_path / f"meminfo-{available_kib}"
        meminfo.write_text(f"MemTotal:       {2 * available_kib} kB\nMemFree:        1000 kB\n"
                           f"MemAvailable:   {available_kib} kB\n")
        monkeypatch.setattr("builtins.open", lambda path, *a, _m=meminfo, **k: real_open(
            _m if path == "/proc/meminfo" else path, *a, **k))
        assert kv_budget.default_cpu_kv_budget() == expected
    monkeypatch.setattr("builtins.open", real_open)
    assert 256 << 20 <= kv_budget.default_cpu_kv_budget() <= 4 << 30
