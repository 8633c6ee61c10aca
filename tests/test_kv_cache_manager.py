"""KVCacheManager and Request's chained block hashes, with block_size 4 and tiny pools.

Block ids are traced by hand: a fresh pool hands out free blocks in id order.
"""

from __future__ import annotations

import pytest

from kvray.engine.kv_cache_manager import KVCacheManager
from kvray.engine.request import Request, hash_block
from kvray.engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], **kw) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(temperature=0.0),
        eos_token_ids=frozenset({0}),
        block_size=BS,
        **kw,
    )


def admit(kv: KVCacheManager, req: Request) -> tuple[list[int], int]:
    """What the scheduler does for a new request: look up hits, allocate the rest."""
    hits, num_hit_tokens = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return hits, num_hit_tokens


def check(kv: KVCacheManager, *, free: int, cached_free: int, used: int) -> None:
    s = kv.stats()
    assert (s.free_blocks, s.cached_free_blocks, s.used_blocks) == (free, cached_free, used)
    assert s.free_blocks + s.cached_free_blocks + s.used_blocks == s.total_blocks
    kv.pool.check_integrity()


# ---- Request block hashes -------------------------------------------------------------


def test_request_hashes_only_full_blocks_and_chains_them():
    req = make_request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    h0 = hash_block(None, [1, 2, 3, 4])
    h1 = hash_block(h0, [5, 6, 7, 8])
    assert req.block_hashes == [h0, h1]  # the 9th token is in no full block yet
    assert h1 != hash_block(None, [5, 6, 7, 8])  # the parent is part of the hash
    for t in (10, 11):
        req.append_token(t)
    assert len(req.block_hashes) == 2  # 11 tokens: still 2 full blocks
    req.append_token(12)
    assert req.block_hashes[2] == hash_block(h1, [9, 10, 11, 12])
    assert req.num_tokens == 12 and req.num_output_tokens == 3


def test_hash_block_depends_on_tokens_order_and_extra_keys():
    base = hash_block(None, [1, 2, 3, 4])
    assert base == hash_block(None, [1, 2, 3, 4])
    assert base != hash_block(None, [1, 2, 4, 3])
    assert base != hash_block(None, [1, 2, 3, 4], ("lora-a",))
    salted = make_request("s", [1, 2, 3, 4], extra_keys=("lora-a",))
    assert salted.block_hashes == [hash_block(None, [1, 2, 3, 4], ("lora-a",))]


# ---- prefix hits ----------------------------------------------------------------------


def test_new_request_has_no_hits_and_gets_blocks_in_order():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(1, 11)))  # 10 tokens -> 3 blocks
    hits, n = kv.get_computed_blocks(req)
    assert (hits, n) == ([], 0)
    assert kv.allocate_slots(req, 10, hits) == [0, 1, 2]
    assert kv.block_ids("a") == [0, 1, 2]
    check(kv, free=5, cached_free=0, used=3)


def test_chained_hashes_same_first_block_different_second_hits_one_block():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, a)  # blocks 0, 1 (full, cached), 2 (partial)

    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 99, 9])
    hits, n = kv.get_computed_blocks(b)
    assert (hits, n) == ([0], 4)

    # same tokens as a's second block but a different first block: the chain breaks at 0
    c = make_request("c", [50, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(c) == ([], 0)

    d = make_request("d", [1, 2, 3, 4, 5, 6, 7, 8, 77, 78])
    assert kv.get_computed_blocks(d) == ([0, 1], 8)


def test_full_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # exactly two full blocks
    admit(kv, make_request("a", prompt))
    # (8 - 1) // 4 = 1: only the first block may hit; the last 4 tokens are recomputed
    assert kv.get_computed_blocks(make_request("b", prompt)) == ([0], 4)
    # with one more token both blocks hit and 1 token is left
    assert kv.get_computed_blocks(make_request("c", prompt + [9])) == ([0, 1], 8)


def test_no_hits_when_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    admit(kv, make_request("a", prompt))
    assert kv.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    assert kv.pool.hash_to_block == {}
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)
    kv.free(make_request("a", prompt))
    check(kv, free=8, cached_free=0, used=0)


def test_shared_hit_block_is_ref_counted_across_requests():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(kv, a)  # a holds [0, 1]
    b = make_request("b", [1, 2, 3, 4, 6])
    hits, _ = admit(kv, b)
    assert hits == [0]
    assert kv.block_ids("b") == [0, 2]
    assert kv.pool.ref_cnt[0] == 2
    check(kv, free=5, cached_free=0, used=3)
    kv.free(a)
    assert kv.pool.ref_cnt[0] == 1  # still held by b
    check(kv, free=6, cached_free=0, used=2)
    kv.free(b)
    check(kv, free=7, cached_free=1, used=0)


# ---- allocate_slots -------------------------------------------------------------------


def test_allocate_slots_grows_by_one_block_when_a_block_fills():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(kv, req)  # 6 tokens: blocks [0, 1]
    req.append_token(7)
    assert kv.allocate_slots(req, 1) == []  # token 7 fits in block 1
    req.num_computed_tokens += 1
    req.append_token(8)
    assert kv.allocate_slots(req, 1) == []  # token 8 fills block 1
    req.num_computed_tokens += 1
    req.append_token(9)
    assert kv.allocate_slots(req, 1) == [2]  # token 9 needs a third block
    assert kv.block_ids("a") == [0, 1, 2]
    # block 1 became full with token 8 and is now in the index under its chained hash
    assert kv.pool.lookup(req.block_hashes[1]) == 1


def test_allocate_slots_returns_none_without_changing_anything():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    admit(kv, a)  # blocks [0, 1]
    b = make_request("b", [9] * 5)  # needs 2 blocks, 1 is available
    queries, hits = kv.prefix_queries, kv.prefix_hits
    ref_before = list(kv.pool.ref_cnt)

    assert kv.allocate_slots(b, 5) is None

    assert kv.block_ids("b") == []
    assert "b" not in kv.req_blocks
    assert kv.pool.ref_cnt == ref_before
    assert (kv.prefix_queries, kv.prefix_hits) == (queries, hits)
    check(kv, free=1, cached_free=0, used=2)
    # a running request that cannot grow keeps what it holds
    a.append_token(10)
    a.num_computed_tokens = 8
    kv.free(make_request("z", []))  # freeing an unknown request is a no-op
    assert kv.allocate_slots(a, 1) == [2]
    a.append_token(11)
    # (pretend the block table needs more than the pool has)
    assert kv.allocate_slots(a, 9) is None
    assert kv.block_ids("a") == [0, 1, 2]
    check(kv, free=0, cached_free=0, used=3)


def test_hits_in_cached_free_do_not_count_as_available_room():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    a = make_request("a", prompt + [9])
    admit(kv, a)  # blocks [0, 1, 2]; 0 and 1 are full and cached
    kv.free(a)
    check(kv, free=1, cached_free=2, used=0)

    # 13 tokens: hits [0, 1] (8 tokens); 5 more need 2 blocks, but taking the 2 hits out of
    # cached_free leaves only 1 block to allocate from -> None, nothing taken
    big = make_request("big", prompt + [20, 21, 22, 23, 24])
    hits, n = kv.get_computed_blocks(big)
    assert (hits, n) == ([0, 1], 8)
    assert kv.allocate_slots(big, 5, hits) is None
    assert kv.pool.ref_cnt == [0, 0, 0]
    check(kv, free=1, cached_free=2, used=0)

    # 12 tokens: the same 2 hits and 4 more tokens need exactly 1 block -> fits
    fit = make_request("fit", prompt + [20, 21, 22, 23])
    hits, n = kv.get_computed_blocks(fit)
    assert kv.allocate_slots(fit, 4, hits) == [2]
    assert kv.block_ids("fit") == [0, 1, 2]
    check(kv, free=0, cached_free=0, used=3)


# ---- freeing and reuse ----------------------------------------------------------------


def test_freed_request_blocks_become_cached_free_and_are_hit_again():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(1, 10))  # 9 tokens: 2 full blocks + 1 partial
    a = make_request("a", prompt)
    admit(kv, a)
    check(kv, free=5, cached_free=0, used=3)
    kv.free(a)
    # full blocks keep their hash (cached_free); the partial block 2 has none (free)
    check(kv, free=6, cached_free=2, used=0)
    assert kv.block_ids("a") == []

    b = make_request("b", prompt)
    hits, n = admit(kv, b)
    assert (hits, n) == ([0, 1], 8)
    assert kv.block_ids("b")[:2] == [0, 1]
    check(kv, free=5, cached_free=0, used=3)


def test_prefix_query_and_hit_counters_count_prompt_tokens_once_per_request():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(1, 10))
    a = make_request("a", prompt)
    admit(kv, a)
    assert (kv.prefix_queries, kv.prefix_hits) == (9, 0)
    a.append_token(50)
    kv.allocate_slots(a, 1)  # a later step of the same request is no new query
    assert (kv.prefix_queries, kv.prefix_hits) == (9, 0)
    b = make_request("b", prompt)
    admit(kv, b)
    assert (kv.prefix_queries, kv.prefix_hits) == (18, 8)
    c = make_request("c", [1, 2, 3, 4, 70, 71])
    admit(kv, c)
    assert (kv.prefix_queries, kv.prefix_hits) == (24, 12)


def test_free_releases_blocks_last_first_so_the_tail_is_evicted_first():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(1, 13)))  # 12 tokens: blocks 0, 1, 2 all full
    admit(kv, a)
    kv.free(a)
    assert list(kv.pool.cached_free) == [2, 1, 0]  # oldest first: the tail
    check(kv, free=0, cached_free=3, used=0)

    other = make_request("x", [90, 91, 92])
    assert kv.allocate_slots(other, 3) == [2]  # the tail block is evicted first
    # the first two blocks of a's prompt are still a hit
    again = make_request("again", list(range(1, 13)))
    assert kv.get_computed_blocks(again) == ([0, 1], 8)


@pytest.mark.parametrize("num_blocks", [2, 5])
def test_every_block_comes_back_after_all_requests_are_freed(num_blocks):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS)
    reqs = [make_request(f"r{i}", [i + 1] * 4 + [100]) for i in range(num_blocks)]
    admitted = []
    for r in reqs:
        hits, n = kv.get_computed_blocks(r)
        if kv.allocate_slots(r, r.num_tokens - n, hits) is not None:
            admitted.append(r)
    assert len(admitted) == num_blocks // 2  # each needs 2 blocks
    for r in admitted:
        kv.free(r)
    s = kv.stats()
    assert s.used_blocks == 0
    assert s.cached_free_blocks == num_blocks // 2  # one full block per request
    kv.pool.check_integrity()
