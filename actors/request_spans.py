"""A worker's spans of one traced request (kvray/tracing.py), from the times its engine
measured (`RequestMetrics`, monotonic seconds of this process): `queue` (arrival to the
first step that scheduled it), `prefill` (that step to its first token) and `decode` (the
first token to the last). A prefilled request on a decode worker has no queue or prefill
here (they ran on its prefill worker): its `decode` runs from the step that took it in."""

from __future__ import annotations

from kvray.engine.outputs import RequestMetrics
from kvray.tracing import Tracing, clock_offset_ns, wall_ns


def record_engine_spans(
    tracing: Tracing,
    carrier: dict[str, str],
    metrics: RequestMetrics,
    attributes: dict,
    phases: tuple[str, ...] = ("queue", "prefill", "decode"),
) -> None:
    """Record the request's `phases` whose ends the engine has seen."""
    scheduled, first, last = metrics.first_scheduled_time, metrics.first_token_time, metrics.last_token_time
    spans = {
        "queue": (metrics.arrival_time, scheduled),
        "prefill": (scheduled, first),
        "decode": (first if "prefill" in phases else scheduled or metrics.arrival_time, last),
    }
    offset = clock_offset_ns()
    for name in phases:
        start, end = spans[name]
        if start is not None and end is not None and end >= start:
            tracing.record(name, carrier, wall_ns(start, offset), wall_ns(end, offset), attributes)
