"""Per-request block tables on top of the block pool, with prefix-cache lookups.

The scheduler asks three things: which leading blocks of a new request are already
cached (`get_computed_blocks`), whether the request's next tokens fit
(`allocate_slots`, which returns None rather than over-committing, so the caller can
preempt), and to give a request's blocks back (`free`).
"""

from __future__ import annotations

from kvray.engine.block_pool import BlockPool, KVCacheStats
from kvray.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[int]] = {}
        self.num_hashed: dict[str, int] = {}  # leading blocks of the request already indexed
        self.prefix_queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.prefix_hits = 0  # of which found cached

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Leading cached blocks of the request and the tokens they cover.

        At least one token is always left to compute: the model needs the last
        position's hidden state to sample, so a fully cached prompt hits one block less.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] = (), cache: bool = True
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `computed_blocks` are prefix hits for a request not yet holding blocks. Returns the
        newly allocated block ids, or None (nothing changed) when the pool cannot fit them.
        `cache=False` leaves the blocks out of the prefix-cache index (their contents are
        still to come, e.g. from a KV pull).
        """
        held = self.req_blocks.setdefault(request.request_id, [])
        num_hit_tokens = len(computed_blocks) * self.block_size
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        need = cdiv(total, self.block_size) - len(held) - len(computed_blocks)
        # hits that sit in cached_free stop being evictable once we take them
        evictable_hits = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_available - evictable_hits:
            if not held:
                del self.req_blocks[request.request_id]
            return None
        if not held and self.enable_caching and cache:  # first allocation: one prefix-cache query
            # (cache=False: contents that arrive from elsewhere, no lookup was made)
            self.prefix_queries += request.num_tokens
            self.prefix_hits += num_hit_tokens
        self.pool.touch(list(computed_blocks))
        held.extend(computed_blocks)
        new = self.pool.allocate(max(need, 0)) or []
        held.extend(new)
        if self.enable_caching and cache:
            self._cache_full_blocks(request, total)
        return new

    def _cache_full_blocks(self, request: Request, num_computed_after: int) -> None:
        """Index the blocks that will be full once this step's tokens are computed."""
        held = self.req_blocks[request.request_id]
        start = self.num_hashed.get(request.request_id, 0)
        end = min(num_computed_after // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache(held[i], request.block_hashes[i])
        self.num_hashed[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release all the request's blocks, last first (so tail blocks are evicted first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_hashed.pop(request.request_id, None)
        self.pool.release(list(reversed(blocks)))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the request's blocks past its first `num_tokens` positions (rejected
        drafts rolled back), last first. They were never indexed: only blocks full of
        known tokens are, and those all lie before a request's drafts."""
        held = self.req_blocks.get(request.request_id, [])
        keep = cdiv(num_tokens, self.block_size)
        if len(held) > keep:
            assert self.num_hashed.get(request.request_id, 0) <= keep, "trimming an indexed block"
            extra = held[keep:]
            del held[keep:]
            self.pool.release(list(reversed(extra)))

    def detach(self, request: Request) -> list[int]:
        """Take the request's blocks out of its table without releasing them (a pin)."""
        self.num_hashed.pop(request.request_id, None)
        return self.req_blocks.pop(request.request_id, [])

    def release(self, blocks: list[int]) -> None:
        """Release detached blocks, last first."""
        self.pool.release(list(reversed(blocks)))

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def stats(self) -> KVCacheStats:
        return self.pool.stats()
