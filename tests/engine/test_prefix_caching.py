"""Prefix caching: block hashes, the hash -> block map, LRU eviction, sharing,
tenant isolation, and the scheduler running with all of it on."""

from __future__ import annotations

import pytest

from core.kv.block_hash import NONE_HASH, RequestBlockHasher, hash_block_tokens
from core.kv.block_pool import BlockPool
from core.kv.kv_cache_manager import KVCacheManager
from core.protocol import EngineCoreEventType, SamplingParams
from core.request import Request, RequestStatus
from tests.support.scheduler_harness import Harness, expected_outputs, make_config

BS = 4


def request(req_id: str, tokens: list[int], salt: str | None = None, block_size: int = BS) -> Request:
    return Request(req_id, list(tokens), SamplingParams(), cache_salt=salt, block_hasher=RequestBlockHasher(block_size))


def admit(manager: KVCacheManager, req: Request) -> int:
    """What the scheduler does for a waiting request; returns the tokens found cached."""
    blocks, num_cached = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, req.num_tokens - num_cached, blocks, num_cached) is not None
    req.num_computed_tokens = req.num_tokens
    return num_cached


def block_ids(manager: KVCacheManager, req: Request) -> list[int]:
    return manager.get_block_ids(req.request_id)[0]


# ------------------------------------------------------------------ hashing


def test_block_hash_chains_parent_tokens_and_extra_keys() -> None:
    h = hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert h == hash_block_tokens(NONE_HASH, (1, 2, 3, 4)) and len(h) == 32  # SHA-256
    assert h != hash_block_tokens(NONE_HASH, [1, 2, 3, 5])
    assert h != hash_block_tokens(NONE_HASH, [1, 2, 3, 4], ("salt",))
    child = hash_block_tokens(h, [5, 6, 7, 8])
    assert child != hash_block_tokens(NONE_HASH, [5, 6, 7, 8])  # same tokens, other prefix


def test_request_hashes_full_blocks_only_and_incrementally() -> None:
    tokens = list(range(100, 110))
    req = request("a", tokens)
    assert len(req.block_hashes) == 2  # 10 tokens: two full blocks, two left over
    assert req.block_hashes[0] == hash_block_tokens(NONE_HASH, tokens[:4])
    assert req.block_hashes[1] == hash_block_tokens(req.block_hashes[0], tokens[4:8])
    first_two = list(req.block_hashes)
    req.append_output_token_ids(110)
    assert req.block_hashes == first_two  # 11 tokens: still two
    req.append_output_token_ids(111)
    assert req.block_hashes[:2] == first_two and len(req.block_hashes) == 3
    # The same 12 tokens hashed from scratch give the same chain.
    assert request("b", list(range(100, 112))).block_hashes == req.block_hashes


def test_hashes_agree_on_a_shared_prefix_and_diverge_after_it() -> None:
    a = request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    b = request("b", [1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12])
    assert a.block_hashes[0] == b.block_hashes[0]
    assert a.block_hashes[1] != b.block_hashes[1]
    assert a.block_hashes[2] != b.block_hashes[2]  # same tokens, but chained from a different block


# ------------------------------------------------------------------ lookup


def test_lookup_finds_the_longest_cached_prefix() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    a = request("a", list(range(12)))
    assert admit(manager, a) == 0
    b = request("b", list(range(8)) + [99, 98, 97, 96, 95])  # shares two blocks, then differs
    blocks, num_cached = manager.get_computed_blocks(b)
    assert num_cached == 8 and [blk.block_id for blk in blocks[0]] == block_ids(manager, a)[:2]
    assert admit(manager, b) == 8
    assert block_ids(manager, b)[:2] == block_ids(manager, a)[:2]
    assert block_ids(manager, b)[2:] != block_ids(manager, a)[2:]
    assert [blk.ref_cnt for blk in manager.get_blocks("a")[0]] == [2, 2, 1]


def test_a_miss_ends_the_hit_even_if_later_blocks_are_cached() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    admit(manager, request("a", list(range(12))))
    # Block 0 differs: blocks 1 and 2 hash differently (chained), nothing is found.
    _, num_cached = manager.get_computed_blocks(request("b", [77, 1, 2, 3] + list(range(4, 12)) + [1]))
    assert num_cached == 0


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    admit(manager, request("a", list(range(8)) + [50]))
    # Exactly two full blocks, both cached: at least one token must be computed,
    # and blocks are shared whole, so the second block is recomputed.
    _, num_cached = manager.get_computed_blocks(request("b", list(range(8))))
    assert num_cached == 4
    # One more token and both blocks are usable.
    _, num_cached = manager.get_computed_blocks(request("c", list(range(9))))
    assert num_cached == 8


def test_without_prefix_caching_nothing_is_computed_or_hashed() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = request("a", list(range(9)))
    admit(manager, a)
    assert manager.get_computed_blocks(request("b", list(range(9)))) == ([], 0)
    assert manager.block_pool.get_num_cached_blocks() == 0


# ------------------------------------------------------------------ eviction


def test_freed_blocks_stay_cached_and_are_evicted_least_recently_used_first() -> None:
    manager = KVCacheManager(num_blocks=7, block_size=BS, enable_caching=True)  # 6 usable
    a, b, c = (request(n, [ord(n)] * 8 + [0]) for n in "abc")  # 2 full blocks + 1 partial each
    admit(manager, a)
    admit(manager, b)
    manager.free(a)  # a's blocks go to the free queue, still cached
    manager.free(b)
    assert manager.block_pool.get_num_cached_blocks() == 4
    # a's full blocks are found again (its partial block was never cached and
    # is the first block handed out for a2's own last token).
    assert admit(manager, request("a2", [ord("a")] * 8 + [1])) == 8
    # c needs 3 blocks: only b's are left in the free queue, and b is evicted
    # even though it was freed after a, because a hit revived a's blocks.
    admit(manager, c)
    assert manager.get_computed_blocks(request("b2", [ord("b")] * 8 + [2]))[1] == 0  # b evicted
    assert manager.get_computed_blocks(request("a3", [ord("a")] * 8 + [3]))[1] == 8


def test_eviction_order_follows_free_order_tail_blocks_first() -> None:
    manager = KVCacheManager(num_blocks=9, block_size=BS, enable_caching=True)  # 8 usable
    old = request("old", [1] * 8 + [0])  # 2 full blocks + 1 partial
    new = request("new", [2] * 8 + [0])
    admit(manager, old)
    admit(manager, new)
    manager.free(old)  # freed first: least recently used
    manager.free(new)
    # Free queue: 2 never-used blocks, then old's blocks tail first (partial,
    # block 1, block 0), then new's: a prompt's first block, the one most
    # likely to be shared, is evicted last among its own.
    hits = lambda tokens: manager.get_computed_blocks(request("q", tokens + [5]))[1]  # noqa: E731
    taker = request("x", [9] * 32)
    expected = [(8, 8), (8, 8), (8, 8), (4, 8), (0, 8), (0, 8), (0, 4), (0, 0)]
    for n, (old_hit, new_hit) in enumerate(expected, start=1):
        assert manager.allocate_slots(taker, 4) is not None
        taker.num_computed_tokens += 4
        assert (hits([1] * 8), hits([2] * 8)) == (old_hit, new_hit), f"after {n} blocks"


def test_shared_blocks_are_not_evicted_while_referenced() -> None:
    manager = KVCacheManager(num_blocks=9, block_size=BS, enable_caching=True)  # 8 usable
    a = request("a", list(range(9)))
    b = request("b", list(range(8)) + [42])
    admit(manager, a)
    assert admit(manager, b) == 8
    shared = manager.get_blocks("b")[0][:2]
    manager.free(a)  # the shared blocks are still held by b
    assert all(blk.ref_cnt == 1 for blk in shared)
    # Exhaust the pool: every free block goes, the shared ones cannot.
    free = manager.get_num_free_blocks()
    hog = request("hog", [7] * (free * BS))
    assert manager.allocate_slots(hog, free * BS) is not None
    assert manager.get_num_free_blocks() == 0
    assert all(blk.block_hash is not None for blk in shared)
    assert manager.get_computed_blocks(request("c", list(range(8)) + [1]))[1] == 8
    assert manager.allocate_slots(request("d", [3] * 4), 4) is None


def test_a_block_computed_twice_is_registered_once() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    a, b = request("a", list(range(9))), request("b", list(range(9)))
    # Both allocate before either registers: the scheduler does this when both
    # are admitted in one step before any lookup sees the other's blocks.
    assert manager.allocate_slots(a, 9) is not None
    assert manager.allocate_slots(b, 9) is not None
    pool = manager.block_pool
    assert pool.get_num_cached_blocks() == 2
    assert [blk.block_hash is not None for blk in manager.get_blocks("b")[0]] == [False, False, False]
    manager.free(a)
    manager.free(b)
    assert pool.get_num_free_blocks() == pool.num_usable_blocks and pool.get_num_cached_blocks() == 2


# ------------------------------------------------------------------ isolation and reset


def test_cache_salt_separates_identical_prompts() -> None:
    manager = KVCacheManager(num_blocks=32, block_size=BS, enable_caching=True)
    tokens = list(range(13))
    admit(manager, request("t1", tokens, salt="tenant-1"))
    assert manager.get_computed_blocks(request("t1b", tokens, salt="tenant-1"))[1] == 12
    assert manager.get_computed_blocks(request("t2", tokens, salt="tenant-2"))[1] == 0
    assert manager.get_computed_blocks(request("none", tokens))[1] == 0
    admit(manager, request("none2", tokens))
    assert manager.get_computed_blocks(request("none3", tokens))[1] == 12
    assert manager.get_computed_blocks(request("t3", tokens, salt="tenant-3"))[1] == 0


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    a = request("a", list(range(9)))
    admit(manager, a)
    assert not manager.reset_prefix_cache()
    assert manager.get_computed_blocks(request("b", list(range(9))))[1] == 8
    manager.free(a)
    assert manager.reset_prefix_cache()
    assert manager.block_pool.get_num_cached_blocks() == 0
    assert all(blk.block_hash is None for blk in manager.block_pool.blocks)
    assert manager.get_computed_blocks(request("c", list(range(9))))[1] == 0


def test_pool_evict_forgets_a_hash() -> None:
    pool = BlockPool(4, enable_caching=True)
    req = request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, req.block_hashes, 0, 2)
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]
    assert pool.evict(blocks[1]) and not pool.evict(blocks[1])
    assert pool.get_cached_block(req.block_hashes[1]) is None
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]


# ------------------------------------------------------------------ the scheduler with caching on


def cached_config(**overrides):
    return make_config(enable_prefix_caching=True, **overrides)


def shared_prefix_request(req_id: str, prefix_len: int, suffix_len: int, **params) -> Request:
    prefix = [(7 * i + 3) % 50 for i in range(prefix_len)]
    suffix = [100 + (len(req_id) * 13 + i) % 40 for i in range(suffix_len)]
    return Request(req_id, prefix + suffix, SamplingParams(**params))


def test_second_request_starts_from_the_cached_prefix_and_reports_it() -> None:
    h = Harness(cached_config(), num_blocks=40)
    h.add(shared_prefix_request("a", 16, 3, max_tokens=3))
    h.run()
    h.add(shared_prefix_request("bb", 16, 5, max_tokens=3))
    out = h.step()
    so = h.steps[-1]
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert so.num_scheduled_tokens == {"bb": 5}
    assert out[0].num_cached_tokens == 16
    stats = h.scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (19 + 21, 16)
    h.run()
    assert h.results["bb"].token_ids == expected_outputs("bb", 21, 3)
    h.assert_no_leak()


def test_requests_admitted_in_one_step_share_blocks_scheduled_in_that_step() -> None:
    h = Harness(cached_config(max_num_batched_tokens=64), num_blocks=40)
    h.add(shared_prefix_request("a", 12, 2, max_tokens=2))
    h.add(shared_prefix_request("bb", 12, 2, max_tokens=2))
    h.step()
    so = h.steps[0]
    assert so.num_scheduled_tokens == {"a": 14, "bb": 2}  # bb reuses a's first 3 blocks
    blocks = {n.req_id: n.block_ids[0] for n in so.scheduled_new_reqs}
    assert blocks["a"][:3] == blocks["bb"][:3]
    h.run()
    assert h.results["bb"].token_ids == expected_outputs("bb", 14, 2)
    h.assert_no_leak()


def test_preempted_request_resumes_from_its_still_cached_blocks() -> None:
    # 4 usable blocks of 4; a needs a third block at its second decode and
    # preempts b, whose first block stays cached (freed tail first).
    h = Harness(cached_config(max_model_len=16, max_num_seqs=2), num_blocks=5)
    h.add(Request("a", list(range(20, 28)), SamplingParams(max_tokens=2)))
    h.add(Request("b", list(range(30, 38)), SamplingParams(max_tokens=3)))
    h.step()
    h.step()
    assert h.steps[-1].preempted_req_ids == {"b"}
    h.run()
    resumed = [n for s in h.steps[2:] for n in s.scheduled_new_reqs if n.req_id == "b"]
    assert len(resumed) == 1 and resumed[0].num_computed_tokens == 4
    assert h.results["b"].token_ids == expected_outputs("b", 8, 3)
    assert EngineCoreEventType.PREEMPTED in h.results["b"].events
    h.assert_no_leak()


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_shared_prefixes_in_a_tiny_pool_all_finish_with_the_right_tokens(pipelined: bool) -> None:
    config = cached_config(max_model_len=32, block_size=2, max_num_batched_tokens=10, max_num_seqs=6)
    h = Harness(config, num_blocks=20)  # 19 usable blocks = 38 tokens for everyone
    specs = {f"r{i}": (6 + (3 * i) % 9, 1 + (5 * i) % 4, 2 + (7 * i) % 9) for i in range(10)}
    for req_id, (prefix, suffix, max_tokens) in specs.items():
        h.add(shared_prefix_request(req_id, prefix, suffix, max_tokens=max_tokens))
    h.run_pipelined() if pipelined else h.run()
    assert sum(len(s.preempted_req_ids) for s in h.steps) > 0
    assert h.scheduler.make_stats().prefix_cache_hits > 0
    for req_id, (prefix, suffix, max_tokens) in specs.items():
        assert h.results[req_id].token_ids == expected_outputs(req_id, prefix + suffix, max_tokens)
    h.assert_no_leak()
    assert not h.scheduler.kv_cache_manager.holds_requests()


def test_scheduler_reset_prefix_cache_refuses_while_running_unless_told() -> None:
    h = Harness(cached_config(), num_blocks=40)
    h.add(shared_prefix_request("a", 12, 1, max_tokens=5))
    h.step()
    h.admits_after_preemption = True  # a preempted outside the step comes straight back
    assert not h.scheduler.reset_prefix_cache()
    assert h.scheduler.kv_cache_manager.block_pool.get_num_cached_blocks() == 3
    assert h.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert h.scheduler.kv_cache_manager.block_pool.get_num_cached_blocks() == 0
    assert h.scheduler.get_request_counts() == (0, 1)
    h.step()
    so = h.steps[-1]
    assert so.preempted_req_ids == {"a"}  # the runner drops its old state...
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a"]  # ...and gets it back whole
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    h.run()
    assert h.results["a"].token_ids == expected_outputs("a", 13, 5)
    assert h.results["a"].events.count(EngineCoreEventType.PREEMPTED) == 1
    h.assert_no_leak()
    assert h.scheduler.reset_prefix_cache()


def test_abort_of_a_request_sharing_blocks_keeps_the_other_intact() -> None:
    h = Harness(cached_config(), num_blocks=40)
    h.add(shared_prefix_request("a", 12, 1, max_tokens=8))
    h.step()
    h.add(shared_prefix_request("bb", 12, 3, max_tokens=8))
    h.step()
    h.scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    h.run()
    assert h.results["bb"].token_ids == expected_outputs("bb", 15, 8)
    h.assert_no_leak()
