"""A step's deltas as the front joins them (router/inbox.py `join`): tokens and text in
order, the first delta's queue time and cached tokens, the last's finish and cost, a
worker's failure wherever it came; hand-checkable values."""

from __future__ import annotations

from kvray.actors.messages import Delta, DeltaInfo
from kvray.router.inbox import join


def test_joined_deltas_keep_each_info_field_once():
    first = Delta("r", [5], "a", None, None, None, DeltaInfo(queue_seconds=0.25, num_cached_tokens=16))
    middle = Delta("r", [6, 7], "bc", None, None, None)
    last = Delta("r", [8], "d", None, "length", None, DeltaInfo(cost_usd=0.5))
    joined = join([first, middle, last])
    assert joined.token_ids == [5, 6, 7, 8] and joined.text == "abcd" and joined.finish_reason == "length"
    assert joined.info == DeltaInfo(queue_seconds=0.25, num_cached_tokens=16, cost_usd=0.5)
    assert join([middle, middle]).info is None  # nothing to say
    failed = Delta("r", [], "", None, None, None, DeltaInfo(worker_failed="EngineDeadError: step broke"))
    assert join([first, failed]).info.worker_failed == "EngineDeadError: step broke"
    assert join([first, failed]).info.queue_seconds == 0.25
