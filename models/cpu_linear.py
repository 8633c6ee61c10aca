"""Linear layers on CPUs with their weights packed once for oneDNN.

`F.linear` on a CPU hands each call to MKL's sgemm, which re-packs the whole weight into
its blocked layout on every call: at the small batches of a decode step (M = 2-64 rows)
that copy costs more than the multiply, so a SmolLM2 decode step's weight matmuls ran at
a third of what its bytes allow (measured: `benchmarks/offline_throughput.py`, BENCHMARKS.md).
Packing each weight once into oneDNN's layout (`torch.ops.mkldnn._reorder_linear_weight`)
and multiplying with `_linear_pointwise` skips that copy: 1.5-2.5x faster at M = 4-64 and
~15 % at M = 256 on a 2-core AVX2 CPU.

At 1-8 rows (a single stream's decode step, a few streams) a linear is bound by reading
the weight, and oneDNN's kernels stream it at about half the machine's bandwidth; the
native kernel (`cpu_native.linear`, kernels/cpu_linear.c) streams the dense rows at
nearly all of it. Where that kernel is built (fp32), the dense weight is kept beside the
packed one for those steps, at the cost of a second copy of the weights; elsewhere the
dense weight is released after packing.

Used where the engine runs on a CPU with oneDNN, for fp32 (and bf16 where oneDNN takes
it: AVX512 or AVX-NE-CONVERT CPUs); anything else keeps `F.linear`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvray.kernels import cpu_native

logger = logging.getLogger(__name__)

BATCH_HINT = 16  # oneDNN's packing is tuned for about this many rows; any count works


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias, packed: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b): a few rows through the native kernel, else through the packed weight
    when there is one."""
    if cpu_native.takes_linear(x, weight):
        return cpu_native.linear(x, weight, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN takes this dtype on this CPU (tried on a tiny weight)."""
    if (
        device.type != "cpu"
        or not torch.backends.mkldnn.is_available()
        or dtype not in (torch.float32, torch.bfloat16)
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), BATCH_HINT)
        return True
    except RuntimeError:  # e.g. bf16 on a CPU without AVX512 / AVX-NE-CONVERT
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def pack_layer(layer: nn.Module) -> None:
    """layer.packed = its weight in oneDNN's layout; the dense `layer.weight` stays only
    where the native few-row kernel will read it (fp32, the library built here)."""
    layer.packed = pack_weight(layer.weight)
    keep = layer.weight.dtype == torch.float32 and layer.weight.is_contiguous() and cpu_native.library()
    if not keep:
        layer.weight = None


def pack_model(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Pack every layer that can (modules with `pack_for_cpu`); returns how many did."""
    if not can_pack(dtype, device):
        return 0
    packed = 0
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "pack_for_cpu"):
                module.pack_for_cpu()
                packed += 1
    kept = dtype == torch.float32 and cpu_native.library() is not None
    dense = f"; dense rows kept for steps of up to {cpu_native.LINEAR_ROWS} rows" if kept else ""
    name = str(dtype).removeprefix("torch.")
    logger.info("kvray: %d linear layers packed for oneDNN (%s)%s", packed, name, dense)
    return packed
