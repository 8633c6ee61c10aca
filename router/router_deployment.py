"""The Router as a Serve deployment: the control plane of the app, in `router.num_replicas`
replicas. Each replica finds the pools' workers itself (their named actors, re-read every
health period), so replicas agree on the members and, by rendezvous hashing, on every
prefix choice; a replica that restarts rebuilds its view at once. No token passes here.

Only what the ingress and the tests call is exposed (the Router's own `refresh` would
otherwise become Serve's replica health check).
"""

from __future__ import annotations

import ray
from ray import serve

from kvray.actors.messages import WorkerStats
from kvray.configs import DeploymentConfig, ServeConfig
from kvray.engine.request_limits import RequestLimits
from kvray.router.router import Router

MAX_ONGOING_REQUESTS = 10_000  # route calls are short; the ingress replicas admit requests
FIRST_WORKER_WAIT_S = 1800.0  # an ingress waits this long for the pools' first worker
ROLES = ("prefill", "decode", "mixed")


def pool_workers(app_name: str) -> dict[str, tuple[str, object]]:
    """The live workers of the app's pools: worker id -> (role, actor handle). Pool
    replicas name their workers `<app>-<role>-<replica id>` (router/pools.py)."""
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if not name.startswith(f"{app_name}-"):
            continue
        worker_id = name[len(app_name) + 1 :]
        role = worker_id.split("-", 1)[0]
        if role not in ROLES or "-" not in worker_id:
            continue
        try:
            found[worker_id] = (role, ray.get_actor(name, namespace=entry["namespace"]))
        except ValueError:  # gone between the listing and the lookup
            continue
    return found


@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0})
class RouterDeployment:
    async def __init__(self, config: dict):
        serve_config = ServeConfig(**config)
        deployment = DeploymentConfig(**serve_config.model_dump(include=set(DeploymentConfig.model_fields)))
        app_name = serve_config.app_name
        self.router = Router(deployment.model_dump(), discover=lambda: pool_workers(app_name))
        self.router.start()

    async def route(
        self, role: str, key: bytes | None = None, exclude: list[str] | tuple = ()
    ) -> tuple | None:
        """(worker id, handle), or None when the pool has no live worker now (Router.route)."""
        return await self.router.route(role, key, exclude)

    async def has_worker(self, worker_id: str) -> bool:
        return worker_id in self.router.workers

    async def model_info(self) -> RequestLimits:
        return await self.router.model_info(wait_seconds=FIRST_WORKER_WAIT_S)

    async def live_workers(self) -> dict[str, list[str]]:
        return await self.router.live_workers()

    async def worker_stats(self) -> list[WorkerStats]:
        return await self.router.worker_stats()
