"""The Ray Serve app: an OpenAI-compatible FastAPI ingress, the Router, the worker pools.

`build_app(config)` is a pure builder: it validates a dict (or a YAML path, or a shipped
preset's name) into `ServeConfig` and binds the deployments; nothing starts until Serve
runs the app. The pools are deployments of their own (router/pools.py: one replica per
worker, fixed or autoscaled on LLM signals); the Router deployment (`router.num_replicas`
replicas, the control plane) finds their workers by name and chooses workers; each
ingress replica (`num_replicas`) tokenizes and validates once, drives its requests
through the workers it was given (router/frontend.py) and receives their tokens straight
from the workers, one batch of deltas per engine step.

HTTP: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (through the
chat path: router/responses_route.py), POST /v1/embeddings (the `embedding:` pool:
router/embeddings_route.py), GET /v1/models, GET /health, GET /metrics. Handles:
`generate(request)` returns the response body of an OpenAI request dict (Responses when it
has `input`, chat when `messages`), `generate_stream(request)` yields its stream chunks,
`embeddings(request)` answers an embeddings body.
A request with `n` samples or several prompts is fanned out into one engine request per
choice. A client that goes away aborts its requests on every worker they touched.
Request metrics are kept by each ingress replica and published to Ray's cluster KV within
`METRICS_PUBLISH_S` of each finished request, so /metrics of any replica shows the whole
app (another replica's latest requests a fraction of a second late).
"""

# No `from __future__ import annotations`: FastAPI must see real types on the (pickled) routes.

import asyncio
import inspect
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import ray
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from kvray.configs import DeploymentConfig, ServeConfig
from kvray.router import metrics
from kvray.router.api_error import APIError, internal_error
from kvray.router.direct_http import DirectHTTP
from kvray.router.embedding_pool import embedding_deployment
from kvray.router.embeddings_route import EmbeddingsRequest, EmbeddingsRoute
from kvray.router.frontend import Frontend
from kvray.router.generation import Generation
from kvray.router.ingest import Ingest
from kvray.router.ingress_parts import (
    Admission,
    check_auth,
    load_config,
    load_tokenizer,
    publish_forever,
    read_json,
)
from kvray.router.openapi import openapi_body, openapi_schemas
from kvray.router.pools import pool_deployment
from kvray.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvray.router.request_body import validate_body
from kvray.router.responses_api import ResponsesRequest
from kvray.router.responses_route import ResponsesRoute
from kvray.router.router_deployment import RouterDeployment
from kvray.router.streams import sse, unless_disconnected
from kvray.timeouts import wait_for
from kvray.tracing import Tracing, traces_endpoint

logger = logging.getLogger(__name__)
CONTROL_CALL_S = 5.0  # /health and /metrics answer 503 when the control plane takes longer

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


def build_app(config: ServeConfig | dict | str | Path) -> serve.Application:
    """Validate the config and bind the ingress (Serve config files: `args` is this dict,
    or `{"config": "<yaml path>"}`)."""
    if isinstance(config, dict) and set(config) == {"config"}:
        config = config["config"]
    cfg = load_config(config)
    if cfg.otlp_traces_endpoint is None and traces_endpoint():  # one endpoint for every process
        cfg = cfg.model_copy(update={"otlp_traces_endpoint": traces_endpoint()})
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
    pools = [pool_deployment(cfg, role) for role in cfg.roles]
    embedding = embedding_deployment(cfg) if cfg.embedding is not None else None
    return ingress.bind(cfg.model_dump(), router_app, pools, embedding)


HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's resource of the head node


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    async def __init__(
        self,
        config: dict,
        router: DeploymentHandle,
        pools: list[DeploymentHandle],
        embedding: DeploymentHandle | None = None,
    ):
        self.config = ServeConfig(**config)
        self.pools = pools  # bound here so Serve runs the pool deployments with the app
        self.router = router  # the control plane: which workers serve a request
        self.limits = await router.model_info.remote()  # RequestLimits: what the engines take
        self.tokenizer, eos = load_tokenizer(self.config.engine_config().model)
        parser = self.config.tool_call_parser
        self.ingest = Ingest(self.tokenizer, self.limits, self.config.model_name, parser, eos)
        self.admission = Admission(self.config.max_queued_requests, self.config.retry_after_seconds)
        self.replica = serve.get_replica_context().replica_id.unique_id  # which one answered
        deployment = DeploymentConfig(**self.config.model_dump(include=set(DeploymentConfig.model_fields)))
        self.front_id = f"{self.config.app_name}-ingress-{self.replica}-{uuid.uuid4().hex[:6]}"
        me = ray.get_runtime_context().current_actor  # the workers watch it: its requests die with it
        endpoint = traces_endpoint(self.config.otlp_traces_endpoint)
        tracing = Tracing(endpoint, "ingress") if endpoint else None  # None: requests untraced
        self.frontend = Frontend(router, deployment, self.front_id, handle=me, tracing=tracing)
        self.generation = Generation(self.config, self.ingest, self.admission, self.frontend, tracing)
        key = metrics.front_key(self.config.app_name, self.front_id)
        self.publisher = asyncio.get_running_loop().create_task(
            publish_forever(self.config.app_name, self.front_id, self.frontend, key)
        )
        # /v1/responses through the chat path; its stored conversations in this replica
        self.responses = ResponsesRoute(
            lambda body, headers=None: self.generation.complete(body, True, headers),
            lambda body, headers=None: self.generation.stream(body, True, headers),
        )
        embedding_model = self.config.embedding.engine["model"] if self.config.embedding else None
        self.embedding_route = EmbeddingsRoute(embedding, embedding_model, self.admission, tracing)
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
        if getattr(self, "generation", None) is not None:
            await self.generation.close()
        parent = getattr(super(), "__del__", None)  # the ASGI wrapper's lifespan shutdown
        if parent is not None and inspect.isawaitable(done := parent()):
            await done

    # ---- HTTP ---------------------------------------------------------------------------

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(self, request: Request):
        return await self._http(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(self, request: Request):
        return await self._http(request, chat=True)

    @app.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest))
    async def responses_create(self, request: Request):
        check_auth(request, self.config.api_key)
        return await self.responses.http(request, await read_json(request, self.config.max_body_bytes))

    @app.post("/v1/embeddings", openapi_extra=openapi_body(EmbeddingsRequest))
    async def embeddings_create(self, request: Request):
        check_auth(request, self.config.api_key)
        body = await read_json(request, self.config.max_body_bytes)
        answer = await unless_disconnected(request, self.embedding_route.answer(body, request.headers))
        return Response(status_code=499) if answer is None else JSONResponse(answer)

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        check_auth(request, self.config.api_key)
        cards = [(self.config.model_name, self.limits.max_model_len)]
        if self.embedding_route.model_name is not None:
            try:
                limit = (await self.embedding_route.info())["max_model_len"]
            except APIError:  # the pool is not up yet: listed all the same
                limit = None
            cards.append((self.embedding_route.model_name, limit))
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvray", "max_model_len": limit}
            for name, limit in cards
        ]
        return {"object": "list", "data": data}

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(self, request: Request) -> dict:
        """vLLM's shape: a prompt or chat messages -> {count, max_model_len, tokens, token_strs}.
        Admitted like a completion (it holds a slot while it runs), tokenized off the loop."""
        check_auth(request, self.config.api_key)
        req = validate_body(TokenizeRequest, await read_json(request, self.config.max_body_bytes))
        self.ingest.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give one of prompt or messages", param="prompt", code="invalid_value")
        with self.admission.admitted(1):
            ids, strs = await self.generation.off_loop(self.ingest.tokenize, req)
        return {
            "count": len(ids),
            "max_model_len": self.limits.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(self, request: Request) -> dict:
        check_auth(request, self.config.api_key)
        req = validate_body(DetokenizeRequest, await read_json(request, self.config.max_body_bytes))
        self.ingest.check_model(req.model)
        vocab = self.limits.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"tokens: ids in [0, {vocab - 1}]", param="tokens", code="invalid_value")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    @app.get("/health")
    async def health(self) -> Response:
        """200 with every pool live; 503 when a pool has no live worker (the embedding
        pool: none answers within CONTROL_CALL_S), or when the control plane does not
        answer within CONTROL_CALL_S."""
        roles = self.config.roles
        try:
            pools = await wait_for(self.router.live_workers.remote(), CONTROL_CALL_S)
        except Exception as e:  # noqa: BLE001 (the Router is down or restarting)
            body = {"status": "unavailable", "error": f"the router did not answer: {type(e).__name__}"}
            return JSONResponse({**body, "replica": self.replica}, 503)
        ok = all(pools.get(r) for r in roles)
        body = {"status": "ok", "workers": pools, "replica": self.replica}
        if self.embedding_route.handle is not None:
            body["embedding"] = await self.embedding_route.alive(CONTROL_CALL_S)
            ok = ok and body["embedding"]
        body["status"] = "ok" if ok else "degraded"
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        if self.config.metrics_need_api_key:
            check_auth(request, self.config.api_key)
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
        check_auth(request, self.config.api_key)
        body = await read_json(request, self.config.max_body_bytes)
        if body.get("stream"):
            gen = self.generation.stream(body, chat, request.headers)
            await anext(gen)  # validated and admitted: errors so far are still plain HTTP errors
            return StreamingResponse(sse(gen), media_type="text/event-stream")  # (it sees disconnects)
        answer = await unless_disconnected(request, self.generation.complete(body, chat, request.headers))
        if answer is None:  # the client left: its requests were aborted; nobody reads this
            return Response(status_code=499)
        return JSONResponse(answer)

    # ---- handle API ---------------------------------------------------------------------

    async def generate(self, request: dict) -> dict:
        """An OpenAI request body (a Responses one if it has `input`, chat if `messages`)
        -> its response body."""
        if "input" in request:
            return await self.responses.answer(request)
        return await self.generation.complete(request, chat="messages" in request)

    async def generate_stream(self, request: dict) -> AsyncIterator[dict]:
        """An OpenAI request body -> its stream chunks (with a usage chunk if asked), or a
        Responses body's events."""
        if "input" in request:
            gen = self.responses.events(request)
        else:
            gen = self.generation.stream(request, chat="messages" in request)
        await anext(gen)
        try:
            async for chunk in gen:
                yield chunk
        finally:
            await gen.aclose()

    async def embeddings(self, request: dict) -> dict:
        """An OpenAI embeddings body -> its response body (the embedding pool's)."""
        return await self.embedding_route.answer(request)
