"""The Ray Serve app: an OpenAI-compatible FastAPI ingress, the Router, the worker pools.

`build_app(config)` is a pure builder: it validates a dict (or a YAML path, or a shipped
preset's name) into `ServeConfig` and binds the deployments; nothing starts until Serve
runs the app. The pools are deployments of their own (router/pools.py: one replica per
worker, fixed or autoscaled on LLM signals); the Router deployment (`router.num_replicas`
replicas, the control plane) finds their workers by name and chooses workers; each
ingress replica (`num_replicas`) tokenizes and validates once, drives its requests
through the workers it was given (router/frontend.py) and receives their tokens straight
from the workers, one batch of deltas per engine step.

HTTP: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics. Handles: `generate(request)` returns the response body of an OpenAI request
dict (chat when it has `messages`), `generate_stream(request)` yields its stream chunks.
A request with `n` samples or several prompts is fanned out into one engine request per
choice. A client that goes away aborts its requests on every worker they touched.
Request metrics are kept by each ingress replica and published to Ray's cluster KV within
`METRICS_PUBLISH_S` of each finished request, so /metrics of any replica shows the whole
app (another replica's latest requests a fraction of a second late).
"""

# No `from __future__ import annotations`: FastAPI must see real types on the (pickled) routes.

import asyncio
import copy
import dataclasses
import hmac
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import ray
import yaml
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from kvray.configs import DeploymentConfig, ServeConfig
from kvray.engine.sampling_params import sample_seed
from kvray.errors import InvalidArgumentError, KvrayError, RequestFailedError
from kvray.router import metrics
from kvray.router.api_error import APIError, internal_error
from kvray.router.autoscaling import publish_waiting
from kvray.router.direct_http import DirectHTTP
from kvray.router.frontend import Frontend, RequestTimeoutError
from kvray.router.ingest import Ingest
from kvray.router.openapi import openapi_body, openapi_schemas
from kvray.router.pools import pool_deployment
from kvray.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
    validate_body,
)
from kvray.router.responses import ResponseBuilder, Usage
from kvray.router.router_deployment import RouterDeployment
from kvray.router.streams import all_or_none, merge, sse, unless_disconnected
from kvray.timeouts import wait_for

logger = logging.getLogger(__name__)
PRESETS = Path(__file__).resolve().parent.parent / "configs"
METRICS_PUBLISH_S = 0.2  # an ingress replica publishes its request metrics this soon after a change
WAITING_REFRESH_S = 2.0  # ... and its waiting requests again this often while any wait
CONTROL_CALL_S = 5.0  # /health and /metrics answer 503 when the control plane takes longer
INGEST_THREADS = 2  # per ingress replica: one long grammar compile does not hold up the rest

app = FastAPI(title="kvray", description="OpenAI-compatible LLM serving on Ray")


def _openapi() -> dict:
    """FastAPI's document plus the request bodies' schemas (the routes name them)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version="0.1.0", description=app.description, routes=app.routes)
        doc.setdefault("components", {}).setdefault("schemas", {}).update(openapi_schemas())
        app.openapi_schema = doc
    return app.openapi_schema


app.openapi = _openapi


@app.exception_handler(APIError)
async def _api_error(_request: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@app.exception_handler(Exception)
async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    """What nothing else caught: logged under an id the client is given, never its text."""
    error_id = f"err-{uuid.uuid4().hex[:12]}"
    logger.error("kvray ingress: %s %s failed (%s)", request.method, request.url.path, error_id, exc_info=e)
    return JSONResponse(internal_error(error_id).body(), status_code=500)


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


def build_app(config: ServeConfig | dict | str | Path) -> serve.Application:
    """Validate the config and bind the ingress (Serve config files: `args` is this dict,
    or `{"config": "<yaml path>"}`)."""
    if isinstance(config, dict) and set(config) == {"config"}:
        config = config["config"]
    cfg = load_config(config)
    router = RouterDeployment.options(name=f"{cfg.app_name}-router", num_replicas=cfg.router.num_replicas)
    actor_options: dict = {"num_cpus": 0}
    if cfg.direct_ingress:  # they listen where the app's URL points: the head node
        actor_options["resources"] = {HEAD_NODE_RESOURCE: 0.001}
    ingress = OpenAIIngress.options(
        name=f"{cfg.app_name}-ingress",
        num_replicas=cfg.num_replicas,
        max_ongoing_requests=cfg.max_queued_requests + 16,  # past the limit we answer 503 ourselves
        ray_actor_options=actor_options,
    )
    router_app = router.bind(cfg.model_dump())
    roles = ["prefill", "decode"] if cfg.disaggregated else ["mixed"]
    pools = [pool_deployment(cfg, role) for role in roles]
    return ingress.bind(cfg.model_dump(), router_app, pools)


HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's resource of the head node
RETRY_AFTER_NO_WORKER_S = 5  # seconds: about how long Serve takes to replace a worker

# Serve pickles the ingress class by value, with the globals defined before it.


def _num_prompt_tokens(jobs: list, n: int) -> int:
    return sum(len(ids) for _, ids, *_ in jobs[::n])


def _replace(params, **changes):
    return dataclasses.replace(params, **changes)


def _cause(e: BaseException) -> BaseException:
    while isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        e = e.cause
    return e


def _api_error_of(e: KvrayError, request_id: str) -> APIError:
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


def _load_tokenizer(model: str):
    """The model's tokenizer and its end-of-sequence ids (the grammars' ends)."""
    from kvray.engine.request_intake import eos_token_ids
    from kvray.models.loader import load_config, load_tokenizer, resolve_model_path

    path = resolve_model_path(model)
    tokenizer = load_tokenizer(path)
    return tokenizer, eos_token_ids(load_config(path), path, tokenizer)


def _any_waiting(waiting: dict[str, dict[str, float]]) -> bool:
    return any(v for signals in waiting.values() for v in signals.values())


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    async def __init__(self, config: dict, router: DeploymentHandle, pools: list[DeploymentHandle]):
        self.config = ServeConfig(**config)
        self.pools = pools  # bound here so Serve runs the pool deployments with the app
        self.router = router  # the control plane: which workers serve a request
        self.limits = await router.model_info.remote()  # RequestLimits: what the engines take
        self.tokenizer, eos = _load_tokenizer(self.config.engine.get("model", "smollm2-135m-instruct"))
        parser = self.config.tool_call_parser
        self.ingest = Ingest(self.tokenizer, self.limits, self.config.model_name, parser, eos)
        # templating, tokenizing and compiling grammars off the event loop: a large body
        # never stalls the streams this replica serves
        self.ingest_thread = ThreadPoolExecutor(INGEST_THREADS, thread_name_prefix="kvray-ingest")
        self.num_ingesting = 0  # bodies handed to those threads, not yet back
        self.num_in_flight = 0
        self.replica = serve.get_replica_context().replica_id.unique_id  # which one answered
        deployment = DeploymentConfig(**self.config.model_dump(include=set(DeploymentConfig.model_fields)))
        self.front_id = f"{self.config.app_name}-ingress-{self.replica}-{uuid.uuid4().hex[:6]}"
        me = ray.get_runtime_context().current_actor  # the workers watch it: its requests die with it
        self.frontend = Frontend(router, deployment, self.front_id, handle=me)
        self.publisher = asyncio.get_running_loop().create_task(self._publish_metrics())
        self.http = None  # direct ingress: this replica's own HTTP server
        if self.config.direct_ingress:
            self.http = DirectHTTP(app, self.config.http_host, self.config.http_port)

    async def check_health(self) -> None:
        """Serve's health check: a replica whose own HTTP server died is replaced."""
        if self.http is not None and not self.http.alive:
            raise RuntimeError(f"HTTP server on {self.http.host}:{self.http.port} has stopped")

    async def __del__(self):
        """Serve stops the replica: stop accepting, let streams in flight finish."""
        if getattr(self, "http", None) is not None:
            await self.http.stop()
        if getattr(self, "ingest_thread", None) is not None:
            self.ingest_thread.shutdown(wait=False)
        parent = getattr(super(), "__del__", None)  # the ASGI wrapper's lifespan shutdown
        if parent is not None and inspect.isawaitable(done := parent()):
            await done

    async def _publish_metrics(self) -> None:
        from ray.experimental import internal_kv

        key = metrics.front_key(self.config.app_name, self.front_id)
        stats, published = self.frontend.stats, -1
        waiting_sent, waiting_at = {}, 0.0
        while True:
            await asyncio.sleep(METRICS_PUBLISH_S)
            waiting = copy.deepcopy(self.frontend.waiting)
            news = waiting != waiting_sent
            if news or (_any_waiting(waiting) and time.monotonic() - waiting_at > WAITING_REFRESH_S):
                try:  # for the pools' autoscaling policies: stamped, so stale ones are ignored
                    await asyncio.to_thread(publish_waiting, self.config.app_name, self.front_id, waiting)
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

    # ---- HTTP ---------------------------------------------------------------------------

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(self, request: Request):
        return await self._http(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(self, request: Request):
        return await self._http(request, chat=True)

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._check_auth(request)
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvray",
            "max_model_len": self.limits.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(self, request: Request) -> dict:
        """vLLM's shape: a prompt or chat messages -> {count, max_model_len, tokens, token_strs}.
        Admitted like a completion (it holds a slot while it runs), tokenized off the loop."""
        self._check_auth(request)
        req = validate_body(TokenizeRequest, await self._read_json(request))
        self.ingest.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give one of prompt or messages", param="prompt", code="invalid_value")
        with self._admitted(1):
            ids, strs = await self._off_loop(self._tokenize, req)
        return {
            "count": len(ids),
            "max_model_len": self.limits.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    def _tokenize(self, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        if req.messages is not None:
            text = self.ingest.chat_text(
                req.messages, req.tools, req.add_generation_prompt, req.continue_final_message
            )
            ids = self.tokenizer(text, add_special_tokens=bool(req.add_special_tokens)).input_ids
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.tokenizer(req.prompt, add_special_tokens=add).input_ids
        return ids, self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None

    async def _off_loop(self, fn, *args):
        """fn(*args) on the ingest threads (templating, tokenizing, compiling grammars).
        Bodies waiting for them count against `max_queued_requests` too (503 past it)."""
        if self.num_ingesting >= self.config.max_queued_requests:
            raise self._at_capacity()
        self.num_ingesting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.ingest_thread, fn, *args)
        finally:
            self.num_ingesting -= 1

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(self, request: Request) -> dict:
        self._check_auth(request)
        req = validate_body(DetokenizeRequest, await self._read_json(request))
        self.ingest.check_model(req.model)
        vocab = self.limits.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"tokens: ids in [0, {vocab - 1}]", param="tokens", code="invalid_value")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    @app.get("/health")
    async def health(self) -> Response:
        """200 with every pool live; 503 when a pool has no live worker, or when the
        control plane does not answer within CONTROL_CALL_S."""
        roles = ["prefill", "decode"] if self.config.disaggregated else ["mixed"]
        try:
            pools = await wait_for(self.router.live_workers.remote(), CONTROL_CALL_S)
        except Exception as e:  # noqa: BLE001 (the Router is down or restarting)
            body = {"status": "unavailable", "error": f"the router did not answer: {type(e).__name__}"}
            return JSONResponse({**body, "replica": self.replica}, 503)
        ok = all(pools.get(r) for r in roles)
        body = {"status": "ok" if ok else "degraded", "workers": pools, "replica": self.replica}
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        if self.config.metrics_need_api_key:
            self._check_auth(request)
        try:
            workers = await wait_for(self.router.worker_stats.remote(), CONTROL_CALL_S)
            others = await wait_for(
                asyncio.to_thread(metrics.published, self.config.app_name, self.front_id), CONTROL_CALL_S
            )
        except Exception as e:  # noqa: BLE001 (the Router or Ray's KV is down)
            raise APIError(
                503, f"the control plane did not answer: {type(e).__name__}", type="service_unavailable"
            ) from None
        requests = metrics.merge([self.frontend.stats.snapshot(), *others])
        text = metrics.render(self.config.model_name, requests, workers)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _http(self, request: Request, chat: bool) -> Response:
        self._check_auth(request)
        body = await self._read_json(request)
        if body.get("stream"):
            gen = self._stream(body, chat)
            await anext(gen)  # validated and admitted: errors so far are still plain HTTP errors
            return StreamingResponse(sse(gen), media_type="text/event-stream")  # (it sees disconnects)
        answer = await unless_disconnected(request, self._complete(body, chat))
        if answer is None:  # the client left: its requests were aborted; nobody reads this
            return Response(status_code=499)
        return JSONResponse(answer)

    def _check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {key}".encode()):  # in constant time
            raise APIError(
                401, "missing or wrong API key", type="authentication_error", code="invalid_api_key"
            )

    async def _read_json(self, request: Request) -> dict:
        limit = self.config.max_body_bytes
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

    # ---- handle API ---------------------------------------------------------------------

    async def generate(self, request: dict) -> dict:
        """An OpenAI request body (chat if it has `messages`) -> its response body."""
        return await self._complete(request, chat="messages" in request)

    async def generate_stream(self, request: dict) -> AsyncIterator[dict]:
        """An OpenAI request body -> its stream chunks (with a usage chunk if asked)."""
        gen = self._stream(request, chat="messages" in request)
        await anext(gen)
        try:
            async for chunk in gen:
                yield chunk
        finally:
            await gen.aclose()

    # ---- the work -----------------------------------------------------------------------

    async def _complete(self, body: dict, chat: bool) -> dict:
        req, builder, jobs = await self._off_loop(self._prepare, body, chat)
        with self._admitted(len(jobs)):
            try:
                finals = await all_or_none([self._final(*job) for job in jobs])
            except KvrayError as e:
                raise _api_error_of(e, builder.request_id) from None
            except APIError:
                raise
            except Exception as e:  # noqa: BLE001 (logged with the request's id; the client gets the id)
                logger.error("kvray ingress: request %s failed", builder.request_id, exc_info=e)
                raise internal_error(builder.request_id) from None
        usage = Usage(_num_prompt_tokens(jobs, req.n), sum(len(f.token_ids) for f in finals))
        return builder.body(dict(enumerate(finals)), usage)

    async def _stream(self, body: dict, chat: bool) -> AsyncIterator[dict]:
        """None once validated and admitted, then the chunks. An error after that ends
        the stream with one OpenAI error event (the SSE framing then sends [DONE])."""
        req, builder, jobs = await self._off_loop(self._prepare, body, chat)
        num_prompt_tokens = _num_prompt_tokens(jobs, req.n)
        with self._admitted(len(jobs)):
            yield None  # validated and admitted: the caller may start the response now
            outs = {}
            try:
                async for index, out in merge([self._outputs(*job) for job in jobs]):
                    outs[index] = out
                    so_far = None
                    if req.continuous_usage:
                        so_far = Usage(num_prompt_tokens, sum(len(c.token_ids) for c in outs.values()))
                    chunk = builder.delta_chunk(index, out, req.include_usage, so_far)
                    if chunk is not None:
                        yield chunk
            except KvrayError as e:
                yield _api_error_of(e, builder.request_id).body()
                return
            except Exception as e:  # noqa: BLE001 (logged with the request's id; the client gets the id)
                logger.error("kvray ingress: stream %s failed", builder.request_id, exc_info=e)
                yield internal_error(builder.request_id).body()
                return
            if req.include_usage:
                done = sum(len(c.token_ids) for c in outs.values())
                yield builder.usage_chunk(Usage(_num_prompt_tokens(jobs, req.n), done))

    def _prepare(self, body: dict, chat: bool):
        """Validate and tokenize: (request, response builder, [(request id, token ids, params)])."""
        req = parse_request(body, chat)
        self.ingest.check_model(req.model)
        try:
            limit = self.config.router.max_request_timeout_s
            if req.request_timeout_s is not None and req.request_timeout_s > limit:
                raise InvalidArgumentError(
                    "request_timeout_s", req.request_timeout_s, f"(0, {limit:g}] seconds"
                )
            params = req.to_params()
            prompts = self.ingest.prompts(req)
            self.ingest.check_room(req, params.max_tokens, prompts)
            self.ingest.check(params, req.grammar_field)
            tools = self.ingest.tool_parser(req) if chat else None
        except InvalidArgumentError as e:
            raise APIError.invalid(e) from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        echo = {}
        if not chat and req.echo:  # each choice starts with its prompt's text
            echo = {
                p * req.n + i: self.tokenizer.decode(ids)
                for p, ids in enumerate(prompts)
                for i in range(req.n)
            }
        builder = ResponseBuilder(chat, req.model, rid, self.tokenizer, tools=tools, echo=echo)
        jobs = []
        for p, prompt in enumerate(prompts):
            for i in range(req.n):
                sample = params if i == 0 else _replace(params, seed=sample_seed(params.seed, i))
                jobs.append((f"{rid}-{p * req.n + i}", prompt, sample, req.request_timeout_s))
        return req, builder, jobs

    async def _outputs(self, rid: str, prompt_token_ids: list[int], params, timeout_s: float | None = None):
        """One engine request's cumulative CompletionOutput after every delta; leaving
        early aborts it everywhere."""
        gen = self.frontend.generate(rid, prompt_token_ids, params, timeout_s)
        try:
            async for out in gen:
                yield out
        except ray.exceptions.RayTaskError as e:
            raise _cause(e) from None
        finally:
            await gen.aclose()

    async def _final(self, rid: str, prompt_token_ids: list[int], params, timeout_s: float | None = None):
        final = None
        async for final in self._outputs(rid, prompt_token_ids, params, timeout_s):  # noqa: B007 (keep the last)
            pass
        return final

    def _at_capacity(self) -> APIError:
        return APIError(
            503,
            "the server is at capacity; retry later",
            type="server_overloaded",
            code="queue_full",
            headers={"Retry-After": str(self.config.retry_after_seconds)},
        )

    @contextmanager
    def _admitted(self, num_choices: int):
        """Hold one of `max_queued_requests` slots per choice (prompts x n: each is an
        engine request), or answer 503 with Retry-After; a request with more choices than
        the limit could never run: 400."""
        limit = self.config.max_queued_requests
        if num_choices > limit:
            raise APIError.invalid(
                InvalidArgumentError(
                    "n", f"{num_choices} choices", f"at most {limit} (prompts x n) per request"
                )
            )
        if self.num_in_flight + num_choices > limit:
            raise self._at_capacity()
        self.num_in_flight += num_choices
        try:
            yield
        finally:
            self.num_in_flight -= num_choices
