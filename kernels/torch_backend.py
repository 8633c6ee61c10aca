"""The torch attention backend: the engine's attention on CPUs (and any device without Triton).

Same cache layout and semantics as the Triton kernels, organised for few large torch
calls per layer:

* decode rows (q_len == 1) of all sequences go through one batched SDPA call; the query
  heads that share a KV head become that head's "query rows", so K/V are never repeated;
* a prefill chunk with no cached prefix attends to its own fresh K/V (no cache read);
* a prefill chunk after a cached prefix reads its context through its block table.

Everything that depends only on the batch (gather indices, masks) is built once per step
in `prepare` and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvray.kernels.backend import AttentionBackend, AttentionMetadata, register_backend
from kvray.kernels.reference import context_mask


@dataclass
class _DecodePlan:
    rows: torch.Tensor  # int64 [Sd]: q rows of the decode sequences
    blocks: torch.Tensor  # int64 [Sd * nb]: their block tables, flattened (padded with 0)
    bias: torch.Tensor  # fp32 [Sd, 1, nb * block_size]: 0 where a key exists, -inf past the end
    lens: torch.Tensor  # int64 [Sd, 1, 1]: context lengths (for sliding windows)
    rows_are_prefix: bool  # rows == arange(Sd): slice instead of gather


@dataclass
class _PrefillPlan:
    lo: int  # first q row
    hi: int  # one past the last q row
    slots: torch.Tensor | None  # int64 [seq_len] context slots; None: fresh K/V only
    mask: torch.Tensor | None  # bool [q_len, seq_len]; None: plain causal


@dataclass
class _Plan:
    decode: _DecodePlan | None
    prefills: list[_PrefillPlan]


def _context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length)
    return block_table[pos // block_size].long() * block_size + pos % block_size


@register_backend("torch")
class TorchBackend(AttentionBackend):
    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        block_tables = meta.block_tables.cpu()
        starts = meta.cu_seqlens_q.tolist()
        decode_seqs = [i for i, n in enumerate(meta.query_lens) if n == 1]
        decode = None
        if decode_seqs:
            lens = torch.tensor([meta.seq_lens_host[i] for i in decode_seqs])
            num_blocks = (int(lens.max()) + meta.block_size - 1) // meta.block_size
            pos = torch.arange(num_blocks * meta.block_size)
            bias = torch.zeros(len(decode_seqs), 1, len(pos))
            bias.masked_fill_(pos[None, None, :] >= lens[:, None, None], float("-inf"))
            rows = torch.tensor([starts[i] for i in decode_seqs])
            decode = _DecodePlan(
                rows=rows.to(device),
                blocks=block_tables[decode_seqs][:, :num_blocks].reshape(-1).long().to(device),
                bias=bias.to(device),
                lens=lens.view(-1, 1, 1).to(device),
                rows_are_prefix=bool(torch.equal(rows, torch.arange(len(decode_seqs)))),
            )
        prefills = []
        for i, q_len in enumerate(meta.query_lens):
            if q_len <= 1:
                continue
            seq_len = meta.seq_lens_host[i]
            slots = None
            mask = None
            if seq_len > q_len:
                slots = _context_slots(block_tables[i], seq_len, meta.block_size).to(device)
                mask = context_mask(q_len, seq_len, None, device)
            prefills.append(_PrefillPlan(starts[i], starts[i] + q_len, slots, mask))
        meta.plan = _Plan(decode, prefills)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window):
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        plan: _Plan = meta.plan
        out = torch.empty_like(q)
        if plan.decode is not None:
            d = plan.decode
            qd = q[: len(d.rows)] if d.rows_are_prefix else q[d.rows]
            od = _decode_attention(qd, k_cache, v_cache, d, scale, sliding_window)
            if d.rows_are_prefix:
                out[: len(d.rows)] = od
            else:
                out[d.rows] = od
        for p in plan.prefills:
            out[p.lo : p.hi] = self._prefill(q, k, v, flat_k, flat_v, p, scale, sliding_window)
        return out

    @staticmethod
    def _prefill(q, k, v, flat_k, flat_v, p: _PrefillPlan, scale, sliding_window):
        q_len = p.hi - p.lo
        if p.slots is None:
            keys, values = k[p.lo : p.hi], v[p.lo : p.hi]
        else:
            keys, values = flat_k[p.slots], flat_v[p.slots]
        seq_len = keys.shape[0]
        mask = p.mask
        if sliding_window is not None:
            mask = context_mask(q_len, seq_len, sliding_window, q.device)
        o = F.scaled_dot_product_attention(
            q[p.lo : p.hi].transpose(0, 1),  # [Hq, q_len, D]
            keys.transpose(0, 1),  # [Hkv, L, D]
            values.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return o.transpose(0, 1)


def _decode_attention(q, k_cache, v_cache, d: _DecodePlan, scale: float, sliding_window):
    """One query token per sequence: q [Sd, Hq, D] -> [Sd, Hq, D].

    K/V are gathered a whole block at a time into [Sd, L, Hkv*D] (their natural layout,
    no transpose). With few KV heads, each query head's vector is placed in its KV
    head's slot of a block-diagonal [Hq, Hkv*D] matrix, so one batched matmul against
    all heads' keys yields every head's scores; the off-diagonal products are discarded.
    That costs Hkv x the (tiny) attention FLOPs but moves K/V through memory only once,
    which is what a decode step on a CPU is bound by.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    keys = k_cache.index_select(0, d.blocks).view(num_seqs, -1, num_kv_heads * head_dim)
    values = v_cache.index_select(0, d.blocks).view(num_seqs, -1, num_kv_heads * head_dim)
    bias = d.bias
    if sliding_window is not None:
        pos = torch.arange(bias.shape[-1], device=bias.device)
        bias = bias.masked_fill(pos <= d.lens - 1 - sliding_window, float("-inf"))
    eye = torch.eye(num_kv_heads, dtype=q.dtype, device=q.device)
    q4 = q.view(num_seqs, num_kv_heads, group, 1, head_dim)
    q_bd = (q4 * eye.view(1, num_kv_heads, 1, num_kv_heads, 1)).view(num_seqs, num_q_heads, -1)
    scores = torch.matmul(q_bd, keys.transpose(1, 2)).float() * scale + bias  # [Sd, Hq, L]
    probs = scores.softmax(dim=-1).to(values.dtype)
    o = torch.matmul(probs, values).view(num_seqs, num_kv_heads, group, num_kv_heads, head_dim)
    o = torch.diagonal(o, dim1=1, dim2=3)  # [Sd, G, D, Hkv]
    return o.permute(0, 3, 1, 2).reshape(num_seqs, num_q_heads, head_dim)
