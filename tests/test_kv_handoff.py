"""Prefill on one engine, decode on another, KV blocks handed over in between (no Ray).

The reference is the offline engine running each request alone in one place: the
disaggregated path must give exactly its tokens, recompute when a lease has ended, and
leave no block used or pinned on either side.
"""

from __future__ import annotations

import pytest

from kvray.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from kvray.engine.kv_handoff import LeasePolicy
from kvray.engine.kv_transfer import pack_blocks, prefill_params, unpack_blocks

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox",
    "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of the "
    "Caribbean, which he believed to be part of Asia. His voyages",
    "def add(a, b):\n    return",
    "Water boils at",
]


@pytest.fixture(scope="module")
def engines(smollm2_path):
    cfg = EngineConfig(
        model=str(smollm2_path), dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20
    )
    return LLMEngine(cfg), LLMEngine(cfg)


def _run(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for out in engine.step():  # outputs produced between steps
        done[out.request_id] = out
    return done


def _handoff(prefill: LLMEngine, decode: LLMEngine, params: SamplingParams, lease: float, late: bool):
    prefill.handoff.policy = LeasePolicy(lease_s=lease)  # the prefill worker's rules
    for i, p in enumerate(PROMPTS):
        prefill.add_request(str(i), p, prefill_params(params), pin_kv=True)
    firsts = _run(prefill)
    if late:  # a zero lease has ended by the time the decode side asks
        prefill.expire_kv_leases()
    for i, p in enumerate(PROMPTS):
        rid = str(i)
        first = firsts[rid].outputs[0]
        ticket = prefill.kv_ticket("prefill-0", rid)
        assert late == (ticket is None)
        blocks = decode.add_prefilled_request(rid, p, params, first.token_ids[0])
        if blocks is None:
            continue
        src = prefill.pins.begin_read(rid)
        if src is None:
            decode.finish_kv_pull(rid, ok=False)
            continue
        assert list(ticket.block_ids) == src and ticket.num_tokens == len(firsts[rid].prompt_token_ids)
        unpack_blocks(decode.runner.kv_cache, blocks, pack_blocks(prefill.runner.kv_cache, src))
        prefill.pins.end_read(rid)
        decode.finish_kv_pull(rid, ok=True)
        assert prefill.release_kv(rid)
    return _run(decode)


@pytest.mark.parametrize("late", [False, True], ids=["pulled", "lease-expired"])
def test_disaggregated_tokens_equal_offline(engines, smollm2_path, late):
    prefill, decode = engines
    params = SamplingParams(temperature=0.0, max_tokens=12)
    offline = LLM(model=str(smollm2_path), dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20)
    want = offline.generate(PROMPTS, params)
    recomputes = decode.num_kv_recomputes
    got = _handoff(prefill, decode, params, lease=0.0 if late else 30.0, late=late)
    for i, w in enumerate(want):
        assert got[str(i)].outputs[0].token_ids == w.outputs[0].token_ids
        assert got[str(i)].outputs[0].text == w.outputs[0].text
    assert decode.num_kv_recomputes - recomputes == (len(PROMPTS) if late else 0)
    for engine in (prefill, decode):
        assert engine.kv_cache_stats().used_blocks == 0 and len(engine.pins) == 0
        engine.kv.pool.check_integrity()


def test_seeded_sampling_continues_across_the_handoff(engines, smollm2_path):
    prefill, decode = engines
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10)
    offline = LLM(model=str(smollm2_path), dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20)
    want = offline.generate(PROMPTS, params)
    got = _handoff(prefill, decode, params, lease=30.0, late=False)
    assert [got[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == [
        w.outputs[0].token_ids for w in want
    ]
