"""Disaggregated prefill/decode on local Ray, against the offline engine's tokens: KV
pulls over each connector, short prompts prefilled where they decode, re-sharded heads,
8-bit caches and speculating decode workers, and the colocated mode. Each test launches
its own deployment (tests/pd_cluster.py) and shuts it down; after every scenario no block
is used or pinned on any live worker. Losing a part: tests/test_disaggregated_failures.py.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from pd_cluster import (  # noqa: E402
    GREEDY,
    PROMPTS,
    assert_clean,
    cluster_tokenizer,
    deploy,
    run_all,
)

from kvray.actors.launch import start_worker  # noqa: E402
from kvray.engine import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("connector", ["torch_dist", "object_store", "tcp"])
def test_disaggregated_matches_offline(local_ray, engine_args, offline, offline_llm, connector):
    cluster = deploy(engine_args, connector=connector)
    try:
        finals = run_all(cluster, PROMPTS)
        assert [f.outputs[0].token_ids for f in finals] == offline
        assert all(f.finished for f in finals)
        stats = {s.role: s for s in ray.get(cluster.router.worker_stats.remote())}
        assert stats["decode"].kv_transfer_bytes > 0 and stats["decode"].kv_recomputes == 0
        assert stats["prefill"].prefix_hits > 0  # the shared prefix stayed on one prefill worker
        # the decode side received those prompts' KV: it looked nothing up in its cache
        assert stats["decode"].prefix_queries == 0
        if connector == "torch_dist":  # n > 1 fans out to one-sample requests (seed + i)
            sampled = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=8)
            got = cluster.complete(PROMPTS[0], sampled)
            want = offline_llm.generate([PROMPTS[0]], sampled)[0]
            assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
            assert [c.index for c in got.outputs] == [0, 1, 2] and got.finished
        assert_clean(cluster)
    finally:
        cluster.shutdown()


def test_short_prompts_prefill_on_the_decode_worker(local_ray, engine_args, offline):
    """router.max_local_prefill_length (conditional disaggregation): prompts of at most 16
    tokens run whole on the decode worker, longer ones are prefilled and pulled; the
    tokens are the offline engine's either way."""
    lengths = [len(ids) for ids in cluster_tokenizer(engine_args)(PROMPTS).input_ids]
    handed_off = sum(n > 16 for n in lengths)
    assert 0 < handed_off < len(PROMPTS)  # some prompts are handed off, some stay
    cluster = deploy(engine_args, router={"max_local_prefill_length": 16})
    try:
        finals = run_all(cluster, PROMPTS)
        assert [f.outputs[0].token_ids for f in finals] == offline
        stats = {s.role: s for s in ray.get(cluster.router.worker_stats.remote())}
        assert sum(stats["decode"].kv_pull_buckets) == handed_off  # one pull per hand-off
        assert_clean(cluster)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize(
    "prefill_tp,decode_tp,connector",
    [(2, 1, "torch_dist"), (2, 1, "object_store"), (1, 2, "tcp")],
)
def test_unequal_tensor_parallel_pools_reshard_heads(
    local_ray, engine_args, offline, prefill_tp, decode_tp, connector
):
    """SmolLM2's 3 KV heads sit 2 + 1 on a tp=2 worker: the pull re-shards them so each
    decode rank receives exactly its heads, and the tokens are the offline engine's."""
    cluster = deploy(
        engine_args,
        connector=connector,
        prefill_engine={"tensor_parallel_size": prefill_tp, "max_num_seqs": 8},
        decode_engine={"tensor_parallel_size": decode_tp, "max_num_seqs": 8},
    )
    try:
        finals = run_all(cluster, PROMPTS[:6])
        got = [f.outputs[0].token_ids for f in finals]
        assert got == offline[:6]  # fp32 SmolLM2 has no near-ties on these prompts (see test_parallel)
        stats = {s.role: s for s in ray.get(cluster.router.worker_stats.remote())}
        assert stats["decode"].kv_transfer_bytes > 0 and stats["decode"].kv_recomputes == 0
        # every byte pulled in was sent out by some prefill shard
        assert stats["prefill"].kv_transfer_bytes == stats["decode"].kv_transfer_bytes
        assert_clean(cluster)
    finally:
        cluster.shutdown()


def test_int8_kv_pulls_and_speculating_decode_workers_give_colocated_int8_tokens(local_ray, engine_args):
    """Both pools hold int8 KV (codes and scales pulled as they are: the connectors move
    bytes of the cache's dtype, whatever it is; tcp here, the CPU presets' connector);
    the decode worker verifies n-gram drafts. Its greedy tokens are those of an offline
    int8 engine that speculates alike.

    One request at a time on both sides, and the same speculation: an int8 cache turns
    float differences of the last bit (another batch's matmul path: on AVX-512 an fp32
    step of 1-2 rows runs the fused decode layers, a verification of 4 rows oneDNN's
    matmuls) into a code one step off, which can flip a near-tied token, so only runs of
    the same steps are compared."""
    ngram = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    int8 = {**engine_args, "kv_cache_dtype": "int8"}
    offline = LLM(**int8, **ngram)
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[6], PROMPTS[7]]  # a shared prefix; Fibonacci's digits
    want = [offline.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    cluster = deploy(int8, decode_engine=ngram, connector="tcp")
    try:
        finals = [run_all(cluster, [p])[0] for p in prompts]
        assert [f.outputs[0].token_ids for f in finals] == want
        stats = {s.role: s for s in ray.get(cluster.router.worker_stats.remote())}
        assert stats["decode"].kv_transfer_bytes > 0 and stats["decode"].kv_recomputes == 0
        assert stats["decode"].spec_decode.num_draft_tokens > 0
        assert_clean(cluster)
    finally:
        cluster.shutdown()


# Speculating decode pools. The grounded prompts' outputs repeat spans of the prompt, so
# n-gram drafts are kept there; PROMPTS are open-ended, where they are mostly rejected.
GROUNDED = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "# The same functions with type hints:\n",
    "Copy the list: apples, pears, plums, cherries, grapes, lemons.\nCopy: apples, pears,",
    "<tr><td>1</td><td>alpha</td></tr>\n<tr><td>2</td><td>beta</td></tr>\n<tr><td>3</td><td>",
]
SPEC_PROMPTS = PROMPTS + GROUNDED
SPEC_GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def offline_spec(offline_llm):
    return [o.outputs[0].token_ids for o in offline_llm.generate(SPEC_PROMPTS, SPEC_GREEDY)]


@pytest.fixture(scope="class")  # torn down after its class: later tests deploy the same names
def speculating(local_ray, engine_args, smollm2_path, tiny_draft):
    """One PD deployment whose decode pool (decode-0) speculates with n-gram, and two more
    decode workers with draft models, started beside it but out of the router until a test
    swaps one in (`_decode_on`): `decode-draft` with SmolLM2 as its own draft (drafts almost
    all kept), `decode-tiny` with a random-weight draft (almost all rejected). The decode
    engines (model dtype KV) get 96 MiB so that all of SPEC_PROMPTS fit without preemption
    even when the draft's K/V shares the blocks."""
    decode = {"speculative_config": NGRAM, "kv_cache_memory_bytes": 96 << 20}
    cluster = deploy(engine_args, decode_engine=decode)
    try:
        pool = cluster.config.decode.model_copy(update={"num_cpus": 0.25})  # both fit in Ray's 2 CPUs
        for worker_id, draft_path in (("decode-draft", smollm2_path), ("decode-tiny", tiny_draft)):
            draft = {"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": 4}
            engine = {**engine_args, **decode, "speculative_config": draft}
            actor, pg = start_worker(worker_id, "decode", engine, pool, cluster.config.kv_transfer)
            cluster.workers[worker_id] = ("decode", actor, pg)  # shutdown() stops it too
            ray.get(actor.ready.remote())
        yield cluster
    finally:
        cluster.shutdown()


def _decode_on(cluster, worker_id: str):
    """Make `worker_id` the router's only decode worker; returns its handle."""
    for wid, (role, *_) in cluster.workers.items():
        if role == "decode" and wid != worker_id:
            ray.get(cluster.router.remove_worker.remote(wid, "swapped out by the test"))
    actor = cluster.workers[worker_id][1]
    ray.get(cluster.router.add_worker.remote(worker_id, "decode", actor))
    assert ray.get(cluster.router.live_workers.remote())["decode"] == [worker_id]
    return actor


def _assert_spec_pd_run(cluster, worker_id: str, want: list[list[int]]):
    """All of SPEC_PROMPTS at once through prefill and `worker_id`: the offline engine's
    greedy tokens, the prompts' KV pulled (not recomputed), and nothing left held."""
    decode = _decode_on(cluster, worker_id)
    before = ray.get(decode.stats.remote()).spec_decode
    finals = run_all(cluster, SPEC_PROMPTS, SPEC_GREEDY)
    assert all(f.finished for f in finals)
    got = [f.outputs[0].token_ids for f in finals]
    assert got == want, [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    stats = ray.get(decode.stats.remote())
    assert stats.kv_transfer_bytes > 0 and stats.kv_recomputes == 0 and stats.prefix_queries == 0
    assert_clean(cluster)
    spec = stats.spec_decode
    return (
        spec.num_draft_tokens - before.num_draft_tokens,
        spec.num_accepted_tokens - before.num_accepted_tokens,
    )


class TestSpeculatingDecodePools:
    def test_ngram_gives_offline_tokens(self, speculating, offline_spec):
        """13 prompts, model-dtype KV: drafts verified on the decode side after the pull keep
        every greedy token of plain offline decoding; some drafts are kept, some rejected."""
        drafted, accepted = _assert_spec_pd_run(speculating, "decode-0", offline_spec)
        assert 0 < accepted < drafted

    def test_draft_model_gives_offline_tokens(self, speculating, offline_spec):
        """The draft model has no pulled K/V (only the target's is pulled): it catches up over
        each prompt on the decode worker, then proposes; SmolLM2 drafting for itself is
        almost always right, and the tokens are still plain offline decoding's."""
        drafted, accepted = _assert_spec_pd_run(speculating, "decode-draft", offline_spec)
        assert drafted > 0 and accepted / drafted > 0.8

    def test_a_mostly_rejected_draft_model_gives_offline_tokens(self, speculating, offline_spec):
        """A random-weight draft: nearly every proposal is rolled back on the decode worker
        (its slots and the draft's own K/V), and the tokens are still plain decoding's."""
        drafted, accepted = _assert_spec_pd_run(speculating, "decode-tiny", offline_spec)
        assert drafted > 0 and accepted / drafted < 0.2


def test_colocated_mode_matches_offline(local_ray, engine_args, offline):
    cluster = deploy(engine_args, disaggregated=False)
    try:
        finals = run_all(cluster, PROMPTS)
        assert [f.outputs[0].token_ids for f in finals] == offline
        assert ray.get(cluster.router.live_workers.remote()) == {"mixed": ["mixed-0"]}
        assert_clean(cluster)
    finally:
        cluster.shutdown()
