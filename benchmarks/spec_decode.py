"""N-gram speculative decoding against plain decoding (issue 15's benchmark).

Two workloads of chat prompts, greedy, run without and with n-gram speculation on the
same engine settings, one request at a time (single stream) and four at a time (batch 4):

- grounded: the answer repeats spans of the prompt (copy a passage, extract from a
  text, edit a piece of code) — what prompt lookup is for;
- open: open-ended chat, where the prompt has little to look up.

Prints tok/s (output tokens over wall time, prefills included), decode tok/s (the tokens
after each request's first over its time from first token to last: what speculation
speeds up; a prefill is the same work in both engines), the speed-ups, the drafts'
acceptance rate, and whether the greedy tokens were identical (they must be). The two
engines run a batch at a time in turn (ABBA), `--repeats` times over: a VM's speed drifts
by 10-30 % over a minute, and a plain run followed by a speculative one measured the drift.

    .venv/bin/python benchmarks/spec_decode.py [--k 8] [--lookup-min 2] [--max-tokens 160]
    .venv/bin/python benchmarks/spec_decode.py --model qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct      (a draft model's speculation beside n-gram)

`--quick`: every path at its smallest (2 prompts a workload, 24 tokens, one repeat), a
smoke run whose speed-ups mean little.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from serve_harness import cpu_banner

QUICK = {"num_prompts": 2, "max_tokens": 24, "repeats": 1, "batches": [1, 2]}  # --quick's sizes

PASSAGE = (
    "The lighthouse stood on a spit of black rock at the mouth of the bay. Every night for "
    "ninety years its lamp had turned, four flashes and a pause, and every fishing boat "
    "that came home in the dark steered by it. When the council voted to replace it with "
    "an automatic beacon, the keeper asked only to stay until the last of the old boats "
    "had been sold."
)
CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
"""
RECORD = (
    "Invoice 4471 was issued on 12 March 2024 by Northwind Traders, 18 Harbour Road, "
    "Leith, to Contoso Ltd for 40 crates of green tea at 12.50 per crate, total 500.00, "
    "payable within 30 days to account GB29 NWBK 6016 1331 9268 19."
)
GROUNDED = [
    f"Copy the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this Python code with type hints on every function. Change nothing else.\n\n{CODE}",
    f"Rename the function `mean` to `average` everywhere in this code and show the full code.\n\n{CODE}",
    f"From this record, list the invoice number, date, seller, buyer, item, quantity, "
    f"unit price, total and account, one per line as 'field: value'.\n\n{RECORD}",
    f"Repeat the passage below, then give it a title.\n\n{PASSAGE}",
    f"Copy this record exactly, then say who must pay whom.\n\n{RECORD}",
    f"Add a docstring to each function of this code and show the full code.\n\n{CODE}",
    f"Quote the second and third sentences of this passage exactly.\n\n{PASSAGE}",
]
OPEN = [
    "Write a short poem about the sea at night.",
    "What are three good habits for learning to cook?",
    "Explain why the sky is blue to a ten-year-old.",
    "Suggest a name and a one-line plot for a mystery novel.",
    "What should I pack for a weekend hiking trip?",
    "Describe your ideal small garden.",
    "Give me two tips for writing clear emails.",
    "Why do cats like boxes?",
]


def chat_ids(tokenizer, text: str) -> dict:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return {"prompt_token_ids": tokenizer(prompt, add_special_tokens=False).input_ids}


def run(llm, prompts: list[dict], params, batch: int) -> tuple[float, int, list[list[int]], float]:
    """(seconds, output tokens, tokens per prompt, decode seconds) running `batch` prompts
    at a time; decode seconds sum each request's time from its first token to its last."""
    tokens, decode, start = [], 0.0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i : i + batch], params)
        tokens += [o.outputs[0].token_ids for o in outs]
        decode += sum(o.metrics.decode_time for o in outs)
    return time.perf_counter() - start, sum(map(len, tokens)), tokens, decode


@dataclass
class Totals:
    """One engine's sums over a workload's runs."""

    seconds: float = 0.0
    tokens: int = 0  # output tokens
    decode_seconds: float = 0.0  # each request's first token to its last
    first_pass: list[list[int]] = field(default_factory=list)  # tokens per prompt, first repeat


def run_engines(engines: list, prompts: list[dict], params, batch: int, repeats: int) -> list[Totals]:
    """`run` of every engine, interleaved a batch at a time (the order rotating, ABBA for
    two) so that a VM's drifting speed hits them alike."""
    totals = [Totals() for _ in engines]
    for r in range(repeats):
        for i in range(0, len(prompts), batch):
            order = list(range(len(engines)))
            if (r + i // batch) % 2:
                order.reverse()
            for which in order:
                s, n, toks, decode = run(engines[which], prompts[i : i + batch], params, batch)
                t = totals[which]
                t.seconds, t.tokens, t.decode_seconds = t.seconds + s, t.tokens + n, t.decode_seconds + decode
                if r == 0:
                    t.first_pass += toks
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the target model")
    ap.add_argument("--draft", default=None, help="also a draft model's speculation (e.g. an alias)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens (n-gram)")
    ap.add_argument("--draft-k", type=int, default=4, help="num_speculative_tokens (draft model)")
    # 1: on the AVX-512 machines (Zen 5, bf16) a verification row costs little beside a
    # step, so more, shorter drafts pay (BENCHMARKS.md); the engine's default stays 2
    ap.add_argument("--lookup-min", type=int, default=1, help="prompt_lookup_min")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each workload, interleaved")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--workloads", nargs="+", default=["grounded", "open"])
    ap.add_argument("--no-ngram", action="store_true", help="plain and the draft model only (less memory)")
    ap.add_argument("--num-prompts", type=int, default=None, help="the first N prompts of each workload")
    ap.add_argument("--quick", action="store_true", help=f"smallest sizes ({QUICK}; flags given win)")
    if ap.parse_known_args()[0].quick:
        ap.set_defaults(**QUICK)
    args = ap.parse_args()

    from kvray.engine import LLM, SamplingParams

    ngram_spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": args.lookup_min,
    }
    common = dict(model=args.model, dtype=args.dtype, max_model_len=1024, enable_prefix_caching=False)
    engines = {"plain": LLM(**common)}
    if not args.no_ngram:
        engines["n-gram"] = LLM(speculative_config=ngram_spec, **common)
    if args.draft:
        draft_spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.draft_k}
        engines["draft"] = LLM(speculative_config=draft_spec, **common)
    plain = engines["plain"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    workloads = {"grounded": GROUNDED, "open": OPEN}
    print(cpu_banner())
    print(
        f"model {plain.engine.config.model}, dtype {plain.engine.dtype}, n-gram k={args.k}"
        + (f", draft {args.draft} k={args.draft_k}" if args.draft else "")
        + ", greedy"
    )
    print()
    print(
        "| workload | batch | method | tok/s | speed-up | decode tok/s | decode speed-up "
        "| acceptance | drafts kept per step | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    warm = [chat_ids(plain.tokenizer, "Hello")]
    for llm in engines.values():
        run(llm, warm, params, 1)
    for name in args.workloads:
        prompts = [chat_ids(plain.tokenizer, t) for t in workloads[name][: args.num_prompts]]
        for batch in args.batches:
            before = {k: _spec_counts(llm) for k, llm in engines.items()}
            totals = dict(
                zip(engines, run_engines(list(engines.values()), prompts, params, batch, args.repeats))
            )
            later = len(prompts) * args.repeats  # decode: tokens after each request's first
            base = totals["plain"]
            base_tps, base_dec = base.tokens / base.seconds, (base.tokens - later) / base.decode_seconds
            for method, t in totals.items():
                tps, dec = t.tokens / t.seconds, (t.tokens - later) / t.decode_seconds
                drafts, proposed, kept = (
                    a - b for a, b in zip(_spec_counts(engines[method]), before[method])
                )
                spec_cols = (
                    f"{kept / max(proposed, 1):.0%} | {kept / max(drafts, 1):.2f}"
                    if method != "plain"
                    else "- | -"
                )
                print(
                    f"| {name} | {batch} | {method} | {tps:.1f} | {tps / base_tps:.2f}x | {dec:.1f} | "
                    f"{dec / base_dec:.2f}x | {spec_cols} | {t.first_pass == base.first_pass} |",
                    flush=True,
                )


def _spec_counts(llm) -> tuple[int, int, int]:
    stats = llm.engine.spec_stats
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


if __name__ == "__main__":
    main()
