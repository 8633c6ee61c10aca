"""The torch attention backend: the engine's attention on CPUs (and any device without Triton).

Same cache layout and semantics as the Triton kernels, organised for few large torch
calls per layer:

* decode rows (q_len == 1, and each row of a short query such as a decode verifying
  drafts) go to the native CPU kernel (kernels/cpu_decode.c: reads K/V straight from
  their blocks, one pass) where it is built and the cache is fp32; else
  through batched matmuls, sequences of similar context length grouped together so
  little time goes to padding;
* a prefill chunk with no cached prefix attends to its own fresh K/V (no cache read);
* a prefill chunk after a cached prefix reads its context through its block table;
  either runs the native CPU kernel (kernels/cpu_prefill.c) where it is built, else SDPA.

Everything that depends only on the batch (groups, gather indices, masks) is built once
per step, in `prepare` (the torch path's decode groups at the first layer that uses them),
and reused by every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvray.kernels import cpu_native
from kvray.kernels.backend import AttentionBackend, AttentionMetadata, register_backend
from kvray.kernels.kv_quant import dequantize, quant_of, quantize
from kvray.kernels.reference import context_mask

# A decode group costs a fixed number of calls per layer; splitting is worth it only when
# it saves more padded context positions than this (measured on a 2-core CPU).
_GROUP_COST_TOKENS = 1024
_MAX_DECODE_GROUPS = 4
# Queries of at most this many tokens attend a row at a time, like decodes (a decode
# verifying drafts is 1 + k tokens, k <= 16 in SpeculativeConfig); longer ones take the
# prefill path. Every verification then runs the decode kernels, whose rows round as in
# a one-row step: greedy speculation gives plain decoding's tokens in bf16 too.
_SHORT_QUERY = 17


@dataclass(frozen=True)
class _DecodeRow:
    row: int  # its q row in the step
    seq: int  # its sequence (block table)
    seq_len: int  # the context it sees, its own position included


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # int64 [Sg]: q rows of the group's sequences
    blocks: torch.Tensor  # int64 [Sg * nb]: their block tables, flattened (padded with 0)
    bias: torch.Tensor  # fp32 [Sg, 1, nb * block_size]: 0 where a key exists, -inf past the end
    lens: torch.Tensor  # int64 [Sg, 1, 1]: context lengths (for sliding windows)
    cast: dict = field(default_factory=dict)  # bias in the activations' dtype, made once a step

    def bias_as(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self.cast:
            self.cast[dtype] = self.bias.to(dtype)
        return self.cast[dtype]


@dataclass
class _PrefillPlan:
    lo: int  # first q row
    hi: int  # one past the last q row
    slots: torch.Tensor | None  # int64 [seq_len] context slots; None: fresh K/V only
    mask: torch.Tensor | None  # bool [q_len, seq_len]; None: plain causal


@dataclass
class _NativeDecode:
    """Every decode sequence of the step, for the native kernel."""

    rows: torch.Tensor  # int64 [Sd]: their q rows
    block_tables: torch.Tensor  # int32 [Sd, nb], contiguous
    seq_lens: torch.Tensor  # int32 [Sd]


@dataclass
class _Plan:
    prefills: list[_PrefillPlan]
    native: _NativeDecode | None  # None: the kernel is not built here, or no decode rows
    make_groups: Callable[[], list[_DecodeGroup]]  # the torch path's decode groups
    groups: list[_DecodeGroup] | None = None

    def decode_groups(self) -> list[_DecodeGroup]:
        """Built at the first layer that needs them (never, when the native kernel runs)."""
        if self.groups is None:
            self.groups = self.make_groups()
        return self.groups


def decode_only(meta) -> _NativeDecode | None:
    """The native kernel's view of this step's rows when every one of them is a decode row
    (the fused decode layers take such a step whole); else None."""
    plan = getattr(meta, "plan", None)
    if not isinstance(plan, _Plan) or plan.prefills or plan.native is None:
        return None
    return plan.native if len(plan.native.rows) == len(meta.slot_mapping) else None


def split_by_length(lengths: list[int], group_cost: int, max_groups: int) -> list[int]:
    """Cut points splitting ascending `lengths` into groups that minimise padded work.

    Each group is padded to its longest member: cost = sum(size * max) + group_cost per
    group. Returns the exclusive end index of each group (the last is len(lengths)); of
    equally cheap splits, the one with the fewest groups.

    A dynamic program over (groups used, items covered), each round one [start, end)
    table: O(max_groups * n^2) work in a few tensor ops, not Python loops (n is a step's
    decode rows: hundreds at a wide batch, every step)."""
    n = len(lengths)
    longest = torch.tensor(lengths, dtype=torch.float64)  # ascending: a group's last is its max
    covered = torch.arange(n + 1, dtype=torch.float64)
    size = covered[1:].view(1, n) - covered[:n].view(n, 1)  # [start, end - 1] -> end - start
    span = (size * longest.view(1, n) + group_cost).masked_fill(size <= 0, float("inf"))
    best = torch.full((n + 1,), float("inf"), dtype=torch.float64)
    best[0] = 0.0  # best[i]: the cheapest cover of the first i items with the groups so far
    starts, best_cost, num_groups = [], float("inf"), 0
    for g in range(1, max_groups + 1):
        cost, start = (best[:n].view(n, 1) + span).min(dim=0)  # per end: the best last cut
        best = torch.cat([best.new_full((1,), float("inf")), cost])
        starts.append(start.tolist())
        if (total := best[n].item()) < best_cost:
            best_cost, num_groups = total, g
    ends, end = [], n
    for g in range(num_groups, 0, -1):
        ends.append(end)
        end = starts[g - 1][end - 1]
    return ends[::-1]


@register_backend("torch")
class TorchBackend(AttentionBackend):
    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        block_tables = meta.block_tables.cpu()
        starts = meta.cu_seqlens_q.tolist()
        # Short queries (decodes, and decodes verifying drafts) run a row at a time: row j
        # of a q_len-token query sees the context up to and including its own position,
        # which is causal attention over the cache (this step's K/V are in it already).
        decode_rows = sorted(
            (
                _DecodeRow(starts[i] + j, i, meta.seq_lens_host[i] - n + 1 + j)
                for i, n in enumerate(meta.query_lens)
                if n <= _SHORT_QUERY
                for j in range(n)
            ),
            key=lambda r: r.seq_len,
        )
        native = None
        if decode_rows and device.type == "cpu" and cpu_native.library() is not None:
            native = _NativeDecode(
                rows=torch.tensor([r.row for r in decode_rows]),
                block_tables=block_tables[[r.seq for r in decode_rows]].contiguous(),
                seq_lens=torch.tensor([r.seq_len for r in decode_rows], dtype=torch.int32),
            )
        prefills = []
        for i, q_len in enumerate(meta.query_lens):
            if q_len <= _SHORT_QUERY:
                continue
            seq_len = meta.seq_lens_host[i]
            slots = mask = None
            if seq_len > q_len:
                pos = torch.arange(seq_len)
                slots = block_tables[i][pos // meta.block_size].long() * meta.block_size
                slots = (slots + pos % meta.block_size).to(device)
                mask = context_mask(q_len, seq_len, None, device)
            prefills.append(_PrefillPlan(starts[i], starts[i] + q_len, slots, mask))

        def make_groups() -> list[_DecodeGroup]:
            groups, begin = [], 0
            lengths = [r.seq_len for r in decode_rows]
            for end in split_by_length(lengths, _GROUP_COST_TOKENS, _MAX_DECODE_GROUPS) if lengths else []:
                groups.append(self._decode_group(decode_rows[begin:end], meta, block_tables, device))
                begin = end
            return groups

        meta.plan = _Plan(prefills, native, make_groups)

    @staticmethod
    def _decode_group(members: list[_DecodeRow], meta, block_tables, device) -> _DecodeGroup:
        lens = torch.tensor([r.seq_len for r in members])
        num_blocks = (int(lens.max()) + meta.block_size - 1) // meta.block_size
        pos = torch.arange(num_blocks * meta.block_size)
        bias = torch.zeros(len(members), 1, len(pos))
        bias.masked_fill_(pos[None, None, :] >= lens[:, None, None], float("-inf"))
        return _DecodeGroup(
            rows=torch.tensor([r.row for r in members], device=device),
            blocks=block_tables[[r.seq for r in members]][:, :num_blocks].reshape(-1).long().to(device),
            bias=bias.to(device),
            lens=lens.view(-1, 1, 1).to(device),
        )

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window, k_scale=None, v_scale=None):
        keys, values = _Paged(k_cache, k_scale), _Paged(v_cache, v_scale)
        # the new K/V as attention will see them (dequantized, in an 8-bit cache)
        k, v = keys.write(k, meta.slot_mapping), values.write(v, meta.slot_mapping)
        plan: _Plan = meta.plan
        out = torch.empty_like(q)
        if plan.native is not None and cpu_native.supports(q, k_cache, k_scale):
            n = plan.native
            cpu_native.paged_decode(
                q,
                out,
                k_cache,
                v_cache,
                n.block_tables,
                n.seq_lens,
                n.rows,
                scale,
                sliding_window,
                k_scale,
                v_scale,
            )
        else:
            for g in plan.decode_groups():
                og = _decode_attention(q.index_select(0, g.rows), keys, values, g, scale, sliding_window)
                out.index_copy_(0, g.rows, og)
        for p in plan.prefills:
            out[p.lo : p.hi] = _prefill_attention(q, k, v, keys, values, p, scale, sliding_window)
        return out


@dataclass
class _Paged:
    """One layer's paged K (or V), read and written by slot or by block."""

    values: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    scales: torch.Tensor | None  # an 8-bit cache's fp32 [num_blocks, block_size, Hkv]; else None

    def write(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Store x [T, Hkv, D] at its slots; returns it as reads will give it back."""
        if self.scales is None:
            self._by_slot().index_copy_(0, slots, x.to(self.values.dtype))
            return x
        codes, scales = quantize(x, quant_of(self.values))
        self._by_slot().index_copy_(0, slots, codes)
        self.scales.view(-1, self.scales.shape[-1]).index_copy_(0, slots, scales)
        return dequantize(codes, scales, x.dtype)

    def blocks(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Whole blocks [n, block_size, Hkv, D], dequantized."""
        x = self.values.index_select(0, index)
        return x if self.scales is None else dequantize(x, self.scales.index_select(0, index), dtype)

    def slots(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows at cache slots [n, Hkv, D], dequantized."""
        x = self._by_slot().index_select(0, index)
        if self.scales is None:
            return x
        return dequantize(x, self.scales.view(-1, self.scales.shape[-1]).index_select(0, index), dtype)

    def _by_slot(self) -> torch.Tensor:
        return self.values.view(-1, self.values.shape[2], self.values.shape[3])


def _decode_attention(q, k_cache: _Paged, v_cache: _Paged, g: _DecodeGroup, scale: float, sliding_window):
    """One query token per sequence: q [Sg, Hq, D] -> [Sg, Hq, D].

    K/V are gathered a whole block at a time into [Sg, L, Hkv*D] (their natural layout,
    no transpose). Each query head's vector is placed in its KV head's slot of a
    block-diagonal [Hq, Hkv*D] matrix, so one batched matmul against all heads' keys
    yields every head's scores; the off-diagonal products are discarded. That costs
    Hkv x the (small) attention FLOPs but moves K/V through memory only once, which is
    what a decode step on a CPU is bound by.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.values.shape[2]
    group = num_q_heads // num_kv_heads
    keys = k_cache.blocks(g.blocks, q.dtype).view(num_seqs, -1, num_kv_heads * head_dim)
    values = v_cache.blocks(g.blocks, q.dtype).view(num_seqs, -1, num_kv_heads * head_dim)
    bias = g.bias_as(q.dtype)
    if sliding_window is not None:
        pos = torch.arange(bias.shape[-1], device=bias.device)
        bias = bias.masked_fill(pos <= g.lens - 1 - sliding_window, float("-inf"))
    eye = torch.eye(num_kv_heads, dtype=q.dtype, device=q.device)
    q4 = q.view(num_seqs, num_kv_heads, group, 1, head_dim)
    q_bd = (q4 * eye.view(1, num_kv_heads, 1, num_kv_heads, 1)).view(num_seqs, num_q_heads, -1)
    # scale and mask fused into the matmul; the softmax upcasts to fp32 as it reads
    scores = torch.baddbmm(bias, q_bd, keys.transpose(1, 2), alpha=scale)  # [Sg, Hq, L]
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype)
    o = torch.matmul(probs, values).view(num_seqs, num_kv_heads, group, num_kv_heads, head_dim)
    o = torch.diagonal(o, dim1=1, dim2=3)  # [Sg, G, D, Hkv]
    return o.permute(0, 3, 1, 2).reshape(num_seqs, num_q_heads, head_dim)


def _prefill_attention(q, k, v, k_cache: _Paged, v_cache: _Paged, p: _PrefillPlan, scale, sliding_window):
    """One sequence's chunk: q rows p.lo:p.hi -> [q_len, Hq, D]; k, v: the step's new
    K/V as the cache holds them."""
    q_len = p.hi - p.lo
    if p.slots is None:
        keys, values = k[p.lo : p.hi], v[p.lo : p.hi]
    else:
        keys, values = k_cache.slots(p.slots, q.dtype), v_cache.slots(p.slots, q.dtype)
    if sliding_window is None and cpu_native.takes_prefill(q, keys, values):
        return cpu_native.prefill_attention(q[p.lo : p.hi], keys, values, scale)  # 2-3x SDPA's speed
    mask = p.mask
    if sliding_window is not None:
        mask = context_mask(q_len, keys.shape[0], sliding_window, q.device)
    # SDPA's grouped-query path (torch >= 2.5) reads each KV head for its query heads: as
    # fast as repeating K/V per query head first (torch 2.13, CPU), without that copy
    o = F.scaled_dot_product_attention(
        q[p.lo : p.hi].transpose(0, 1)[None],  # [1, Hq, q_len, D]
        keys.transpose(0, 1)[None],  # [1, Hkv, L, D]
        values.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)
