"""Deployment configuration: which workers, how KV moves, how the router chooses.

Data only (pydantic models validated at the edges); the engine's own arguments stay a
plain dict here (what travels to the workers), checked against `kvray.engine.EngineConfig`
as the config loads.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlannerConfig(_Strict):
    """Size the pool from kvray.sim's planner: the app's measured request rate and mean
    prompt and output lengths (the ingresses' published request metrics) against what one
    worker of this pool takes within the SLOs, read off a step-time model. The planner's
    ask joins the pool's other signals (the largest ask wins), so with a planner block on
    both pools of a PD app the prefill:decode ratio follows the measured token rates."""

    ttft_seconds: float = Field(gt=0)  # the SLOs the pool must meet (90th percentile TTFT)
    tpot_seconds: float = Field(gt=0)
    # the step-time model: a fitted profile (`kvray bench step-times`), else `model` on
    # `gpu` (kvray.sim's datasheet table) at tensor-parallel size `tp`
    profile: str | None = None
    model: str = "llama-3.1-8b"
    gpu: str = "H100"
    tp: int = Field(1, ge=1)
    window_seconds: float = Field(30.0, gt=0)  # rates are measured over this much time


class PoolAutoscaling(_Strict):
    """A pool's worker count follows its LLM signals (Ray Serve autoscaling with kvray's
    policy, `kvray.router.autoscaling`): each signal asks for enough workers to bring it
    to its target, the pool takes the largest ask, and Serve applies the bounds and delays.

    A prefill pool reads the prompt tokens waiting to be computed and the time its prompts
    take to their first token; a decode (or mixed) pool reads KV-cache usage, running
    requests and the inter-token latency; an embedding pool reads its queued input tokens.
    A target of None leaves that signal out.
    """

    min_workers: int = Field(1, ge=1)
    max_workers: int = Field(4, ge=1)
    upscale_delay_s: float = Field(10.0, ge=0)  # a signal must stay high this long
    downscale_delay_s: float = Field(60.0, ge=0)  # ... or low this long
    look_back_period_s: float = Field(30.0, gt=0)  # signals are averaged over this window
    # prefill (and embedding) signals (per worker)
    target_queued_prompt_tokens: int | None = Field(2048, ge=1)
    target_ttft_seconds: float | None = Field(None, gt=0)
    # decode signals (per worker)
    target_kv_cache_usage: float | None = Field(0.8, gt=0, le=1)
    target_running_requests: int | None = Field(32, ge=1)
    target_itl_seconds: float | None = Field(None, gt=0)
    planner: PlannerConfig | None = None  # kvray.sim's sizing from measured rates and SLOs

    @model_validator(mode="after")
    def _bounds(self) -> PoolAutoscaling:
        if self.max_workers < self.min_workers:
            raise ValueError(f"max_workers={self.max_workers} must be >= min_workers={self.min_workers}")
        return self


class PoolConfig(_Strict):
    num_workers: int = Field(1, ge=0)
    # per shard: a worker of tp x pp shards reserves one bundle of these per shard
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    # custom Ray resources each shard's bundle also reserves, e.g. {"kvray_decode": 1} to
    # keep the pool on the nodes (ray up node types, KubeRay groups) that offer them
    resources: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _custom_resources(self) -> PoolConfig:
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU", "memory") or amount < 0:
                raise ValueError(
                    f"resources.{name}={amount}: custom resources only, each >= 0 "
                    "(CPUs and GPUs are num_cpus and num_gpus)"
                )
        return self

    torch_threads: int | None = Field(None, ge=1)  # None: torch's default
    price_per_hour: float = Field(0.0, ge=0)  # USD per worker-hour, for kvray:request_cost_usd
    # EngineConfig arguments for this pool only, over the deployment's `engine` (e.g. a
    # prefill pool with tensor_parallel_size 2 in front of a decode pool with 1)
    engine: dict = Field(default_factory=dict)
    # how a worker's tp x pp shards (one bundle each) are placed: PACK prefers one node,
    # STRICT_PACK requires it
    placement_strategy: Literal["PACK", "STRICT_PACK"] = "PACK"
    # None: a fixed pool of num_workers; else served as a Serve deployment that scales
    # between min_workers and max_workers on the pool's signals (starting at num_workers)
    autoscaling: PoolAutoscaling | None = None


class KVTransferConfig(_Strict):
    # torch_dist: gloo / NCCL pair groups; tcp: a socket per pair, received on the worker's
    # event loop (CPU caches: no thread hand-off per pull); object_store: Ray objects
    connector: Literal["torch_dist", "object_store", "tcp"] = "torch_dist"
    lease_seconds: float = Field(30.0, gt=0)  # how long prefill keeps a ticket's blocks pinned
    pull_timeout_seconds: float = Field(30.0, gt=0)  # a pull slower than this is given up

    def lease_policy(self):
        """The hand-off's timing rules these set (kvray.engine.kv_handoff.LeasePolicy): the
        one policy a worker, its engine and its transports apply, and the simulator too."""
        from kvray.engine.kv_handoff import LeasePolicy

        return LeasePolicy(self.lease_seconds, self.pull_timeout_seconds)


class RouterConfig(_Strict):
    affinity_blocks: int = Field(4, ge=1)  # leading full blocks hashed for prefix affinity
    imbalance_threshold: int = Field(4, ge=0)  # load gap (requests) that overrides affinity
    max_retries: int = Field(2, ge=0)  # other workers tried when one dies before the first token
    # times a request may move to another worker after its worker died mid-stream (Dynamo's
    # name); each move recomputes prompt + tokens so far there and the stream goes on
    migration_limit: int = Field(3, ge=0)
    # a request still running this long after it arrived is aborted everywhere (its own
    # `request_timeout_s` may set another); it also bounds the wait for a worker to join
    request_timeout_s: float = Field(600.0, gt=0)
    # the most a request's own `request_timeout_s` may ask for (more is a 400)
    max_request_timeout_s: float = Field(3600.0, gt=0)
    health_check_seconds: float = Field(2.0, gt=0)  # also how soon a new worker is found
    num_replicas: int = Field(1, ge=1)  # Router replicas (Serve); they agree on every choice
    # disaggregated only: a prompt of at most this many tokens is prefilled on its decode
    # worker, in its continuous batch, instead of being handed off (Dynamo's conditional
    # disaggregation, its `max_local_prefill_length`); 0: every prompt goes to a prefill worker.
    # (The decode pool's autoscaling counts that prompt work in `queued_prompt_tokens`, as a
    # mixed pool's; the planner's sizing does not.)
    max_local_prefill_length: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _timeouts(self) -> RouterConfig:
        if self.max_request_timeout_s < self.request_timeout_s:
            raise ValueError(
                f"max_request_timeout_s={self.max_request_timeout_s} must be >= "
                f"request_timeout_s={self.request_timeout_s}"
            )
        return self


class DeploymentConfig(_Strict):
    engine: dict = Field(default_factory=dict)  # kvray.engine.EngineConfig arguments
    disaggregated: bool = True  # False: colocated `mixed` workers, no KV transfer
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()
    mixed: PoolConfig = PoolConfig()
    # embedding workers for /v1/embeddings (None: the app serves no embeddings): the pool's
    # own `engine` names an embedding model (e.g. {model: all-minilm-l6-v2}); the
    # deployment's `engine` does not apply to it. Autoscaled on queued input tokens
    # (`autoscaling.target_queued_prompt_tokens` per worker).
    embedding: PoolConfig | None = None
    kv_transfer: KVTransferConfig = KVTransferConfig()
    router: RouterConfig = RouterConfig()

    @property
    def roles(self) -> list[str]:
        """The pools this deployment runs."""
        return ["prefill", "decode"] if self.disaggregated else ["mixed"]

    def engine_config(self, role: str | None = None):
        """The kvray.engine.EngineConfig pool `role`'s workers run (None: the deployment's
        `engine` alone): its defaults are EngineConfig's, stated nowhere else."""
        from kvray.engine.config import EngineConfig

        return EngineConfig(**(self.engine if role is None else self.pool_engine(role)))

    def pool_engine(self, role: str) -> dict:
        """The EngineConfig arguments the workers of pool `role` run: the deployment's
        `engine`, then the pool's own over it (the one place they are merged)."""
        return {**self.engine, **getattr(self, role).engine}

    @model_validator(mode="after")
    def _engines(self) -> DeploymentConfig:
        """Each pool's engine arguments are a valid EngineConfig here, where the config
        loads, not in a remote worker minutes later (an unknown or bad field names the
        pool and the field)."""
        import dataclasses

        from kvray.engine.config import EngineConfig

        known = {f.name for f in dataclasses.fields(EngineConfig)}
        for role in self.roles:
            engine = self.pool_engine(role)
            unknown = sorted(engine.keys() - known)
            if unknown:
                raise ValueError(f"{role} engine: unknown field {unknown[0]!r} (EngineConfig's)")
            try:
                EngineConfig(**engine)
            except ValueError as e:  # InvalidArgumentError: the field and its allowed range
                raise ValueError(f"{role} engine: {e}") from None
        if self.embedding is not None:
            engine = self.embedding.engine
            unknown = sorted(engine.keys() - known)
            if "model" not in engine or unknown:
                bad = unknown[0] if unknown else "model"
                raise ValueError(
                    f"embedding engine: {bad!r}: an embedding model's EngineConfig fields, `model` "
                    "among them (e.g. {model: all-minilm-l6-v2})"
                )
            try:
                EngineConfig(**engine)
            except ValueError as e:
                raise ValueError(f"embedding engine: {e}") from None
            if self.embedding.autoscaling is not None and self.embedding.autoscaling.planner is not None:
                raise ValueError("embedding.autoscaling.planner: none (the planner sizes generating pools)")
        return self
