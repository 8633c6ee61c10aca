"""A GGUF file read as a model's weights: its tensors by Hugging Face name, de-quantized one
at a time with gguf's own `dequantize` (what transformers' GGUF loader does, without
holding the whole model in fp32 at once), and the file's config and tokenizer.

A GGUF model's folder (models/fetch.py) holds config.json, the tokenizer and the file
itself (GGUF_NAME): `quantization="gguf"` keeps its quantized linears as codes
(models/gguf_groups.py) and reads only the rest here; any other load reads every tensor
here, each as its fp32 values.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

GGUF_NAME = "model.gguf"  # the source GGUF, kept in its model's folder

# GGUF tensor names -> Hugging Face's (llama, qwen2, gemma3), the part after "blk.N."
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma's four norms a layer: its ffn_norm comes before the MLP
_GEMMA_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
}


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one kvray does not load (rope
    frequency tables and the like, which the config already gives)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[3] not in ("weight", "bias"):
        return None
    names = {**_LAYER_NAMES, **_GEMMA_NAMES} if arch.startswith("gemma") else _LAYER_NAMES
    ours = names.get(parts[2])
    return None if ours is None else f"model.layers.{parts[1]}.{ours}.{parts[3]}"


def architecture(reader) -> str:
    """A GGUFReader's `general.architecture` (fetch's check; loads use GgufIndex.arch)."""
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else ""


@dataclass
class TensorEntry:
    """One tensor of a GGUF file, as GGUFReader names its parts: its bytes stay mapped."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying (k) first
    data: np.ndarray  # uint8 [rows, row bytes], a view of the mapped file


# GGUF metadata value types: struct formats of the fixed-size ones (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class GgufIndex:
    """A GGUF file's tensors, found by reading its header: the metadata is stepped over
    (only the architecture and alignment are kept), where gguf's GGUFReader builds an
    object per value (seconds, and 0.5 GB for a 151k-token vocabulary, at every load)."""

    def __init__(self, path: Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.file = np.memmap(path, dtype=np.uint8, mode="r")
        buf, at = memoryview(self.file), 0

        def take(fmt: str):
            nonlocal at
            values = struct.unpack_from("<" + fmt, buf, at)
            at += struct.calcsize("<" + fmt)
            return values[0] if len(values) == 1 else values

        def text() -> str:
            nonlocal at
            size = take("Q")
            at += size
            return bytes(buf[at - size : at]).decode("utf-8", "replace")

        def skip(kind: int) -> object:
            nonlocal at
            if kind == 8:
                return text()
            if kind == 9:
                inner, count = take("I"), take("Q")
                if inner in _SCALARS:
                    at += count * struct.calcsize(_SCALARS[inner])
                else:
                    for _ in range(count):
                        skip(inner)
                return None
            return take(_SCALARS[kind])

        magic, version = bytes(buf[:4]), struct.unpack_from("<I", buf, 4)[0]
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a GGUF v2+ file")
        at = 8
        count, kvs = take("Q"), take("Q")
        meta = {}
        for _ in range(kvs):
            key, kind = text(), take("I")
            value = skip(kind)
            if key in ("general.architecture", "general.alignment"):
                meta[key] = value
        self.arch = str(meta.get("general.architecture", ""))
        infos = []
        for _ in range(count):
            name, dims = text(), take("I")
            shape = tuple(take("Q") for _ in range(dims))
            infos.append((name, shape, GGMLQuantizationType(take("I")), take("Q")))
        align = int(meta.get("general.alignment", 32))
        start = -(-at // align) * align
        self.tensors = []
        for name, shape, kind, offset in infos:
            per, size = GGML_QUANT_SIZES[kind]
            rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
            row_bytes = shape[0] // per * size
            data = self.file[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
            self.tensors.append(TensorEntry(name, kind, shape, data))


def unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """llama q/k rows (or their per-row scales) back in Hugging Face's order: the converter
    interleaved each head's two rotary halves; transformers' GGUF loader undoes it so too."""
    return t.reshape(heads, t.shape[0] // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def rotary_heads(arch: str, name: str, config) -> int | None:
    """The heads to un-permute a llama q/k projection's rows by, else None."""
    if arch != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return None
    return config.num_attention_heads if "q_proj" in name else config.num_key_value_heads


def iter_gguf(path: Path, config, skip: Callable[[str], bool] = lambda name: False) -> Iterator:
    """(Hugging Face name, fp32 tensor) for each tensor of the GGUF at `path` that kvray
    loads and `skip(name)` does not refuse, de-quantized one at a time: the values
    transformers' GGUF loader gives (llama q/k rows un-permuted, Gemma's norms stored as
    1 + w read back as w)."""
    from gguf.quants import dequantize

    index = GgufIndex(path)
    arch = index.arch
    for tensor in index.tensors:
        name = hf_name(tensor.name, arch)
        if name is None or skip(name):
            continue
        shape = [int(v) for v in reversed(tensor.shape)]
        values = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), np.float32))  # a copy
        values = values.reshape(shape)
        if (heads := rotary_heads(arch, name, config)) is not None:
            values = unpermute(values, heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            values = values - 1
        yield name, values


def write_config_and_tokenizer(gguf: Path, out: Path) -> None:
    """The config, generation config and tokenizer (with its chat template) transformers
    reads from the GGUF's metadata, saved into `out`: no tensor is read."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.dtype = torch.float32  # what the file's tensors read as
    if not getattr(config, "architectures", None):  # what a saved model's config names
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
