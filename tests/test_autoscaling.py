"""Pool autoscaling on LLM signals: the policy's arithmetic (hand-checked), and on local Ray
a decode-heavy burst that grows only the decode pool, a prompt-heavy one that grows only
the prefill pool, each shrinking back after idle.
"""

from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace

import pytest

from kvray.configs import PlannerConfig, PoolAutoscaling, PoolConfig
from kvray.router.autoscaling import PoolPolicy, autoscaling_config, desired_workers

TARGETS = {
    "target_queued_prompt_tokens": 1000,
    "target_ttft_seconds": 2.0,
    "target_kv_cache_usage": 0.5,
    "target_running_requests": 4,
    "target_itl_seconds": None,
}


def test_prefill_asks_for_queued_tokens_over_target_and_scales_ttft_with_the_pool():
    # 2 replicas holding 1500 + 1700 queued tokens: ceil(3200 / 1000) = 4
    assert desired_workers("prefill", TARGETS, 2, {"queued_prompt_tokens": [1500, 1700]}) == 4
    # mean TTFT 3 s against 2 s on 2 replicas: ceil(2 * 1.5) = 3; tokens ask 1: the larger wins
    metrics = {"queued_prompt_tokens": [100, 0], "ttft_seconds": [2.0, 4.0]}
    assert desired_workers("prefill", TARGETS, 2, metrics) == 3
    # decode signals do not move a prefill pool
    assert desired_workers("prefill", TARGETS, 1, {"running_requests": [50], "kv_cache_usage": [1.0]}) is None


def test_decode_asks_for_kv_usage_and_requests():
    # KV usage mean 0.9 against 0.5 on 2 replicas: ceil(2 * 1.8) = 4; 6 requests / 4: 2
    metrics = {"kv_cache_usage": [0.8, 1.0], "running_requests": [3, 3], "itl_seconds": [9.0, 9.0]}
    assert desired_workers("decode", TARGETS, 2, metrics) == 4  # ITL has no target: ignored
    # idle: every ask is 0
    idle = {"kv_cache_usage": [0, 0, 0], "running_requests": [0, 0, 0]}
    assert desired_workers("decode", TARGETS, 3, idle) == 0
    assert desired_workers("decode", TARGETS, 3, {}) is None  # no signals yet: no opinion


def test_decode_counts_the_prompt_tokens_it_computes_itself():
    # a PD decode worker's short prompts (router.max_local_prefill_length): 2500 tokens
    # queued on one replica ask ceil(2500 / 1000) = 3 workers; 2 requests alone ask 1
    metrics = {"queued_prompt_tokens": [2500], "running_requests": [2], "kv_cache_usage": [0.1]}
    assert desired_workers("decode", TARGETS, 1, metrics) == 3
    assert desired_workers("decode", TARGETS, 1, {**metrics, "queued_prompt_tokens": [0]}) == 1
    # the time to first token stays the prefill (or mixed) pool's signal
    assert desired_workers("decode", TARGETS, 1, {"ttft_seconds": [9.0]}) is None
    assert desired_workers("mixed", TARGETS, 1, {"ttft_seconds": [4.0]}) == 2


def test_embedding_asks_for_its_queued_input_tokens_only():
    # 2 replicas with 1200 + 900 input tokens waiting for a batch: ceil(2100 / 1000) = 3
    assert desired_workers("embedding", TARGETS, 2, {"queued_prompt_tokens": [1200, 900]}) == 3
    assert desired_workers("embedding", TARGETS, 2, {"queued_prompt_tokens": [0, 0]}) == 0
    assert desired_workers("embedding", TARGETS, 1, {"running_requests": [50], "ttft_seconds": [9.0]}) is None


def test_policy_never_asks_for_zero_and_keeps_its_state():
    policy = PoolPolicy("decode", TARGETS)
    ctx = SimpleNamespace(
        aggregated_metrics={"running_requests": {"r1": 0.0}, "kv_cache_usage": {"r1": 0.0}},
        current_num_replicas=1,
        policy_state={"k": 1},
    )
    assert policy(ctx) == (1, {"k": 1})
    ctx.aggregated_metrics = {"running_requests": {"r1": 9.0, "r2": 4.0}}
    assert policy(ctx)[0] == 4  # ceil(13 / 4)


def test_requests_waiting_at_the_ingresses_count_in_the_summed_signals():
    # 3 requests (900 prompt tokens) wait for a worker of the pool to join
    waiting = {"running_requests": 3.0, "queued_prompt_tokens": 900.0}
    ctx = SimpleNamespace(
        aggregated_metrics={"running_requests": {"r1": 6.0}, "queued_prompt_tokens": {"r1": 600.0}},
        current_num_replicas=1,
        policy_state={},
    )
    assert PoolPolicy("decode", TARGETS, waiting=lambda: waiting)(ctx)[0] == 3  # ceil((6 + 3) / 4)
    assert PoolPolicy("prefill", TARGETS, waiting=lambda: waiting)(ctx)[0] == 2  # ceil(1500 / 1000)
    # the pool is empty (its worker died): the waiting requests alone decide
    ctx.aggregated_metrics = {}
    assert PoolPolicy("mixed", TARGETS, waiting=lambda: waiting)(ctx)[0] == 1  # ceil(3 / 4), ceil(0.9)
    assert PoolPolicy("decode", TARGETS, waiting=lambda: {"running_requests": 9.0})(ctx)[0] == 3

    def unreachable():
        raise ConnectionError("GCS restarting")

    assert PoolPolicy("decode", TARGETS, waiting=unreachable)(ctx)[0] == 1  # keeps its size


def test_autoscaling_config_maps_the_pool_fields():
    pool = PoolConfig(
        num_workers=3,
        autoscaling={"min_workers": 1, "max_workers": 2, "upscale_delay_s": 1, "downscale_delay_s": 5},
    )
    cfg = autoscaling_config("decode", pool)
    assert (cfg["min_replicas"], cfg["max_replicas"], cfg["initial_replicas"]) == (1, 2, 2)
    assert (cfg["upscale_delay_s"], cfg["downscale_delay_s"]) == (1, 5)
    assert cfg["policy"]["policy_function"] == "kvray.router.autoscaling:PoolPolicy"
    assert cfg["policy"]["policy_kwargs"]["targets"]["target_running_requests"] == 32
    assert autoscaling_config("decode", pool, "app-1")["policy"]["policy_kwargs"]["app_name"] == "app-1"
    with pytest.raises(ValueError, match="max_workers"):
        PoolConfig(autoscaling={"min_workers": 3, "max_workers": 2})


# ---- end to end on local Ray -------------------------------------------------------------

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

LOW = {"upscale_delay_s": 0.5, "downscale_delay_s": 4.0, "look_back_period_s": 2.0, "max_workers": 2}
NEVER = 10**9


def _deploy(engine_args, prefill_scaling: dict, decode_scaling: dict):
    from kvray.router.app import build_app

    pool = {"num_workers": 1, "num_cpus": 0.5, "torch_threads": 1}
    config = {
        "engine": {**engine_args, "max_num_seqs": 16},
        "prefill": {**pool, "autoscaling": {**LOW, **prefill_scaling}},
        "decode": {**pool, "autoscaling": {**LOW, **decode_scaling}},
        "router": {"health_check_seconds": 0.5},
    }
    return serve.run(build_app(config), name="kvray", route_prefix="/")


class ReplicaWatch:
    """Samples the replicas of both pools in the background (running or starting: the
    autoscaler's decision, not how fast a worker loads its model on a busy machine);
    keeps the peaks."""

    def __init__(self):
        self.peak = {"prefill": 0, "decode": 0}
        self.now = dict(self.peak)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            deployments = serve.status().applications["kvray"].deployments
            for role in self.peak:
                states = deployments[f"kvray-{role}"].replica_states
                self.now[role] = states.get("RUNNING", 0) + states.get("STARTING", 0)
                self.peak[role] = max(self.peak[role], self.now[role])
            time.sleep(0.25)

    def wait_for(self, role: str, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.now[role] == count:
                return True
            time.sleep(0.25)
        return False


def _burst(handle, prompts: list[str], max_tokens: int) -> list:
    base = {"model": "smollm2-135m-instruct", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    requests = [{**base, "prompt": p} for p in prompts]
    return [r.result(timeout_s=300) for r in [handle.generate.remote(req) for req in requests]]


def test_waiting_requests_reach_the_policy_through_rays_kv(local_serve, monkeypatch):
    """Two ingresses publish their waiting requests; one of them stopped publishing a
    minute ago (it is gone): the policy counts only the fresh one."""
    from kvray.router import autoscaling

    now = time.time()
    autoscaling.publish_waiting("kv-app", "ingress-a", {"decode": {"running_requests": 7.0}})
    monkeypatch.setattr(autoscaling.time, "time", lambda: now - 60)
    autoscaling.publish_waiting("kv-app", "ingress-b", {"decode": {"running_requests": 50.0}})
    monkeypatch.undo()
    autoscaling.publish_waiting("other-app", "ingress-c", {"decode": {"running_requests": 40.0}})
    assert autoscaling.read_waiting("kv-app", "decode") == {"running_requests": 7.0}
    assert autoscaling.read_waiting("kv-app", "prefill") == {}
    ctx = SimpleNamespace(aggregated_metrics={}, current_num_replicas=1, policy_state={})
    assert PoolPolicy("decode", TARGETS, app_name="kv-app")(ctx)[0] == 2  # ceil(7 / 4)


@pytest.mark.slow
def test_decode_burst_grows_the_decode_pool_only(local_serve, engine_args):
    handle = _deploy(engine_args, {"target_queued_prompt_tokens": NEVER}, {"target_running_requests": 2})
    watch = ReplicaWatch()
    try:
        # bursts until the pool has grown (a fast engine finishes one burst before the
        # autoscaler's next look): the load, not the engine's speed, decides
        bodies, deadline = [], time.monotonic() + 120
        while watch.peak["decode"] < 2 and time.monotonic() < deadline:
            bodies += _burst(handle, [f"Story number {i}:" for i in range(8)], max_tokens=96)
        assert bodies and all(b["usage"]["completion_tokens"] == 96 for b in bodies)
        assert watch.wait_for("decode", 2, timeout=60) or watch.peak["decode"] == 2
        assert watch.wait_for("decode", 1, timeout=60), watch.now  # back to 1 after idle
        assert watch.peak == {"prefill": 1, "decode": 2}
    finally:
        watch.stop.set()
        serve.delete("kvray")


@pytest.mark.slow
def test_prompt_burst_grows_the_prefill_pool_only(local_serve, engine_args):
    handle = _deploy(engine_args, {"target_queued_prompt_tokens": 300}, {"target_running_requests": NEVER})
    watch = ReplicaWatch()
    try:
        long_prompt = "Paged attention stores keys and values in fixed-size blocks. " * 36  # ~430 tokens
        bodies = _burst(handle, [f"{i}. {long_prompt}" for i in range(16)], max_tokens=2)
        assert all(b["usage"]["completion_tokens"] == 2 for b in bodies)
        assert watch.wait_for("prefill", 2, timeout=60) or watch.peak["prefill"] == 2
        assert watch.wait_for("prefill", 1, timeout=60), watch.now
        assert watch.peak == {"prefill": 2, "decode": 1}
    finally:
        watch.stop.set()
        serve.delete("kvray")


@pytest.mark.slow
def test_a_router_restart_breaks_no_stream_and_finds_the_workers_again(local_serve, engine_args):
    """Tokens go from the workers to the ingress, never through the Router: a stream in
    flight when every Router replica is killed finishes with the right tokens; Serve
    replaces the replicas, which find the pools' workers again, and new requests flow."""
    from kvray.router.app import build_app

    config = {
        "engine": engine_args,
        "disaggregated": False,
        "mixed": {"num_workers": 1, "num_cpus": 0.5, "torch_threads": 1},
        "router": {"num_replicas": 2},
    }
    ingress = serve.run(build_app(config), name="kvray", route_prefix="/")
    router = serve.get_deployment_handle("kvray-router", app_name="kvray")
    request = {"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    story = {**request, "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True}
    try:
        before = router.live_workers.remote().result(timeout_s=30)
        assert ingress.generate.remote(request).result(timeout_s=120)["usage"]["completion_tokens"] == 3
        want = ingress.generate.remote(story).result(timeout_s=120)["choices"][0]["text"]
        stream = ingress.options(stream=True).generate_stream.remote(story)
        pieces = [next(stream)["choices"][0]["text"]]  # streaming: the route was chosen
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if "kvray-router" in actor["name"]:
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        pieces += [chunk["choices"][0]["text"] for chunk in stream if chunk["choices"]]
        assert "".join(pieces) == want
        deadline = time.monotonic() + 90
        after = {}
        while time.monotonic() < deadline and after != before:
            try:
                after = router.live_workers.remote().result(timeout_s=5)
            except Exception:  # the new replica is starting
                pass
            time.sleep(0.5)
        assert after == before
        assert ingress.generate.remote(request).result(timeout_s=120)["usage"]["completion_tokens"] == 3
    finally:
        serve.delete("kvray")


def test_a_planner_block_sizes_each_pool_from_the_measured_rates():
    """The rates come from differencing the app's cumulative request counts; each pool asks
    for rate / what one of its workers takes within the SLOs (kvray.sim's planner)."""
    from kvray.router.planner_sizing import PlannerSizing
    from kvray.sim.planner import decode_rate, prefill_rate

    planner = {"ttft_seconds": 1.5, "tpot_seconds": 0.025, "model": "llama-3.1-8b", "gpu": "H100"}
    engine = {"max_num_batched_tokens": 2048, "max_num_seqs": 256, "max_model_len": 8192}
    asks = {}
    for name, (rate, prompt, output) in {"summaries": (40.0, 1740, 90), "chat": (80.0, 760, 200)}.items():
        for role in ("prefill", "decode"):
            now = [0.0]
            done = iter([(0.0, 0.0, 0.0), (rate * 10, rate * 10 * prompt, rate * 10 * output)])
            sizing = PlannerSizing(role, planner, engine, lambda d=done: next(d), clock=lambda n=now: n[0])
            assert sizing.ask() is None  # one reading: no rate yet
            now[0] = 10.0
            asks[name, role] = sizing.ask()
        cost, eng = sizing.cost, sizing.engine
        assert asks[name, "prefill"] == math.ceil(rate / prefill_rate(cost, eng, [prompt], 1, 1.5))
        ctx_len = prompt + output / 2
        assert asks[name, "decode"] == math.ceil(rate / decode_rate(cost, eng, ctx_len, output, 1, 0.025))
    # long prompts with short answers want more prefill than decode workers; chat the reverse mix
    assert asks["summaries", "prefill"] > asks["summaries", "decode"]
    ratio = {n: asks[n, "prefill"] / asks[n, "decode"] for n in ("summaries", "chat")}
    assert ratio["summaries"] > ratio["chat"]


def test_the_planners_ask_joins_the_pools_other_signals():
    planner = {"ttft_seconds": 1.5, "tpot_seconds": 0.025}
    engine = {"max_num_batched_tokens": 2048, "max_num_seqs": 256, "max_model_len": 8192}
    totals = iter([(0.0, 0.0, 0.0), (400.0, 400.0 * 1740, 400.0 * 90)])
    policy = PoolPolicy("prefill", TARGETS, planner=planner, engine=engine, totals=lambda: next(totals))
    policy.sizing.clock = iter([0.0, 10.0]).__next__
    ctx = SimpleNamespace(aggregated_metrics={}, current_num_replicas=1, policy_state={})
    assert policy(ctx)[0] == 1  # no rate yet, no signals: at least one
    planned = policy(ctx)[0]
    assert planned > 1  # 40 req/s of 1,740-token prompts need more than one H100
    cfg = autoscaling_config(
        "prefill",
        PoolConfig(autoscaling=PoolAutoscaling(planner=PlannerConfig(**planner))),
        "app",
        engine,
    )
    assert cfg["policy"]["policy_kwargs"]["planner"]["ttft_seconds"] == 1.5
    assert cfg["policy"]["policy_kwargs"]["engine"] == engine


def test_a_planner_alone_shrinks_the_pool_when_the_rate_falls_and_when_idle():
    """With every other signal off, the workers' reports carry no opinion: the planner's ask
    is the size, down as well as up (one worker after a window with nothing finished)."""
    off = dict.fromkeys(TARGETS)
    planner = {"ttft_seconds": 1.5, "tpot_seconds": 0.025, "window_seconds": 10.0}
    engine = {"max_num_batched_tokens": 2048, "max_num_seqs": 256, "max_model_len": 8192}
    finished = [(0.0, 0.0, 0.0), (400.0, 400.0 * 1740, 400.0 * 90)]  # 40 req/s of summaries
    finished += [(401.0, 401.0 * 1740, 401.0 * 90)]  # then 1 request in 10 s
    finished += [finished[-1]]  # then nothing for a window
    totals = iter(finished)
    policy = PoolPolicy("prefill", off, planner=planner, engine=engine, totals=lambda: next(totals))
    policy.sizing.clock = iter([0.0, 10.0, 20.0, 30.0]).__next__
    ctx = SimpleNamespace(
        aggregated_metrics={"queued_prompt_tokens": {"r1": 0.0}, "ttft_seconds": {"r1": 9.0}},
        current_num_replicas=2,
        policy_state={},
    )
    assert policy(ctx)[0] == 2  # no rate yet: keep the size
    ctx.current_num_replicas = policy(ctx)[0]
    assert ctx.current_num_replicas > 2  # 40 req/s of 1,740-token prompts
    assert policy(ctx)[0] == 1  # 0.1 req/s: one H100 takes it
    ctx.current_num_replicas = 3
    assert policy(ctx)[0] == 1  # a whole window without a finished request


def test_every_autoscaling_signal_is_a_field_of_the_workers_load_signals():
    """The policy reads the metrics a pool replica records (`LoadSignals.metrics()`) by
    name: a renamed field would leave a signal silently unread."""
    import dataclasses

    from kvray.actors.signals import LoadSignals
    from kvray.router.autoscaling import MEANS, SIGNALS

    fields = {f.name for f in dataclasses.fields(LoadSignals)}
    assert {s for signals in SIGNALS.values() for s in signals} <= fields
    assert set(MEANS) <= fields
