"""The Router as a Serve deployment: one replica that starts the worker pools and routes
the requests of every ingress replica.

Ingress replicas scale out (HTTP parsing, tokenizing, admission); routing does not: one
Router holds the pools, their health and the request metrics, so `/metrics` from any
ingress replica shows the whole app. The pools are this replica's child actors and share
its lifetime. Only what the ingress calls is exposed (the Router's own `check_health`
would otherwise become Serve's replica health check).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve

from kvray.actors.launch import start_pools, stop_pools
from kvray.configs import DeploymentConfig, ServeConfig
from kvray.engine import RequestOutput, SamplingParams
from kvray.router.router import Router

# Serve queues past this; the ingress replicas answer 503 long before (max_queued_requests)
MAX_ONGOING_REQUESTS = 10_000


@serve.deployment(
    num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0}
)
class RouterDeployment:
    def __init__(self, config: dict):
        serve_config = ServeConfig(**config)
        deployment = DeploymentConfig(**serve_config.model_dump(include=set(DeploymentConfig.model_fields)))
        self.pools = start_pools(deployment)
        self.router = Router(
            deployment.model_dump(),
            [(wid, role, actor) for wid, (role, actor, _) in self.pools.items()],
            serve_config.model_name,
        )

    def __del__(self):
        stop_pools(getattr(self, "pools", {}))  # none when start_pools failed (it cleaned up)

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
        return await self.router.model_info()

    async def live_workers(self) -> dict[str, list[str]]:
        return await self.router.live_workers()
