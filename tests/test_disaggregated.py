"""Disaggregated prefill/decode on local Ray, against the offline engine's tokens.

One local Ray for the module (own temp dir, no dashboard, auth off, 2 CPUs); each test
launches its own deployment (workers with half a CPU and one torch thread each) and
shuts it down. After every scenario no block is used or pinned on any live worker.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from kvray.actors.messages import EngineRequest  # noqa: E402
from kvray.cluster.local import ensure_ray, launch  # noqa: E402
from kvray.engine import (  # noqa: E402
    LLM,
    RequestOutputKind,  # noqa: E402
    SamplingParams,
)
from kvray.router.frontend import WorkerDiedError  # noqa: E402

pytestmark = pytest.mark.slow

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
def offline(engine_args):
    llm = LLM(**engine_args)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _deploy(
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
            "router": {"health_check_seconds": 0.5},
        }
    )


def cluster_tokenizer(engine_args):
    from kvray.models.loader import load_tokenizer

    return load_tokenizer(Path(engine_args["model"]))


def _run_all(cluster, prompts, params=GREEDY):
    streams = [cluster.front.generate.remote(p, params, f"r{i}") for i, p in enumerate(prompts)]
    finals = []
    for s in streams:
        out = None
        for ref in s:
            out = ray.get(ref)
        finals.append(out)
    return finals


def _assert_clean(cluster):
    for stats in ray.get(cluster.router.worker_stats.remote()):
        assert stats.used_blocks == 0 and stats.pinned == 0, stats


@pytest.mark.parametrize("connector", ["torch_dist", "object_store"])
def test_disaggregated_matches_offline(local_ray, engine_args, offline, connector):
    cluster = _deploy(engine_args, connector=connector)
    try:
        finals = _run_all(cluster, PROMPTS)
        assert [f.outputs[0].token_ids for f in finals] == offline
        assert all(f.finished for f in finals)
        _assert_clean(cluster)
        stats = {s.role: s for s in ray.get(cluster.router.worker_stats.remote())}
        assert stats["decode"].kv_transfer_bytes > 0 and stats["decode"].kv_recomputes == 0
        assert stats["prefill"].prefix_hits > 0  # the shared prefix stayed on one prefill worker
    finally:
        cluster.shutdown()


@pytest.mark.parametrize(
    "prefill_tp,decode_tp,connector",
    [(2, 1, "torch_dist"), (2, 1, "object_store"), (1, 2, "torch_dist")],
)
def test_unequal_tensor_parallel_pools_reshard_heads(
    local_ray, engine_args, offline, prefill_tp, decode_tp, connector
):
    """SmolLM2's 3 KV heads sit 2 + 1 on a tp=2 worker: the pull re-shards them so each
    decode rank receives exactly its heads, and the tokens are the offline engine's."""
    cluster = _deploy(
        engine_args,
        connector=connector,
        prefill_engine={"tensor_parallel_size": prefill_tp, "max_num_seqs": 8},
        decode_engine={"tensor_parallel_size": decode_tp, "max_num_seqs": 8},
    )
    try:
        finals = _run_all(cluster, PROMPTS[:6])
        got = [f.outputs[0].token_ids for f in finals]
        assert got == offline[:6]  # fp32 SmolLM2 has no near-ties on these prompts (see test_parallel)
        stats = {s.role: s for s in ray.get(cluster.router.worker_stats.remote())}
        assert stats["decode"].kv_transfer_bytes > 0 and stats["decode"].kv_recomputes == 0
        # every byte pulled in was sent out by some prefill shard
        assert stats["prefill"].kv_transfer_bytes == stats["decode"].kv_transfer_bytes
        _assert_clean(cluster)
    finally:
        cluster.shutdown()


def test_expired_lease_recomputes_identically(local_ray, engine_args, offline):
    cluster = _deploy(engine_args, lease=1e-6)  # over before any decode side can pull
    try:
        finals = _run_all(cluster, PROMPTS[:4])
        assert [f.outputs[0].token_ids for f in finals] == offline[:4]
        stats = {s.role: s for s in ray.get(cluster.router.worker_stats.remote())}
        assert stats["decode"].kv_recomputes == 4
        _assert_clean(cluster)
    finally:
        cluster.shutdown()


def test_colocated_mode_matches_offline(local_ray, engine_args, offline):
    cluster = _deploy(engine_args, disaggregated=False)
    try:
        finals = _run_all(cluster, PROMPTS)
        assert [f.outputs[0].token_ids for f in finals] == offline
        assert ray.get(cluster.router.live_workers.remote()) == {"mixed": ["mixed-0"]}
        _assert_clean(cluster)
    finally:
        cluster.shutdown()


def test_decode_worker_killed_mid_stream(local_ray, engine_args):
    cluster = _deploy(engine_args, decode=2)
    long = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    try:
        streams = [cluster.front.generate.remote(p, long, f"k{i}") for i, p in enumerate(PROMPTS[:4])]
        firsts = [ray.get(next(s)) for s in streams]  # the first token, from the decode worker
        seconds = [ray.get(next(s)) for s in streams]  # decoding there: every pull is done
        assert all(len(f.outputs[0].token_ids) == 1 for f in firsts)
        assert all(not s.finished and len(s.outputs[0].token_ids) >= 2 for s in seconds)
        victim = "decode-0"
        ray.kill(cluster.workers[victim][1])
        failed, finished = 0, 0
        for s in streams:
            try:
                out = None
                for ref in s:
                    out = ray.get(ref)
                assert out.finished and len(out.outputs[0].token_ids) == 48
                finished += 1
            except WorkerDiedError as e:
                assert victim in str(e)
                failed += 1
        assert failed >= 1 and finished >= 1
        deadline = time.monotonic() + 10  # the router's health check finds it gone
        while ray.get(cluster.router.live_workers.remote())["decode"] != ["decode-1"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        after = _run_all(cluster, PROMPTS[:2])  # new traffic goes to the live decode worker
        assert all(f.finished for f in after)
        _assert_clean(cluster)  # the prefill side leaked nothing
    finally:
        cluster.shutdown()


def test_prefill_worker_killed(local_ray, engine_args, offline):
    cluster = _deploy(engine_args, prefill=2)
    try:
        ray.kill(cluster.workers["prefill-0"][1])
        finals = _run_all(cluster, PROMPTS)  # those routed to the dead one are retried
        assert [f.outputs[0].token_ids for f in finals] == offline
        assert ray.get(cluster.router.live_workers.remote())["prefill"] == ["prefill-1"]
        _assert_clean(cluster)
    finally:
        cluster.shutdown()


def test_sharded_prefill_gone_before_the_pull_recomputes_on_the_decode_side(local_ray, engine_args, offline):
    """A tp=2 prefill worker that vanishes after answering: the decode worker's pull fails,
    it recomputes the prompt, gives the offline tokens, and stays in its pool."""
    cluster = _deploy(engine_args, prefill_engine={"tensor_parallel_size": 2})
    try:
        prefill, decode = cluster.workers["prefill-0"][1], cluster.workers["decode-0"][1]
        ids = cluster_tokenizer(engine_args)(PROMPTS[0]).input_ids
        params = dataclasses.replace(GREEDY, output_kind=RequestOutputKind.DELTA)
        req = EngineRequest("gone", ids, params, destination="test-front")
        handoff = ray.get(prefill.prefill.remote(req))
        assert handoff.ticket is not None
        ray.kill(prefill)
        stream = decode.outputs.options(num_returns="streaming").remote("test-front")
        ray.get(decode.decode.remote(req, handoff, prefill))
        tokens = []
        for ref in stream:
            for delta in ray.get(ref):
                tokens += delta.token_ids
            if delta.finish_reason is not None:
                break
        ray.cancel(stream)
        assert tokens == offline[0]
        stats = ray.get(decode.stats.remote())
        assert stats.kv_recomputes == 1 and stats.used_blocks == 0
    finally:
        cluster.shutdown()
