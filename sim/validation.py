"""`kvray sim validate`: predict a measured `kvray bench serve` run of a serve config.

The cluster comes from the config, read as `kvray serve` reads it (`ServeConfig`: each
pool's engine is `DeploymentConfig.engine_config(role)`, with EngineConfig's defaults; the
KV budget in blocks; the router's and the hand-off's settings), the load from the result
JSON (each request's prompt and output length in send order, the request rate and the
clients' max concurrency), the step times from the profile measured on this machine for
each pool's torch threads (`kvray bench step-times --threads N`).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import yaml

from kvray.configs import ServeConfig
from kvray.engine.config import DEFAULT_CPU_KV_BYTES
from kvray.sim.cluster import ClusterSpec, PoolSpec, simulate
from kvray.sim.cost_model import StepTimeModel
from kvray.sim.results import SimResult
from kvray.sim.worker import SimEngineConfig
from kvray.sim.workload import SimRequest, arrival_times

PROFILES = Path(__file__).parent / "profiles"
COMPARED = (
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "mean_e2el_ms",
)


def profile_path(threads: int, override: str | None = None) -> Path:
    """The step times to use: `override`, else the served engine's (fitted to a traced
    serve run), else the offline engine's, for that many torch threads."""
    if override:
        return Path(override)
    for name in (f"cpu-t{threads}-served.json", f"cpu-t{threads}.json"):
        if (PROFILES / name).exists():
            return PROFILES / name
    raise FileNotFoundError(
        f"no step times for {threads} threads: run `kvray bench step-times --threads {threads}`"
    )


def _profile(threads: int, override: str | None) -> StepTimeModel:
    return StepTimeModel.from_dict(json.loads(profile_path(threads, override).read_text())["fit"])


def serve_config(config: ServeConfig | dict) -> ServeConfig:
    """A serve config (a YAML file's fields) validated as `kvray serve` takes it."""
    return config if isinstance(config, ServeConfig) else ServeConfig(**config)


def cluster_from_config(
    config: ServeConfig | dict, profile: str | None = None, network_s: float = 0.0
) -> ClusterSpec:
    """The cluster `config` serves: each pool's workers with the engine they run (the
    deployment's `engine`, the pool's own over it), their KV budget in blocks and the step
    times of their torch threads."""
    cfg = serve_config(config)

    def pool(role: str) -> PoolSpec:
        p, e = getattr(cfg, role), cfg.engine_config(role)
        cost = _profile(p.torch_threads or 2, profile)
        if e.kv_cache_dtype in ("int8", "fp8_e4m3"):
            d = cost.model.head_dim  # per token and head: d one-byte codes and a 4-byte scale
            cost = replace(cost, model=replace(cost.model, kv_dtype_bytes=(d + 4) / d))
        num_blocks = cost.blocks_in(e.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES, e.block_size)
        return PoolSpec(p.num_workers, SimEngineConfig.from_engine(e, num_blocks), cost)

    router, kv = cfg.router, cfg.kv_transfer
    common = {
        "affinity_blocks": router.affinity_blocks,
        "imbalance_threshold": router.imbalance_threshold,
        "report_interval_s": router.health_check_seconds,
        "network_s": network_s,
        "lease": kv.lease_policy(),  # as the workers take it
    }
    if cfg.disaggregated:
        pools = {"prefill": pool("prefill"), "decode": pool("decode")}
        return ClusterSpec(**pools, max_local_prefill_length=router.max_local_prefill_length, **common)
    return ClusterSpec(mixed=pool("mixed"), **common)


def requests_from_result(result: dict) -> list[SimRequest]:
    """The run's requests in send order; those that failed there (an error, no output) are
    left out."""
    errors = result.get("errors") or [""] * len(result["input_lens"])
    n = len(result["input_lens"])
    rate = result.get("request_rate", "inf")
    rate = math.inf if rate in ("inf", None) else float(rate)
    times = arrival_times(n, rate, float(result.get("burstiness") or 1.0))
    return [
        SimRequest(f"r{i}", t, int(p), int(o))
        for i, (t, p, o, e) in enumerate(zip(times, result["input_lens"], result["output_lens"], errors))
        if not e and int(o) > 0
    ]


def predict(
    config: ServeConfig | dict, result: dict, profile: str | None = None, network_s: float = 0.0
) -> SimResult:
    spec = cluster_from_config(config, profile, network_s)
    concurrency = result.get("max_concurrency") or None  # 0 or none: unlimited, as the bench reads it
    return simulate(spec, requests_from_result(result), max_concurrency=concurrency)


def compare(measured: dict, simulated: dict) -> list[tuple[str, float, float, float]]:
    """(metric, measured, simulated, relative error) for the metrics both have."""
    rows = []
    for key in COMPARED:
        if key in measured and key in simulated:
            m, s = float(measured[key]), float(simulated[key])
            rows.append((key, m, s, abs(s - m) / m if m else math.nan))
    return rows


def validate(
    config_path: Path, result_path: Path, profile: str | None = None, network_s: float = 0.0
) -> list:
    if not config_path.exists():  # a preset's name
        config_path = Path(__file__).resolve().parent.parent / "configs" / f"{config_path.stem}.yaml"
    config = serve_config(yaml.safe_load(config_path.read_text()))
    measured = json.loads(result_path.read_text())
    sim = predict(config, measured, profile, network_s).summary()
    rows = compare(measured, replace_nan(sim))
    threads = sorted({getattr(config, r).torch_threads or 2 for r in config.roles})
    used = ", ".join(profile_path(t, profile).name for t in threads)
    n, conc = len(measured["input_lens"]), measured.get("max_concurrency")
    print(f"{config_path.name}: {n} requests, max concurrency {conc}; step times: {used}")
    print("| metric | measured | simulated | error |\n|---|---|---|---|")
    for key, m, s, err in rows:
        print(f"| {key} | {m:.1f} | {s:.1f} | {err:.0%} |")
    return rows


def replace_nan(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if not (isinstance(v, float) and math.isnan(v))}
