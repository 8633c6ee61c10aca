"""How the router picks workers: pure functions over a snapshot of worker load.

Prefill: prefix affinity — the hash of the prompt's first full blocks names a worker, so
prompts sharing a prefix land where it is already cached — unless that worker's load
exceeds the least-loaded one's by more than the imbalance threshold; then least loaded.
Decode: least KV usage, then fewest running requests.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass


@dataclass
class WorkerLoad:
    worker_id: str
    in_flight: int = 0  # requests the router has sent and not seen finish
    kv_usage: float = 0.0  # last reported used / total blocks
    num_running: int = 0  # last reported running requests


def prefix_key(token_ids: list[int], block_size: int, num_blocks: int) -> bytes | None:
    """Hash of the prompt's leading full blocks (None when it has no full block)."""
    n = min(len(token_ids) // block_size, num_blocks) * block_size
    if n == 0:
        return None
    return hashlib.blake2b(struct.pack(f"<{n}q", *token_ids[:n]), digest_size=8).digest()


def choose_prefill(loads: list[WorkerLoad], key: bytes | None, imbalance_threshold: int) -> WorkerLoad:
    least = min(loads, key=lambda w: (w.in_flight, w.worker_id))
    if key is None:
        return least
    ordered = sorted(loads, key=lambda w: w.worker_id)
    affine = ordered[int.from_bytes(key, "little") % len(ordered)]
    if affine.in_flight - least.in_flight > imbalance_threshold:
        return least
    return affine


def choose_decode(loads: list[WorkerLoad]) -> WorkerLoad:
    """Least KV usage (to 1 %), then fewest running + in-flight requests."""
    return min(loads, key=lambda w: (round(w.kv_usage, 2), w.num_running + w.in_flight, w.worker_id))
