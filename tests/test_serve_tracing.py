"""OpenTelemetry traces (kvray/tracing.py) from the PD test app (tests/serve_fixtures.py:
`otlp_traces_endpoint` set to an OTLP/HTTP receiver this test process runs): one trace per
request with the ingress's root and its spans, the prefill worker's, the decode worker's;
a client's `traceparent` continued; a failed request's root marked as an error; the
colocated app, configured without an endpoint, sends nothing."""

from __future__ import annotations

import json
import secrets

import pytest

httpx = pytest.importorskip("httpx2")
pytest.importorskip("ray")
from serve_fixtures import API_KEY, MODEL, workers_of  # noqa: E402

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
WORKER_SPANS = {"queue", "prefill", "kv_pull", "decode"}


def _names(spans) -> list[str]:
    return sorted(s.name for s in spans)


def test_a_streamed_request_is_one_trace_under_the_clients_traceparent(server, otlp):
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {**HEADERS, "traceparent": f"00-{trace_id}-{parent_id}-01"}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    usage = json.loads(lines[-1][6:])["usage"]
    want = {"llm_request", "ingress", "route", "finish", *WORKER_SPANS}
    otlp.wait_for(lambda _: want <= {s.name for s in otlp.trace(trace_id)})
    spans = otlp.trace(trace_id)
    assert _names(spans) == sorted(["llm_request", "ingress", "route", "route", "finish", *WORKER_SPANS])
    (root,) = [s for s in spans if s.name == "llm_request"]
    assert root.parent_span_id == parent_id  # the client's span is its parent
    assert all(s.parent_span_id == root.span_id for s in spans if s is not root)
    a = root.attributes
    assert a["gen_ai.request.id"].startswith("chatcmpl-") and a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["gen_ai.latency.time_in_queue"] >= 0
    assert root.status_code != 2
    by_name = {s.name: s for s in spans}
    # each part recorded by the process that did it
    assert root.resource["kvray.component"] == by_name["ingress"].resource["kvray.component"] == "ingress"
    assert {by_name[n].resource["kvray.component"] for n in ("queue", "prefill")} == {"prefill"}
    assert {by_name[n].resource["kvray.component"] for n in ("kv_pull", "decode")} == {"decode"}
    assert by_name["kv_pull"].attributes["kvray.kv_pull.ok"] is True
    assert sorted(s.attributes["kvray.role"] for s in spans if s.name == "route") == ["decode", "prefill"]
    assert {s.resource["service.name"] for s in spans} == {"kvray"}
    for s in spans:  # every span inside the request's own (one host: one clock)
        assert root.start_ns - 5_000_000 <= s.start_ns <= s.end_ns <= root.end_ns + 5_000_000, s.name


def test_without_a_traceparent_a_request_starts_its_own_trace_and_errors_are_marked(server, otlp):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    r = httpx.post(f"{server}/v1/completions", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200
    rid = r.json()["id"]

    def root_of(request_id):
        return [
            s
            for s in otlp.spans
            if s.name == "llm_request" and s.attributes.get("gen_ai.request.id") == request_id
        ]

    otlp.wait_for(lambda _: root_of(rid))
    (root,) = root_of(rid)
    assert root.parent_span_id == ""  # a trace of its own
    otlp.wait_for(lambda _: WORKER_SPANS <= {s.name for s in otlp.trace(root.trace_id)})
    # a bad request: its root (only ingress work ran) says so, but is no server error
    trace_id = secrets.token_hex(16)
    bad = {**body, "temperature": -1}
    headers = {**HEADERS, "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    assert httpx.post(f"{server}/v1/completions", json=bad, headers=headers, timeout=60).status_code == 400
    otlp.wait_for(lambda _: otlp.trace(trace_id))
    (refused,) = otlp.trace(trace_id)
    assert refused.name == "llm_request" and refused.attributes["http.response.status_code"] == 400
    assert refused.status_code != 2
    # a parent sent unsampled: served, untraced (it once failed every such request with a 500)
    unsampled = secrets.token_hex(16)
    headers = {**HEADERS, "traceparent": f"00-{unsampled}-{secrets.token_hex(8)}-00"}
    assert httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=120).status_code == 200
    after = secrets.token_hex(16)
    headers = {**HEADERS, "traceparent": f"00-{after}-{secrets.token_hex(8)}-01"}
    assert httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=120).status_code == 200
    otlp.wait_for(lambda _: {"llm_request", *WORKER_SPANS} <= {s.name for s in otlp.trace(after)})
    assert not otlp.trace(unsampled)  # (nor did its workers record theirs)


def test_an_app_without_an_endpoint_sends_no_spans(colo_server, server, otlp):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    trace_id = secrets.token_hex(16)
    headers = {**HEADERS, "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    r = httpx.post(f"{colo_server}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200
    rid = r.json()["id"]
    # a traced request to the PD app after it: by the time its whole trace is in, an export
    # batch from the colocated app's processes would have come too (same batching delay)
    pd_trace = secrets.token_hex(16)
    headers = {**HEADERS, "traceparent": f"00-{pd_trace}-{secrets.token_hex(8)}-01"}
    assert httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=120).status_code == 200
    otlp.wait_for(lambda _: {"llm_request", *WORKER_SPANS} <= {s.name for s in otlp.trace(pd_trace)})
    assert not otlp.trace(trace_id)
    assert not [s for s in otlp.spans if s.attributes.get("gen_ai.request.id") == rid]
    # ... and its worker has no tracer at all
    import ray

    name, namespace = workers_of("colo")["mixed"]
    worker = ray.get_actor(name, namespace=namespace)
    assert ray.get(worker.__ray_call__.remote(lambda w: w.tracing), timeout=60) is None
