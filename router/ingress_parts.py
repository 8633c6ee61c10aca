"""The ingress's parts that need no Serve replica (router/app.py's OpenAIIngress calls
them): loading a serve config, reading and authorizing an HTTP body, turning a request
body into engine jobs, mapping kvray's errors to OpenAI-shaped ones, and publishing a
replica's request metrics and waiting requests to Ray's cluster KV.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hmac
import json
import logging
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import ray
import yaml
from fastapi import Request

from kvray.configs import ServeConfig
from kvray.engine.sampling_params import sample_seed
from kvray.errors import InvalidArgumentError, KvrayError, RequestFailedError
from kvray.router.api_error import APIError, internal_error
from kvray.router.autoscaling import publish_waiting
from kvray.router.frontend import RequestTimeoutError
from kvray.router.protocol import parse_request
from kvray.router.responses import ResponseBuilder

logger = logging.getLogger(__name__)
PRESETS = Path(__file__).resolve().parent.parent / "configs"
RETRY_AFTER_NO_WORKER_S = 5  # seconds: about how long Serve takes to replace a worker
METRICS_PUBLISH_S = 0.2  # an ingress replica publishes its request metrics this soon after a change
WAITING_REFRESH_S = 2.0  # ... and its waiting requests again this often while any wait

Job = tuple[
    str, list[int], object, float | None, int
]  # (engine request id, prompt ids, params, timeout, priority)


def load_config(config: ServeConfig | dict | str | Path) -> ServeConfig:
    """A ServeConfig from a dict, a YAML path, or a preset name (`smollm2-cpu-pd`)."""
    if isinstance(config, ServeConfig):
        return config
    if isinstance(config, str | Path):
        path = Path(config)
        if not path.exists():  # a preset's name ("qwen2.5-1.5b-cpu-pd": its dot is no suffix)
            path = PRESETS / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
        if not path.exists():
            raise InvalidArgumentError("config", str(config), "a YAML file or a preset in kvray/configs")
        config = yaml.safe_load(path.read_text()) or {}
    return ServeConfig(**config)


def check_auth(request: Request, key: str | None) -> None:
    """401 unless the request carries `Bearer <key>` (compared in constant time)."""
    if key is None:
        return
    given = request.headers.get("authorization", "").encode()
    if not hmac.compare_digest(given, f"Bearer {key}".encode()):
        raise APIError(401, "missing or wrong API key", type="authentication_error", code="invalid_api_key")


async def read_json(request: Request, limit: int) -> dict:
    """The request's JSON object body: 413 past `limit` bytes, 400 when it is not one."""
    too_big = APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    if int(request.headers.get("content-length") or 0) > limit:
        raise too_big
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise too_big
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except RecursionError:  # (check_body's bound is far lower: this is only the parser's)
        raise APIError(400, "the JSON body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def prepare(config: ServeConfig, ingest, tokenizer, body: dict, chat: bool):
    """Validate and tokenize: (request, response builder, [Job]), one job per choice
    (prompts x n; sample i > 0 seeded from the request's seed)."""
    req = parse_request(body, chat)
    ingest.check_model(req.model)
    try:
        limit = config.router.max_request_timeout_s
        if req.request_timeout_s is not None and req.request_timeout_s > limit:
            raise InvalidArgumentError("request_timeout_s", req.request_timeout_s, f"(0, {limit:g}] seconds")
        check_priority(config, req.priority)
        params = req.to_params()
        prompts = ingest.prompts(req)
        ingest.check_room(req, params.max_tokens, prompts)
        ingest.check(params, req.grammar_field)
        tools = ingest.tool_parser(req) if chat else None
    except InvalidArgumentError as e:
        raise APIError.invalid(e) from None
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    echo = {}
    if not chat and req.echo:  # each choice starts with its prompt's text
        echo = {p * req.n + i: tokenizer.decode(ids) for p, ids in enumerate(prompts) for i in range(req.n)}
    builder = ResponseBuilder(chat, req.model, rid, tokenizer, tools=tools, echo=echo)
    jobs: list[Job] = []
    for p, prompt in enumerate(prompts):
        for i in range(req.n):
            sample = params if i == 0 else dataclasses.replace(params, seed=sample_seed(params.seed, i))
            jobs.append((f"{rid}-{p * req.n + i}", prompt, sample, req.request_timeout_s, req.priority))
    return req, builder, jobs


def check_priority(config: ServeConfig, priority: int) -> None:
    """A `priority` other than 0 needs every pool to schedule by it (vLLM refuses it so)."""
    if priority and any(config.engine_config(r).scheduling_policy != "priority" for r in config.roles):
        raise InvalidArgumentError("priority", priority, "0 (the pools' scheduling_policy is not priority)")


def num_prompt_tokens(jobs: list[Job], n: int) -> int:
    return sum(len(ids) for _, ids, *_ in jobs[::n])


def cause(e: BaseException) -> BaseException:
    """The error a Ray task raised, out of its RayTaskError wrappers."""
    while isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        e = e.cause
    return e


def api_error_of(e: KvrayError, request_id: str) -> APIError:
    """kvray's error as the OpenAI-shaped HTTP error a client gets."""
    if isinstance(e, InvalidArgumentError):
        return APIError.invalid(e)
    if isinstance(e, RequestFailedError):  # something of its own failed on its worker (logged there)
        return internal_error(request_id)
    if isinstance(e, RequestTimeoutError):  # Ray Serve's request_timeout_s answers 408 too
        return APIError(408, str(e), type="timeout_error", code="request_timeout")
    # no worker (none live, none joined in time), or its worker died past migration_limit
    return APIError(
        503,
        str(e),
        type="service_unavailable",
        code=type(e).__name__,
        headers={"Retry-After": str(RETRY_AFTER_NO_WORKER_S)},
    )


def load_tokenizer(model: str):
    """The model's tokenizer and its end-of-sequence ids (the grammars' ends)."""
    from kvray.engine.request_intake import eos_token_ids
    from kvray.models.loader import load_config as load_model_config
    from kvray.models.loader import load_tokenizer as load_model_tokenizer
    from kvray.models.loader import resolve_model_path

    path = resolve_model_path(model)
    tokenizer = load_model_tokenizer(path)
    return tokenizer, eos_token_ids(load_model_config(path), path, tokenizer)


def _any_waiting(waiting: dict[str, dict[str, float]]) -> bool:
    return any(v for signals in waiting.values() for v in signals.values())


async def publish_forever(app_name: str, front_id: str, frontend, key: str) -> None:
    """Publish the frontend's request metrics (under `key`) within METRICS_PUBLISH_S of a
    change, and its waiting requests for the pools' autoscaling (stamped, so stale ones are
    ignored) when they change or every WAITING_REFRESH_S while any wait."""
    from ray.experimental import internal_kv

    stats, published = frontend.stats, -1
    waiting_sent, waiting_at = {}, 0.0
    while True:
        await asyncio.sleep(METRICS_PUBLISH_S)
        waiting = copy.deepcopy(frontend.waiting)
        news = waiting != waiting_sent
        if news or (_any_waiting(waiting) and time.monotonic() - waiting_at > WAITING_REFRESH_S):
            try:
                await asyncio.to_thread(publish_waiting, app_name, front_id, waiting)
                waiting_sent, waiting_at = waiting, time.monotonic()
            except Exception:
                logger.exception("kvray ingress: publishing waiting requests failed")
        if stats.version == published:
            continue
        try:
            version, snapshot = stats.version, json.dumps(stats.snapshot()).encode()
            await asyncio.to_thread(internal_kv._internal_kv_put, key, snapshot, True)
            published = version
        except Exception:  # keep publishing; the next change tries again
            logger.exception("kvray ingress: publishing metrics failed")


class Admission:
    """An ingress replica's slots: `max_queued_requests` engine requests in flight
    (prompts x n per request), and as many bodies waiting for the ingest threads; past
    either a 503 with Retry-After."""

    def __init__(self, limit: int, retry_after_s: int):
        self.limit, self.retry_after_s = limit, retry_after_s
        self.num_in_flight = 0
        self.num_ingesting = 0  # bodies handed to the ingest threads, not yet back

    def at_capacity(self) -> APIError:
        return APIError(
            503,
            "the server is at capacity; retry later",
            type="server_overloaded",
            code="queue_full",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    @contextmanager
    def admitted(self, num_choices: int):
        """Hold one slot per choice, or answer 503; a request with more choices than the
        limit could never run: 400."""
        if num_choices > self.limit:
            raise APIError.invalid(
                InvalidArgumentError(
                    "n", f"{num_choices} choices", f"at most {self.limit} (prompts x n) per request"
                )
            )
        if self.num_in_flight + num_choices > self.limit:
            raise self.at_capacity()
        self.num_in_flight += num_choices
        try:
            yield
        finally:
            self.num_in_flight -= num_choices

    @contextmanager
    def ingesting(self):
        """Hold one of the ingest threads' waiting places, or answer 503."""
        if self.num_ingesting >= self.limit:
            raise self.at_capacity()
        self.num_ingesting += 1
        try:
            yield
        finally:
            self.num_ingesting -= 1
