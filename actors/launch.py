"""Where workers are made: one placement group per worker (one bundle per tp x pp shard),
the worker's driver actor in bundle 0; it starts the other shards in the other bundles."""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvray.actors.decode_worker import DecodeWorker
from kvray.actors.prefill_worker import PrefillWorker
from kvray.actors.worker import EngineWorker, MixedWorker, Role
from kvray.configs import DeploymentConfig, KVTransferConfig, PoolConfig
from kvray.engine.config import EngineConfig

WORKER_CLASSES: dict[Role, type[EngineWorker]] = {
    "prefill": PrefillWorker,
    "decode": DecodeWorker,
    "mixed": MixedWorker,
}


def worker_bundles(engine: dict, pool: PoolConfig) -> list[dict]:
    """One placement-group bundle per tp x pp shard. `engine`: the EngineConfig arguments,
    with the pool's own overrides already applied."""
    bundle = {"CPU": pool.num_cpus, **pool.resources}
    if pool.num_gpus:
        bundle["GPU"] = pool.num_gpus
    config = EngineConfig(**engine)
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    return [bundle] * world


def start_worker(worker_id: str, role: Role, engine: dict, pool: PoolConfig, kv: KVTransferConfig):
    """Start one engine worker in its own placement group; returns (handle, group)."""
    bundles = worker_bundles(engine, pool)
    pg = placement_group(bundles, strategy=pool.placement_strategy, name=f"kvray-{worker_id}")
    ray.get(pg.ready())
    return start_worker_in(pg, f"kvray-{worker_id}", worker_id, role, engine, pool, kv), pg


def start_worker_in(
    pg,
    name: str,
    worker_id: str,
    role: Role,
    engine: dict,
    pool: PoolConfig,
    kv: KVTransferConfig,
    otlp_traces_endpoint: str | None = None,
):
    """The worker's driver actor in bundle 0 of `pg` (its other shards take the rest);
    `otlp_traces_endpoint`: where it exports traced requests' spans."""
    return (
        ray.remote(WORKER_CLASSES[role])
        .options(
            name=name,
            num_cpus=pool.num_cpus,
            num_gpus=pool.num_gpus,
            max_concurrency=1000,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        )
        .remote(
            worker_id,
            engine,
            kv.model_dump(),
            pool.torch_threads,
            {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus},
            pool.price_per_hour,
            otlp_traces_endpoint,
        )
    )


def stop_worker(actor, pg) -> None:
    try:
        ray.kill(actor)
    finally:
        remove_placement_group(pg)


def start_pools(config: DeploymentConfig) -> dict[str, tuple[str, object, object]]:
    """Start every configured worker and wait until all are ready: id -> (role, actor, group)."""
    workers = {}
    try:
        for role in config.roles:
            pool = getattr(config, role)
            for i in range(pool.num_workers):
                wid = f"{role}-{i}"
                engine = config.pool_engine(role)
                actor, pg = start_worker(wid, role, engine, pool, config.kv_transfer)
                workers[wid] = (role, actor, pg)
        ray.get([actor.ready.remote() for _, actor, _ in workers.values()])
    except BaseException:
        stop_pools(workers)
        raise
    return workers


def stop_pools(workers: dict[str, tuple[str, object, object]]) -> None:
    for _, actor, pg in workers.values():
        try:
            stop_worker(actor, pg)
        except Exception:  # already gone
            pass
