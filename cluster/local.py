"""Local bring-up: start (or join) Ray, start the workers, the Router and a front, tear down.

`RAY_ADDRESS` set: join that cluster. Unset: start a local Ray with a temp dir of our
own, no dashboard, token auth disabled for this local cluster only (Ray 2.60 enables
it by default, and a local single-user cluster has no one to keep out), and Ray's
background chatter turned down (`QUIET_LOCAL_RAY`).

Without HTTP, a `FrontActor` plays the ingress: it tokenizes, drives each request through
the workers the Router (an actor here) chooses, and receives their deltas
(router/frontend.py); `KvrayCluster.generate` streams cumulative outputs from it.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import ray

from kvray.actors.launch import start_pools, stop_pools
from kvray.configs import DeploymentConfig
from kvray.engine import CompletionOutput, RequestOutput, SamplingParams
from kvray.engine.sampling_params import sample_seed
from kvray.router import metrics
from kvray.router.frontend import Frontend
from kvray.router.router import Router
from kvray.router.streams import merge

# Ray's periodic work on an idle local cluster (Serve's controller loop every 0.1 s, each
# replica exporting its metrics every 0.1 s, every worker reporting task events to the GCS
# every second) took 0.17 of a core on a 2-core machine, 8 % of it; with the first three,
# 0.07; with all, 0.057 (BENCHMARKS.md, served against offline). On 2 cores the served
# engine's threads pay for it twice over: a thread taken off its core stalls its partner.
# Set where the environment does not say otherwise; the raylet and every worker inherit them.
QUIET_LOCAL_RAY = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",  # autoscaling and health react within 0.5 s
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",  # Serve's own ray_serve_* metrics
    "RAY_task_events_report_interval_ms": "0",  # no task events: the dashboard's task table
    # the log monitor looks for new log files every 2 s instead of every 0.1 s (a glob of the
    # session's log folder each time); lines of files it knows still go out within 0.1 s
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "2",
    "REPORTER_UPDATE_INTERVAL_MS": "15000",  # the agent's node stats (ray_node_*): every 15 s, not 5
}


def ensure_ray(num_cpus: int | None = None, temp_dir: str | None = None) -> bool:
    """Connect to Ray; returns True when this call started a local cluster."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for name, value in QUIET_LOCAL_RAY.items():
        os.environ.setdefault(name, value)
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="kvray-ray-")
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        _temp_dir=temp_dir,
        runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}},
    )
    return True


class RouterActorImpl(Router):
    """The Router as a plain actor (its health loop starts with the actor)."""

    async def ping(self) -> bool:
        self.start()
        return True


RouterActor = ray.remote(RouterActorImpl)


class FrontActorImpl:
    """The front of a local deployment: what the ingress does, minus HTTP."""

    def __init__(self, config: dict, router):
        from kvray.models.loader import load_tokenizer, resolve_model_path

        self.config = DeploymentConfig(**config)
        self.router = router
        self.tokenizer = load_tokenizer(resolve_model_path(self.config.engine_config().model))
        me = ray.get_runtime_context().current_actor  # the workers watch it: its requests die with it
        self.frontend = Frontend(router, self.config, f"front-{uuid.uuid4().hex[:8]}", handle=me)

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None) -> AsyncIterator:
        """Stream cumulative RequestOutputs of one request (the last has finished=True).
        `n > 1` fans out as the ingress does: n one-sample requests (seed + i each), so a
        disaggregated deployment serves them too; every output holds all n so far."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer(prompt).input_ids
        elif isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        else:
            text, ids = None, list(prompt)
        rid = request_id or f"req-{uuid.uuid4().hex}"
        samples = [
            dataclasses.replace(params, n=1, seed=sample_seed(params.seed, i)) for i in range(params.n)
        ]
        if params.n == 1:
            gens = [self.frontend.generate(rid, ids, samples[0])]
        else:
            gens = [self.frontend.generate(f"{rid}#{i}", ids, p) for i, p in enumerate(samples)]
        latest: dict[int, CompletionOutput] = {}
        stream = merge(gens)
        try:
            async for i, c in stream:
                c.index = i
                latest[i] = c
                done = len(latest) == len(gens) and all(o.finish_reason is not None for o in latest.values())
                yield RequestOutput(rid, text, ids, [latest[k] for k in sorted(latest)], finished=done)
        finally:
            await stream.aclose()
            for gen in gens:
                await gen.aclose()

    async def metrics_text(self) -> bytes:
        workers = await self.router.worker_stats.remote()
        return metrics.render(self.config.engine_config().model, self.frontend.stats.snapshot(), workers)


FrontActor = ray.remote(FrontActorImpl)


@dataclass
class KvrayCluster:
    """A running deployment: its front, router and the workers it routes to."""

    config: DeploymentConfig
    router: object
    front: object
    workers: dict[str, tuple[str, object, object]] = field(default_factory=dict)  # id -> (role, actor, pg)
    started_ray: bool = False

    def generate(
        self, prompt, params: SamplingParams, request_id: str | None = None
    ) -> Iterator[RequestOutput]:
        """Blocking stream of cumulative outputs (the Python entry point without HTTP)."""
        for ref in self.front.generate.remote(prompt, params, request_id):
            yield ray.get(ref)

    def complete(self, prompt, params: SamplingParams) -> RequestOutput:
        final = None
        for final in self.generate(prompt, params):  # noqa: B007 (keep the last)
            pass
        return final

    def shutdown(self) -> None:
        ray.kill(self.front)
        ray.kill(self.router)
        stop_pools(self.workers)
        if self.started_ray:
            ray.shutdown()


def launch(config: DeploymentConfig | dict, num_cpus: int | None = None) -> KvrayCluster:
    """Start Ray if needed, the configured worker pools, the router and a front."""
    config = config if isinstance(config, DeploymentConfig) else DeploymentConfig(**config)
    started = ensure_ray(num_cpus)
    workers = start_pools(config)
    router = RouterActor.options(num_cpus=0, max_concurrency=1000).remote(
        config.model_dump(), [(wid, role, actor) for wid, (role, actor, _) in workers.items()]
    )
    ray.get(router.ping.remote())
    front = FrontActor.options(num_cpus=0, max_concurrency=1000).remote(config.model_dump(), router)
    return KvrayCluster(config, router, front, workers, started)
