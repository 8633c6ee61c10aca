"""A prefilled request that finds no free blocks on the decode side waits for some (while
its prefill's pin lasts) and pulls then, instead of recomputing its prompt there."""

from __future__ import annotations

import time

import pytest
from test_known_defects import _tiny_config

from kvray.engine import SamplingParams
from kvray.engine.config import EngineConfig
from kvray.engine.kv_handoff import LeasePolicy
from kvray.engine.llm_engine import LLMEngine
from kvray.errors import InvalidArgumentError

MARGIN = LeasePolicy().pull_margin_s  # how near its pin's end a waiting pull gives up

BLOCK_BYTES = 2 * 2 * 16 * 2 * 8 * 4  # layers x (K, V) x block_size x KV heads x head_dim x fp32


def _engine() -> LLMEngine:
    config = EngineConfig(model="tiny", dtype="float32", kv_cache_memory_bytes=10 * BLOCK_BYTES)
    engine = LLMEngine(config, hf_config=_tiny_config())
    assert engine.kv.pool.num_available == 10
    return engine


PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
LATER = time.time() + 3600  # a pin that lasts


def _fill(engine: LLMEngine) -> None:
    """A pulled 100-token prompt takes 7 of the 10 blocks, and runs."""
    assert len(engine.add_prefilled_request("big", list(range(1, 101)), PARAMS, 7, pull_deadline=LATER)) == 7
    engine.finish_kv_pull("big", ok=True)


def test_waits_for_blocks_then_pulls_without_recomputing():
    engine = _engine()
    _fill(engine)
    # 60 tokens need 4 blocks; 3 are free
    assert engine.add_prefilled_request("late", list(range(101, 161)), PARAMS, 7, pull_deadline=LATER) is None
    assert engine.waits_for_room("late")
    assert engine.handoff_step() == []  # still no room: it waits on
    granted = []
    while not granted:
        assert "big" in engine.outputs.tracked  # blocks come only as "big" finishes
        engine.step()
        granted = engine.handoff_step()
    ((rid, blocks),) = granted
    assert rid == "late" and len(blocks) == 4 and not engine.waits_for_room("late")
    engine.finish_kv_pull("late", ok=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.outputs[0].token_ids[0] for o in outs if o.finished] == [7]  # its first token kept
    assert engine.num_kv_recomputes == 0
    assert engine.kv_cache_stats().used_blocks == 0


def test_recomputes_when_the_pin_would_lapse_first():
    engine = _engine()
    _fill(engine)
    soon = time.time() + MARGIN + 60
    assert engine.add_prefilled_request("late", list(range(101, 161)), PARAMS, 7, pull_deadline=soon) is None
    assert engine.handoff_step(now=soon - MARGIN) == [("late", None)]  # too near: recompute
    assert engine.num_kv_recomputes == 1 and not engine.waits_for_room("late")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache_stats().used_blocks == 0
    # no deadline (no pin to pull from): recomputed at once
    _fill(engine)
    assert engine.add_prefilled_request("now", list(range(101, 161)), PARAMS, 7) is None
    assert not engine.waits_for_room("now") and engine.num_kv_recomputes == 2


def test_aborted_while_waiting_takes_no_blocks():
    engine = _engine()
    _fill(engine)
    assert engine.add_prefilled_request("late", list(range(101, 161)), PARAMS, 7, pull_deadline=LATER) is None
    final = engine.abort_request(["late"])[-1]  # (after its first token's output)
    assert final.request_id == "late" and final.finished and final.outputs[0].finish_reason == "abort"
    assert engine.handoff_step() == [("late", None)]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache_stats().used_blocks == 0 and engine.num_kv_recomputes == 0


def test_aborted_while_its_pull_writes_frees_the_blocks_only_when_the_pull_ends():
    """A transfer may still be writing into a pulling request's blocks: its abort ends the
    stream at once, but the 7 blocks stay out of the pool (and the id stays taken) until
    the pull reports back; then they are freed and nothing runs."""
    engine = _engine()
    blocks = engine.add_prefilled_request("big", list(range(1, 101)), PARAMS, 7, pull_deadline=LATER)
    assert len(blocks) == 7
    final = engine.abort_request(["big"])[-1]
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert engine.kv_cache_stats().used_blocks == 7 and engine.has_unfinished_requests()
    with pytest.raises(InvalidArgumentError, match="request_id"):
        engine.add_request("big", [1, 2, 3], PARAMS)
    engine.finish_kv_pull("big", ok=True)
    assert engine.kv_cache_stats().used_blocks == 0 and not engine.has_unfinished_requests()
    assert engine.step() == [] and engine.num_kv_recomputes == 0


def test_first_come_first_served_and_an_abort_behind_the_first_leaves_at_once():
    engine = _engine()
    _fill(engine)
    prompt = list(range(101, 161))
    assert engine.add_prefilled_request("first", prompt, PARAMS, 7, pull_deadline=LATER) is None
    # 20 tokens fit in the 3 free blocks, but "first" waits ahead of it: it queues
    assert engine.add_prefilled_request("second", list(range(1, 21)), PARAMS, 7, pull_deadline=LATER) is None
    assert engine.add_prefilled_request("third", list(range(1, 21)), PARAMS, 7, pull_deadline=LATER) is None
    assert engine.kv.pool.num_available == 3
    engine.abort_request(["third"])
    assert engine.handoff_step() == [("third", None)]  # gone while "first" still waits
    assert engine.stats().num_waiting == 2 and engine.stats().num_pulling == 2
    granted = []
    while not granted:
        engine.step()
        granted = engine.handoff_step()
    assert [(rid, len(blocks)) for rid, blocks in granted] == [("first", 4), ("second", 2)]
    engine.finish_kv_pull("first", ok=True)
    engine.finish_kv_pull("second", ok=True)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache_stats().used_blocks == 0 and engine.num_kv_recomputes == 0


def test_a_pin_too_near_to_lapse_means_recompute_even_once_there_is_room():
    engine = _engine()
    assert len(engine.add_prefilled_request("big", list(range(1, 121)), PARAMS, 7, pull_deadline=LATER)) == 8
    soon = time.time() + MARGIN + 60
    assert engine.add_prefilled_request("late", list(range(1, 61)), PARAMS, 7, pull_deadline=soon) is None
    assert engine.stats().num_running == 0 and engine.stats().num_pulling == 2
    engine.finish_kv_pull("big", ok=False)  # its pull failed: recomputed, as before; its blocks free
    assert engine.kv.pool.num_available == 10
    assert engine.handoff_step(now=soon) == [("late", None)]
    assert engine.num_kv_recomputes == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache_stats().used_blocks == 0
