"""Disaggregated and colocated deployments losing a part, against the offline engine's
tokens: an expired KV lease, a worker killed mid-stream, a prefill worker killed, a
sharded prefill gone before its pull. After every scenario no block is used or pinned on
any live worker (tests/pd_cluster.py has the deployments).
"""

from __future__ import annotations

import dataclasses
import time

import pytest

ray = pytest.importorskip("ray")

from pd_cluster import (  # noqa: E402
    GREEDY,
    PROMPTS,
    assert_clean,
    cluster_tokenizer,
    deploy,
    last,
    run_all,
)

from kvray.actors.messages import EngineRequest  # noqa: E402
from kvray.engine import LLM, RequestOutputKind, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow


def test_expired_lease_recomputes_identically(local_ray, engine_args, offline):
    cluster = deploy(engine_args, lease=1e-6)  # over before any decode side can pull
    try:
        finals = run_all(cluster, PROMPTS[:4])
        assert [f.outputs[0].token_ids for f in finals] == offline[:4]
        stats = {s.role: s for s in ray.get(cluster.router.worker_stats.remote())}
        assert stats["decode"].kv_recomputes == 4
        assert_clean(cluster)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("disaggregated", [True, False], ids=["pd", "colocated"])
def test_worker_killed_mid_stream_loses_no_request(local_ray, engine_args, disaggregated):
    """Every stream in flight on the killed worker moves to the other one and goes on from
    its next token: all requests finish with the tokens of an undisturbed offline run."""
    if disaggregated:
        cluster, victim, survivor = deploy(engine_args, decode=2), "decode-0", "decode-1"
    else:
        cluster = deploy(engine_args, mixed=2, disaggregated=False)
        victim, survivor = "mixed-0", "mixed-1"
    long = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0] for o in LLM(**engine_args).generate(PROMPTS[:4], long)]
    try:
        streams = [cluster.front.generate.remote(p, long, f"k{i}") for i, p in enumerate(PROMPTS[:4])]
        seconds = [(ray.get(next(s)), ray.get(next(s)))[1] for s in streams]  # decoding now
        assert all(not s.finished and len(s.outputs[0].token_ids) >= 2 for s in seconds)
        ray.kill(cluster.workers[victim][1])
        finals = [last(s) for s in streams]
        assert [f.outputs[0].token_ids for f in finals] == [w.token_ids for w in want]
        assert [f.outputs[0].text for f in finals] == [w.text for w in want]
        text = ray.get(cluster.front.metrics_text.remote()).decode()
        moved = next(line for line in text.splitlines() if line.startswith("kvray:request_migrations_total"))
        assert float(moved.split()[-1]) >= 1  # some were on the victim and moved
        deadline = time.monotonic() + 10  # the router's health check finds it gone
        role = "decode" if disaggregated else "mixed"
        while ray.get(cluster.router.live_workers.remote())[role] != [survivor]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        after = run_all(cluster, PROMPTS[:2])  # new traffic goes to the live worker
        assert all(f.finished for f in after)
        assert_clean(cluster)  # nothing leaked on the workers left
    finally:
        cluster.shutdown()


def test_prefill_worker_killed(local_ray, engine_args, offline):
    cluster = deploy(engine_args, prefill=2)
    try:
        ray.kill(cluster.workers["prefill-0"][1])
        finals = run_all(cluster, PROMPTS)  # those routed to the dead one are retried
        assert [f.outputs[0].token_ids for f in finals] == offline
        assert ray.get(cluster.router.live_workers.remote())["prefill"] == ["prefill-1"]
        assert_clean(cluster)
    finally:
        cluster.shutdown()


def test_sharded_prefill_gone_before_the_pull_recomputes_on_the_decode_side(local_ray, engine_args, offline):
    """A tp=2 prefill worker that vanishes after answering: the decode worker's pull fails,
    it recomputes the prompt, gives the offline tokens, and stays in its pool."""
    cluster = deploy(engine_args, prefill_engine={"tensor_parallel_size": 2})
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
