"""Maps Hugging Face architecture names to kvray model classes."""

from __future__ import annotations

from torch import nn

from kvray.errors import UnsupportedArchitectureError
from kvray.models.gemma3 import Gemma3ForCausalLM
from kvray.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def model_class(config) -> type[nn.Module]:
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise UnsupportedArchitectureError("model.architectures", archs, f"one of {sorted(MODEL_REGISTRY)}")
