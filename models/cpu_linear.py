"""Linear layers on CPUs with their weights packed once for oneDNN.

`F.linear` on a CPU hands each call to MKL's sgemm, which re-packs the whole weight into
its blocked layout on every call: at the small batches of a decode step (M = 2-64 rows)
that copy costs more than the multiply, so a SmolLM2 decode step's weight matmuls ran at
a third of what its bytes allow (measured: `benchmarks/offline_throughput.py`, BENCHMARKS.md).
Packing each weight once into oneDNN's layout (`torch.ops.mkldnn._reorder_linear_weight`)
and multiplying with `_linear_pointwise` skips that copy: 1.5-2.5x faster at M = 4-64 and
~15 % at M = 256 on a 2-core AVX2 CPU.

At the rows of a decode step (1-64) oneDNN's kernels are slow for these shapes: at one
row they stream the weight at about half the machine's bandwidth. Where the native
kernel is built (fp32 and bf16), each layer also keeps its weight in that kernel's panel layout
(`cpu_native.to_panels`, kernels/cpu_linear.c) and steps of up to the policy's rows go
through it, at the cost of a second copy of the weights; fp32 on a CPU without AVX-512
takes it at every step, prompt chunks included, so there the panels are the only copy.
The dense weight is released after packing.

Used where the engine runs on a CPU with oneDNN, for fp32 (and bf16 where oneDNN takes
it: AVX512 or AVX-NE-CONVERT CPUs); anything else keeps `F.linear`.
"""

from __future__ import annotations

import functools
import logging
from fnmatch import fnmatch

import torch
import torch.nn.functional as F
from torch import nn

from kvray.errors import InvalidArgumentError
from kvray.kernels import cpu_groups, cpu_native
from kvray.kernels.cpu_memory import huge_page_zeros, release_freed_memory
from kvray.models.fp8_linear import Fp8Weight
from kvray.models.triton_linear import TritonGrouped, on_triton

logger = logging.getLogger(__name__)

BATCH_HINT = 16  # oneDNN's packing is tuned for about this many rows; any count works


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias,
    packed: torch.Tensor | None,
    panels: cpu_native.Panels | None = None,
) -> torch.Tensor:
    """x W^T (+ b): through the native panels where they take the rows (`panels.rows`),
    else through the packed weight when there is one (fp8 codes, on any device, through
    torch._scaled_mm; grouped codes on a GPU through Triton, models/triton_linear.py)."""
    if isinstance(panels, (Fp8Weight, TritonGrouped)):
        return panels.matmul(x, bias)
    if int8_dense(x, panels):
        return F.linear(x, cpu_native.dequantized(panels).to(x.dtype), bias)
    if cpu_native.takes_linear(x, panels):
        return cpu_native.linear(x, panels, bias)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if weight is not None:
        return F.linear(x, weight, bias)
    # the panels are the weight's only copy (they take every step here): x of another
    # shape or layout goes through them as rows
    dtype = panels.data.dtype
    if dtype in cpu_native.QUANTIZED:  # codes take fp32 or bf16 rows
        dtype = x.dtype if x.dtype in cpu_native.DTYPES else torch.float32
    rows = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
    out = cpu_native.linear(rows, panels, None if bias is None else bias.to(dtype))
    return out.to(x.dtype).view(*x.shape[:-1], panels.n)


# Prompt chunks of int8 panels: above this many rows the weight is de-quantized for the
# call (a pass over n x k codes, ~1 % of the matmul's work at 512 rows) and multiplied by
# oneDNN, whose bf16/fp32 kernels beat the int8 panels' fp32 FMAs at wide batches; decode
# steps (the fused step takes up to 64 rows) read the codes themselves.
INT8_DENSE_ROWS = 64


def int8_dense(x: torch.Tensor, panels: cpu_native.Panels | None) -> bool:
    """Whether `linear` multiplies x by the de-quantized weight (see INT8_DENSE_ROWS): int8
    panels, and grouped codes where the CPU has no integer dot products for them."""
    return (
        panels is not None
        and (
            panels.data.dtype == torch.int8
            or panels.data.dtype == torch.uint8
            and not cpu_native.integer_dots()
        )
        and x.dtype in cpu_native.DTYPES
        and x.numel() > INT8_DENSE_ROWS * x.shape[-1]
    )


@functools.cache
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


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's layout, or None where oneDNN does not take its dtype here."""
    if not can_pack(weight.dtype, weight.device):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def panels_for(weight: torch.Tensor, policy: cpu_native.NativePolicy) -> cpu_native.Panels | None:
    """The weight in the native kernel's panels, taking the policy's rows, where that
    kernel runs (built here, a dtype it takes)."""
    if not cpu_native.takes(weight.dtype, weight.device):
        return None
    panels = cpu_native.to_panels(weight)
    return None if panels is None else panels._replace(rows=policy.panel_rows(weight.dtype))


def weight_copies(
    weight: torch.Tensor, policy: cpu_native.NativePolicy
) -> tuple[torch.Tensor | None, cpu_native.Panels | None]:
    """`weight`'s copies for `linear`: (oneDNN-packed, native panels), each None where that
    way does not run here; no oneDNN copy where the panels take every step (fp32 on an
    AVX2 CPU: it would never be read)."""
    panels = panels_for(weight, policy)
    if panels is not None and policy.every_step(weight.dtype):
        return None, panels
    return pack_weight(weight), panels


def quantized_panels(
    weight: torch.Tensor, quantization: str | None, grouped=None, group_size: int = 32
) -> cpu_native.Panels | None:
    """The weight [n, k] as panels of codes for `quantization` (engine/config.py
    QUANTIZATIONS): int8 per channel, int4 in groups of `group_size` (32 or 128), fp8
    (models/fp8_linear.py: any device), or "gguf": the file's own codes (`grouped`,
    models/gguf_groups.py; None where the file holds the tensor unquantized). None: the
    weight stays in the dtype."""
    if quantization == "int8":
        return cpu_native.to_panels_int8(weight)
    if quantization == "fp8":
        return Fp8Weight.of(weight)
    if quantization == "int4":
        n, k = weight.shape
        if k % group_size:
            field = "quantization" if group_size == 32 else "quantization_group_size"
            raise InvalidArgumentError(
                field,
                quantization if group_size == 32 else group_size,
                f"weights whose k divides into groups of {group_size} (k={k}; list the module in "
                "quantization_ignore to keep it in dtype)",
            )
        codes, scales, mins = cpu_groups.quantize_int4(weight.cpu(), group_size)  # built on the CPU
        layout = cpu_groups.Layout(4, group_size)
        return cpu_native.Panels(cpu_groups.to_panels(codes, scales, mins, layout), n, k)
    if quantization == "gguf" and grouped is not None:
        return grouped  # attached as panels (models/gguf_groups.py)
    return None


def pack_layer(
    layer: nn.Module, quantization: str | None, policy: cpu_native.NativePolicy, group_size: int = 32
) -> None:
    """layer.packed, layer.panels = its weight's copies (`weight_copies`); the dense
    `layer.weight` goes once they serve every step (oneDNN's copy, or the panels alone).
    Quantized (`quantized_panels`): panels of codes are the weight's only copy (every
    step's rows)."""
    weight = layer.weight
    panels = quantized_panels(weight, quantization, getattr(layer, "grouped", None), group_size)
    layer.grouped = None
    if panels is not None:
        layer.packed, layer.panels, layer.weight = None, panels, None
        return
    layer.packed, layer.panels = weight_copies(weight, policy)
    if layer.packed is not None or layer.panels is not None and policy.every_step(weight.dtype):
        layer.weight = None


def ignored(model: nn.Module, name: str, patterns: tuple[str, ...]) -> bool:
    """Whether `model`'s module `name` is one `quantization_ignore` keeps in the dtype
    (matched by the whole model's name: a pipeline stage's layers.i is its layer_range's)."""
    parts = name.split(".")
    if len(parts) > 1 and parts[0] == "layers" and hasattr(model, "layer_range"):
        parts[1] = str(model.layer_range.start + int(parts[1]))
    return any(fnmatch(".".join(parts), p.removeprefix("model.")) for p in patterns)


def check_ignore(model: nn.Module, patterns: tuple[str, ...]) -> None:
    """Every pattern names a module of the whole model, else an InvalidArgumentError."""
    layers = getattr(model.config, "num_hidden_layers", 0)
    rests = {n.split(".", 2)[2] for n, _ in model.named_modules() if n.startswith("layers.") and "." in n[7:]}
    names = {f"layers.{i}.{rest}" for i in range(layers) for rest in rests} | {"lm_head", "embed_tokens"}
    for p in patterns:
        if not any(fnmatch(n, p.removeprefix("model.")) for n in names):
            raise InvalidArgumentError(
                "quantization_ignore",
                p,
                f"module name patterns, e.g. lm_head, embed_tokens, layers.0.*, layers.{layers - 1}.mlp.*",
            )


def pack_model(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    ignore: tuple[str, ...] = (),
    policy: cpu_native.NativePolicy | None = None,
    group_size: int = 32,
) -> int:
    """Pack every layer that can (modules with `pack_for_cpu`); returns how many did. Where
    oneDNN does not take the dtype (bf16 on a CPU without AVX-512) the native panels still
    do, beside the dense weights. `quantization` (engine/config.py QUANTIZATIONS) needs the
    native kernels on a CPU: else an InvalidArgumentError naming it; "gguf" a model built
    from a GGUF file with it (loader.build_model: its linears' codes attached). Modules
    `ignore` names (engine/config.py quantization_ignore; the model's own entry stands for
    its LM head, "lm_head") stay in the dtype. `policy`: which steps go to the native
    kernels (default: this CPU's, `cpu_native.machine_policy`), kept as
    `model.native_policy` for its fused decode steps. `group_size`: int4's group
    (engine/config.py quantization_group_size)."""
    policy = policy or cpu_native.machine_policy()
    model.native_policy = policy
    triton = on_triton(device) and quantization in TRITON_QUANTIZATIONS
    if quantization not in (None, "fp8") and not (triton or cpu_native.takes(dtype, device)):
        raise InvalidArgumentError(
            "quantization", quantization, "None here (quantized weights run on the native CPU kernels: a CPU "
            "with a C compiler, KVRAY_NATIVE_KERNELS not 0; on CUDA, fp8, and int4 and gguf on Triton)"
        )  # fmt: skip
    if quantization == "gguf" and not getattr(model, "gguf_codes", False):
        raise InvalidArgumentError(
            "quantization", quantization, "a model loaded from a GGUF file (an alias or a .gguf path)"
        )
    if ignore:
        check_ignore(model, ignore)
    if quantization != "fp8" and not (triton or can_pack(dtype, device) or cpu_native.takes(dtype, device)):
        return 0
    packed = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "pack_for_cpu"):
                kept = ignored(model, name or "lm_head", ignore)
                module.pack_for_cpu(None if kept else quantization, policy, group_size)
                packed += 1
    if triton:
        to_triton(model, dtype, device)
    native = gather_panels(model) > 0
    name = str(dtype).removeprefix("torch.")
    if quantization is not None:
        where = "Triton kernels on the GPU" if triton else "native panels"
        how = f"quantized as {quantization} ({where}, the LM head too; the embedding in {name})"
    elif native and policy.every_step(dtype):
        how = "held once, in the native panels (they take every step)"
    else:
        rows = policy.panel_rows(dtype)
        how = "packed for oneDNN" if can_pack(dtype, device) else "kept dense (oneDNN does not take it)"
        how += f"; native panels for steps of up to {rows} rows" if native else ""
    logger.info("kvray: %d linear layers (%s) %s", packed, name, how)
    return packed


PANEL_ATTRS = ("panels", "panels_head")  # where modules keep their native panels
TRITON_QUANTIZATIONS = ("int4", "gguf")  # grouped codes, which kernels/triton_linear_qg.py takes


def to_triton(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Grouped codes' panels (built on the CPU) onto the GPU for the Triton kernels
    (models/triton_linear.py); an embedding held in codes gets its rows back in `dtype`."""
    moved: dict[int, TritonGrouped] = {}  # a tied head's panels are its embedding's too
    for module in model.modules():
        for attr in PANEL_ATTRS:
            panels = getattr(module, attr, None)
            if not isinstance(panels, cpu_native.Panels) or panels.data.dtype != torch.uint8:
                continue
            if hasattr(module, "hold_codes"):  # an embedding: its rows, dense
                rows = cpu_native.dequantized(panels).to(device, dtype)
                module.weight, module.panels = nn.Parameter(rows, requires_grad=False), None
            else:
                if id(panels) not in moved:
                    moved[id(panels)] = TritonGrouped.of(panels, device)
                setattr(module, attr, moved[id(panels)])


def gather_panels(model: nn.Module) -> int:
    """Move every native panel of the model into one buffer of huge-page memory
    (kernels/cpu_memory.py: a decode step streams them all, and with 2 MiB pages it does
    so with ~1/500 of the TLB misses); returns how many there are. Panels two modules share
    (a tied embedding held in its LM head's codes) move once."""
    found = [
        (module, attr)
        for module in model.modules()
        for attr in PANEL_ATTRS
        if isinstance(getattr(module, attr, None), cpu_native.Panels)
    ]
    owners, sharers = [], []
    for module, attr in found:
        first = next((o for o in owners if getattr(o[0], o[1]) is getattr(module, attr)), None)
        (sharers.append((module, attr, first)) if first else owners.append((module, attr)))
    spans = [-(-getattr(m, a).data.nbytes // 64) * 64 for m, a in owners]  # each 64-byte aligned
    # faulted in as the copies fill it, each first copy freed once moved and the heap
    # trimmed as it goes: the model's panels are held about once, not twice (a 1.5B model
    # in fp32 is 6.2 GB of panels beside oneDNN's 6.2 GB copy)
    arena = huge_page_zeros((sum(spans),), torch.uint8, touch=False)
    start = moved = 0
    for (module, attr), span in zip(owners, spans):
        old = getattr(module, attr)
        new = arena[start : start + old.data.nbytes].view(old.data.dtype).view(old.data.shape)
        new.copy_(old.data)
        setattr(module, attr, old._replace(data=new))
        start, moved = start + span, moved + span
        old = None
        if moved >= TRIM_EVERY:
            release_freed_memory()  # the first copies' pages
            moved = 0
    for module, attr, (owner, owner_attr) in sharers:
        setattr(module, attr, getattr(owner, owner_attr))
    release_freed_memory()
    return len(owners)


TRIM_EVERY = 256 << 20  # bytes of panels moved between trims of the heap
