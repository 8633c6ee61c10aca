"""Building blocks of Llama-family models: RMSNorm, rotary embedding, packed linears.

Packed linears hold several Hugging Face projections in one weight (q/k/v, gate/up) so
each layer does one matmul where HF does three. Every parameter gets a `weight_loader`
that knows where a named HF tensor goes inside it; the model file stays free of slicing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvray.kernels import cpu_native
from kvray.models.cpu_linear import linear, pack_layer
from kvray.models.parallel import ShardContext


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and cpu_native.usable(x) and self.weight.dtype == x.dtype:  # one pass, not six ops
            return cpu_native.rms_norm(x, self.weight, self.eps)[0]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add, fused with the norm."""
        same_dtype = residual.dtype == x.dtype == self.weight.dtype
        if x.dim() == 2 and same_dtype and cpu_native.usable(x) and cpu_native.usable(residual):
            return cpu_native.rms_norm(x, self.weight, self.eps, residual)
        summed = x + residual
        return self(summed), summed


class PackedLinear(nn.Module):
    """Column-parallel y = x W^T (+ b): W stacks named parts along the output dim (q|k|v,
    gate|up), each part holding the rows `parts[name]` of that Hugging Face tensor (all
    of them on a single device, this rank's slice under tensor parallelism)."""

    def __init__(self, in_features: int, parts: dict[str, range], bias: bool = False):
        super().__init__()
        self.offsets: dict[str, tuple[int, range]] = {}
        start = 0
        for name, rows in parts.items():
            self.offsets[name] = (start, rows)
            start += len(rows)
        self.weight = nn.Parameter(torch.empty(start, in_features))
        self.bias = nn.Parameter(torch.zeros(start)) if bias else None
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's layout (CPU)
        self.panels: cpu_native.Panels | None = None  # ... and in the native kernel's (CPU)
        self.weight.weight_loader = self._load
        if self.bias is not None:
            self.bias.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, part: str) -> None:
        start, rows = self.offsets[part]
        param.data[start : start + len(rows)].copy_(loaded[rows.start : rows.stop])

    def pack_for_cpu(
        self, quantization: str | None, policy: cpu_native.NativePolicy, group_size: int = 32
    ) -> None:
        """Multiply through a packed copy from now on (loaded weights only)."""
        pack_layer(self, quantization, policy, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.panels)


class RowParallelLinear(nn.Module):
    """y = sum over tensor ranks of x_r W_r^T, + b once: each rank holds the input
    columns `in_cols` of the HF weight and the partial products are all-reduced."""

    def __init__(self, in_cols: range, out_features: int, bias: bool, shard: ShardContext):
        super().__init__()
        self.in_cols = in_cols
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(out_features, len(in_cols)))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's layout (CPU)
        self.panels: cpu_native.Panels | None = None  # ... and in the native kernel's (CPU)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, part: str | None = None) -> None:
        param.data.copy_(loaded[:, self.in_cols.start : self.in_cols.stop])

    def pack_for_cpu(
        self, quantization: str | None, policy: cpu_native.NativePolicy, group_size: int = 32
    ) -> None:
        pack_layer(self, quantization, policy, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard.tp_size == 1:
            return linear(x, self.weight, self.bias, self.packed, self.panels)
        y = self.shard.all_reduce(linear(x, self.weight, None, self.packed, self.panels))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows `rows` of the vocabulary; ids outside them look up zeros and the
    ranks' results are all-reduced. Its weight doubles as a tied LM head's slice. Under
    `quantization="gguf"` the rows may be held as grouped codes instead (`hold_codes`)."""

    def __init__(self, rows: range, hidden_size: int, shard: ShardContext):
        super().__init__()
        self.rows = rows
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(len(rows), hidden_size))
        self.weight.weight_loader = self._load
        self.panels: cpu_native.Panels | None = None  # grouped codes, where they hold the rows

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, part: str | None = None) -> None:
        param.data.copy_(loaded[self.rows.start : self.rows.stop])

    def hold_codes(self, panels: cpu_native.Panels) -> None:
        """Look the rows up in grouped codes' panels (a tied LM head's, or the embedding's
        own) from now on; the dense rows go."""
        self.dtype, self.panels, self.weight = self.weight.dtype, panels, None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(ids, self.weight)
        return cpu_native.embedding_rows(self.panels, ids, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.tp_size == 1:
            return self._lookup(ids)
        outside = (ids < self.rows.start) | (ids >= self.rows.stop)
        x = self._lookup((ids - self.rows.start).masked_fill(outside, 0))
        return self.shard.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


def rope_inv_freq(config, params: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for the config's RoPE type (default, linear, llama3),
    or for `params` (one layer type's entry of a per-layer-type `rope_parameters`)."""
    params = dict(params or getattr(config, "rope_parameters", None) or {})
    if not params:  # transformers 4 style configs
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    base = float(params.get("rope_theta") or 10000.0)
    dim = head_dim_of(config)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, params)
    elif rope_type != "default":
        from kvray.errors import UnsupportedArchitectureError

        raise UnsupportedArchitectureError(
            "rope_parameters.rope_type", rope_type, "one of default, linear, llama3"
        )
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RotaryEmbedding(nn.Module):
    """Applies HF's non-interleaved ("rotate half") RoPE at arbitrary token positions."""

    def __init__(self, config, max_positions: int, params: dict | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(config, params)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # Plain attributes, not buffers: `model.to(bf16)` must not round the tables.
        self.cos = freqs.cos()  # fp32 [P, D/2]
        self.sin = freqs.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] for the step's positions, in the activations' dtype (fp32
        where the native kernel rotates); looked up once per forward and shared by every layer."""
        if cpu_native.takes(dtype, positions.device):
            dtype = torch.float32
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the tables of `RotaryEmbedding.tables` (on a CPU in fp32 or
    bf16: in place, in one pass)."""
    if cpu_native.usable(x) and cos.dtype == torch.float32 and x.stride(1) == x.shape[2]:
        return cpu_native.rotary_(x, cos, sin)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
