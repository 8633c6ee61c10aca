"""The pool of KV-cache blocks: ref counts, the prefix-cache index and LRU eviction.

Every block is in exactly one of three states::

    used         ref_cnt > 0                      (held by requests, or pinned)
    cached_free  ref_cnt == 0, has a block hash    (reusable by a prefix hit until evicted)
    free         ref_cnt == 0, no hash

so `free + cached_free + used == total` always. New blocks come from `free` first and
only then evict cached_free blocks, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class KVCacheStats:
    total_blocks: int
    used_blocks: int
    cached_free_blocks: int
    free_blocks: int

    def __getitem__(self, key: str) -> int:  # stats["used_blocks"] works too
        return getattr(self, key)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.num_evictions = 0

    @property
    def num_available(self) -> int:
        """Blocks a request could get right now (free or evictable)."""
        return len(self.free) + len(self.cached_free)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref 1, or None (nothing taken) when fewer are available."""
        if n > self.num_available:
            return None
        blocks = []
        for _ in range(n):
            if self.free:
                block, _ = self.free.popitem(last=False)
            else:
                block, _ = self.cached_free.popitem(last=False)
                del self.hash_to_block[self.block_hash[block]]
                self.block_hash[block] = None
                self.num_evictions += 1
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def lookup(self, block_hash: bytes) -> int | None:
        return self.hash_to_block.get(block_hash)

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference to each block (a prefix-cache hit or a shared block)."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                self.cached_free.pop(block)
            self.ref_cnt[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference each; blocks reaching 0 become free or cached_free, in order."""
        for block in blocks:
            assert self.ref_cnt[block] > 0, f"block {block} released more than taken"
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                if self.block_hash[block] is None:
                    self.free[block] = None
                else:
                    self.cached_free[block] = None

    def cache(self, block: int, block_hash: bytes) -> None:
        """Index a full, computed block under its chained hash (first block wins a tie)."""
        if self.block_hash[block] is None and block_hash not in self.hash_to_block:
            self.block_hash[block] = block_hash
            self.hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached_free block (used blocks keep their hashes)."""
        for block in list(self.cached_free):
            del self.hash_to_block[self.block_hash[block]]
            self.block_hash[block] = None
            self.free[block] = None
        self.cached_free.clear()

    def stats(self) -> KVCacheStats:
        free, cached = len(self.free), len(self.cached_free)
        return KVCacheStats(self.num_blocks, self.num_blocks - free - cached, cached, free)

    def check_integrity(self) -> None:
        used = sum(1 for r in self.ref_cnt if r > 0)
        assert used + len(self.free) + len(self.cached_free) == self.num_blocks
        assert all(self.ref_cnt[b] == 0 and self.block_hash[b] is None for b in self.free)
        assert all(self.ref_cnt[b] == 0 and self.block_hash[b] is not None for b in self.cached_free)
        assert all(self.block_hash[b] == h for h, b in self.hash_to_block.items())
