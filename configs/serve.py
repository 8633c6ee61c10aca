"""Serve configuration: the deployment plus what the HTTP front needs (data only)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvray.configs.deployment import DeploymentConfig


class ServeConfig(DeploymentConfig):
    """What `kvray.router.build_app` takes: a DeploymentConfig (same fields, flat) plus
    the OpenAI front's name, key and admission limits."""

    app_name: str = "kvray"  # the Serve application name (handles: serve.get_app_handle)
    model_name: str = "smollm2-135m-instruct"  # the `model` clients send; /v1/models lists it
    api_key: str | None = None  # None: no auth; else `Authorization: Bearer <api_key>`
    metrics_need_api_key: bool = False  # True: GET /metrics takes the API key too
    max_body_bytes: int = Field(1 << 20, ge=1)  # larger request bodies get 413
    max_queued_requests: int = Field(64, ge=1)  # requests in flight per ingress replica; more get 503
    retry_after_seconds: int = Field(1, ge=0)  # the 503's Retry-After header
    num_replicas: int = Field(1, ge=1)  # ingress replicas (they share one Router)
    # how `tool_choice: auto` replies are read (vLLM's --tool-call-parser); None: the
    # format the model's chat template uses (hermes unless it is Llama 3.1's)
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    # Direct ingress: the ingress replicas serve HTTP themselves on http_host:http_port
    # (replicas on one node share the port), on the head node, and Serve starts no proxy.
    # A streamed chunk then crosses no Ray hop; the plane's CPU per token falls by ~4x.
    # False: Serve's proxies serve HTTP (KubeRay and `serve deploy` config files).
    direct_ingress: bool = False
    http_host: str = "127.0.0.1"  # direct ingress only; `kvray serve/deploy` set both
    http_port: int = Field(8000, ge=1, le=65535)
    # OpenTelemetry traces (vLLM's --otlp-traces-endpoint): the OTLP/HTTP URL that the
    # ingress replicas and the workers export request spans to, e.g.
    # http://collector:4318/v1/traces. None: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT where a
    # process has it (as `kvray serve` starts: then every process uses it), else no tracing.
    otlp_traces_endpoint: str | None = None
