"""A local Ray and small PD / colocated deployments of SmolLM2 for the disaggregated tests
(tests/test_disaggregated.py, tests/test_disaggregated_failures.py).

Fixtures (through tests/conftest.py): `local_ray`, one local Ray per test module (own
temp dir, no dashboard, auth off, 2 CPUs); `offline_llm` and `offline`, the offline
engine and its tokens for PROMPTS. `deploy` launches a deployment of workers with half a
CPU and one torch thread each, which the test shuts down; `assert_clean`: no block is
used or pinned on any live worker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from kvray.cluster.local import ensure_ray, launch
from kvray.engine import LLM, SamplingParams

SHARED = (
    "A paged KV cache splits each sequence's keys and values into fixed-size blocks, "
    "so memory is allocated on demand and blocks can be shared between requests. "
)
PROMPTS = [
    "The capital of France is",
    SHARED + "The main benefit is",
    SHARED + "A second benefit is",
    "def square(x):\n    return",
    "Rain falls when",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "1, 1, 2, 3, 5, 8,",
    SHARED + "Prefix caching means",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    started = ensure_ray(num_cpus=2, temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def offline_llm(engine_args):
    return LLM(**engine_args)


@pytest.fixture(scope="module")
def offline(offline_llm):
    return [o.outputs[0].token_ids for o in offline_llm.generate(PROMPTS, GREEDY)]


def deploy(
    engine_args,
    *,
    prefill=1,
    decode=1,
    mixed=1,
    disaggregated=True,
    connector="torch_dist",
    lease=30.0,
    pull_timeout=20.0,
    prefill_engine=None,
    decode_engine=None,
    router=None,
):
    pool = {"num_cpus": 0.5, "torch_threads": 1}
    return launch(
        {
            "engine": engine_args,
            "disaggregated": disaggregated,
            "prefill": {**pool, "num_workers": prefill, "engine": prefill_engine or {}},
            "decode": {**pool, "num_workers": decode, "engine": decode_engine or {}},
            "mixed": {**pool, "num_workers": mixed},
            "kv_transfer": {
                "connector": connector,
                "lease_seconds": lease,
                "pull_timeout_seconds": pull_timeout,
            },
            "router": {"health_check_seconds": 0.5, **(router or {})},
        }
    )


def cluster_tokenizer(engine_args):
    from kvray.models.loader import load_tokenizer

    return load_tokenizer(Path(engine_args["model"]))


def last(stream):
    """The last output of a front's `generate` stream (its final RequestOutput)."""
    out = None
    for ref in stream:
        out = ray.get(ref)
    return out


def run_all(cluster, prompts, params=GREEDY):
    streams = [cluster.front.generate.remote(p, params, f"r{i}") for i, p in enumerate(prompts)]
    return [last(s) for s in streams]


def assert_clean(cluster, timeout: float = 10.0):
    """No worker holds a block or a pin. The decode side lets a prefill pin go with a
    fire-and-forget call after its pull, so the last ones may land just after the final
    token reached the client: wait for them, a while."""
    deadline = time.monotonic() + timeout
    while True:
        workers = ray.get(cluster.router.worker_stats.remote())
        if all(s.used_blocks == 0 and s.pinned == 0 for s in workers) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for stats in workers:
        assert stats.used_blocks == 0 and stats.pinned == 0, stats
