"""The prefix-affinity map: longest known prefix, salts, forgetting, and its bound."""

from __future__ import annotations

from core.prefix_affinity import PrefixAffinity


def test_the_longest_known_block_prefix_wins() -> None:
    affinity = PrefixAffinity(block_size=4)
    a = list(range(12))  # three whole blocks
    assert len(affinity.keys(a)) == 3 and affinity.keys(a[:7]) == affinity.keys(a)[:1]
    assert affinity.lookup(affinity.keys(a)) == (-1, 0)
    affinity.record(affinity.keys(a[:8]), engine=1)
    assert affinity.lookup(affinity.keys(a)) == (1, 2)
    affinity.record(affinity.keys(a), engine=0)  # the latest engine to get a prefix owns it
    assert affinity.lookup(affinity.keys(a)) == (0, 3)
    other = [99, *a[1:]]  # differs in the first block: nothing in common
    assert affinity.lookup(affinity.keys(other)) == (-1, 0)
    assert affinity.lookup(affinity.keys(a, salt="tenant")) == (-1, 0)


def test_forgetting_an_engine_and_the_bound() -> None:
    affinity = PrefixAffinity(block_size=2, capacity=4)
    affinity.record(affinity.keys([1, 2, 3, 4]), engine=0)
    affinity.record(affinity.keys([5, 6, 7, 8]), engine=1)
    assert len(affinity) == 4
    affinity.record(affinity.keys([9, 10]), engine=1)
    assert len(affinity) == 4 and affinity.lookup(affinity.keys([1, 2])) == (-1, 0)  # the oldest went
    affinity.forget_engine(1)
    assert affinity.lookup(affinity.keys([5, 6, 7, 8])) == (-1, 0) and len(affinity) == 1
