"""Offline throughput: kvray's LLM.generate against transformers' generate, same run.

64 requests, prompt lengths uniform in [32, 512] tokens cut from real English text (the
Python documentation shipped with CPython, `pydoc_data.topics`), max_tokens uniform in
[16, 256], ignore_eos, fixed seed, bf16. The baseline is how transformers users batch:
static batches of 16, left padded, each batch run to its longest request. Both sides
are credited only with the tokens the requests asked for.

Also reports kvray's decode model-FLOPs utilisation against a bf16 matmul peak measured
in this run, and (with --profile) where a decode step's time goes.

    python benchmarks/offline_throughput.py [--num-requests 64] [--skip-baseline] [--profile]
"""

from __future__ import annotations

import argparse
import platform
import random
import time

import torch


def real_text_token_pool(tokenizer) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer(text).input_ids


def make_requests(pool: list[int], n: int, seed: int, min_in=32, max_in=512, min_out=16, max_out=256):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        length = rng.randint(min_in, max_in)
        start = rng.randint(0, len(pool) - length - 1)
        reqs.append((pool[start : start + length], rng.randint(min_out, max_out)))
    return reqs


def bf16_matmul_peak(size: int = 2048, reps: int = 10, trials: int = 3) -> float:
    """FLOP/s of a square bf16 matmul on this machine, now (best of a few trials)."""
    a = torch.randn(size, size, dtype=torch.bfloat16)
    b = torch.randn(size, size, dtype=torch.bfloat16)
    for _ in range(2):
        a @ b
    best = 0.0
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * size**3 * reps / (time.perf_counter() - t))
    return best


def decode_flops_per_token(hf_config, context: float) -> float:
    """Matmul FLOPs of one decode token: weights (LM head included) plus attention."""
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    hd = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * hd, hf_config.num_key_value_heads * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * hf_config.intermediate_size
    weights = layers * per_layer + h * hf_config.vocab_size
    attention = layers * 2 * q * context  # QK^T and PV
    return 2 * (weights + attention)


def run_kvray(model: str, reqs, args) -> dict:
    from kvray.engine import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
    )
    engine = llm.engine
    llm.generate([{"prompt_token_ids": reqs[0][0][:32]}], SamplingParams(max_tokens=4, ignore_eos=True))
    for i, (ids, m) in enumerate(reqs):
        engine.add_request(
            str(i), {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        )
    decode_time, decode_tokens, decode_ctx = 0.0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        running = list(engine.scheduler.running)
        pure_decode = not engine.scheduler.waiting and all(
            r.num_tokens - r.num_computed_tokens == 1 for r in running
        )
        t = time.perf_counter()
        engine.step()
        if pure_decode and running:
            decode_time += time.perf_counter() - t
            decode_tokens += len(running)
            decode_ctx += sum(r.num_computed_tokens for r in running)
    elapsed = time.perf_counter() - start
    generated = sum(m for _, m in reqs)
    avg_ctx = decode_ctx / max(decode_tokens, 1)
    flops = decode_flops_per_token(engine.hf_config, avg_ctx) * decode_tokens
    out = {
        "seconds": elapsed,
        "tok_s": generated / elapsed,
        "decode_tok_s": decode_tokens / max(decode_time, 1e-9),
        "decode_flops_s": flops / max(decode_time, 1e-9),
        "decode_share": decode_time / elapsed,
    }
    if args.profile:
        out["profile"] = profile_decode(llm, reqs)
    return out


def profile_decode(llm, reqs, steps: int = 5) -> str:
    from torch.profiler import ProfilerActivity, profile

    from kvray.engine import SamplingParams

    engine = llm.engine
    for i, (ids, _) in enumerate(reqs[: llm.engine.config.max_num_seqs]):
        engine.add_request(
            f"p{i}",
            {"prompt_token_ids": ids},
            SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
        )
    while engine.scheduler.waiting or any(
        r.num_tokens - r.num_computed_tokens > 1 for r in engine.scheduler.running
    ):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    engine.abort_request([f"p{i}" for i in range(len(reqs))])
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def run_transformers(model_path, reqs, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
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
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tok_s": sum(m for _, m in reqs) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--baseline-batch-size", type=int, default=16)
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of decode steps")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from kvray.models.loader import resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    reqs = make_requests(real_text_token_pool(tokenizer), args.num_requests, args.seed)
    peak = bf16_matmul_peak()
    kv = run_kvray(str(path), reqs, args)
    hf = None if args.skip_baseline else run_transformers(path, reqs, args.baseline_batch_size)

    print(
        f"\nmachine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; bf16 matmul peak {peak / 1e9:.0f} GFLOP/s"
    )
    print(
        f"workload: {len(reqs)} requests, prompts {sum(len(i) for i, _ in reqs)} tokens, "
        f"generated {sum(m for _, m in reqs)} tokens, bf16, greedy, ignore_eos\n"
    )
    print("| engine | seconds | generated tok/s |")
    print("|---|---|---|")
    print(
        f"| kvray LLM.generate (max_num_seqs={args.max_num_seqs}) | {kv['seconds']:.1f} | {kv['tok_s']:.1f} |"
    )
    if hf:
        print(
            f"| transformers generate, static batches of {args.baseline_batch_size} | "
            f"{hf['seconds']:.1f} | {hf['tok_s']:.1f} |"
        )
        print(f"\nratio kvray / transformers: **{kv['tok_s'] / hf['tok_s']:.2f}x**")
    print(
        f"kvray decode-only steps: {kv['decode_tok_s']:.0f} tok/s, "
        f"{kv['decode_flops_s'] / 1e9:.0f} GFLOP/s = {100 * kv['decode_flops_s'] / peak:.0f}% of the "
        f"bf16 matmul peak (MFU); decode steps took {100 * kv['decode_share']:.0f}% of kvray's time"
    )
    if "profile" in kv:
        print("\nwhere a decode step's time goes (torch.profiler, 5 steps at full batch):\n")
        print(kv["profile"])


if __name__ == "__main__":
    main()
