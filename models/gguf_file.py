"""A GGUF file read as a model's weights: its tensors by Hugging Face name, de-quantized one
at a time with gguf's own `dequantize` (what transformers' GGUF loader does, without
holding the whole model in fp32 at once), and the file's config and tokenizer.

A GGUF model's folder (models/fetch.py) holds config.json, the tokenizer and the file
itself (GGUF_NAME): `quantization="gguf"` keeps its quantized linears as codes
(models/gguf_groups.py) and reads only the rest here; any other load reads every tensor
here, each as its fp32 values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else ""


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
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = architecture(reader)
    for tensor in reader.tensors:
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
