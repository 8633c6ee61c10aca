"""`kvray sim ...`: the studies, the planner and the validation against a measured run.

kvray sim study    [--model llama-3.1-8b] [--gpu H100] [--num-gpus 4] [--plot DIR] [--save F]
kvray sim plan     --workload summarization --num-gpus 8 [--simulate]
kvray sim validate --config configs/smollm2-cpu.yaml --result RESULT.json [--profile F]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

PROFILES = Path(__file__).parent / "profiles"


def _gpu_setup(args):
    from kvray.sim.cost_model import HARDWARE, MODELS, StepTimeModel
    from kvray.sim.worker import SimEngineConfig

    cost = StepTimeModel(MODELS[args.model], HARDWARE[args.gpu], tp=args.tp)
    if args.profile:  # a fitted GPU's efficiencies and overheads, on the model studied
        fitted = load_profile(args.profile)
        cost = replace(fitted, model=cost.model, hardware=cost.hardware, tp=args.tp)
    engine = SimEngineConfig(
        num_blocks=cost.kv_cache_blocks(16), max_num_batched_tokens=args.max_num_batched_tokens
    )
    return cost, engine


def _study(args) -> int:
    from kvray.sim.report import run_study

    cost, engine = _gpu_setup(args)
    run_study(cost, engine, args.num_gpus, args.workloads, args.duration, args.plot, args.save)
    return 0


def _plan(args) -> int:
    from kvray.sim.planner import plan, ratio_for
    from kvray.sim.studies import WORKLOADS

    cost, engine = _gpu_setup(args)
    work = WORKLOADS[args.workload]
    p, d = ratio_for(work, cost, engine, args.num_gpus // cost.tp)
    print(f"{args.workload} on {args.num_gpus} x {args.gpu}, {args.model}: analytic P:D = {p}:{d}")
    if args.simulate:
        result = plan(work, cost, engine, args.num_gpus)
        for row in result.rows:
            print(f"  {row.name:16s} goodput {row.goodput:8.2f} req/s  ({row.per_gpu:.2f} per GPU)")
        print(f"simulated best: {result.best.name}")
    return 0


def _run(args) -> int:
    """One cluster under one load (a trace file or a mix at a rate): vllm bench serve's keys."""
    from kvray.sim.cluster import simulate
    from kvray.sim.studies import colocated_cluster, pd_cluster
    from kvray.sim.workload import MIXES, load_trace, synthetic

    cost, engine = _gpu_setup(args)
    if args.trace:
        reqs = load_trace(args.trace)
    else:
        reqs = synthetic(MIXES[args.mix], args.num_prompts, args.request_rate, args.burstiness, args.seed)
    if args.pd:
        p, d = (int(x) for x in args.pd.split(":"))
        spec = pd_cluster(cost, engine, p, d)
    else:
        spec = colocated_cluster(cost, engine, args.num_gpus // cost.tp)
    summary = simulate(spec, reqs, max_concurrency=args.max_concurrency).summary()
    print(json.dumps({"cluster": spec.name, "num_gpus": spec.num_gpus, **summary}, indent=1))
    return 0


def _validate(args) -> int:
    from kvray.sim.validation import validate

    validate(Path(args.config), Path(args.result), args.profile, args.network_ms / 1e3)
    return 0


def add_parser(sub) -> None:
    sim = sub.add_parser("sim", help="simulate a kvray cluster: PD vs colocated studies, the P:D planner")
    cmds = sim.add_subparsers(dest="sim_command", required=True)

    def gpu_args(p) -> None:
        p.add_argument("--model", default="llama-3.1-8b", help="llama-3.1-8b | llama-3.1-70b | smollm2-135m")
        p.add_argument("--gpu", default="H100", help="H100 | H200 | A10G | L40S")
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--num-gpus", type=int, default=4)
        p.add_argument("--max-num-batched-tokens", type=int, default=2048)
        p.add_argument(
            "--profile",
            default=None,
            help="a fitted GPU step-time JSON (`kvray bench step-times --from-gpu`)",
        )

    study = cmds.add_parser("study", help="goodput of PD splits vs colocated, SLO sweep, chunked prefill")
    gpu_args(study)
    study.add_argument("--workloads", default="chatbot,summarization")
    study.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    study.add_argument("--plot", type=Path, default=None, metavar="DIR")
    study.add_argument("--save", type=Path, default=None, metavar="FILE.json")
    study.set_defaults(func=_study)

    pl = cmds.add_parser("plan", help="the P:D ratio for a workload (analytic; --simulate checks it)")
    gpu_args(pl)
    pl.add_argument("--workload", default="chatbot", help="chatbot | summarization")
    pl.add_argument("--simulate", action="store_true")
    pl.set_defaults(func=_plan)

    one = cmds.add_parser("run", help="one cluster under a trace or a mix: the vllm bench serve summary")
    gpu_args(one)
    one.add_argument("--pd", default=None, metavar="P:D", help="prefill:decode workers (default: colocated)")
    one.add_argument(
        "--trace", default=None, help="CSV or JSON lines: time, prompt_len, output_len[, prefix_id]"
    )
    one.add_argument(
        "--mix", default="chatbot", help="chatbot | summarization | code | cpu-mix (without --trace)"
    )
    one.add_argument("--num-prompts", type=int, default=500)
    one.add_argument("--request-rate", type=float, default=10.0)
    one.add_argument("--burstiness", type=float, default=1.0)
    one.add_argument("--max-concurrency", type=int, default=None)
    one.add_argument("--seed", type=int, default=0)
    one.set_defaults(func=_run)

    val = cmds.add_parser("validate", help="predict a measured `kvray bench serve` run of a preset")
    val.add_argument("--config", required=True, help="the serve config the run used")
    val.add_argument("--result", required=True, help="its `kvray bench serve --save-result` JSON")
    val.add_argument("--profile", default=None, help="step times JSON (default: sim/profiles/cpu*.json)")
    val.add_argument(
        "--network-ms",
        type=float,
        default=5.0,
        help="one-way ingress <-> worker latency (5: fitted on this machine)",
    )
    val.set_defaults(func=_validate)


def load_profile(path: str | Path):
    from kvray.sim.cost_model import StepTimeModel

    return StepTimeModel.from_dict(json.loads(Path(path).read_text())["fit"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvray")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)
