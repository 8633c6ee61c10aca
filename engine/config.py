"""Engine arguments: a plain dataclass (the engine path stays free of pydantic and Ray).

Values the engine discovers at start-up (number of KV blocks, EOS ids, the model's
context length) live on the engine, never written back into this object.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvray.engine import request_limits as limits
from kvray.engine.spec_decode import SpeculativeConfig
from kvray.errors import InvalidArgumentError, check_range
from kvray.kernels.kv_quant import KV_CACHE_DTYPES

DTYPES = ("float32", "bfloat16", "float16", "auto")
POLICIES = ("fcfs", "priority", "deadline")
# weights kept quantized (vLLM's `quantization=`): None (the default), the checkpoint's own:
# "gguf" where `model` names a GGUF (an alias or a .gguf file) and the native CPU kernels
# run, else its values cast to `dtype` (`quantization_ignore=["*"]` de-quantizes a GGUF's
# too); "int8": every
# layer's linears quantized at load, weight-only, one symmetric scale per output channel,
# multiplied by the native CPU kernels (the LM head too; the embedding's rows stay in
# `dtype`); "int4": the same, as 4-bit codes with a scale and min per group of
# `quantization_group_size` values (32 or 128; kernels/cpu_groups.py); "gguf": a GGUF
# model's quantized tensors as the file holds them (models/gguf_groups.py), with
# activations quantized per group of 16-32 values as
# llama.cpp's kernels do; "fp8": e4m3 weights with a scale per output channel, activations
# quantized per row, torch._scaled_mm (for CUDA GPUs; models/fp8_linear.py)
QUANTIZATIONS = (None, "int8", "int4", "gguf", "fp8")
INT4_GROUPS = (32, 128)
DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB of KV cache on CPUs unless told otherwise


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # auto: bf16 on CUDA (fp16 without bf16); on CPU bf16 only if native, else fp32
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; int8 (any device), fp8_e4m3 (CUDA)
    quantization: str | None = None  # QUANTIZATIONS
    # modules kept in `dtype` under `quantization` (shell patterns of module names, as
    # compressed-tensors' `ignore`): "lm_head", "embed_tokens", "layers.0.*",
    # "*.down_proj" (attention's q/k/v are one `qkv_proj`, the MLP's gate/up `gate_up_proj`)
    quantization_ignore: tuple[str, ...] = ()
    # "int4"'s group along k (GPTQ's and AWQ's group_size): 32, or 128 (a quarter of the
    # scales' bytes: 4.5 bits a weight against 6; the activations are quantized per group too)
    quantization_group_size: int = 32
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on CPU, gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = 0.9
    attention_backend: str | None = None  # None: triton on CUDA, torch on CPU
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    seed: int = 0
    scheduling_policy: str = "fcfs"
    device: str | None = None  # None: cuda when available
    # vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": k, ...};
    # parsed into a SpeculativeConfig here (None: no speculation)
    speculative_config: SpeculativeConfig | dict | None = None
    # a folder: a served engine writes each step's batch and seconds there as JSON lines
    # (steps-<pid>.jsonl), what `kvray bench step-times --from-trace` fits kvray.sim to
    step_trace_dir: str | None = None
    # what one request may ask (engine/request_limits.py; the ingress checks the same)
    max_stop_strings: int = limits.MAX_STOP_STRINGS
    max_stop_string_length: int = limits.MAX_STOP_STRING_LENGTH  # characters
    max_grammar_bytes: int = limits.MAX_GRAMMAR_BYTES  # a structured output's schema/grammar
    max_grammar_depth: int = limits.MAX_GRAMMAR_DEPTH  # a JSON schema's nesting
    # a step (or anything else the engine loop does between waits) running longer than this
    # marks the engine unhealthy: its worker fails its health check and is replaced, and its
    # requests move to other workers. Generous: a long prompt chunk of a large model on a
    # CPU, or a first step that compiles GPU kernels, takes tens of seconds.
    step_timeout_s: float = 300.0
    # CPU: a decode step of up to 64 rows runs every layer in one native call
    # (models/native_decode.py); KVRAY_FUSED_DECODE=0 turns it off too, read once, here
    fused_decode: bool = field(default_factory=lambda: os.environ.get("KVRAY_FUSED_DECODE", "1") != "0")

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.dtype not in DTYPES:
            raise InvalidArgumentError("dtype", self.dtype, f"one of {DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidArgumentError("kv_cache_dtype", self.kv_cache_dtype, f"one of {KV_CACHE_DTYPES}")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidArgumentError("quantization", self.quantization, f"one of {list(QUANTIZATIONS)}")
        ignore = self.quantization_ignore
        if isinstance(ignore, str) or not all(isinstance(p, str) and p for p in ignore):
            raise InvalidArgumentError(
                "quantization_ignore", ignore, "a list of module name patterns, e.g. [lm_head, layers.0.*]"
            )
        object.__setattr__(self, "quantization_ignore", tuple(ignore))
        if self.quantization_group_size not in INT4_GROUPS:
            raise InvalidArgumentError(
                "quantization_group_size", self.quantization_group_size, f"one of {list(INT4_GROUPS)}"
            )
        if self.block_size not in (8, 16, 32, 64, 128):
            raise InvalidArgumentError("block_size", self.block_size, "one of 8, 16, 32, 64, 128")
        check_range("max_num_seqs", self.max_num_seqs, low=1)
        check_range("max_num_batched_tokens", self.max_num_batched_tokens, low=1)
        if self.max_model_len is not None:
            check_range("max_model_len", self.max_model_len, low=1)
        if self.kv_cache_memory_bytes is not None:
            check_range("kv_cache_memory_bytes", self.kv_cache_memory_bytes, low=1)
        check_range("gpu_memory_utilization", self.gpu_memory_utilization, low=0.0, high=1.0, low_open=True)
        if self.scheduling_policy not in POLICIES:
            raise InvalidArgumentError("scheduling_policy", self.scheduling_policy, f"one of {POLICIES}")
        check_range("tensor_parallel_size", self.tensor_parallel_size, low=1)
        check_range("pipeline_parallel_size", self.pipeline_parallel_size, low=1)
        for name in limits.CONFIGURABLE:
            check_range(name, getattr(self, name), low=1)
        check_range("step_timeout_s", self.step_timeout_s, low=0.0, low_open=True)
