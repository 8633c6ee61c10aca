"""The int8 KV cache against the model-dtype cache (issue 15's benchmark), in one run:

- blocks a 1 GiB budget holds, and the bytes a prefill-to-decode pull moves per prompt
  token (the packed blocks, scales included);
- the native decode-attention kernel alone over 16 sequences of 1,000 tokens (fp32 rows
  against int8 codes + scales);
- offline decode tok/s at 16 and 32 sequences of long prompts: time of a 1 + N token
  generation minus a 1-token one (prefix caching off).

    .venv/bin/python benchmarks/kv_int8.py [--prompt-tokens 640] [--new-tokens 48] [--quick]

`--quick`: every path at its smallest (4 and 8 sequences of 32 tokens, 8 new ones), a smoke
run whose decode rates mean little (a difference of two short timings).
"""

from __future__ import annotations

import argparse
import time

import torch
from serve_harness import cpu_banner

CACHES = ("auto", "int8")
QUICK = {"prompt_tokens": 32, "new_tokens": 8, "num_seqs": [4, 8]}  # --quick's sizes


def kernel_ms(
    kv_cache_dtype: str, model_dtype: torch.dtype, seqs: int = 16, context: int = 1000, reps: int = 20
) -> float:
    """Milliseconds of one layer's native decode attention (SmolLM2's heads), queries in
    the model's dtype: an "auto" cache holds that dtype too (bf16 where `dtype=auto` chose
    it), an int8 one codes and scales."""
    from kvray.kernels import cpu_native
    from kvray.kernels.kv_quant import QUANTS, quantize, split_cache

    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    blocks_per_seq = -(-context // block)
    num_blocks = seqs * blocks_per_seq
    values = torch.randn(2, num_blocks, block, kv_heads, head_dim)
    scales = (None, None)
    if kv_cache_dtype == "auto":
        k, v = values[0].to(model_dtype), values[1].to(model_dtype)
    else:
        storage = torch.zeros(2, num_blocks, block, kv_heads, head_dim + 4, dtype=torch.int8)
        (k, ks), (v, vs) = (split_cache(storage[i], QUANTS[kv_cache_dtype]) for i in range(2))
        for codes, sc, x in ((k, ks, values[0]), (v, vs, values[1])):
            codes[:], sc[:] = quantize(x, QUANTS[kv_cache_dtype])
        scales = (ks, vs)
    q = torch.randn(seqs, heads, head_dim).to(model_dtype)
    out = torch.empty_like(q)
    tables = torch.randperm(num_blocks).view(seqs, blocks_per_seq).to(torch.int32).contiguous()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    rows = torch.arange(seqs)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        cpu_native.paged_decode(q, out, k, v, tables, lens, rows, 0.125, None, *scales)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def decode_rate(llm, prompts: list[list[int]], new_tokens: int) -> float:
    from kvray.engine import SamplingParams

    def timed(n: int) -> float:
        start = time.perf_counter()
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=n, ignore_eos=True)
        )
        return time.perf_counter() - start

    prefill = min(timed(1) for _ in range(2))
    total = timed(1 + new_tokens)
    return len(prompts) * new_tokens / (total - prefill)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=640)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--num-seqs", type=int, nargs="+", default=[16, 32], help="decode batch sizes")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quick", action="store_true", help=f"smallest sizes ({QUICK}; flags given win)")
    if ap.parse_known_args()[0].quick:
        ap.set_defaults(**QUICK)
    args = ap.parse_args()

    from kvray.engine import LLM

    print(cpu_banner())
    llms = {
        c: LLM(
            model=args.model,
            kv_cache_dtype=c,
            max_model_len=1024,
            enable_prefix_caching=False,
            max_num_batched_tokens=1024,
        )
        for c in CACHES
    }
    gib = 1 << 30
    print()
    print(
        "| cache | bytes / block | blocks per GiB | pull bytes / prompt token "
        "| kernel 16 x 1000 ctx (ms, a layer) |"
    )
    print("|---|---|---|---|---|")
    for c, llm in llms.items():
        runner, layout = llm.engine.runner, llm.engine.kv_layout
        name = f"{c} ({layout.cache_dtype})"
        per_token = layout.packed_bytes(1) / layout.block_size
        print(
            f"| {name} | {runner.bytes_per_block:,} | {gib // runner.bytes_per_block:,} | "
            f"{per_token:,.0f} | {kernel_ms(c, llm.engine.dtype):.2f} |",
            flush=True,
        )
    print()
    print(
        "| cache | " + " | ".join(f"decode tok/s, {n} x {args.prompt_tokens}" for n in args.num_seqs) + " |"
    )
    print("|---" * (1 + len(args.num_seqs)) + "|")
    gen = torch.Generator().manual_seed(0)
    vocab = llms["auto"].engine.hf_config.vocab_size
    prompts = [
        torch.randint(100, vocab, (args.prompt_tokens,), generator=gen).tolist()
        for _ in range(max(args.num_seqs))
    ]
    for c, llm in llms.items():
        rates = [decode_rate(llm, prompts[:n], args.new_tokens) for n in args.num_seqs]
        print(f"| {c} | " + " | ".join(f"{r:.1f}" for r in rates) + " |", flush=True)


if __name__ == "__main__":
    main()
