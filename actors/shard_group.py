"""A worker's tensor/pipeline-parallel shards: the other `tp x pp - 1` actors next to the
driver (the EngineWorker, rank 0), their process group, and their part of KV transfers.

The driver hosts a TCPStore; every shard joins one torch.distributed world (NCCL on CUDA,
gloo on CPU) with a gloo group beside it for the pickled step plans, and one
tensor-parallel group per pipeline stage. Shards sit in the driver's placement group, one
bundle each, so Ray places the whole worker together (PACK or STRICT_PACK).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import threading
from concurrent.futures import Future

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvray.actors.kv_transport import KVPullError, KVServing, KVSource, connector_class
from kvray.actors.net import bind_collectives_to, node_ip
from kvray.configs import KVTransferConfig
from kvray.engine import EngineConfig
from kvray.engine.kv_transfer import KVLayout, KVPiece, kv_layout_of
from kvray.engine.kv_views import BlockView, KVViews
from kvray.engine.model_runner import build_runner, engine_device
from kvray.models.loader import load_config, resolve_model_path
from kvray.models.parallel import ShardContext, ShardSpec

logger = logging.getLogger(__name__)
GROUP_TIMEOUT_S = 600  # joining the group includes loading every shard's weights
PLAN_WAIT_S = 365 * 24 * 3600  # how long an idle shard waits for the next step


def init_shard_context(spec: ShardSpec, host: str, port: int, backend: str, store=None) -> ShardContext:
    """Join the worker's process group as `spec.rank`; blocks until every shard has."""
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    if store is None:
        store = dist.TCPStore(host, port, spec.world_size, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout)
    # Step plans wait as long as the worker stays idle: their own gloo group, no timeout
    # in practice (the collectives inside a step keep the world's timeout).
    cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PLAN_WAIT_S))
    tp_group = None
    if spec.tp_size > 1:  # every rank makes every stage's group, in the same order
        for stage in range(spec.pp_size):
            group = dist.new_group([stage * spec.tp_size + i for i in range(spec.tp_size)], timeout=timeout)
            if stage == spec.pp_rank:
                tp_group = group
    return ShardContext(spec, tp_group, cpu_group, p2p_collectives=backend == "gloo")


def device_backend(config: EngineConfig) -> str:
    return "nccl" if engine_device(config).type == "cuda" else "gloo"


def start_shards(
    worker_id: str,
    engine_config: dict,
    kv_config: dict,
    resources: dict,
    torch_threads: int | None,
    host: str,
) -> tuple[list, ShardContext, dist.TCPStore]:
    """Driver side: start ranks 1.. in the current placement group and join the group.
    Returns the shard actors, rank 0's context and the group's store (keep it alive)."""
    config = EngineConfig(**engine_config)
    spec = ShardSpec(config.tensor_parallel_size, config.pipeline_parallel_size, 0)
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    store = dist.TCPStore(host, 0, spec.world_size, True, timeout=timeout, wait_for_workers=False)
    pg = ray.util.get_current_placement_group()
    shards = []
    for rank in range(1, spec.world_size):
        strategy = None
        if pg is not None:
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
        actor = (
            ray.remote(ShardWorker)
            .options(
                num_cpus=resources.get("num_cpus", 0),
                num_gpus=resources.get("num_gpus", 0),
                max_concurrency=100,
                scheduling_strategy=strategy,
            )
            .remote(worker_id, engine_config, kv_config, rank, host, store.port, torch_threads)
        )
        shards.append(actor)
    return shards, init_shard_context(spec, host, store.port, device_backend(config), store), store


class ShardWorker(KVServing):
    """Rank > 0 of a worker: its slice of the model and KV cache; runs the driver's plans."""

    def __init__(
        self,
        worker_id: str,
        engine_config: dict,
        kv_config: dict,
        rank: int,
        host: str,
        port: int,
        torch_threads: int | None,
    ):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        config = EngineConfig(**engine_config)
        torch.manual_seed(config.seed)
        spec = ShardSpec(config.tensor_parallel_size, config.pipeline_parallel_size, rank)
        bind_collectives_to(node_ip())  # a shard on another node than its driver (tp/pp across nodes)
        shard = init_shard_context(spec, host, port, device_backend(config))
        path = resolve_model_path(config.model)
        hf_config = load_config(path)
        # built on the thread that runs it: one OpenMP master per process (as AsyncLLM)
        built: Future = Future()
        self.thread = threading.Thread(
            target=self._serve, args=(config, hf_config, path, shard, built), name="kvray-shard", daemon=True
        )
        self.thread.start()
        self.runner = built.result()
        self.shard_id = f"{worker_id}/{rank}"
        layout = kv_layout_of(hf_config, spec, config.block_size, self.runner.dtype, self.runner.kv_quant)
        self.views = KVViews(self.runner.kv_cache)  # no pins: the worker's driver holds them
        self.source = KVSource(self.views, layout)
        kv = KVTransferConfig(**kv_config)
        backend = "nccl" if self.runner.device.type == "cuda" else "gloo"
        self.host = node_ip()  # this shard's node (its driver's may be another)
        self.connector = connector_class(kv.connector)(self.shard_id, kv, self.host, backend)
        self.lease = self.connector.lease

    def _serve(self, config, hf_config, path, shard, built: Future) -> None:
        try:
            runner = build_runner(config, hf_config, path, shard)
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(runner)
        try:
            runner.serve()
        except BaseException as e:  # the group is out of step: exit, so the driver's
            logger.error("kvray shard %s: step failed (%r); exiting", self.shard_id, e)
            os._exit(1)  # pending collective fails and its worker exits too

    async def ready(self) -> str:
        return self.shard_id

    # KV source side (this shard's slice of a prefill worker's cache): KVServing's methods

    # KV destination side (this shard's slice of a decode worker's cache)
    async def pull_pieces(self, dst_blocks: list[int], *args) -> int:
        return await pull_pieces(self.connector, self.views.of(dst_blocks), *args)


async def pull_pieces(
    connector,
    into: BlockView,
    sources: list,  # prefill shard handles by rank (rank 0: the prefill worker)
    source_ids: list[str],
    pieces: list[KVPiece],
    src_layout: KVLayout,
    dst_layout: KVLayout,
    src_blocks: list[int],
    start_by: float,
) -> int:
    """One decode shard's part of a pull: each piece from its prefill shard, the pieces
    from different shards at once, none starting after `start_by` (see
    KVConnector.pull_piece). Returns the bytes moved; raises KVPullError."""

    async def one(piece: KVPiece) -> int:
        src_layers, src_heads = piece.local(src_layout, piece.src_rank)
        dst_layers, dst_heads = piece.local(dst_layout, piece.dst_rank)
        return await connector.pull_piece(
            source_ids[piece.src_rank],
            sources[piece.src_rank],
            src_blocks,
            (src_layers, src_heads),
            into,
            (dst_layers, dst_heads),
            start_by,
        )

    results = await asyncio.gather(*(one(p) for p in pieces), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r if isinstance(r, KVPullError) else KVPullError(f"piece failed: {r!r}")
    return sum(results)
