"""How a model is cut into tensor- and pipeline-parallel shards, and the collectives
the parallel layers call.

A worker of `tp x pp` shards numbers them `rank = pp_rank * tp + tp_rank`: stage
`pp_rank` holds a contiguous range of layers, and inside a stage, tensor-parallel rank
`tp_rank` holds a contiguous range of KV heads (with the query heads of their groups), of
the MLP's intermediate columns and of the vocabulary. Ranges may be uneven (SmolLM2's 3
KV heads over tp=2 give 2 + 1); when tp exceeds the KV heads, each KV head is replicated
on tp / num_kv_heads ranks that split its query heads.

Every function here is pure arithmetic on the config, so every process computes the same
partition without talking to the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvray.errors import InvalidArgumentError


def even_split(n: int, parts: int, index: int) -> range:
    """The `index`-th of `parts` contiguous ranges covering range(n); earlier ones get the
    remainder, so sizes differ by at most one."""
    size, extra = divmod(n, parts)
    start = index * size + min(index, extra)
    return range(start, start + size + (1 if index < extra else 0))


@dataclass(frozen=True)
class ShardSpec:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0  # pp_rank * tp_size + tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def sampler_rank(self) -> int:
        """The rank that samples: tensor rank 0 of the last stage (rank 0 when pp == 1)."""
        return (self.pp_size - 1) * self.tp_size

    def with_rank(self, rank: int) -> ShardSpec:
        return ShardSpec(self.tp_size, self.pp_size, rank)

    def stage_peer(self, pp_rank: int) -> int:
        """The rank holding this rank's tensor slice in stage `pp_rank`."""
        return pp_rank * self.tp_size + self.tp_rank

    def layers(self, num_layers: int) -> range:
        if num_layers < self.pp_size:
            raise InvalidArgumentError(
                "pipeline_parallel_size", self.pp_size, f"[1, {num_layers}] (the model's layers)"
            )
        return even_split(num_layers, self.pp_size, self.pp_rank)

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> range:
        """The KV heads this rank holds (one replicated head when tp > num_kv_heads)."""
        self.check_heads(num_heads, num_kv_heads)
        if num_kv_heads >= self.tp_size:
            return even_split(num_kv_heads, self.tp_size, self.tp_rank)
        head = self.tp_rank // (self.tp_size // num_kv_heads)
        return range(head, head + 1)

    def q_heads(self, num_heads: int, num_kv_heads: int) -> range:
        """The query heads this rank holds: those of its KV heads' groups."""
        group = num_heads // num_kv_heads
        kv = self.kv_heads(num_heads, num_kv_heads)
        if num_kv_heads >= self.tp_size:
            return range(kv.start * group, kv.stop * group)
        replicas = self.tp_size // num_kv_heads
        part = even_split(group, replicas, self.tp_rank % replicas)
        return range(kv.start * group + part.start, kv.start * group + part.stop)

    def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
        tp = self.tp_size
        if num_kv_heads < tp and (tp % num_kv_heads or num_heads // num_kv_heads < tp // num_kv_heads):
            raise InvalidArgumentError(
                "tensor_parallel_size",
                tp,
                f"at most {num_kv_heads} (the model's KV heads), or a multiple of it that "
                f"leaves every rank a query head (at most {num_heads})",
            )

    def columns(self, n: int) -> range:
        """This rank's slice of a tensor-parallel dimension (MLP intermediate size)."""
        return even_split(n, self.tp_size, self.tp_rank)

    def vocab(self, vocab_size: int) -> range:
        """Equal slices of ceil(vocab / tp) rows (the last may be short), so the logits'
        all-gather moves equal-sized tensors."""
        per = -(-vocab_size // self.tp_size)
        start = min(self.tp_rank * per, vocab_size)
        return range(start, min(start + per, vocab_size))


class ShardContext:
    """A shard's place in its worker group plus the tensor-parallel collectives.

    The default is a single-device model: every collective is the identity.
    `tp_group` is this stage's tensor-parallel process group (None when tp == 1).
    With `p2p_collectives` (gloo) the all-reduce and all-gather are point-to-point
    exchanges: every rank sends its part to every other and sums the parts in rank order
    (the same order on every rank, so all ranks keep bitwise-equal activations). For
    the small activations of a decode step this costs one message latency, where gloo's
    own all-reduce takes several (measured: ~0.09 ms against ~1.2 ms between two local
    processes, `benchmarks/tensor_parallel.py`).
    """

    def __init__(self, spec: ShardSpec | None = None, tp_group=None, cpu_group=None, p2p_collectives=False):
        self.spec = spec or ShardSpec()
        self.tp_group = tp_group
        self.cpu_group = cpu_group  # world group for pickled step metadata (gloo)
        self.p2p_collectives = p2p_collectives
        stage = self.spec.pp_rank * self.spec.tp_size
        self.tp_ranks = [stage + i for i in range(self.spec.tp_size)]  # global ranks

    @property
    def tp_size(self) -> int:
        return self.spec.tp_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the stage's tensor ranks."""
        if self.tp_size == 1:
            return x
        if not self.p2p_collectives:
            dist.all_reduce(x, group=self.tp_group)
            return x
        parts = self._exchange(x)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def all_gather_last(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """Concatenate every tensor rank's `x` along the last dim; each rank's part is
        padded to `width` columns for the collective, then the padding is dropped by the
        caller (parts are in rank order)."""
        if self.tp_size == 1:
            return x
        padded = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        padded = padded.contiguous()
        if self.p2p_collectives:
            parts = self._exchange(padded)
        else:
            parts = [torch.empty_like(padded) for _ in range(self.tp_size)]
            dist.all_gather(parts, padded, group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor rank's `x`, in rank order (this rank's is `x` itself)."""
        x = x.contiguous()
        me = self.spec.rank
        parts = [x if r == me else torch.empty_like(x) for r in self.tp_ranks]
        works = [dist.isend(x, r, group=self.tp_group) for r in self.tp_ranks if r != me]
        works += [dist.irecv(p, r, group=self.tp_group) for p, r in zip(parts, self.tp_ranks) if r != me]
        for work in works:
            work.wait()
        return parts
