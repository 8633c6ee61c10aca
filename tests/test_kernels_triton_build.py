"""How the Triton kernels build and import, each in a fresh interpreter: the package
imports without Triton (the torch backend alone), and without a GPU every kernel, 8-bit
caches included, compiles to sm_90 cubin (GPU-only rules: tl.dot sizes, loop-carried
types)."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


def test_package_imports_without_triton():
    script = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` fail
        "import kvray.kernels as k, kvray.kernels.reference as r\n"
        "from kvray.kernels.backend import available_backends\n"
        "assert callable(r.unified_attention_ref) and callable(r.reshape_and_cache_ref)\n"
        "assert not hasattr(k, 'unified_attention') and not hasattr(k, 'reshape_and_cache')\n"
        "assert available_backends() == ['torch'], available_backends()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


_AOT_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from kvray.kernels import triton_attention as ta, triton_cache as tc, triton_decode_split as ts
INT_PTRS = {"cu_seqlens_q_ptr": "*i32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32",
            "slot_mapping_ptr": "*i64", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
            "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
def compile_for_sm90(fn, dtype, consts, cache=None):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("k_cache_ptr", "v_cache_ptr") and cache:
            sig[name] = "*" + cache  # an 8-bit cache's codes
        elif name.endswith("_ptr"):
            sig[name] = INT_PTRS.get(name, "*" + dtype)
        else:
            sig[name] = "fp32" if name in ("qk_scale", "qmax") else "i32"
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
attn = dict(GROUP=4, BLOCK_SIZE=16, TILE_N=32, BLOCK_D=128, HAS_WINDOW=True, DOT_PRECISION="tf32",
            QUANT=False)
for block_m in (16, 64):
    consts = dict(attn, BLOCK_M=block_m, BLOCK_Q=block_m // 4)
    compile_for_sm90(ta._unified_attention_kernel, "fp16", consts)
compile_for_sm90(ta._unified_attention_kernel, "fp32",
                 dict(attn, GROUP=3, BLOCK_M=16, BLOCK_Q=5, HAS_WINDOW=False, DOT_PRECISION="ieee"))
compile_for_sm90(ts._split_decode_kernel, "bf16", dict(attn, GROUP=8, BLOCK_M=16))
compile_for_sm90(ts._split_reduce_kernel, "bf16", dict(BLOCK_SPLITS=8, BLOCK_D=128))
compile_for_sm90(tc._reshape_and_cache_kernel, "fp16", dict(BLOCK_H=8, BLOCK_D=128, QUANT=False, ROUND=False))
# 8-bit caches: int8 and fp8 e4m3 codes with fp32 scales, dequantized in the tiles
for codes, rounds in (("i8", True), ("fp8e4nv", False)):
    quant = dict(attn, QUANT=True)
    compile_for_sm90(ta._unified_attention_kernel, "bf16", dict(quant, BLOCK_M=64, BLOCK_Q=16), codes)
    compile_for_sm90(ts._split_decode_kernel, "bf16", dict(quant, GROUP=8, BLOCK_M=16), codes)
    cache = dict(BLOCK_H=8, BLOCK_D=128, QUANT=True, ROUND=rounds)
    compile_for_sm90(tc._reshape_and_cache_kernel, "bf16", cache, codes)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile for real")
def test_kernels_compile_for_sm90_without_a_gpu():
    """GPU-only rules (tl.dot sizes, loop-carried types) checked by compiling to cubin."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
