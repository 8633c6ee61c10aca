"""Worker pools as Serve deployments: one replica per engine worker, so Ray Serve's
autoscaler grows and shrinks the prefill and decode pools independently.

A replica reserves its worker's placement group (`placement_group_bundles`, one bundle
per tp x pp shard), starts the worker's driver actor in bundle 0 (which starts the other
shards in the rest), and joins the Router (and joins it again, from its health check, should the Router
restart). It reports the worker's load
signals to the autoscaler (`record_autoscaling_stats`, read by
`kvray.router.autoscaling.PoolPolicy`). When Serve stops it, the worker leaves the Router
(nothing new is routed to it), finishes the requests it holds, then stops.
When new replicas need resources the cluster lacks, Ray's autoscaler (or KubeRay's) adds
nodes: Serve asks for the placement groups, the cluster autoscaler sees the demand.
"""

from __future__ import annotations

import asyncio
import time

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from kvray.actors.launch import start_worker_in, worker_bundles
from kvray.configs import ServeConfig

DRAIN_SECONDS = 60.0  # a leaving worker finishes its requests for at most this long
ROUTER_CALL_S = 5.0
HEALTH_CHECK_S = 2.0  # also how soon a worker re-joins a restarted Router


@serve.deployment(
    ray_actor_options={"num_cpus": 0},
    graceful_shutdown_timeout_s=DRAIN_SECONDS + 30,
    health_check_period_s=HEALTH_CHECK_S,
)
class PoolReplica:
    async def __init__(self, role: str, config: dict, router: DeploymentHandle):
        cfg = ServeConfig(**config)
        pool = getattr(cfg, role)
        self.role = role
        self.router = router
        self.leaving = False
        self.membership = asyncio.Lock()  # joining (health checks) vs leaving (__del__)
        # unique for the app's life, also across Router restarts (ids name KV tickets and
        # the pair groups between workers)
        self.worker_id = f"{role}-{serve.get_replica_context().replica_id.unique_id}"
        engine = {**cfg.engine, **pool.engine}
        pg = ray.util.get_current_placement_group()
        name = f"{cfg.app_name}-{self.worker_id}"
        self.worker = start_worker_in(pg, name, self.worker_id, role, engine, pool, cfg.kv_transfer)
        await self.worker.ready.remote()
        await router.add_worker.remote(self.worker_id, role, self.worker)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return await self.worker.load_signals.remote()

    async def check_health(self) -> None:
        await self.worker.ready.remote()  # a dead worker makes Serve replace this replica
        async with self.membership:  # never re-join after __del__ has left
            if self.leaving:
                return
            try:  # a restarted Router starts empty: join it again
                if not await asyncio.wait_for(self.router.has_worker.remote(self.worker_id), ROUTER_CALL_S):
                    await self.router.add_worker.remote(self.worker_id, self.role, self.worker)
            except Exception:  # the Router is restarting: try again at the next check
                pass

    async def __del__(self):
        """Leave the Router, let the requests the worker holds finish (and its pinned
        prefills be pulled or expire), stop it. (When the whole app is deleted the Router
        may be gone already: then just drain.)"""
        async with self.membership:
            self.leaving = True
            try:
                await asyncio.wait_for(self.router.remove_worker.remote(self.worker_id), ROUTER_CALL_S)
            except Exception:
                pass
        deadline = time.monotonic() + DRAIN_SECONDS
        try:
            while time.monotonic() < deadline:
                load = await self.worker.load_signals.remote()
                if not load["running_requests"] and not load["kv_handoffs"]:
                    break
                await asyncio.sleep(0.2)
            await asyncio.wait_for(self.worker.shutdown.remote(), ROUTER_CALL_S)
        except Exception:  # the worker is already gone
            pass
        finally:
            ray.kill(self.worker)


def pool_deployment(cfg: ServeConfig, role: str, router) -> serve.Application:
    """The pool of `role` bound for the app: a fixed `num_workers`, or autoscaled."""
    from kvray.router.autoscaling import autoscaling_config

    pool = getattr(cfg, role)
    engine = {**cfg.engine, **pool.engine}
    options = {
        "name": f"{cfg.app_name}-{role}",
        "placement_group_bundles": worker_bundles(engine, pool),
        "placement_group_strategy": pool.placement_strategy,
    }
    if pool.autoscaling is None:
        options["num_replicas"] = pool.num_workers
    else:
        options["autoscaling_config"] = autoscaling_config(role, pool)
    return PoolReplica.options(**options).bind(role, cfg.model_dump(), router)
