"""Worker pools as Serve deployments: one replica per engine worker, so Ray Serve's
autoscaler grows and shrinks the prefill and decode pools independently.

A replica reserves its worker's placement group (`placement_group_bundles`, one bundle
per tp x pp shard) and starts the worker's driver actor in bundle 0 (which starts the other
shards in the rest), named `<app>-<role>-<replica id>`: the Router replicas find it by that
name. It reports the worker's load signals to the autoscaler (`record_autoscaling_stats`,
read by `kvray.router.autoscaling.PoolPolicy`). When Serve stops it, the worker drains: it
takes no new request (the Routers stop choosing it at their next health check; a request
sent meanwhile is refused and retried elsewhere), finishes those it holds, then stops.
When new replicas need resources the cluster lacks, Ray's autoscaler (or KubeRay's) adds
nodes: Serve asks for the placement groups, the cluster autoscaler sees the demand.
"""

from __future__ import annotations

import asyncio
import time

import ray
from ray import serve

from kvray.actors.launch import start_worker_in, worker_bundles
from kvray.configs import ServeConfig
from kvray.timeouts import wait_for

DRAIN_SECONDS = 60.0  # a leaving worker finishes its requests for at most this long
WORKER_CALL_S = 5.0
HEALTH_CHECK_S = 2.0
HEALTH_CALL_S = 10.0  # a worker that does not answer its health check this soon is unhealthy


@serve.deployment(
    ray_actor_options={"num_cpus": 0},
    graceful_shutdown_timeout_s=DRAIN_SECONDS + 30,
    health_check_period_s=HEALTH_CHECK_S,
)
class PoolReplica:
    async def __init__(self, role: str, config: dict):
        cfg = ServeConfig(**config)
        pool = getattr(cfg, role)
        # unique for the app's life (ids name KV tickets and the pair groups between workers)
        self.worker_id = f"{role}-{serve.get_replica_context().replica_id.unique_id}"
        engine = cfg.pool_engine(role)
        pg = ray.util.get_current_placement_group()
        name = f"{cfg.app_name}-{self.worker_id}"
        self.worker = start_worker_in(
            pg, name, self.worker_id, role, engine, pool, cfg.kv_transfer, cfg.otlp_traces_endpoint
        )
        await self.worker.ready.remote()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        signals = await wait_for(self.worker.load_signals.remote(), WORKER_CALL_S)
        return signals.metrics()

    async def check_health(self) -> None:
        """A dead worker, or one whose engine can no longer serve (its loop died, a step
        hangs past step_timeout_s), makes Serve replace this replica."""
        await wait_for(self.worker.ready.remote(), HEALTH_CALL_S)

    async def __del__(self):
        """Drain the worker: no new request, the ones it holds finish (and its pinned
        prefills are pulled or expire), then stop it. A worker whose engine has failed
        has nothing left to finish (its requests moved on): it stops at once."""
        deadline = time.monotonic() + DRAIN_SECONDS
        try:
            await wait_for(self.worker.ready.remote(), WORKER_CALL_S)
            await wait_for(self.worker.drain.remote(), WORKER_CALL_S)
            while time.monotonic() < deadline:
                load = await wait_for(self.worker.load_signals.remote(), WORKER_CALL_S)
                if not load.running_requests and not load.kv_handoffs:
                    break
                await asyncio.sleep(0.2)
            await wait_for(self.worker.shutdown.remote(), WORKER_CALL_S)
        except Exception:  # the worker is already gone
            pass
        finally:
            ray.kill(self.worker)


def pool_deployment(cfg: ServeConfig, role: str) -> serve.Application:
    """The pool of `role` bound for the app: a fixed `num_workers`, or autoscaled."""
    from kvray.router.autoscaling import autoscaling_config

    pool = getattr(cfg, role)
    engine = cfg.pool_engine(role)
    options = {
        "name": f"{cfg.app_name}-{role}",
        "placement_group_bundles": worker_bundles(engine, pool),
        "placement_group_strategy": pool.placement_strategy,
    }
    if pool.autoscaling is None:
        options["num_replicas"] = pool.num_workers
    else:
        options["autoscaling_config"] = autoscaling_config(role, pool, cfg.app_name, engine)
    return PoolReplica.options(**options).bind(role, cfg.model_dump())
