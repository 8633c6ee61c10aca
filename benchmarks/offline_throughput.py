"""Offline throughput against the matmul roofline, transformers and (optionally) vLLM, one run.

Workload (kvray's reference mix, as `kvray bench serve --dataset-name mix`): 32 requests,
prompts 32-384 tokens of English words, outputs 16-160 tokens, `ignore_eos`, greedy,
`dtype="auto"` (fp32 on a CPU without bf16 instructions). Useful tok/s = the output tokens
the requests asked for / wall time.

The roofline is measured in the same run: the workload's model matmul FLOPs (weights for
every prompt and output token, the LM head where a token is sampled, attention over each
token's context; from the HF config and the token counts) divided by the best rate of
linear in the chosen dtype at the model's own shapes (`F.linear`, a oneDNN-packed weight,
kvray's native panels), i.e. the time the workload takes
if every matmul ran at this machine's best rate and nothing else cost anything.

Baselines: transformers' `generate` in static batches of 16 (left padded, each batch run
to its longest request, as its users batch), and with `--vllm PYTHON` vLLM's CPU build
run from that interpreter (a separate venv: it pins its own torch) on the same prompts.

    python benchmarks/offline_throughput.py [--num-requests 32] [--vllm /path/to/python]
        [--skip-transformers] [--profile] [--quick]

`--quick`: every path at its smallest (4 requests of at most 16 output tokens, the matmul
rate at two row counts), a smoke run whose numbers mean little.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from serve_datasets import DatasetArgs, WordVocab, sample_requests
from serve_harness import cpu_banner

VLLM_SCRIPT = Path(__file__).with_name("vllm_offline.py")
QUICK = {"num_requests": 4, "max_output_tokens": 16, "rate_rows": [16, 256]}  # --quick's sizes


def workload(tokenizer, num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) per request."""
    reqs = sample_requests("mix", DatasetArgs(num_prompts=num_requests, seed=seed), WordVocab(tokenizer))
    return [(tokenizer(r.prompt).input_ids, r.expected_output_len) for r in reqs]


def model_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of each weight matmul a token goes through (qkv, o, gate_up, down, LM head)."""
    h = cfg.hidden_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return [
        (h, q + 2 * kv),
        (q, h),
        (h, 2 * cfg.intermediate_size),
        (cfg.intermediate_size, h),
        (h, cfg.vocab_size),
    ]


def workload_flops(cfg, reqs) -> float:
    """Matmul FLOPs of the whole workload (multiply-adds x 2)."""
    *layer, head = model_shapes(cfg)
    per_token = cfg.num_hidden_layers * sum(i * o for i, o in layer)
    q = cfg.num_attention_heads * (
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    )
    macs = 0.0
    for ids, out in reqs:
        tokens = len(ids) + out - 1  # the last output token is sampled, never fed back
        macs += tokens * per_token + out * head[0] * head[1]
        # attention: QK^T and PV of each token over its context (causal), every layer
        macs += cfg.num_hidden_layers * 2 * q * sum(range(1, tokens + 1))
    return 2 * macs


def best_matmul_rate(
    cfg, dtype: torch.dtype, rows=(16, 32, 64, 128, 256, 512), reps: int = 5
) -> tuple[float, str]:
    """FLOP/s of the fastest linear at the model's shapes in `dtype` (torch's `F.linear`,
    a oneDNN-packed weight where oneDNN takes the dtype, and kvray's native panels where
    they are built, at any row count), and where."""
    from kvray.kernels import cpu_native
    from kvray.models.cpu_linear import can_pack, linear, pack_weight

    cpu = torch.device("cpu")
    packs, native = can_pack(dtype, cpu), cpu_native.takes(dtype, cpu)
    best, where = 0.0, ""
    for i, o in model_shapes(cfg):
        w = torch.randn(o, i, dtype=dtype)
        ways = {"F.linear": lambda x, w=w: linear(x, w, None, None)}
        if packs:
            packed = pack_weight(w)
            ways["oneDNN packed"] = lambda x, p=packed: linear(x, None, None, p)
        if native:
            panels = cpu_native.to_panels(w)
            ways["native panels"] = lambda x, p=panels: cpu_native.linear(x, p, None)
        for t in rows:
            x = torch.randn(t, i, dtype=dtype)
            for way, run in ways.items():
                run(x)
                seconds = float("inf")
                for _ in range(3):
                    start = time.perf_counter()
                    for _ in range(reps):
                        run(x)
                    seconds = min(seconds, (time.perf_counter() - start) / reps)
                rate = 2 * t * i * o / seconds
                if rate > best:
                    best, where = rate, f"{way} [{t}x{i}] @ [{i}x{o}]"
    return best, where


def run_kvray(model: str, reqs, args) -> dict:
    from kvray.engine import LLM, SamplingParams

    llm = LLM(
        model=model, dtype=args.dtype, max_model_len=2048, seed=args.seed, quantization=args.quantization
    )
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    llm.generate(prompts[:4], params[:4])  # warm up
    start = time.perf_counter()
    llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    import psutil

    out = {"seconds": seconds, "dtype": str(llm.engine.dtype).removeprefix("torch."), "llm": llm}
    out["rss_gb"] = psutil.Process().memory_info().rss / 1e9  # weights + KV cache + runtime
    if args.profile:
        out["profile"] = profile(llm, prompts, params)
    return out


def profile(llm, prompts, params) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def run_transformers(model_path, reqs, dtype: torch.dtype, batch_size: int) -> float:
    from kvray.models.loader import transformers_model

    model = transformers_model(Path(model_path), dtype)
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    start = time.perf_counter()
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b : b + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in batch])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
        longest = max(m for _, m in batch)
        with torch.no_grad():
            model.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
    return time.perf_counter() - start


def run_vllm(python: str, model_path, reqs, dtype: str, threads: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": str(model_path), "dtype": dtype, "requests": reqs}, f)
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run([python, str(VLLM_SCRIPT), f.name], capture_output=True, text=True, env=env)
    Path(f.name).unlink()
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("{")), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"vLLM run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(line)["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", help="kvray's (and vLLM's: the one kvray chose)")
    parser.add_argument("--quantization", default=None, choices=["int8"], help="kvray's (vLLM: as loaded)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-output-tokens", type=int, default=None, help="cap each request's output")
    parser.add_argument(
        "--rate-rows", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512], help="the matmul rate's rows"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline-batch-size", type=int, default=16)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--vllm", metavar="PYTHON", help="also run vLLM's CPU build from this interpreter")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of kvray's run")
    parser.add_argument("--quick", action="store_true", help=f"smallest sizes ({QUICK}; flags given win)")
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from kvray.models.loader import load_config, load_tokenizer, resolve_model_path

    path = resolve_model_path(args.model)
    cfg = load_config(path)
    reqs = workload(load_tokenizer(path), args.num_requests, args.seed)
    if args.max_output_tokens:
        reqs = [(ids, min(m, args.max_output_tokens)) for ids, m in reqs]
    useful = sum(m for _, m in reqs)
    flops = workload_flops(cfg, reqs)

    kv = run_kvray(str(path), reqs, args)
    dtype = kv["llm"].engine.dtype
    rate, shape = best_matmul_rate(cfg, dtype, rows=tuple(args.rate_rows))
    roofline_s = flops / rate
    rows = [("kvray `LLM.generate`", kv["seconds"])]
    if not args.skip_transformers:
        rows.append((f"transformers `generate`, static batches of {args.baseline_batch_size}",
                     run_transformers(path, reqs, dtype, args.baseline_batch_size)))  # fmt: skip
    if args.vllm:
        rows.append(
            ("vLLM CPU `LLM.generate` (eager)", run_vllm(args.vllm, path, reqs, kv["dtype"], args.threads))
        )

    threads = f"torch {torch.__version__}, {args.threads} threads"
    print(f"\n{cpu_banner()}; {threads}; dtype {args.dtype} -> {kv['dtype']}")
    print(
        f"workload: {len(reqs)} requests (mix), {sum(len(i) for i, _ in reqs)} prompt tokens, "
        f"{useful} output tokens, greedy, ignore_eos; {flops / 1e12:.2f} TFLOP of model matmuls"
    )
    print(f"kvray process RSS after the run: {kv['rss_gb']:.2f} GB (weights, KV cache, runtime)")
    print(
        f"roofline: best {kv['dtype']} linear at the model's shapes {rate / 1e9:.1f} GFLOP/s ({shape}) "
        f"-> {roofline_s:.1f} s, {useful / roofline_s:.1f} useful tok/s\n"
    )
    print("| engine | seconds | useful tok/s | of the roofline | vs kvray |")
    print("|---|---|---|---|---|")
    for name, seconds in rows:
        print(
            f"| {name} | {seconds:.1f} | {useful / seconds:.1f} | {100 * roofline_s / seconds:.0f} % | "
            f"{kv['seconds'] / seconds:.2f}x |"
        )
    if len(rows) > 1:
        print(
            f"\nkvray / transformers: **{rows[1][1] / kv['seconds']:.2f}x**"
            if not args.skip_transformers
            else ""
        )
    if "profile" in kv:
        print("\nwhere kvray's time goes (torch.profiler, one more run of the workload):\n")
        print(kv["profile"])


if __name__ == "__main__":
    main()
