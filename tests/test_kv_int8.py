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


def test_a_pull_between_different_kinds_of_cache_is_refused_before_any_byte_moves():
    """The decode side checks the ticket's layout first: int8 blocks never land in an
    fp32 cache (it recomputes instead), and the prefill side is still told to unpin."""
    import asyncio
    import dataclasses
    import time

    import torch

    from kvray.actors.kv_pull import KVPuller
    from kvray.engine.kv_transfer import KVLayout, KVTicket
    from kvray.engine.kv_views import KVViews

    fp32 = KVLayout(30, 16, 3, 64, "float32", 9)
    int8 = dataclasses.replace(fp32, dtype="int8", quant="int8")
    released = []

    class Prefill:  # the prefill worker's actor handle: only release_kv is called
        class release_kv:  # noqa: N801 (Ray's method handle)
            @staticmethod
            def remote(request_id):
                released.append(request_id)

    class Connector:  # no transfer may start
        async def pull(self, *args):
            raise AssertionError("a pull started")

    puller = KVPuller(Connector(), fp32, [])
    ticket = KVTicket("prefill-0", "r1", (1, 2), 20, (), int8, time.time() + 30)
    into = KVViews(torch.zeros(1)).of([5, 6])
    assert asyncio.run(puller.pull(ticket, Prefill(), into)) is False
    assert released == ["r1"] and puller.bytes_pulled == 0
    assert (int8.row_width, int8.packed_bytes(1), fp32.packed_bytes(1)) == (68, 195_840, 737_280)
    with pytest.raises(ValueError, match="cache_dtype"):
        fp32.check_pull_from(int8)
    fp32.check_pull_from(dataclasses.replace(fp32, dtype="bfloat16"))  # floats convert as they land
