"""A GGUF file's quantized tensors as grouped low-bit codes (kernels/cpu_groups.py), without
loss: `quantization="gguf"` multiplies by them as the file holds them (kernels/
cpu_linear_qg.c), where the loader's de-quantized copy would be 4-8x the bytes.

Every block format the shipped files use is a per-group affine map of unsigned codes:

    Q4_0  32 / group, 4 bits   d * (q - 8)          scale d, min -8 d
    Q4_1  32, 4 bits           d * q + m
    Q4_K  32, 4 bits           d sc_j * q - dmin m_j (6-bit sc_j, m_j per 32 of 256)
    Q5_0  32, 8-bit codes      d * (q - 16)
    Q5_1  32, 8-bit codes      d * q + m
    Q5_K  32, 8-bit codes      as Q4_K with a fifth bit
    Q6_K  16, 8-bit codes      d sc_j * (q - 32)    (int8 sc_j per 16 of 256)
    Q8_0  32, 8-bit codes      d * q                codes q + 128, min -128 d

The products (an fp16 times a 6- or 8-bit scale, times a code) fit fp32's mantissa, so
code * scale + min is the value `gguf.quants.dequantize` gives, bit for bit (the tests'
oracle). 5- and 6-bit codes are held in bytes (the kernel's codes are 4 or 8 bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvray.errors import InvalidArgumentError
from kvray.kernels import cpu_groups, cpu_native


@dataclass
class Grouped:
    """A weight [n, k] as codes (uint8) with a scale and min per group of `group` along k."""

    codes: torch.Tensor  # [n, k] uint8
    scales: torch.Tensor  # [n, k / group] fp32
    mins: torch.Tensor
    bits: int  # 4 or 8
    group: int  # 16 or 32

    def rows(self, rows: range) -> Grouped:
        r = slice(rows.start, rows.stop)
        return Grouped(self.codes[r], self.scales[r], self.mins[r], self.bits, self.group)

    def columns(self, cols: range) -> Grouped:
        """Columns [start, stop) of k (a tensor-parallel rank's), on group boundaries."""
        if cols.start % self.group or cols.stop % self.group:
            raise InvalidArgumentError(
                "tensor_parallel_size",
                str(cols),
                f"input-column slices on {self.group}-value group boundaries",
            )
        c, g = slice(cols.start, cols.stop), slice(cols.start // self.group, cols.stop // self.group)
        return Grouped(self.codes[:, c], self.scales[:, g], self.mins[:, g], self.bits, self.group)

    def as_layout(self, bits: int, group: int) -> Grouped:
        """The same weight with wider codes or smaller groups (no loss)."""
        assert bits >= self.bits and self.group % group == 0
        scales, mins = (t.repeat_interleave(self.group // group, 1) for t in (self.scales, self.mins))
        return Grouped(self.codes, scales, mins, bits, group)

    def panels(self) -> cpu_native.Panels:
        """In the kernel's panels (kernels/cpu_groups.py)."""
        n, k = self.codes.shape
        return cpu_native.Panels(
            cpu_groups.to_panels(self.codes, self.scales, self.mins, self.bits, self.group), n, k
        )


def stacked(parts: list[Grouped]) -> Grouped:
    """Parts stacked along n (q|k|v, gate|up) in one layout: the widest codes, the smallest group."""
    bits, group = max(p.bits for p in parts), min(p.group for p in parts)
    parts = [p.as_layout(bits, group) for p in parts]
    return Grouped(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.mins for p in parts]),
        bits,
        group,
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


def _blocks(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """[blocks, bytes] of one format -> codes [blocks, values], scales and mins [blocks, groups]"""
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
        return q, d[:, None], mins[:, None], 4 if kind.startswith("Q4") else 8, 32
    if kind == "Q8_0":
        d = _f16(blocks, 0)
        q = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d[:, None], (-128 * d)[:, None], 8, 32
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
        return q, d[:, None] * sc, -(dmin[:, None] * mn), 4 if kind == "Q4_K" else 8, 32
    if kind == "Q6_K":
        ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & 15).reshape(-1, 2, 128)
        qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        qh = (qh & 3).reshape(-1, 2, 128)
        q = (ql | (qh << 4)).reshape(-1, 256)
        scale = _f16(blocks, 208)[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
        return q, scale, -32 * scale, 8, 16
    raise KeyError(kind)


FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


def grouped(tensor) -> Grouped:
    """A GGUFReader tensor (a quantized weight [n, k]) as Grouped; its data stays mapped."""
    from gguf import GGML_QUANT_SIZES

    kind = tensor.tensor_type.name
    if kind not in FORMATS:
        raise InvalidArgumentError(
            "quantization", "gguf", f"GGUF tensors in {', '.join(FORMATS)} ({tensor.name}: {kind})"
        )
    k, n = (int(v) for v in tensor.shape[:2])
    per, size = GGML_QUANT_SIZES[tensor.tensor_type]
    blocks = np.asarray(tensor.data).reshape(n * (k // per), size)
    q, scales, mins, bits, group = _blocks(blocks, kind)
    return Grouped(
        torch.from_numpy(np.ascontiguousarray(q)).view(n, k),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)).reshape(n, k // group),
        torch.from_numpy(np.ascontiguousarray(mins, dtype=np.float32)).reshape(n, k // group),
        bits,
        group,
    )


# GGUF tensor names -> Hugging Face's (llama, qwen2, gemma3)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF weight, or None for one that is not a linear's."""
    if name == "output.weight":
        return "lm_head.weight"
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def _unpermuted(g: Grouped, heads: int) -> Grouped:
    """llama q/k rows back in Hugging Face's order (the converter interleaved each head's
    two rotary halves; transformers' GGUF loader undoes it the same way)"""

    def order(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(heads, t.shape[0] // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    return Grouped(order(g.codes), order(g.scales), order(g.mins), g.bits, g.group)


class GgufWeights:
    """The quantized linears of a GGUF file by Hugging Face name, read on demand."""

    def __init__(self, path: Path, config):
        from gguf import GGUFReader

        self.path = path
        self.reader = GGUFReader(str(path))
        self.tensors = {hf: t for t in self.reader.tensors if (hf := hf_name(t.name)) is not None}
        arch = self.reader.fields.get("general.architecture")
        self.arch = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else ""
        self.config = config

    def get(self, name: str) -> Grouped | None:
        """The weight `name` (HF) as Grouped, or None where the file holds it unquantized."""
        tensor = self.tensors.get(name)
        if tensor is None or tensor.tensor_type.name not in FORMATS:
            return None
        g = grouped(tensor)
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config.num_attention_heads if "q_proj" in name else self.config.num_key_value_heads
            g = _unpermuted(g, heads)
        return g


def attach(model, path: Path) -> int:
    """Give each linear of `model` (and its LM head) its weight from the GGUF at `path` as
    `grouped` (this shard's rows or input columns), for pack_model's "gguf"; returns how
    many it found quantized. Tensors the file holds unquantized stay as loaded."""
    from kvray.models.layers import PackedLinear, RowParallelLinear

    weights = GgufWeights(path, model.config)
    found = 0
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            parts = [
                (weights.get(model._hf_name(f"{name}.weight", p)), rows)
                for p, (_, rows) in module.offsets.items()
            ]
            module.grouped = (
                None if any(g is None for g, _ in parts) else stacked([g.rows(r) for g, r in parts])
            )
        elif isinstance(module, RowParallelLinear):
            g = weights.get(model._hf_name(f"{name}.weight", None))
            module.grouped = None if g is None else g.columns(module.in_cols)
        else:
            continue
        found += module.grouped is not None
    if hasattr(model, "norm"):  # the last stage: its LM head (a tied one is the embedding's rows)
        head = model.embed_tokens if model.tie_word_embeddings else model.lm_head
        g = weights.get("model.embed_tokens.weight" if model.tie_word_embeddings else "lm_head.weight")
        model.grouped_head = None if g is None else g.rows(head.rows)
        found += g is not None
    if hasattr(model, "embed_tokens") and not model.tie_word_embeddings:  # an untied embedding's own codes
        g = weights.get("model.embed_tokens.weight")
        model.grouped_embed = None if g is None else g.rows(model.embed_tokens.rows)
        found += g is not None
    return found
