"""A GGUF file's quantized tensors as grouped low-bit codes (kernels/cpu_groups.py), without
loss: `quantization="gguf"` multiplies by them as the file holds them (kernels/
cpu_linear_qg.c), where the loader's de-quantized copy would be 4-8x the bytes.

Every block format the shipped files use is a per-group affine map of unsigned codes:

    Q4_0  32 / group, 4 bits   d * (q - 8)          scale d (fp16), min -8 d (not stored)
    Q4_1  32, 4 bits           d * q + m            fp16 scale and min
    Q4_K  32, 4 bits           d sc_j * q - dmin m_j (6-bit sc_j, m_j per 32 of 256; fp32)
    Q5_0  32, 5 bits           d * (q - 16)         fp16 scale
    Q5_1  32, 5 bits           d * q + m            fp16 scale and min
    Q5_K  32, 5 bits           as Q4_K with a fifth bit
    Q6_K  16, 6 bits           d sc_j * (q - 32)    (int8 sc_j per 16 of 256; fp32 scale)
    Q8_0  32, 8 bits           d * q                codes q + 128, fp16 scale, min -128 d

The products (an fp16 times a 6- or 8-bit scale, times a code) fit fp32's mantissa, so
code * scale + min is the value `gguf.quants.dequantize` gives, bit for bit (the tests'
oracle). Held this way a weight takes about the file's bytes: Q4_0, Q4_1, Q5_0, Q5_1 and
Q8_0 exactly theirs, the K formats 1.2-1.33x (their per-group scales in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvray.errors import InvalidArgumentError
from kvray.kernels import cpu_groups, cpu_native
from kvray.models import gguf_file


@dataclass
class Grouped:
    """A weight [n, k] as codes (uint8) with a scale and min per group of `group` along k."""

    codes: torch.Tensor  # [n, k] uint8
    scales: torch.Tensor  # [n, k / group] fp32
    mins: torch.Tensor
    bits: int  # 4, 5, 6 or 8
    group: int  # 16 or 32
    half: bool = False  # scales and mins held exactly in fp16
    offset: int = 0  # > 0: every min is -offset * its scale (not stored)

    def _with(self, codes, scales, mins) -> Grouped:
        return Grouped(codes, scales, mins, self.bits, self.group, self.half, self.offset)

    def rows(self, rows: range) -> Grouped:
        r = slice(rows.start, rows.stop)
        return self._with(self.codes[r], self.scales[r], self.mins[r])

    def columns(self, cols: range) -> Grouped:
        """Columns [start, stop) of k (a tensor-parallel rank's), on group boundaries."""
        if cols.start % self.group or cols.stop % self.group:
            raise InvalidArgumentError(
                "tensor_parallel_size",
                str(cols),
                f"input-column slices on {self.group}-value group boundaries",
            )
        c, g = slice(cols.start, cols.stop), slice(cols.start // self.group, cols.stop // self.group)
        return self._with(self.codes[:, c], self.scales[:, g], self.mins[:, g])

    def as_layout(self, bits: int, group: int, half: bool, offset: int) -> Grouped:
        """The same weight with wider codes, smaller groups, fp32 scales or stored mins (no loss)."""
        assert bits >= self.bits and self.group % group == 0
        assert (self.half or not half) and offset in (0, self.offset)
        scales, mins = (t.repeat_interleave(self.group // group, 1) for t in (self.scales, self.mins))
        return Grouped(self.codes, scales, mins, bits, group, half, offset)

    def panels(self) -> cpu_native.Panels:
        """In the kernel's panels (kernels/cpu_groups.py), built CHUNK values at a time (a
        chunk's panels are one span of the bytes): what building them adds to the codes
        stays small for the largest tensor."""
        n, k = self.codes.shape
        layout = cpu_groups.Layout(self.bits, self.group, self.half, self.offset)
        rows = _chunk_rows(k, cpu_groups.WIDTH)
        spans = [
            cpu_groups.to_panels(
                self.codes[r : r + rows], self.scales[r : r + rows], self.mins[r : r + rows], layout
            )
            for r in range(0, n, rows)
        ]
        data = torch.cat([spans[0][: cpu_groups.HEADER]] + [s[cpu_groups.HEADER :] for s in spans])
        return cpu_native.Panels(data, n, k)


def stacked(parts: list[Grouped]) -> Grouped:
    """Parts stacked along n (q|k|v, gate|up) in one layout: the widest codes, the smallest
    group, fp16 scales and implied mins only where every part has them."""
    bits, group = max(p.bits for p in parts), min(p.group for p in parts)
    offset = parts[0].offset if all(p.offset == parts[0].offset for p in parts) else 0
    half = all(p.half for p in parts) and (offset > 0 or all(cpu_groups.exact_in_half(p.mins) for p in parts))
    parts = [p.as_layout(bits, group, half, offset) for p in parts]
    return Grouped(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.mins for p in parts]),
        bits,
        group,
        half,
        offset,
    )


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: the low nibbles are codes 0-15, the high ones 16-31"""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """a little-endian u32 per block -> its 32 bits, code j's fifth bit at j"""
    bits = qh.copy().view(np.uint32)[:, 0]
    return ((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 6-bit scales and 8 6-bit mins"""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _blocks(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, cpu_groups.Layout]:
    """[blocks, bytes] of one format -> codes [blocks, values], scales and mins [blocks,
    groups], and the layout that holds them"""
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(blocks, 0)
        has_min = kind.endswith("_1")
        at = 4 if has_min else 2
        m = _f16(blocks, 2) if has_min else None
        high = None
        if kind.startswith("Q5"):
            high, at = _high_bits(blocks[:, at : at + 4]), at + 4
        q = _nibbles(blocks[:, at : at + 16])
        if high is not None:
            q = q | (high << 4)
        offset = 16 if kind.startswith("Q5") else 8
        mins = m if has_min else -offset * d
        layout = cpu_groups.Layout(4 if kind.startswith("Q4") else 5, 32, True, 0 if has_min else offset)
        return q, d[:, None], mins[:, None], layout
    if kind == "Q8_0":
        d = _f16(blocks, 0)
        q = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d[:, None], (-128 * d)[:, None], cpu_groups.Layout(8, 32, True, 128)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _k_scales(blocks[:, 4:16])
        if kind == "Q4_K":
            qs = blocks[:, 16:144].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
            q = (qs & 15).reshape(-1, 256)
        else:
            qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            qs = blocks[:, 48:176].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
            q = ((qs & 15).reshape(-1, 8, 32) | ((qh & 1) << 4)).reshape(-1, 256)
        return q, d[:, None] * sc, -(dmin[:, None] * mn), cpu_groups.Layout(4 if kind == "Q4_K" else 5, 32)
    if kind == "Q6_K":
        ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & 15).reshape(-1, 2, 128)
        qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        qh = (qh & 3).reshape(-1, 2, 128)
        q = (ql | (qh << 4)).reshape(-1, 256)
        scale = _f16(blocks, 208)[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
        return q, scale, -32 * scale, cpu_groups.Layout(6, 16, False, 32)
    raise KeyError(kind)


FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


def grouped(tensor) -> Grouped:
    """A GGUF tensor (gguf_file.TensorEntry, or a GGUFReader's: a quantized weight [n, k])
    as Grouped; its data stays mapped."""
    from gguf import GGML_QUANT_SIZES

    kind = tensor.tensor_type.name
    if kind not in FORMATS:
        raise InvalidArgumentError(
            "quantization", "gguf", f"GGUF tensors in {', '.join(FORMATS)} ({tensor.name}: {kind})"
        )
    k, n = (int(v) for v in tensor.shape[:2])
    per, size = GGML_QUANT_SIZES[tensor.tensor_type]
    blocks = np.asarray(tensor.data).reshape(n, (k // per) * size)
    rows = _chunk_rows(k, 1)
    parts = [_blocks(blocks[r : r + rows].reshape(-1, size), kind) for r in range(0, n, rows)]
    layout, groups = parts[0][3], k // parts[0][3].group

    def joined(i: int, dtype) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([np.asarray(p[i], dtype=dtype).reshape(-1) for p in parts]))

    return Grouped(
        joined(0, np.uint8).view(n, k),
        joined(1, np.float32).view(n, groups),
        joined(2, np.float32).view(n, groups),
        layout.bits,
        layout.group,
        layout.half,
        layout.offset,
    )


CHUNK = 1 << 22  # values a chunk of a tensor's rows holds while it is repacked


def _chunk_rows(k: int, multiple: int) -> int:
    return max(multiple, CHUNK // k // multiple * multiple)


class GgufWeights:
    """The quantized linears of a GGUF file by Hugging Face name, read on demand."""

    def __init__(self, path: Path, config):
        self.path = path
        index = gguf_file.GgufIndex(path)
        self.arch = index.arch
        self.tensors = {
            hf: t for t in index.tensors if (hf := gguf_file.hf_name(t.name, self.arch)) is not None
        }
        self.config = config

    def get(self, name: str) -> Grouped | None:
        """The weight `name` (HF) as Grouped, or None where the file holds it unquantized."""
        tensor = self.tensors.get(name)
        if tensor is None or tensor.tensor_type.name not in FORMATS or not name.endswith(".weight"):
            return None
        g = grouped(tensor)
        if (heads := gguf_file.rotary_heads(self.arch, name, self.config)) is not None:
            g = g._with(*(gguf_file.unpermute(t, heads) for t in (g.codes, g.scales, g.mins)))
        return g


def attach(model, path: Path, ignore: tuple[str, ...] = ()) -> set[str]:
    """Give each linear of `model` (and its LM head, and an untied embedding) its weight
    from the GGUF at `path` as `grouped`, the kernel's panels of this shard's rows or input
    columns (built a tensor at a time: the codes are held about once), for pack_model's
    "gguf", before any weight is loaded: each dense parameter they stand for
    becomes a meta tensor (never allocated, never loaded). Returns the Hugging Face names
    of the tensors held as codes; tensors the file holds unquantized, and modules `ignore`
    names (cpu_linear.ignored), load as usual."""
    from kvray.models.cpu_linear import ignored
    from kvray.models.layers import PackedLinear, RowParallelLinear

    weights = GgufWeights(path, model.config)
    held: set[str] = set()

    def hold(module: nn.Module, names: list[str]) -> None:
        module.weight = nn.Parameter(torch.empty_like(module.weight, device="meta"), requires_grad=False)
        held.update(names)

    for name, module in model.named_modules():
        if ignored(model, name, ignore):
            continue
        if isinstance(module, PackedLinear):
            names = [model._hf_name(f"{name}.weight", p) for p in module.offsets]
            parts = [(weights.get(hf), rows) for hf, (_, rows) in zip(names, module.offsets.values())]
            module.grouped = (
                None if any(g is None for g, _ in parts) else stacked([g.rows(r) for g, r in parts]).panels()
            )
        elif isinstance(module, RowParallelLinear):
            names = [model._hf_name(f"{name}.weight", None)]
            g = weights.get(names[0])
            module.grouped = None if g is None else g.columns(module.in_cols).panels()
        else:
            continue
        if module.grouped is not None:
            hold(module, names)
    # the last stage's LM head (a tied one's codes are the embedding's rows too: either name keeps both)
    kept = (
        ignored(model, "lm_head", ignore)
        or model.tie_word_embeddings
        and ignored(model, "embed_tokens", ignore)
    )
    if hasattr(model, "norm") and not kept:
        head = model.embed_tokens if model.tie_word_embeddings else model.lm_head
        hf = "model.embed_tokens.weight" if model.tie_word_embeddings else "lm_head.weight"
        g = weights.get(hf)
        model.grouped_head = None if g is None else g.rows(head.rows).panels()
        if g is not None:
            hold(head, [hf])
    untied = hasattr(model, "embed_tokens") and not model.tie_word_embeddings
    if untied and not ignored(model, "embed_tokens", ignore):
        g = weights.get("model.embed_tokens.weight")
        model.grouped_embed = None if g is None else g.rows(model.embed_tokens.rows).panels()
        if g is not None:
            hold(model.embed_tokens, ["model.embed_tokens.weight"])
    model.gguf_codes = True
    return held
