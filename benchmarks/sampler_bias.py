"""The sampler's per-request work in a step: logit_bias, allowed_token_ids and the tokens
suppressed before min_tokens, for a batch where every row asks for them.

kvray applies each kind in one indexed op for the whole batch (`Sampler._apply_logit_bias`);
the baseline is the loop it replaced, run in the same process on the same logits: one
indexing op per bias entry per row (what kvray did until issue 48), so a request with
OpenAI's maximum of 300 biases cost 300 small ops in every step of every request batched
with it. Both must give the same logits (checked).

    python benchmarks/sampler_bias.py [--rows 32] [--entries 300] [--vocab 49152] [--repeat 50]
"""

from __future__ import annotations

import argparse
import time

import torch
from serve_harness import cpu_banner

from kvray.engine.sampler import Sampler, SampleRow
from kvray.engine.sampling_params import SamplingParams


def row_by_row(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The replaced loop: each bias entry, then each row's suppressed tokens, one op each."""
    logits = logits.clone()
    for i, r in enumerate(rows):
        for token, bias in (r.sampling_params.logit_bias or {}).items():
            logits[i, token] += bias
        if r.suppressed_token_ids:
            logits[i, r.suppressed_token_ids] = float("-inf")
    return logits


def timed(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--entries", type=int, default=300)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=gen)
    rows = []
    for i in range(args.rows):
        ids = torch.randperm(args.vocab, generator=gen)[: args.entries].tolist()
        bias = {t: float((t % 200) - 100) for t in ids}
        row = SampleRow(f"r{i}", SamplingParams(temperature=0.0, logit_bias=bias), 0, 0, [], [])
        row.suppressed_token_ids = [0, 1, 2]  # EOS and stop tokens before min_tokens
        rows.append(row)
    sampler = Sampler(args.vocab)
    assert torch.equal(sampler.process(logits, rows), row_by_row(logits, rows))
    ours = timed(lambda: sampler.process(logits, rows), args.repeat)
    base = timed(lambda: row_by_row(logits, rows), args.repeat)
    print(cpu_banner())
    print(f"{args.rows} rows x {args.entries} logit_bias entries (+3 suppressed), vocab {args.vocab}")
    print("| | ms per step |\n|---|---|")
    print(f"| row by row (before) | {base * 1e3:.2f} |")
    print(f"| one op per kind (kvray) | {ours * 1e3:.2f} |")
    print(f"speed-up: {base / ours:.1f}x")


if __name__ == "__main__":
    main()
