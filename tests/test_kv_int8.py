"""An int8 KV cache in the engine on the real SmolLM2: the block budget it buys, and that
bad cache dtypes are refused by name. Greedy agreement with transformers is in
test_parity_hf.py, the kernels in test_torch_backend.py and test_kernels_triton.py, the
PD pull of an int8 cache in test_disaggregated.py."""

from __future__ import annotations

import pytest

from kvray.engine import LLM
from kvray.errors import InvalidArgumentError

pytestmark = pytest.mark.slow
BUDGET = 64 << 20


def test_int8_holds_3_7x_the_fp32_blocks_of_a_budget(smollm2_path):
    """SmolLM2: 30 layers x K,V x 16 tokens x 3 KV heads; a row is 64 fp32 (256 B) or 64
    int8 codes + a 4-byte scale (68 B): 737,280 B against 195,840 B a block."""
    fp32 = LLM(model=str(smollm2_path), dtype="float32", max_model_len=512, kv_cache_memory_bytes=BUDGET)
    int8 = LLM(
        model=str(smollm2_path),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=BUDGET,
        kv_cache_dtype="int8",
    )
    assert fp32.kv_cache_stats().total_blocks == BUDGET // 737_280 == 91
    assert int8.kv_cache_stats().total_blocks == BUDGET // 195_840 == 342
    assert int8.kv_cache_stats().total_blocks >= 3.5 * fp32.kv_cache_stats().total_blocks
    assert int8.engine.kv_layout.cache_dtype == "int8" and int8.engine.kv_layout.row_width == 68


@pytest.mark.parametrize(("value", "allowed"), [("int4", "one of"), ("fp8_e4m3", "CUDA only")])
def test_bad_kv_cache_dtype_names_the_field(smollm2_path, value, allowed):
    with pytest.raises(InvalidArgumentError) as e:
        LLM(model=str(smollm2_path), dtype="float32", max_model_len=256, kv_cache_dtype=value)
    assert e.value.field == "kv_cache_dtype" and allowed in e.value.allowed
