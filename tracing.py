"""Request traces over OpenTelemetry (vLLM's `--otlp-traces-endpoint`): one trace per HTTP
request, exported by every process that works on it to the same OTLP/HTTP endpoint.

The ingress replica opens the request's root span, `llm_request` (a SERVER span; its parent
the client's `traceparent` header when it sends one), with vLLM's `gen_ai.*` attributes,
and records `ingress` (validate, template, tokenize), one `route` per worker chosen and
`finish` under it. The root's W3C context travels with the request to its workers (the
`trace` field of `EngineRequest`: a `traceparent` string through Ray), which record their
parts as spans under the same root when the request leaves them: `queue`, `prefill`,
`kv_pull` and `decode` (an embeddings request: the embedding worker's `embed`). Spans are
recorded whole, with the times their process measured (an engine's monotonic clock mapped
to the wall clock), so nothing is held open across calls and no step waits on tracing.

Tracing is on where the serve config's `otlp_traces_endpoint` is set, or where the process
sees OpenTelemetry's `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; `OTEL_SERVICE_NAME`,
`OTEL_EXPORTER_OTLP_TRACES_HEADERS` and `OTEL_BSP_*` apply as usual. Off, kvray makes no
tracer and imports no exporter, and a request carries `None`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping

TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ROOT_SPAN = "llm_request"  # vLLM's name for a request's span

# vLLM's span attribute names (vllm/tracing.py SpanAttributes)
REQUEST_ID = "gen_ai.request.id"
RESPONSE_MODEL = "gen_ai.response.model"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
N = "gen_ai.request.n"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"


def traces_endpoint(configured: str | None = None) -> str | None:
    """Where this process exports spans: the config's endpoint, else OpenTelemetry's
    variable, else None (tracing off)."""
    return configured or os.environ.get(TRACES_ENDPOINT_ENV) or None


def clock_offset_ns() -> int:
    """Wall-clock nanoseconds minus time.monotonic_ns() in this process, now."""
    return time.time_ns() - time.monotonic_ns()


def wall_ns(monotonic_s: float, offset_ns: int) -> int:
    """A time.monotonic() reading of this process as wall-clock nanoseconds (`offset_ns`:
    one clock_offset_ns() for several readings, so their differences stay exact)."""
    return offset_ns + round(monotonic_s * 1e9)


class Tracing:
    """One process's tracer: an OTLP/HTTP exporter behind a batching processor."""

    def __init__(self, endpoint: str, component: str):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        attributes = {"kvray.component": component}
        if "OTEL_SERVICE_NAME" not in os.environ and "service.name" not in os.environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        ):
            attributes["service.name"] = "kvray"
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("kvray")
        self.propagator = TraceContextTextMapPropagator()

    def request(
        self, headers: Mapping[str, str] | None = None, attributes: dict | None = None
    ) -> RequestTrace | None:
        """A request's root span, started now; its parent the `traceparent` in `headers`.
        None where the sampler drops it (a parent sent unsampled, `OTEL_TRACES_SAMPLER`,
        `OTEL_SDK_DISABLED`): the request then goes untraced."""
        from opentelemetry.trace import SpanKind

        parent = self.propagator.extract(dict(headers or {}))
        start_ns = time.time_ns()
        span = self.tracer.start_span(
            ROOT_SPAN, context=parent, kind=SpanKind.SERVER, attributes=attributes, start_time=start_ns
        )
        if not span.is_recording():
            return None
        return RequestTrace(self, span, start_ns)

    def record(
        self,
        name: str,
        carrier: Mapping[str, str],
        start_ns: int,
        end_ns: int,
        attributes: dict | None = None,
    ) -> None:
        """A finished span `name` under the span whose context `carrier` holds."""
        parent = self.propagator.extract(dict(carrier))
        span = self.tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
        span.end(end_time=max(end_ns, start_ns))

    def shutdown(self) -> None:
        """Export what is buffered, then stop."""
        self.provider.shutdown()


class RequestTrace:
    """One request's root span in the ingress, and its context for the workers."""

    def __init__(self, tracing: Tracing, span, start_ns: int):
        from opentelemetry.trace import set_span_in_context

        self.tracing = tracing
        self.span = span
        self.carrier: dict[str, str] = {}
        tracing.propagator.inject(self.carrier, context=set_span_in_context(span))
        self.start_ns = start_ns
        self.first_token_seen = False
        self.ended = False

    def record(
        self, name: str, start_ns: int, end_ns: int | None = None, attributes: dict | None = None
    ) -> None:
        """A finished child span of the root (`end_ns` None: now)."""
        self.tracing.record(name, self.carrier, start_ns, end_ns or time.time_ns(), attributes)

    def set(self, attributes: dict) -> None:
        if not self.ended:
            self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def first_token(self) -> None:
        """The request's first token reached the ingress now (the first of its samples)."""
        if not self.first_token_seen:
            self.first_token_seen = True
            self.set({TIME_TO_FIRST_TOKEN: (time.time_ns() - self.start_ns) / 1e9})

    def end(self, error: BaseException | None = None) -> None:
        """End the root span, once: with an error status if it failed (not if the client
        left, nor for the client's own 4xx mistakes, as OpenTelemetry's HTTP conventions)."""
        if self.ended:
            return
        self.ended = True
        status = getattr(error, "status", None)  # an APIError's HTTP status
        if isinstance(error, GeneratorExit | asyncio.CancelledError):  # the client left: not a failure
            self.span.set_attribute("kvray.client_left", True)
        elif isinstance(status, int) and status < 500:  # the client's error (OpenTelemetry's rule for 4xx)
            self.span.set_attribute("http.response.status_code", status)
        elif error is not None:
            if isinstance(status, int):
                self.span.set_attribute("http.response.status_code", status)
            from opentelemetry.trace import Status, StatusCode

            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        self.span.set_attribute(E2E, (time.time_ns() - self.start_ns) / 1e9)
        self.span.end()
