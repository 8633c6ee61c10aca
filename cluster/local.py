"""Local bring-up: start (or join) Ray, start the workers and the router, tear down.

`RAY_ADDRESS` set: join that cluster. Unset: start a local Ray with a temp dir of our
own, no dashboard, and token auth disabled for this local cluster only (Ray 2.60 enables
it by default, and a local single-user cluster has no one to keep out).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import ray

from kvray.actors.launch import start_pools, stop_pools
from kvray.configs import DeploymentConfig
from kvray.engine import RequestOutput, SamplingParams
from kvray.router.router import RouterActor


def ensure_ray(num_cpus: int | None = None, temp_dir: str | None = None) -> bool:
    """Connect to Ray; returns True when this call started a local cluster."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="kvray-ray-")
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        _temp_dir=temp_dir,
        runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}},
    )
    return True


@dataclass
class KvrayCluster:
    """A running deployment: its router handle and the workers it routes to."""

    config: DeploymentConfig
    router: object
    workers: dict[str, tuple[str, object, object]] = field(default_factory=dict)  # id -> (role, actor, pg)
    started_ray: bool = False

    def generate(
        self, prompt, params: SamplingParams, request_id: str | None = None
    ) -> Iterator[RequestOutput]:
        """Blocking stream of cumulative outputs (the Python entry point without HTTP)."""
        for ref in self.router.generate.remote(prompt, params, request_id):
            yield ray.get(ref)

    def complete(self, prompt, params: SamplingParams) -> RequestOutput:
        final = None
        for final in self.generate(prompt, params):  # noqa: B007 (keep the last)
            pass
        return final

    def shutdown(self) -> None:
        ray.kill(self.router)
        stop_pools(self.workers)
        if self.started_ray:
            ray.shutdown()


def launch(config: DeploymentConfig | dict, num_cpus: int | None = None) -> KvrayCluster:
    """Start Ray if needed, the configured worker pools, and the router."""
    config = config if isinstance(config, DeploymentConfig) else DeploymentConfig(**config)
    started = ensure_ray(num_cpus)
    workers = start_pools(config)
    router = RouterActor.options(num_cpus=0, max_concurrency=1000).remote(
        config.model_dump(), [(wid, role, actor) for wid, (role, actor, _) in workers.items()]
    )
    return KvrayCluster(config, router, workers, started)
