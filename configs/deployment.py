"""Deployment configuration: which workers, how KV moves, how the router chooses.

Data only (pydantic models validated at the edges); the engine's own arguments stay a
plain dict here and are validated by `kvray.engine.EngineConfig` where engines are made.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PoolConfig(_Strict):
    num_workers: int = Field(1, ge=0)
    # per shard: a worker of tp x pp shards reserves one bundle of these per shard
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    torch_threads: int | None = Field(None, ge=1)  # None: torch's default
    price_per_hour: float = Field(0.0, ge=0)  # USD per worker-hour, for kvray:request_cost_usd
    # EngineConfig arguments for this pool only, over the deployment's `engine` (e.g. a
    # prefill pool with tensor_parallel_size 2 in front of a decode pool with 1)
    engine: dict = Field(default_factory=dict)
    # how a worker's tp x pp shards (one bundle each) are placed: PACK prefers one node,
    # STRICT_PACK requires it
    placement_strategy: Literal["PACK", "STRICT_PACK"] = "PACK"


class KVTransferConfig(_Strict):
    connector: Literal["torch_dist", "object_store"] = "torch_dist"
    lease_seconds: float = Field(30.0, gt=0)  # how long prefill keeps a ticket's blocks pinned
    pull_timeout_seconds: float = Field(30.0, gt=0)  # a pull slower than this is given up


class RouterConfig(_Strict):
    affinity_blocks: int = Field(4, ge=1)  # leading full blocks hashed for prefix affinity
    imbalance_threshold: int = Field(4, ge=0)  # in-flight gap that overrides affinity
    max_retries: int = Field(2, ge=0)  # other workers tried when one dies before the first token
    health_check_seconds: float = Field(2.0, gt=0)


class DeploymentConfig(_Strict):
    engine: dict = Field(default_factory=dict)  # kvray.engine.EngineConfig arguments
    disaggregated: bool = True  # False: colocated `mixed` workers, no KV transfer
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()
    mixed: PoolConfig = PoolConfig()
    kv_transfer: KVTransferConfig = KVTransferConfig()
    router: RouterConfig = RouterConfig()
