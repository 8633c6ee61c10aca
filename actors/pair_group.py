"""Pairwise torch.distributed groups between two workers, made on first use.

No default process group is needed: the two peers meet through a TCPStore that the
decode side (rank 0) hosts on a free port, and each builds the same two-rank groups at
the same time. One process can hold many pairs. A pair has two groups:

* `data` carries KV blocks (gloo on CPU, NCCL on CUDA) and times out like a pull;
* `control` carries pull requests (gloo, tiny messages) and waits indefinitely between
  pulls: a peer that goes away closes it instead.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

CONTROL_TIMEOUT_S = 7 * 24 * 3600


@dataclass
class PairGroups:
    data: object  # ProcessGroupGloo | ProcessGroupNCCL
    control: object  # ProcessGroupGloo


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on a free port (read it back from `.port`)."""
    return dist.TCPStore(
        host, 0, 2, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_pair_groups(
    store: dist.Store | None, host: str, port: int, rank: int, key: str, backend: str, timeout_s: float
) -> PairGroups:
    """Build this rank's side of both groups; blocks until the peer builds its side."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, 2, False, timeout=timeout)
    data_store = dist.PrefixStore(f"{key}/data", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout  # a stuck pull fails (and recomputes), not NCCL's watchdog
        data = dist.ProcessGroupNCCL(data_store, rank, 2, options)
    else:
        data = dist.ProcessGroupGloo(data_store, rank, 2, timeout)
    control_timeout = datetime.timedelta(seconds=CONTROL_TIMEOUT_S)
    control = dist.ProcessGroupGloo(dist.PrefixStore(f"{key}/control", store), rank, 2, control_timeout)
    return PairGroups(data, control)
