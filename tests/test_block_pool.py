"""BlockPool: ref counts, the prefix-cache index and LRU eviction, with small hand-traced pools.

Every test ends with `check_integrity()` and the invariant `free + cached_free + used == total`.
"""

from __future__ import annotations

import pytest

from kvray.engine.block_pool import BlockPool


def h(name: str) -> bytes:
    """A stand-in block hash (the pool treats hashes as opaque keys)."""
    return name.encode()


def assert_stats(pool: BlockPool, *, free: int, cached_free: int, used: int) -> None:
    s = pool.stats()
    assert (s.free_blocks, s.cached_free_blocks, s.used_blocks) == (free, cached_free, used)
    assert s.free_blocks + s.cached_free_blocks + s.used_blocks == s.total_blocks == pool.num_blocks
    assert s["used_blocks"] == used  # dict-style access used by metrics code
    pool.check_integrity()


def test_fresh_pool_is_all_free():
    pool = BlockPool(5)
    assert pool.num_available == 5
    assert_stats(pool, free=5, cached_free=0, used=0)
    assert pool.stats().usage == 0.0


def test_allocate_takes_free_blocks_in_id_order_with_ref_1():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.ref_cnt == [1, 1, 1, 0]
    assert_stats(pool, free=1, cached_free=0, used=3)
    assert pool.stats().usage == 0.75


def test_allocate_zero_returns_empty_list():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert_stats(pool, free=2, cached_free=0, used=0)


def test_allocate_prefers_free_blocks_over_evicting_cached_ones():
    pool = BlockPool(4)
    a = pool.allocate(2)  # [0, 1]
    pool.cache(a[0], h("A0"))
    pool.cache(a[1], h("A1"))
    pool.release(a)  # 0 and 1 become cached_free; 2 and 3 are free
    assert_stats(pool, free=2, cached_free=2, used=0)

    assert pool.allocate(2) == [2, 3]  # free first: nothing evicted
    assert pool.num_evictions == 0
    assert pool.lookup(h("A0")) == 0 and pool.lookup(h("A1")) == 1
    assert_stats(pool, free=0, cached_free=2, used=2)

    assert pool.allocate(1) == [0]  # only now a cached block is evicted
    assert pool.num_evictions == 1
    assert pool.lookup(h("A0")) is None  # its hash left the index
    assert pool.block_hash[0] is None
    assert pool.lookup(h("A1")) == 1
    assert_stats(pool, free=0, cached_free=1, used=3)


def test_eviction_is_least_recently_released_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)  # [0, 1, 2]
    for b in blocks:
        pool.cache(b, h(f"B{b}"))
    # release in the order 2, 0, 1: the LRU order of cached_free is 2, 0, 1
    pool.release([2])
    pool.release([0])
    pool.release([1])
    assert list(pool.cached_free) == [2, 0, 1]
    assert_stats(pool, free=0, cached_free=3, used=0)

    assert pool.allocate(1) == [2]
    assert pool.allocate(1) == [0]
    assert pool.allocate(1) == [1]
    assert pool.num_evictions == 3
    assert pool.hash_to_block == {}
    assert_stats(pool, free=0, cached_free=0, used=3)


def test_touching_a_cached_block_refreshes_its_place_in_the_lru_order():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    pool.cache(0, h("X"))
    pool.cache(1, h("Y"))
    pool.release(blocks)  # LRU order 0, 1
    pool.touch([0])  # a prefix hit takes block 0 back out of cached_free
    assert pool.ref_cnt[0] == 1
    assert list(pool.cached_free) == [1]
    assert_stats(pool, free=0, cached_free=1, used=1)
    pool.release([0])  # now released after 1: order 1, 0
    assert list(pool.cached_free) == [1, 0]
    assert pool.allocate(1) == [1]
    assert pool.lookup(h("X")) == 0  # the refreshed block survived
    assert_stats(pool, free=0, cached_free=1, used=1)


def test_touch_and_release_count_references():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch([b])
    pool.touch([b])
    assert pool.ref_cnt[b] == 3
    pool.release([b])
    pool.release([b])
    assert pool.ref_cnt[b] == 1
    assert_stats(pool, free=2, cached_free=0, used=1)  # still held once
    pool.release([b])
    assert pool.ref_cnt[b] == 0
    assert_stats(pool, free=3, cached_free=0, used=0)
    with pytest.raises(AssertionError):
        pool.release([b])  # released more than taken


def test_released_unhashed_block_goes_to_free_and_hashed_one_to_cached_free():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(b, h("B"))
    pool.release([a, b])
    assert list(pool.free) == [a]
    assert list(pool.cached_free) == [b]
    assert_stats(pool, free=1, cached_free=1, used=0)


def test_cache_first_block_wins():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, h("same"))
    pool.cache(b, h("same"))  # another block with the same content: not indexed
    assert pool.lookup(h("same")) == a
    assert pool.block_hash[b] is None
    pool.cache(a, h("other"))  # a block keeps its first hash
    assert pool.block_hash[a] == h("same")
    assert pool.lookup(h("other")) is None
    pool.cache(c, h("other"))
    assert pool.lookup(h("other")) == c
    pool.release([a, b, c])
    assert list(pool.free) == [b]
    assert list(pool.cached_free) == [a, c]
    assert_stats(pool, free=1, cached_free=2, used=0)


def test_lookup_of_unknown_hash_is_none():
    pool = BlockPool(1)
    assert pool.lookup(h("missing")) is None


def test_allocate_returns_none_and_takes_nothing_when_short():
    pool = BlockPool(4)
    held = pool.allocate(2)
    pool.cache(held[0], h("H0"))
    pool.release([held[0]])  # 1 cached_free, 1 used, 2 free -> 3 available
    assert pool.num_available == 3
    before = (list(pool.ref_cnt), list(pool.free), list(pool.cached_free), dict(pool.hash_to_block))

    assert pool.allocate(4) is None

    after = (list(pool.ref_cnt), list(pool.free), list(pool.cached_free), dict(pool.hash_to_block))
    assert after == before
    assert pool.num_evictions == 0
    assert_stats(pool, free=2, cached_free=1, used=1)
    assert pool.allocate(3) == [2, 3, 0]  # exactly what was available: free then evicted
    assert_stats(pool, free=0, cached_free=0, used=4)


def test_reset_prefix_cache_frees_cached_blocks_but_keeps_used_hashes():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, h("A"))
    pool.cache(b, h("B"))
    pool.release([a])  # a cached_free; b used with a hash; c used without one
    pool.reset_prefix_cache()
    assert pool.lookup(h("A")) is None
    assert pool.lookup(h("B")) == b
    assert list(pool.free) == [a]
    assert_stats(pool, free=1, cached_free=0, used=2)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda p: p.free.pop(0),  # a block in no state
        lambda p: p.block_hash.__setitem__(0, h("stray")),  # a free block with a hash
        lambda p: p.hash_to_block.__setitem__(h("ghost"), 1),  # index points at wrong block
    ],
    ids=["lost-block", "free-with-hash", "stale-index"],
)
def test_check_integrity_catches_corruption(corrupt):
    pool = BlockPool(3)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_cached_free_block_without_hash():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, h("A"))
    pool.release([a])
    pool.check_integrity()
    pool.block_hash[a] = None
    with pytest.raises(AssertionError):
        pool.check_integrity()
