"""Pairwise torch.distributed groups between two workers, made on first use.

No default process group is needed: the two peers meet through a TCPStore that the
decode side (rank 0) hosts on a free port, and each builds the same two-rank group at
the same time (gloo on CPU, NCCL on CUDA). One process can hold many such groups.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on a free port (read it back from `.port`)."""
    return dist.TCPStore(host, 0, 2, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_group(store: dist.Store | None, host: str, port: int, rank: int, key: str,
               backend: str, timeout_s: float):
    """Build this rank's side of the pair group; blocks until the peer builds its side."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, 2, False, timeout=timeout)
    prefixed = dist.PrefixStore(key, store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, 2, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
