"""kvray.sim's link to measured runs: the served engine's step trace, a serve config as a
simulated cluster, a bench result as simulated load, and the `kvray sim` CLI."""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml

from kvray.cluster.cli import main as kvray_main
from kvray.sim.cost_model import StepSample, StepTimeModel
from kvray.sim.validation import PROFILES, cluster_from_config, predict, requests_from_result

PRESETS = PROFILES.parent.parent / "configs"


def test_a_served_engine_traces_each_step_as_the_scheduler_handed_it_out(tmp_path, smollm2_path):
    from kvray.engine import EngineConfig, SamplingParams
    from kvray.engine.async_engine import AsyncLLM

    config = EngineConfig(
        model=str(smollm2_path), dtype="float32", max_model_len=256, step_trace_dir=str(tmp_path)
    )
    engine = AsyncLLM(config)

    async def go():
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        async for _ in engine.generate({"prompt_token_ids": list(range(100, 140))}, params):
            pass

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
    (path,) = tmp_path.glob("steps-*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["threads"] >= 1
    steps = [StepSample.from_dict(d) for d in lines[1:]]
    # the 40-token prompt in one step (it samples the first token), then two decodes
    assert [[(w.num_new_tokens, w.context_len, w.samples) for w in s.batch] for s in steps] == [
        [(40, 40, True)],
        [(1, 41, True)],
        [(1, 42, True)],
    ]
    assert all(s.seconds > 0 for s in steps)
    # the loop thread's own CPU time: positive, and never more than the step's wall time
    # (its OMP helpers are other threads)
    assert all(0 < d["cpu_seconds"] <= d["seconds"] * 1.01 + 1e-3 for d in lines[1:])


@pytest.mark.parametrize("preset", ["smollm2-cpu", "smollm2-cpu-pd"])
def test_a_serve_preset_becomes_the_simulated_cluster(preset):
    config = yaml.safe_load((PRESETS / f"{preset}.yaml").read_text())
    spec = cluster_from_config(config)
    pools = [spec.mixed] if not config["disaggregated"] else [spec.prefill, spec.decode]
    for pool in pools:
        model = pool.cost.model  # the KV budget in blocks of 16 tokens, as the runner sizes it
        assert pool.engine.num_blocks == config["engine"]["kv_cache_memory_bytes"] // (
            model.kv_bytes_per_token * 16
        )
        assert pool.engine.max_num_batched_tokens == 512 and pool.engine.max_model_len == 2048
        assert pool.num_workers == 1
    assert spec.disaggregated == config["disaggregated"]


def test_a_bench_result_becomes_the_simulated_load_and_every_request_finishes():
    result = {
        "input_lens": [40, 300, 120, 64],
        "output_lens": [5, 20, 1, 9],
        "request_rate": "inf",
        "max_concurrency": 2,
    }
    reqs = requests_from_result(result)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in reqs] == [
        (0.0, 40, 5), (0.0, 300, 20), (0.0, 120, 1), (0.0, 64, 9)
    ]  # fmt: skip
    config = yaml.safe_load((PRESETS / "smollm2-cpu-pd.yaml").read_text())
    res = predict(config, result)
    assert [len(r.token_times) for r in res.records] == [5, 20, 1, 9]
    sent = sorted(r.arrival_s for r in res.records)
    assert sent[:2] == [0.0, 0.0] and sent[2] > 0  # two clients: the third waits for a slot


def test_short_prompts_of_a_pd_config_run_whole_on_the_decode_pool():
    """router.max_local_prefill_length in the simulator as in the front: the prompts of at
    most that many tokens never reach the prefill pool."""
    result = {"input_lens": [40, 300, 120, 64], "output_lens": [5, 20, 3, 9], "max_concurrency": 4}
    config = yaml.safe_load((PRESETS / "smollm2-cpu-pd.yaml").read_text())
    for local, prefilled in ((0, True), (100, True), (1000, False)):  # prompts of 40-300 tokens
        config["router"] = {**(config.get("router") or {}), "max_local_prefill_length": local}
        res = predict(config, result)
        assert [len(r.token_times) for r in res.records] == [5, 20, 3, 9]
        busy = {wid.split("-")[0]: s for wid, s in res.busy_s.items()}
        assert (busy["prefill"] > 0) == prefilled, (local, busy)
        assert cluster_from_config(config).max_local_prefill_length == local


def test_the_shipped_profiles_load_and_predict_growing_step_times():
    names = {p.name for p in PROFILES.glob("*.json")}
    assert {"cpu-t1.json", "cpu-t2.json", "cpu-t1-served.json", "cpu-t2-served.json"} <= names
    for path in sorted(PROFILES.glob("cpu-t*.json")):
        model = StepTimeModel.from_dict(json.loads(path.read_text())["fit"])
        from kvray.sim import RequestWork

        small, big = model.predict([RequestWork(1, 100)]), model.predict([RequestWork(1, 100)] * 16)
        assert 0 < small < big, path.name


def test_kvray_sim_plan_prints_the_analytic_ratio(capsys):
    assert kvray_main(["sim", "plan", "--workload", "summarization", "--num-gpus", "4"]) == 0
    assert "analytic P:D = 3:1" in capsys.readouterr().out


def test_kvray_sim_run_simulates_a_trace(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("time,prompt_len,output_len,prefix_id,prefix_len\n0.0,500,50,1,256\n0.1,600,40,1,256\n")
    assert kvray_main(["sim", "run", "--pd", "1:1", "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"] == "PD 1:1" and out["completed"] == 2 and out["total_output_tokens"] == 90
    assert 0 < out["mean_ttft_ms"] < out["mean_e2el_ms"]
