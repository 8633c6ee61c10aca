"""The Router as a Serve deployment: one replica that routes the requests of every
ingress replica to the workers of the pool deployments (router/pools.py).

Ingress replicas scale out (HTTP parsing, tokenizing, admission); routing does not: one
Router knows the pools' workers (their replicas join and leave it), their health and the
request metrics, so `/metrics` from any ingress replica shows the whole app. Only what the
ingress and the pool replicas call is exposed (the Router's own `check_health` would
otherwise become Serve's replica health check).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve

from kvray.configs import DeploymentConfig, ServeConfig
from kvray.engine import RequestOutput, SamplingParams
from kvray.router.router import Router

# Serve queues past this; the ingress replicas answer 503 long before (max_queued_requests)
MAX_ONGOING_REQUESTS = 10_000
FIRST_WORKER_WAIT_S = 1800.0  # an ingress waits this long for the pools' first worker


@serve.deployment(
    num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0}
)
class RouterDeployment:
    def __init__(self, config: dict):
        serve_config = ServeConfig(**config)
        deployment = DeploymentConfig(**serve_config.model_dump(include=set(DeploymentConfig.model_fields)))
        self.router = Router(deployment.model_dump(), [], serve_config.model_name)

    async def add_worker(self, worker_id: str, role: str, handle) -> None:
        self.router.add_worker(worker_id, role, handle)

    async def has_worker(self, worker_id: str) -> bool:
        return worker_id in self.router.workers

    async def remove_worker(self, worker_id: str) -> None:
        self.router.remove_worker(worker_id)

    async def generate(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Call with `handle.options(stream=True)`; see Router.generate."""
        gen = self.router.generate(prompt, params, request_id)
        try:
            async for out in gen:
                yield out
        finally:
            await gen.aclose()

    async def abort(self, request_id: str) -> bool:
        return await self.router.abort(request_id)

    async def metrics_text(self) -> bytes:
        return await self.router.metrics_text()

    async def model_info(self) -> dict:
        return await self.router.model_info(wait_seconds=FIRST_WORKER_WAIT_S)

    async def live_workers(self) -> dict[str, list[str]]:
        return await self.router.live_workers()
