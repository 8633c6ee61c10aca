"""The Serve apps that the HTTP test modules share (test_serve_openai, test_serve_structured):
one local Ray and two apps for the session, started on first use — the PD preset's shape
(1 prefill + 1 decode worker, torch_dist) at "/" through Serve's proxy (`server`), and the
colocated one (1 mixed worker, scheduling by priority, 2 requests at a time, 1 embedding
worker) serving HTTP from its ingress replica itself, as the CPU presets do (direct
ingress, `colo_server`: its own port; its /metrics behind the key too)
— with the official `openai` client and a raw httpx client beside them.

Session-scoped so the second module does not pay the start-up again; conftest.py imports
these fixtures."""

from __future__ import annotations

import time

import pytest
import ray

from kvray.cluster.ports import free_port

MODEL = "smollm2-135m-instruct"
API_KEY = "test-key"
MAX_QUEUED = 16
EMBEDDING_MODEL = "all-minilm-l6-v2"


@pytest.fixture(scope="session")
def otlp():
    """The OTLP receiver the PD app's processes export their request spans to
    (benchmarks/otlp_receiver.py: the tracing benchmark's too)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from otlp_receiver import OTLPReceiver

    receiver = OTLPReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def apps(tmp_path_factory, engine_args, otlp) -> dict[str, str]:
    ray = pytest.importorskip("ray")
    from ray import serve

    from kvray.cluster.local import ensure_ray
    from kvray.router import build_app

    started = ensure_ray(num_cpus=2, temp_dir=str(tmp_path_factory.mktemp("ray")))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    pool = {"num_workers": 1, "num_cpus": 0.5, "torch_threads": 1, "price_per_hour": 3.6}
    config = {
        "model_name": MODEL,
        "engine": engine_args,
        "disaggregated": True,
        "prefill": pool,
        "decode": pool,
        "kv_transfer": {"connector": "torch_dist"},
        "router": {"health_check_seconds": 0.5},
        "api_key": API_KEY,
        "max_body_bytes": 64 << 10,
        "max_queued_requests": MAX_QUEUED,
        "otlp_traces_endpoint": otlp.endpoint,  # traced (tests/test_serve_tracing.py)
    }
    serve.run(build_app(config), name="kvray", route_prefix="/")
    # the colocated preset's shape beside it: one mixed worker, its own app and HTTP port
    colo_port = free_port()
    # ... scheduling by priority, two requests at a time (tests/test_serve_priority.py)
    mixed = {**pool, "engine": {"scheduling_policy": "priority", "max_num_seqs": 2}}
    colo = {
        **config,
        "app_name": "colo",
        "disaggregated": False,
        "mixed": mixed,
        "otlp_traces_endpoint": None,
    }
    # ... and an embedding worker (tests/test_serve_embeddings.py)
    colo["embedding"] = {"num_cpus": 0, "torch_threads": 1, "engine": {"model": EMBEDDING_MODEL}}
    colo.update(direct_ingress=True, http_host="127.0.0.1", http_port=colo_port, metrics_need_api_key=True)
    serve.run(build_app(colo), name="colo", route_prefix="/colo")
    yield {"pd": f"http://127.0.0.1:{port}", "colocated": f"http://127.0.0.1:{colo_port}"}
    serve.shutdown()
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def server(apps) -> str:
    """The PD app's base URL (Serve's proxy)."""
    return apps["pd"]


@pytest.fixture(scope="session")
def colo_server(apps) -> str:
    """The colocated app's base URL (its ingress replica's own HTTP server)."""
    return apps["colocated"]


@pytest.fixture(scope="session")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    httpx = pytest.importorskip("httpx2")
    with httpx.Client(base_url=server, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def workers_of(app: str = "kvray") -> dict[str, tuple[str, str]]:
    """role -> (name, namespace) of the one worker actor of that pool (pool replicas name
    their workers `<app>-<role>-<replica>`): read from Ray itself, not through a Serve
    handle in this driver (one there once never answered and held a whole CI run)."""
    found = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        for role in ("prefill", "decode", "mixed"):
            if actor["name"].startswith(f"{app}-{role}-"):
                found[role] = (actor["name"], actor["namespace"])
    return found


def worker_ids(app: str = "kvray") -> dict[str, str]:
    """role -> the one worker id of that pool."""
    return {role: name[len(app) + 1 :] for role, (name, _) in workers_of(app).items()}


def worker_stats(app: str = "kvray"):
    workers = [ray.get_actor(name, namespace=ns) for name, ns in workers_of(app).values()]
    return ray.get([w.stats.remote() for w in workers], timeout=60)


def wait_clean(timeout: float = 30.0, app: str = "kvray"):
    """Until every worker of `app` runs nothing and holds no block or pin (its stats)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = worker_stats(app)
        if all(s.used_blocks == 0 and s.pinned == 0 and s.num_running == 0 for s in stats):
            return stats
        assert time.monotonic() < deadline, [
            (s.worker_id, s.num_running, s.used_blocks, s.pinned) for s in stats
        ]
        time.sleep(0.2)
