"""kvray/tracing.py and actors/request_spans.py against a real OTLP/HTTP receiver
(benchmarks/otlp_receiver.py) in this process: a root continued from a `traceparent`,
children under it through the W3C carrier, an engine's monotonic times mapped to spans of
hand-checkable lengths, a prefilled request's decode alone, and the root's error status
(set for a failure, not for a client that left)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from otlp_receiver import OTLPReceiver  # noqa: E402

from kvray.actors.request_spans import record_engine_spans  # noqa: E402
from kvray.engine.outputs import RequestMetrics  # noqa: E402
from kvray.tracing import Tracing, traces_endpoint  # noqa: E402

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture
def receiver():
    r = OTLPReceiver()
    yield r
    r.close()


def test_the_endpoint_comes_from_the_config_else_the_otel_variable(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert traces_endpoint(None) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/v1/traces")
    assert traces_endpoint(None) == "http://c:4318/v1/traces"
    assert traces_endpoint("http://mine/v1/traces") == "http://mine/v1/traces"


def test_root_children_and_engine_spans_in_one_trace(receiver):
    tracing = Tracing(receiver.endpoint, "ingress")
    trace = tracing.request({"traceparent": f"00-{TRACE}-{PARENT}-01"}, {"gen_ai.request.id": "r1"})
    assert trace.carrier["traceparent"].startswith(f"00-{TRACE}-")
    trace.record("ingress", trace.start_ns, trace.start_ns + 2_000_000)
    now = time.monotonic()  # an engine's clock: arrival, scheduled 0.5 s later, tokens at 1 s and 2 s
    metrics = RequestMetrics(now - 3.0, now - 2.5, first_token_time=now - 2.0, last_token_time=now - 1.0)
    worker = Tracing(receiver.endpoint, "mixed")
    record_engine_spans(worker, trace.carrier, metrics, {"kvray.role": "mixed"})
    record_engine_spans(worker, trace.carrier, metrics, {"kvray.role": "decode"}, ("decode",))
    trace.first_token()
    trace.end()
    tracing.shutdown()  # flushes: no waiting for the batch delay
    worker.shutdown()
    spans = receiver.trace(TRACE)
    by = {(s.name, s.attributes.get("kvray.role")): s for s in spans}
    root = by[("llm_request", None)]
    assert root.parent_span_id == PARENT and root.attributes["gen_ai.request.id"] == "r1"
    assert root.attributes["gen_ai.latency.e2e"] >= root.attributes["gen_ai.latency.time_to_first_token"] > 0
    assert all(s.parent_span_id == root.span_id for s in spans if s is not root)
    assert by[("ingress", None)].end_ns - by[("ingress", None)].start_ns == 2_000_000

    def seconds(name, role):
        s = by[(name, role)]
        return (s.end_ns - s.start_ns) / 1e9

    assert seconds("queue", "mixed") == pytest.approx(0.5, abs=1e-6)
    assert seconds("prefill", "mixed") == pytest.approx(0.5, abs=1e-6)
    assert seconds("decode", "mixed") == pytest.approx(1.0, abs=1e-6)
    # prefilled elsewhere: its decode runs from the step that took it in
    assert seconds("decode", "decode") == pytest.approx(1.5, abs=1e-6)
    assert ("queue", "decode") not in by and ("prefill", "decode") not in by
    # the engine's times land where the wall clock had them (within the test's own run)
    assert abs(by[("queue", "mixed")].start_ns - (time.time_ns() - 3e9)) < 2e9
    assert {s.resource["kvray.component"] for s in spans} == {"ingress", "mixed"}


def test_a_failure_marks_the_root_and_a_client_that_left_or_erred_does_not(receiver):
    from kvray.router.api_error import APIError

    tracing = Tracing(receiver.endpoint, "ingress")
    failed, left, bad, overloaded = (tracing.request() for _ in range(4))
    failed.end(ValueError("boom"))
    failed.end()  # once only
    left.end(asyncio.CancelledError())
    bad.end(APIError(400, "temperature: must be >= 0"))
    overloaded.end(APIError(503, "busy"))
    tracing.shutdown()
    spans = {s.span_id: s for s in receiver.spans}
    assert len(spans) == 4

    def received(trace):
        return spans[trace.span.get_span_context().span_id.to_bytes(8, "big").hex()]

    assert received(failed).status_code == 2
    assert received(left).status_code != 2 and received(left).attributes["kvray.client_left"] is True
    assert received(bad).status_code != 2 and received(bad).attributes["http.response.status_code"] == 400
    assert received(overloaded).status_code == 2
    assert received(overloaded).attributes["http.response.status_code"] == 503


def test_an_unsampled_parent_leaves_the_request_untraced(receiver):
    tracing = Tracing(receiver.endpoint, "ingress")
    assert tracing.request({"traceparent": f"00-{TRACE}-{PARENT}-00"}) is None  # sampled flag off
    assert tracing.request({"traceparent": f"00-{TRACE}-{PARENT}-01"}) is not None
    tracing.shutdown()


def test_tracing_off_loads_no_exporter():
    """The serving modules load without kvray's tracer: no OTLP exporter is imported (Ray
    itself loads parts of OpenTelemetry for its own metrics)."""
    code = (
        "import sys; import kvray.router.app, kvray.actors.launch, kvray.router.generation; "
        "print([m for m in sys.modules if m.startswith('opentelemetry.exporter.otlp')])"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_an_embeddings_request_is_a_root_and_the_workers_embed_span(receiver):
    """The route and the pool's replica class, joined by a stand-in for Serve's handle
    (each `.remote(...)` awaits the replica's method), both exporting to the receiver."""
    from kvray.router.embedding_pool import EmbeddingReplica
    from kvray.router.embeddings_route import EmbeddingsRoute
    from kvray.router.ingress_parts import Admission

    config = {
        "embedding": {"engine": {"model": "all-minilm-l6-v2"}},
        "otlp_traces_endpoint": receiver.endpoint,
    }
    replica = EmbeddingReplica.func_or_class(config)

    class Method:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args):
            return self.fn(*args)

    async def model_info():
        return replica.model_info()

    handle = type("Handle", (), {"embed": Method(replica.embed), "model_info": Method(model_info)})()
    route = EmbeddingsRoute(
        handle, "all-minilm-l6-v2", Admission(8, 1), Tracing(receiver.endpoint, "ingress")
    )
    body = {"model": "all-minilm-l6-v2", "input": ["a river", "of stone"]}
    answer = asyncio.run(route.answer(body, {"traceparent": f"00-{TRACE}-{PARENT}-01"}))
    route.tracing.shutdown()
    replica.tracing.shutdown()
    replica.batcher.close()
    spans = {s.name: s for s in receiver.trace(TRACE)}
    assert set(spans) == {"llm_request", "embed"}
    root, embed = spans["llm_request"], spans["embed"]
    assert root.parent_span_id == PARENT and embed.parent_span_id == root.span_id
    tokens = answer["usage"]["prompt_tokens"]
    assert (
        root.attributes["gen_ai.usage.prompt_tokens"]
        == embed.attributes["gen_ai.usage.prompt_tokens"]
        == tokens
    )
    assert root.attributes["gen_ai.request.id"].startswith("embd-") and embed.attributes["kvray.inputs"] == 2
    assert embed.resource["kvray.component"] == "embedding"
