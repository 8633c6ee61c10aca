"""vLLM's per-request `priority` through HTTP into the pools' `scheduling_policy: priority`
(the apps of tests/serve_fixtures.py: the colocated one schedules by priority, two requests
at a time; the PD one first come, first served)."""

from __future__ import annotations

import threading
import time

import pytest

httpx = pytest.importorskip("httpx2")
pytest.importorskip("ray")
from serve_fixtures import API_KEY, MODEL, wait_clean, worker_stats  # noqa: E402

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def test_a_high_priority_request_overtakes_the_queued_ones(colo_server):
    """Six long requests at priority 10: two run, four queue. One at priority 0 sent after
    them runs as soon as a slot frees, before the four queued ones; first come, first
    served it would finish after at least four of them."""
    finished: list[str] = []
    lock = threading.Lock()

    def complete(tag: str, priority: int, max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": f"Count slowly, request {tag}:", "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0, "priority": priority}  # fmt: skip
        r = httpx.post(f"{colo_server}/v1/completions", json=body, headers=HEADERS, timeout=600)
        assert r.status_code == 200, r.text
        with lock:
            finished.append(tag)

    low = [threading.Thread(target=complete, args=(f"low{i}", 10, 48)) for i in range(6)]
    for t in low:
        t.start()
    deadline = time.monotonic() + 120
    while sum(s.num_waiting for s in worker_stats("colo")) < 4:  # two running, four queued
        assert time.monotonic() < deadline, "the low-priority requests never queued"
        time.sleep(0.1)
    high = threading.Thread(target=complete, args=("high", 0, 8))
    high.start()
    for t in [*low, high]:
        t.join(timeout=600)
    assert len(finished) == 7
    assert finished.index("high") <= 2, finished  # only the two that were running finished first
    wait_clean(app="colo")


def test_a_priority_the_pools_do_not_schedule_by_is_a_400(server):
    def complete(priority: int):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "priority": priority}
        return httpx.post(f"{server}/v1/completions", json=body, headers=HEADERS, timeout=60)

    r = complete(5)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "priority" and "scheduling_policy" in error["message"]
    assert complete(0).status_code == 200
