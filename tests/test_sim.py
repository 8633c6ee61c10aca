"""kvray.sim: the event loop against hand-computed timelines, block accounting after
preemptions and recomputes, the router's choices, the cost model's arithmetic and fit,
and the workload generators."""

from __future__ import annotations

import math
import statistics

import pytest

from kvray.engine.kv_handoff import LeasePolicy
from kvray.routing import affine_worker, prefix_key
from kvray.sim import (
    ClusterSpec,
    Hardware,
    ModelSpec,
    PoolSpec,
    RequestWork,
    SimEngineConfig,
    SimRequest,
    Simulator,
    StepTimeModel,
    fit,
    load_trace,
)
from kvray.sim.cost_model import StepSample, _grid, step_work
from kvray.sim.workload import arrival_times, prompt_token_ids

TINY = ModelSpec("tiny", num_layers=1, hidden_size=4, intermediate_size=8, num_heads=2, num_kv_heads=1,
                 head_dim=2, vocab_size=10, dtype_bytes=2)  # fmt: skip
IDEAL = Hardware(
    "ideal", peak_flops=1e30, mem_bandwidth=1e30, memory_bytes=1e12, link_bandwidth=1e30, link_latency_s=0
)
STEP = StepTimeModel(TINY, IDEAL, overhead_s=0.01, per_seq_s=0.0)  # every step takes 10 ms


def engine(num_blocks=64, budget=16, **kw) -> SimEngineConfig:
    kw.setdefault("max_model_len", num_blocks * 16)
    return SimEngineConfig(num_blocks=num_blocks, block_size=16, max_num_batched_tokens=budget, **kw)


def pd(decode_blocks: int = 64, **kw) -> ClusterSpec:
    """One prefill and one decode worker (token budget 64); a pull lasts 50 ms unless told."""
    kw = {"kv_bandwidth": 1e30, "kv_latency_s": 0.05, **kw}
    return ClusterSpec(
        prefill=PoolSpec(1, engine(budget=64), STEP),
        decode=PoolSpec(1, engine(decode_blocks, 64), STEP),
        **kw,
    )


def run(spec: ClusterSpec, requests: list[SimRequest]):
    sim = Simulator(spec)
    return sim, sim.run(requests)


def assert_blocks_all_back(sim: Simulator) -> None:
    for workers in sim.pools.values():
        for w in workers:
            w.kv.pool.check_integrity()
            assert w.kv.stats().used_blocks == 0, w.worker_id
            assert not w.scheduler.has_unfinished() and w.handoff.num_pulling == 0
            assert w.handoff.num_pinned == 0


def test_colocated_timeline_chunks_the_prompt_then_decodes_one_token_per_step():
    sim, res = run(ClusterSpec(mixed=PoolSpec(1, engine(budget=16), STEP)), [SimRequest("a", 0.0, 40, 5)])
    # prompt 40 in chunks of 16, 16, 8: the third step samples the first token (t = 30 ms)
    assert res.records[0].token_times == pytest.approx([0.03, 0.04, 0.05, 0.06, 0.07])
    assert res.records[0].ttft == pytest.approx(0.03) and res.records[0].tpot == pytest.approx(0.01)
    assert_blocks_all_back(sim)
    stats = sim.pools["mixed"][0].kv.stats()  # 44 tokens computed: two full blocks stay cached
    assert (stats.cached_free_blocks, stats.free_blocks) == (2, 62)


def test_requests_that_arrive_together_share_steps():
    reqs = [SimRequest("a", 0.0, 8, 3), SimRequest("b", 0.0, 8, 3)]
    _, res = run(ClusterSpec(mixed=PoolSpec(1, engine(budget=16), STEP)), reqs)
    for r in res.records:  # both prompts in the first step, both decodes in each later one
        assert r.token_times == pytest.approx([0.01, 0.02, 0.03])


def test_pd_timeline_first_token_at_prefill_then_pull_then_decode_steps():
    spec = pd()
    sim, res = run(spec, [SimRequest("a", 0.0, 32, 4)])
    # prefill step 0-10 ms (first token), pull 10-60 ms, decode steps at 70, 80, 90 ms
    assert res.records[0].token_times == pytest.approx([0.01, 0.07, 0.08, 0.09])
    assert_blocks_all_back(sim)
    decode = sim.pools["decode"][0].kv
    assert decode.stats().cached_free_blocks == 2  # the pulled prompt's full blocks, indexed


def test_one_token_outputs_end_at_the_prefill_and_unpin():
    spec = ClusterSpec(prefill=PoolSpec(1, engine(), STEP), decode=PoolSpec(1, engine(), STEP))
    sim, res = run(spec, [SimRequest("a", 0.0, 20, 1)])
    assert res.records[0].token_times == pytest.approx([0.02])
    assert sim.pools["decode"][0].num_steps == 0
    assert_blocks_all_back(sim)


def test_preemption_under_block_pressure_still_finishes_every_request_exactly():
    reqs = [SimRequest(f"r{i}", 0.0, 40, 40) for i in range(6)]  # 80 tokens = 5 blocks each at the end
    sim, res = run(ClusterSpec(mixed=PoolSpec(1, engine(num_blocks=12, budget=64), STEP)), reqs)
    assert res.num_preemptions > 0
    assert all(len(r.token_times) == 40 for r in res.records)
    assert all(b > a for r in res.records for a, b in zip(r.token_times, r.token_times[1:]))
    assert_blocks_all_back(sim)


def test_a_decode_worker_without_room_waits_for_blocks_then_pulls():
    # the decode worker's 3 blocks: a's pulled prompt takes 2 (and its third at its first
    # decode step), b's needs 2 -- b waits for room while its pin lasts (30 s) and is
    # granted blocks between steps as a ends, as the engine's `handoff_step` does
    sim, res = run(pd(decode_blocks=3), [SimRequest("a", 0.0, 32, 8), SimRequest("b", 0.0, 32, 8)])
    # prefill 0-10 ms; a's pull 10-60, its steps 60-130; b's pull 130-180, its steps 180-250
    assert res.records[0].token_times == pytest.approx([0.01, *(0.07 + 0.01 * i for i in range(7))])
    assert res.records[1].token_times == pytest.approx([0.01, *(0.19 + 0.01 * i for i in range(7))])
    assert res.num_kv_recomputes == 0
    assert_blocks_all_back(sim)


def test_a_decode_worker_recomputes_when_the_pin_would_lapse_before_room_comes():
    # as above, but b's ticket lasts 1.095 s from its prompt's end (10 ms): with the 1 s
    # margin its wait ends at 105 ms, and the decode worker, mid-step, sends it to
    # recompute at its next step boundary (110 ms), where the pin goes. a ends at 130 ms;
    # b's 33 tokens (prompt and first token) run in the step 130-140 ms, then 6 more
    lease = LeasePolicy(lease_s=1.095)
    sim = Simulator(pd(decode_blocks=3, lease=lease))
    res = sim.run([SimRequest("a", 0.0, 32, 8), SimRequest("b", 0.0, 32, 8)])
    assert res.records[0].token_times == pytest.approx([0.01, *(0.07 + 0.01 * i for i in range(7))])
    assert res.records[1].token_times == pytest.approx([0.01, *(0.14 + 0.01 * i for i in range(7))])
    assert res.num_kv_recomputes == 1
    assert_blocks_all_back(sim)
    # a ticket shorter than the margin: b is queued to recompute as it arrives (10 ms), and
    # runs at the same times (a's blocks come back at 130 ms either way)
    sim = Simulator(pd(decode_blocks=3, lease=LeasePolicy(lease_s=0.5)))
    res = sim.run([SimRequest("a", 0.0, 32, 8), SimRequest("b", 0.0, 32, 8)])
    assert res.records[1].token_times == pytest.approx([0.01, *(0.14 + 0.01 * i for i in range(7))])
    assert res.num_kv_recomputes == 1
    assert_blocks_all_back(sim)


def test_prefill_choice_follows_the_routers_prefix_affinity():
    reqs = [SimRequest(f"r{i}", i * 0.5, 80, 2, prefix_id=i % 3, prefix_len=64) for i in range(12)]
    spec = ClusterSpec(
        prefill=PoolSpec(3, engine(budget=128), STEP),
        decode=PoolSpec(1, engine(budget=128), STEP),
        imbalance_threshold=100,
    )
    sim, _ = run(spec, reqs)
    ids = [w.worker_id for w in sim.pools["prefill"]]
    expected = dict.fromkeys(ids, 0)
    for r in reqs:  # the router's own function, called here independently
        expected[affine_worker(ids, prefix_key(prompt_token_ids(r), 16, 4))] += r.prompt_len
    assert {w.worker_id: w.kv.prefix_queries for w in sim.pools["prefill"]} == expected
    assert sum(w.kv.prefix_hits for w in sim.pools["prefill"]) == (12 - 3) * 64  # all but each first


def test_step_work_by_hand():
    # layer matmuls: q,o 4x4 each (32), k,v 4x2 each (16), MLP 3 x 4x8 (96) = 144 weights
    assert TINY.layer_params == 144 and TINY.kv_bytes_per_token == 8
    flops, attn, nbytes = step_work(TINY, [RequestWork(3, 5, True)])
    assert flops == 2 * 144 * 3 + 2 * 4 * 10  # 3 tokens through the layer, 1 LM-head row
    assert attn == 4 * 2 * 2 * (3 + 4 + 5)  # positions 3, 4, 5 attend to that many keys
    assert nbytes == (144 + 40) * 2 + 5 * 8 + 3 * 8  # weights, context read, new K/V written


def test_tp_divides_the_roofline_and_adds_all_reduces():
    hw = Hardware("h", 1e12, 1e11, 1e11, 1e9, 1e-5)
    one, two = StepTimeModel(TINY, hw, tp=1), StepTimeModel(TINY, hw, tp=2)
    batch = [RequestWork(100, 100, True)]
    ring = 2 * (1 / 2) * 100 * 4 * 2 / 1e9  # 100 tokens x hidden 4 x 2 bytes, ring factor 2(tp-1)/tp
    assert two.all_reduce_s(batch) == pytest.approx(2 * 1 * (ring + 1e-5))
    roof = one.predict(batch) - one.overhead_s - one.per_seq_s
    assert two.predict(batch) == pytest.approx(
        roof / 2 + two.overhead_s + two.per_seq_s + two.all_reduce_s(batch)
    )


def _batches() -> list[list[RequestWork]]:
    out = [[RequestWork(p, p, True)] for p in (16, 64, 256, 512)]
    out += [[RequestWork(1, c, True)] * b for b in (1, 4, 16, 32) for c in (128, 1024)]
    out += [[RequestWork(1, 300, True)] * 8 + [RequestWork(256, 700, False)]]
    return out


def test_fit_recovers_the_parameters_that_made_the_steps():
    model = ModelSpec("m", 30, 576, 1536, 9, 3, 64, 49152, dtype_bytes=2)
    hw = Hardware("cpu", 4e11, 5e10, 24e9, 2e9)
    grid = _grid(0.02, 1.0, 40)
    true = StepTimeModel(model, hw, 1, grid[30], grid[12], 0.2, 2e-3, 1e-3, "made up")
    samples = [StepSample(tuple(b), true.predict(b)) for b in _batches()]
    got = fit(samples, model, hw)
    for name in ("eff_compute", "eff_memory", "eff_attention", "overhead_s", "per_seq_s"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    with pytest.raises(ValueError, match="at least 4"):
        fit(samples[:3], model, hw)


def test_arrivals_have_the_asked_rate_and_burstiness():
    gaps = lambda ts: [b - a for a, b in zip([0.0, *ts], ts)]  # noqa: E731
    poisson = gaps(arrival_times(20000, rate=4.0, seed=1))
    bursty = gaps(arrival_times(20000, rate=4.0, burstiness=0.25, seed=1))
    assert statistics.mean(poisson) == pytest.approx(0.25, rel=0.03)
    assert statistics.mean(bursty) == pytest.approx(0.25, rel=0.06)
    cv = lambda g: statistics.pstdev(g) / statistics.mean(g)  # noqa: E731
    assert cv(poisson) == pytest.approx(1.0, rel=0.05) and cv(bursty) == pytest.approx(2.0, rel=0.1)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]


def test_trace_file_loads_sorted_and_names_a_bad_row(tmp_path):
    good = tmp_path / "t.csv"
    good.write_text("time,prompt_len,output_len,prefix_id\n0.5,10,3,\n0.1,20,4,7\n")
    reqs = load_trace(good)
    assert [(r.arrival_s, r.prompt_len, r.output_len, r.prefix_id) for r in reqs] == [
        (0.1, 20, 4, 7),
        (0.5, 10, 3, None),
    ]
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"time": 0, "prompt_len": 5, "output_len": 2}\n{"time": 1, "prompt_len": 5}\n')
    with pytest.raises(ValueError, match="row 2"):
        load_trace(bad)


def test_shared_prefixes_share_token_ids_and_nothing_else():
    a, b = SimRequest("a", 0, 40, 1, 5, 32), SimRequest("b", 0, 40, 1, 5, 32)
    ia, ib = prompt_token_ids(a), prompt_token_ids(b)
    assert ia[:32] == ib[:32] and ia[32:] != ib[32:] and len(ia) == 40


def test_max_concurrency_sends_the_next_request_when_one_finishes():
    reqs = [SimRequest(f"r{i}", 0.0, 8, 2) for i in range(3)]
    sim = Simulator(ClusterSpec(mixed=PoolSpec(1, engine(budget=16), STEP)))
    res = sim.run(reqs, max_concurrency=1)
    assert [r.token_times for r in res.records] == [
        pytest.approx([0.01, 0.02]),
        pytest.approx([0.03, 0.04]),
        pytest.approx([0.05, 0.06]),
    ]
    assert [r.arrival_s for r in res.records] == pytest.approx(
        [0.0, 0.02, 0.04]
    )  # latency counts from the send
    assert all(r.ttft == pytest.approx(0.01) for r in res.records)


def test_a_run_gives_up_once_the_slo_budget_is_spent():
    from kvray.sim.results import SLO, SLOBudget

    reqs = [SimRequest(f"r{i}", 0.0, 64, 50) for i in range(20)]  # one worker, 16-token chunks: TTFTs pile up
    spec = ClusterSpec(mixed=PoolSpec(1, engine(budget=16), STEP))
    budget = SLOBudget(SLO(0.05, 1.0), {r.request_id for r in reqs}, allowed=2)
    res = Simulator(spec).run(reqs, budget)
    assert res.gave_up and len(budget.missed) == 3
    assert not all(r.done for r in res.records)
    full = Simulator(spec).run(reqs)
    assert not full.gave_up and full.attainment(SLO(0.05, 1.0)) < 0.9


def test_the_analytic_planner_picks_the_simulators_best_split_on_contrasting_workloads():
    """Long prompts with short answers want prefill workers, short prompts with long
    answers decode workers: the instant planner agrees with the simulated goodputs."""
    from kvray.sim import HARDWARE, MODELS, SLO, LengthMix
    from kvray.sim.planner import ratio_for
    from kvray.sim.studies import Workload, candidates, goodput

    cost = StepTimeModel(MODELS["llama-3.1-8b"], HARDWARE["H100"])
    eng = SimEngineConfig(num_blocks=cost.kv_cache_blocks(16), max_num_batched_tokens=2048)
    works = {
        "prompt-heavy": Workload(LengthMix("p", 1500, 0.3, 16, 0.3), SLO(0.5, 0.025), duration_s=4),
        "output-heavy": Workload(LengthMix("o", 64, 0.3, 96, 0.3), SLO(0.5, 0.020), duration_s=5),
    }
    chosen = {}
    for name, work in works.items():
        splits = candidates(cost, eng, 4)[1:]  # PD 1:3, 2:2, 3:1
        rates = [goodput(s, work, iters=2, guess=32) for s in splits]
        best = splits[max(range(len(rates)), key=rates.__getitem__)]
        chosen[name] = ratio_for(work, cost, eng, 4)
        assert chosen[name] == (best.prefill.num_workers, best.decode.num_workers), (name, rates)
    assert chosen == {"prompt-heavy": (3, 1), "output-heavy": (1, 3)}


def test_requests_sent_at_the_same_instant_join_the_same_step():
    # a's last token frees a client slot at 10 ms: c is sent then, and the step starting at
    # 10 ms must take it along with b (events of one instant all run before a step starts)
    reqs = [SimRequest("a", 0.0, 8, 1), SimRequest("b", 0.0, 8, 5), SimRequest("c", 0.0, 8, 2)]
    res = Simulator(ClusterSpec(mixed=PoolSpec(1, engine(budget=16), STEP))).run(reqs, max_concurrency=2)
    assert res.records[2].token_times == pytest.approx([0.02, 0.03])


def test_pd_first_token_reaches_the_client_through_the_decode_worker():
    spec = pd(network_s=0.001)
    _, res = run(spec, [SimRequest("a", 0.0, 32, 3)])
    # to prefill 1 ms, step 1-11, to the front 12, to decode 13 (first token out: 14),
    # pull 13-63, decode steps 63-73 and 73-83 (+1 ms each to the client)
    assert res.records[0].token_times == pytest.approx([0.014, 0.074, 0.084])


def test_impossible_requests_and_budgets_are_refused_up_front():
    with pytest.raises(ValueError, match="max_model_len"):
        run(ClusterSpec(mixed=PoolSpec(1, engine(num_blocks=4), STEP)), [SimRequest("a", 0.0, 60, 10)])
    with pytest.raises(ValueError, match="num_blocks"):
        SimEngineConfig(num_blocks=4, block_size=16, max_model_len=128)


def test_pulls_into_one_decode_worker_queue_on_its_link():
    spec = pd()
    _, res = run(spec, [SimRequest("a", 0.0, 24, 2), SimRequest("b", 0.0, 24, 2)])
    # both prompts in one 10 ms prefill step; a's pull 10-60 ms, b's 60-110 ms
    assert [r.token_times for r in res.records] == [pytest.approx([0.01, 0.07]), pytest.approx([0.01, 0.12])]


def test_pulls_out_of_one_prefill_worker_queue_on_its_link_and_others_run_side_by_side():
    def spec(num_prefill: int) -> ClusterSpec:
        return ClusterSpec(
            prefill=PoolSpec(num_prefill, engine(budget=64), STEP),
            decode=PoolSpec(2, engine(budget=64), STEP),
            kv_bandwidth=1e30,
            kv_latency_s=0.05,
        )

    requests = [SimRequest("a", 0.0, 24, 2), SimRequest("b", 0.0, 24, 2)]
    sim, res = run(spec(1), requests)
    # one prefill step for both (0-10 ms), then each to its own decode worker -- and still
    # b's pull waits for a's on the prefill worker's link
    assert [w.num_steps for w in sim.pools["decode"]] == [1, 1]
    assert [r.token_times for r in res.records] == [pytest.approx([0.01, 0.07]), pytest.approx([0.01, 0.12])]
    assert_blocks_all_back(sim)

    # two prefill workers: the prompts of a and c hash to different ones (the router's
    # prefix affinity), so with different decode workers too their pulls overlap
    sim, res = run(spec(2), [SimRequest("a", 0.0, 24, 2), SimRequest("c", 0.0, 24, 2)])
    assert [w.num_steps for w in sim.pools["prefill"]] == [1, 1]
    assert [w.num_steps for w in sim.pools["decode"]] == [1, 1]
    assert [r.token_times[-1] for r in res.records] == pytest.approx([0.07, 0.07])
    assert_blocks_all_back(sim)
