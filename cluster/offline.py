"""The offline `LLM` when the model is sharded (tensor/pipeline parallel > 1).

The shards are the same Ray actors a serving worker uses: one `MixedWorker` (the group's
driver, rank 0) in its placement group starts the others. A local Ray is started when
none is running (and stopped again by `close`).
"""

from __future__ import annotations

import os
import uuid

import ray
from ray.exceptions import RayTaskError

from kvray.actors.launch import start_worker, stop_worker
from kvray.cluster.local import ensure_ray
from kvray.configs import KVTransferConfig, PoolConfig
from kvray.engine.config import EngineConfig
from kvray.engine.outputs import RequestOutput
from kvray.models.loader import load_config, load_tokenizer, resolve_model_path
from kvray.models.parallel import ShardSpec


class ShardedEngine:
    """What `LLM` needs of an engine, served by a tp x pp worker group on Ray."""

    def __init__(self, config: EngineConfig):
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        path = resolve_model_path(config.model)
        _check_partition(config, load_config(path))  # here, not as an actor's failed start
        self.started_ray = ensure_ray()
        self.tokenizer = load_tokenizer(path)
        cpus = ray.cluster_resources().get("CPU", os.cpu_count() or 1)
        # a CPU machine with fewer cores than shards still runs them (threads share cores)
        per_shard = min(1.0, cpus / world)
        pool = PoolConfig(
            num_cpus=per_shard,
            num_gpus=1.0 if config.device != "cpu" and ray.cluster_resources().get("GPU", 0) else 0.0,
            torch_threads=max(1, int((os.cpu_count() or 1) // world)),
        )
        engine = {f: getattr(config, f) for f in EngineConfig.__dataclass_fields__}
        worker_id = f"offline-{uuid.uuid4().hex[:8]}"  # several LLMs may share a cluster
        self.worker, self.pg = start_worker(worker_id, "mixed", engine, pool, KVTransferConfig())
        try:
            _unwrap(self.worker.ready.remote())
        except BaseException:
            self._stop()
            raise

    def generate(self, request_ids, prompts, params, priorities) -> list[RequestOutput]:
        return _unwrap(self.worker.generate_batch.remote(request_ids, prompts, params, priorities))

    def kv_cache_stats(self):
        return _unwrap(self.worker.kv_cache_stats.remote())

    def close(self) -> None:
        if not ray.is_initialized():  # Ray is gone and the shards with it; calling Ray
            return  # now would start a new cluster
        try:
            ray.get(self.worker.shutdown.remote(), timeout=30)
        except Exception:  # already gone
            pass
        finally:
            self._stop()

    def _stop(self) -> None:
        try:
            stop_worker(self.worker, self.pg)
        finally:
            if self.started_ray:
                ray.shutdown()


def _check_partition(config: EngineConfig, hf_config) -> None:
    spec = ShardSpec(config.tensor_parallel_size, config.pipeline_parallel_size)
    spec.check_heads(hf_config.num_attention_heads, hf_config.num_key_value_heads)
    spec.layers(hf_config.num_hidden_layers)


def _unwrap(ref):
    """ray.get, raising the engine's own error (e.g. InvalidArgumentError) as it is."""
    try:
        return ray.get(ref)
    except RayTaskError as e:
        raise (e.cause if e.cause is not None else e) from None
