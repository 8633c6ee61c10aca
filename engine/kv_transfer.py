"""What moves between a prefill and a decode engine: tickets, pins and packed blocks.

The prefill side finishes a request after its first token but keeps the prompt's
blocks *pinned* (still counted as used) under a lease (engine/kv_handoff.py owns the
pins). A `KVTicket` names them. The decode side pulls the blocks' contents, then
confirms; the prefill side then releases the pin and the blocks become ordinary
prefix-cache blocks. A lease that ends first releases them too, and a pull that comes
later finds nothing and recomputes — never reading blocks that were reused meanwhile: a
pin that is being read cannot expire.

Packed layout of n blocks (one tensor, so a transfer is one message, not n * layers)::

    [num_layers, 2 (k, v), n, block_size, num_kv_heads, row_width]

row_width is head_dim, or for an 8-bit cache head_dim codes and their 4-byte scale
(kernels/kv_quant.py): a pull moves the quantized bytes as they are. Both sides must
hold the same kind of cache (`KVLayout.check_pull_from`); a pull between different ones
is refused, and the decode side recomputes the prompt.

A large transfer goes as a few such tensors, each a contiguous range of layers
(`layer_chunks`), so packing one chunk overlaps with sending the previous one and
unpacking overlaps with receiving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvray.kernels.kv_quant import QUANTS, KVQuant
from kvray.models.layers import head_dim_of
from kvray.models.parallel import ShardSpec


@dataclass(frozen=True)
class KVLayout:
    """A worker's KV cache: the model's totals and how its shards cut them.

    With tp = pp = 1 (one shard) the packed shapes below are that shard's whole cache;
    a worker of several shards moves `KVPiece`s instead (`plan_kv_pull`).
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the cache tensor's torch dtype name, e.g. "float32" ("int8": 8-bit caches)
    num_heads: int = 0  # query heads (0: as many as KV heads); fixes the head partition
    tp_size: int = 1
    pp_size: int = 1
    quant: str | None = None  # an 8-bit cache's kv_cache_dtype ("int8", "fp8_e4m3"): rows
    # then hold head_dim codes and a 4-byte scale (kernels/kv_quant.py)

    @property
    def cache_dtype(self) -> str:
        """What the blocks hold: the quantization, or the values' dtype."""
        return self.quant or self.dtype

    @property
    def row_width(self) -> int:
        """Elements of one (token, KV head) row of the cache tensor."""
        return QUANTS[self.quant].row_bytes(self.head_dim) if self.quant else self.head_dim

    def check_pull_from(self, src: KVLayout) -> None:
        """Refuse a pull from a cache whose blocks this one cannot hold: another layout, or
        8-bit codes on one side only or of another kind (values of two float dtypes
        convert as they land)."""
        names = ["block_size", "head_dim", "num_layers", "num_kv_heads"]
        if self.quant or src.quant:
            names.insert(0, "cache_dtype")
        for name in names:
            mine, theirs = getattr(self, name), getattr(src, name)
            if mine != theirs:
                raise ValueError(
                    f"KV layouts differ: {name} is {theirs!r} on the prefill side, {mine!r} here"
                )

    @property
    def num_shards(self) -> int:
        return self.tp_size * self.pp_size

    def shard(self, rank: int) -> tuple[range, range]:
        """(layers, KV heads) of the model that shard `rank` holds."""
        spec = ShardSpec(self.tp_size, self.pp_size, rank)
        num_heads = self.num_heads or self.num_kv_heads
        return spec.layers(self.num_layers), spec.kv_heads(num_heads, self.num_kv_heads)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def packed_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.row_width)

    def packed_bytes(self, num_blocks: int) -> int:
        n = 1
        for d in self.packed_shape(num_blocks):
            n *= d
        return n * torch.tensor([], dtype=self.torch_dtype).element_size()


@dataclass(frozen=True)
class KVTicket:
    """Claim on a prefilled prompt's KV blocks, handed from prefill to decode."""

    worker_id: str  # the prefill worker holding the blocks
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int  # prompt tokens whose K/V the blocks hold
    block_hashes: tuple[bytes, ...]  # chained hashes of the full blocks
    layout: KVLayout
    lease_deadline: float  # time.time() after which the blocks may be reused


def kv_layout_of(
    hf_config, spec: ShardSpec, block_size: int, dtype: torch.dtype, quant: KVQuant | None = None
) -> KVLayout:
    """`dtype`: the model's; `quant`: the cache's 8-bit form, if any."""
    return KVLayout(
        hf_config.num_hidden_layers,
        block_size,
        hf_config.num_key_value_heads,
        head_dim_of(hf_config),
        "int8" if quant is not None else str(dtype).removeprefix("torch."),
        hf_config.num_attention_heads,
        spec.tp_size,
        spec.pp_size,
        quant.name if quant is not None else None,
    )


@dataclass(frozen=True)
class KVPiece:
    """Layers x KV heads (model numbering) that decode shard `dst_rank` copies from
    prefill shard `src_rank`."""

    src_rank: int
    dst_rank: int
    layers: range
    heads: range

    def local(self, layout: KVLayout, rank: int) -> tuple[range, range]:
        """The piece's layers and heads in shard `rank`'s own cache numbering."""
        layers, heads = layout.shard(rank)
        return _shift(self.layers, layers.start), _shift(self.heads, heads.start)


def plan_kv_pull(src: KVLayout, dst: KVLayout) -> list[KVPiece]:
    """Every piece a pull moves: each decode shard receives exactly its layers x heads,
    each part from one prefill shard that holds it (the first, when KV heads are
    replicated over tensor ranks). Equal tp and pp make it rank to rank."""
    pieces = []
    for d in range(dst.num_shards):
        d_layers, d_heads = dst.shard(d)
        taken: set[tuple[int, int, int, int]] = set()
        for s in range(src.num_shards):
            s_layers, s_heads = src.shard(s)
            layers, heads = _overlap(d_layers, s_layers), _overlap(d_heads, s_heads)
            key = (layers.start, layers.stop, heads.start, heads.stop)
            if len(layers) and len(heads) and key not in taken:
                taken.add(key)
                pieces.append(KVPiece(s, d, layers, heads))
    return pieces


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))  # empty when they do not meet


def _shift(r: range, by: int) -> range:
    return range(r.start - by, r.stop - by)


CHUNK_BYTES = 1 << 20  # target size of one message of a chunked transfer


def layer_chunks(layout: KVLayout, num_blocks: int, chunk_bytes: int = CHUNK_BYTES) -> list[range]:
    """Contiguous layer ranges of about `chunk_bytes` each (both sides compute the same)."""
    per_layer = layout.packed_bytes(num_blocks) // layout.num_layers
    step = max(1, chunk_bytes // max(per_layer, 1))
    return [range(i, min(i + step, layout.num_layers)) for i in range(0, layout.num_layers, step)]


def _view(kv_cache: torch.Tensor, layers: range | None, heads: range | None) -> torch.Tensor:
    view = kv_cache if layers is None else kv_cache[layers.start : layers.stop]
    return view if heads is None else view[:, :, :, :, heads.start : heads.stop]


def pack_blocks(
    kv_cache: torch.Tensor, block_ids: list[int], layers: range | None = None, heads: range | None = None
) -> torch.Tensor:
    """Copy the blocks of the given layers and KV heads (all by default) into one
    contiguous tensor.

    kv_cache: the engine's [num_layers, 2, num_blocks, block_size, Hkv, D] tensor.
    """
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    return _view(kv_cache, layers, heads).index_select(2, index)


def unpack_blocks(
    kv_cache: torch.Tensor,
    block_ids: list[int],
    packed: torch.Tensor,
    layers: range | None = None,
    heads: range | None = None,
) -> None:
    """Write packed blocks (of the given layers and heads, all by default) into the
    cache at `block_ids`."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    dst = _view(kv_cache, layers, heads)
    dst.index_copy_(2, index, packed.to(device=kv_cache.device, dtype=kv_cache.dtype))


def prefill_params(params):
    """The sampling parameters a prefill worker runs: the user's, cut to the first token
    (its one, final output holds it, whatever kind the caller streams)."""
    import dataclasses

    from kvray.engine.sampling_params import RequestOutputKind

    return dataclasses.replace(
        params, max_tokens=1, min_tokens=0, n=1, output_kind=RequestOutputKind.CUMULATIVE
    )
