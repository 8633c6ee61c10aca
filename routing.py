"""How the router picks workers: pure functions over a snapshot of worker load.

Prefill (and colocated `mixed`): prefix affinity by rendezvous hashing — the hash of the
prompt's first full blocks scores every worker id and the highest score wins, so prompts
sharing a prefix land where it is already cached, every Router replica with the same
members makes the same choice, and a pool that grows or shrinks by one worker moves only
the prefixes of that worker — unless the affine worker's load exceeds the least-loaded
one's by more than the imbalance threshold; then least loaded.
Decode: least KV usage, then fewest requests.

A module of its own below the router and the simulator (kvray.sim runs the same choices):
neither imports the other through it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass


@dataclass
class WorkerLoad:
    worker_id: str
    num_requests: int = 0  # running + waiting at the last report
    kv_usage: float = 0.0  # used / total blocks at the last report
    routed: int = 0  # requests this router sent it since that report

    @property
    def load(self) -> int:
        return self.num_requests + self.routed


def prefix_key(token_ids: list[int], block_size: int, num_blocks: int) -> bytes | None:
    """Hash of the prompt's leading full blocks (None when it has no full block)."""
    n = min(len(token_ids) // block_size, num_blocks) * block_size
    if n == 0:
        return None
    return hashlib.blake2b(struct.pack(f"<{n}q", *token_ids[:n]), digest_size=8).digest()


def affine_worker(worker_ids: list[str], key: bytes) -> str:
    """The worker a prefix belongs to: the highest rendezvous score of (key, worker id)."""
    return max(worker_ids, key=lambda w: hashlib.blake2b(key + w.encode(), digest_size=8).digest())


def choose_prefill(loads: list[WorkerLoad], key: bytes | None, imbalance_threshold: int) -> WorkerLoad:
    least = min(loads, key=lambda w: (w.load, w.worker_id))
    if key is None:
        return least
    chosen = affine_worker([w.worker_id for w in loads], key)
    affine = next(w for w in loads if w.worker_id == chosen)
    if affine.load - least.load > imbalance_threshold:
        return least
    return affine


def choose_decode(loads: list[WorkerLoad]) -> WorkerLoad:
    """Least KV usage (to 1 %), then fewest requests."""
    return min(loads, key=lambda w: (round(w.kv_usage, 2), w.load, w.worker_id))
