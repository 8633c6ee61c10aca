"""The `kvray` command line: generate, serve, deploy, bench, sim, cluster."""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_CHAT = "What is the capital of France? Answer in one sentence."


def _generate(args: argparse.Namespace) -> int:
    from kvray.engine import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        quantization_ignore=["*"] if args.dequantize else [],
        quantization_group_size=args.quantization_group_size,
        speculative_config=json.loads(args.speculative_config) if args.speculative_config else None,
    )
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    if args.raw or not getattr(llm.tokenizer, "chat_template", None):  # a base model: no template
        out = llm.generate([args.prompt], params)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    print(out.outputs[0].text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Deploy the Serve app (starting a local Ray when RAY_ADDRESS is unset) until a signal."""
    import signal
    import threading

    import ray
    from ray import serve

    from kvray.cluster.deploy import run_app
    from kvray.cluster.local import ensure_ray
    from kvray.router.app import load_config

    config = load_config(args.config)
    started = ensure_ray()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        run_app(config, args.host, args.port)
        print(f"kvray: serving {config.model_name} at http://{args.host}:{args.port}/v1", flush=True)
        while not stop.wait(0.5):
            pass
        print("kvray: shutting down", flush=True)
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()
        else:  # a cluster we joined keeps running; only our app goes
            serve.delete(config.app_name)
    return 0


def _deploy(args: argparse.Namespace) -> int:
    """Deploy the Serve app onto a running cluster, print its URL and leave it running."""
    from kvray.cluster.deploy import deploy

    url = deploy(args.config, args.address, args.host, args.port, args.proxy_location)
    print(f"kvray: deployed at {url}", flush=True)
    return 0


BENCHMARKS = {
    "offline": "offline_throughput.py",
    "serve": "serve.py",
    "tp": "tensor_parallel.py",
    "spec": "spec_decode.py",
    "kv-int8": "kv_int8.py",
    "kernel-ab": "kernel_ab.py",
    "step-times": "step_times.py",
    "planner": "planner_live.py",
}


def _bench(args: argparse.Namespace) -> int:
    """Run a script from the checkout's benchmarks/ folder (editable installs have it), as
    `python benchmarks/<script>` would: its folder first on sys.path, for its sibling modules."""
    import runpy
    from pathlib import Path

    import kvray

    script = Path(kvray.__file__).resolve().parent / "benchmarks" / BENCHMARKS[args.name]
    if not script.exists():
        print(f"kvray: error: {script} not found (benchmarks run from a source checkout)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvray", description="kvray: distributed LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer one prompt with the offline engine")
    gen.add_argument("--model", default="smollm2-135m-instruct")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"])
    gen.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "gguf", "fp8"],
        help="weights kept quantized (default: the checkpoint's own; a GGUF's codes on a CPU)",
    )
    gen.add_argument(
        "--quantization-group-size",
        type=int,
        default=32,
        choices=[32, 128],
        help="--quantization int4's group along k",
    )
    gen.add_argument(
        "--dequantize", action="store_true", help="a GGUF model's weights de-quantized to --dtype"
    )
    gen.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    gen.add_argument("--prompt", default=DEFAULT_CHAT)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP app (Ray Serve)")
    srv.add_argument("--config", required=True, help="a YAML file or a preset name (smollm2-cpu-pd)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.set_defaults(func=_serve)

    dep = sub.add_parser("deploy", help="deploy the app onto a running Ray cluster and print its URL")
    dep.add_argument("--config", required=True, help="a YAML file or a preset name (llama3-8b-gpu-pd)")
    dep.add_argument("--address", default=None, help="the cluster (default: RAY_ADDRESS; `auto` on a node)")
    dep.add_argument("--host", default="0.0.0.0", help="the proxies' interface (new Serve only)")
    dep.add_argument("--port", type=int, default=8000)
    dep.add_argument(
        "--proxy-location",
        choices=["HeadOnly", "EveryNode"],
        default=None,
        help="Serve proxies on the head only, or on every node with a replica (Serve's default)",
    )
    dep.set_defaults(func=_deploy)

    bench = sub.add_parser(
        "bench",
        help="run a benchmark from benchmarks/ (e.g. `kvray bench offline`, `kvray bench serve --help`)",
    )
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    bench.set_defaults(func=_bench)

    from kvray.cluster.netns_cli import add_parser as add_cluster_parser
    from kvray.sim.cli import add_parser as add_sim_parser

    add_sim_parser(sub)
    add_cluster_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvray.errors import KvrayError

    try:
        return args.func(args)
    except KvrayError as e:
        print(f"kvray: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
