"""Tensor parallelism on this machine: what a tp=2 group costs per step, and what it buys.

1. Per-step overhead on a tiny random Llama (4 layers, hidden 256), where compute is
   negligible: one process (tp=1) against a tp=2 group of Ray shard actors, the time of
   one decode step of a batch of 8, from the slope between two generation lengths (so
   start-up, prefill and the one Ray call per batch cancel out).
2. Where that overhead goes: the collectives a tp=2 step makes, timed alone between two
   gloo processes — the step plan's broadcast, the all-reduces (2 per layer + the
   embedding) and the logits' all-gather — for the tiny model and for SmolLM2.
3. SmolLM2-135M (fp32) decode tokens/s at tp=1 and tp=2, batch 16, same slope method.

    python benchmarks/tensor_parallel.py [--skip-smollm2] [--quick]

`--quick`: every part at its smallest (lengths 4 and 12, 20 timings of each collective,
SmolLM2 at batch 4), a smoke run whose numbers mean little: a slope between two short
runs can come out negative on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvray.engine import LLM, SamplingParams
from kvray.engine.model_runner import StepPlan
from kvray.engine.sampler import SampleRow
from kvray.models.parallel import ShardContext, ShardSpec

TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=4096,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, vocab_size=49152)


@dataclass(frozen=True)
class Sizes:
    """How much each part runs: the slope's two generation lengths, the timings of each
    collective, SmolLM2's batch."""

    short: int = 16
    long: int = 80
    collective_reps: int = 200
    smollm2_batch: int = 16
    smollm2_short: int = 16
    smollm2_long: int = 48


QUICK = Sizes(short=4, long=12, collective_reps=20, smollm2_batch=4, smollm2_short=4, smollm2_long=12)


def save_tiny_model(folder: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder)


def decode_step_seconds(llm: LLM, batch: int, prompt_len: int, short: int, long: int) -> float:
    """Seconds per decode step of `batch` sequences: the slope between two lengths."""
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(prompt_len)]} for i in range(batch)
    ]

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - t

    run(4)  # warm-up
    best = {n: min(run(n) for _ in range(2)) for n in (short, long)}
    return (best[long] - best[short]) / (long - short)


def engine_steps(model: str, tp: int, batch: int, prompt_len: int, short: int, long: int, **kw) -> float:
    with LLM(model=model, dtype="float32", max_model_len=512, tensor_parallel_size=tp, **kw) as llm:
        return decode_step_seconds(llm, batch, prompt_len, short, long)


# ---- the collectives alone, between two gloo processes -------------------------------


def _collectives(rank: int, port: int, shape: dict, batch: int, reps: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    plan = StepPlan(
        input_ids=list(range(batch)),
        positions=[100] * batch,
        slot_mapping=list(range(batch)),
        query_lens=[1] * batch,
        seq_lens=[101] * batch,
        block_tables=[list(range(7))] * batch,
        logit_rows=list(range(batch)),
        samples=[SampleRow(str(i), SamplingParams(temperature=0.0), 0, 10, [], []) for i in range(batch)],
        forget=[],
    )
    x = torch.randn(batch, hidden)
    logits = torch.randn(batch, vocab // 2)
    shard = ShardContext(ShardSpec(2, 1, rank), dist.group.WORLD, dist.group.WORLD, p2p_collectives=True)

    def timed(fn) -> float:
        for _ in range(5):
            fn()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps

    box = [plan if rank == 0 else None]
    results = {
        "plan broadcast": timed(lambda: dist.broadcast_object_list(box, src=0)),
        "all-reduce": timed(lambda: shard.all_reduce(x)),
        "logits all-gather": timed(lambda: shard.all_gather_last(logits, logits.shape[-1])),
        "gloo all_reduce": timed(lambda: dist.all_reduce(x)),
    }
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def collective_costs(shape: dict, batch: int = 8, reps: int = 200) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_collectives, args=(r, port, shape, batch, reps, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join()
    return result


def overhead_table(name: str, shape: dict, costs: dict[str, float]) -> float:
    n_reduce = 2 * shape["num_hidden_layers"] + 1
    rows = [
        ("plan broadcast", 1, costs["plan broadcast"]),
        ("all-reduce [8, hidden] (p2p exchange)", n_reduce, costs["all-reduce"]),
        ("logits all-gather", 1, costs["logits all-gather"]),
    ]
    total = sum(n * t for _, n, t in rows)
    print(f"\n{name}: collectives of one tp=2 decode step (batch 8), timed alone")
    print("| collective | per step | µs each | ms per step |\n|---|---|---|---|")
    for label, n, t in rows:
        print(f"| {label} | {n} | {t * 1e6:.0f} | {n * t * 1e3:.2f} |")
    print(f"| **total** | | | **{total * 1e3:.2f}** |")
    gloo = costs["gloo all_reduce"]
    print(
        f"(gloo's own all_reduce, not used on CPU: {gloo * 1e6:.0f} µs each, "
        f"{n_reduce * gloo * 1e3:.1f} ms per step)"
    )
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument("--quick", action="store_true", help=f"smallest sizes ({QUICK})")
    args = parser.parse_args()
    sizes = QUICK if args.quick else Sizes()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    machine = platform.processor() or platform.machine()
    print(f"machine: {machine}, {os.cpu_count()} cores, torch {torch.__version__}")

    with tempfile.TemporaryDirectory(prefix="kvray-tiny-") as tiny:
        save_tiny_model(tiny)
        single = engine_steps(tiny, 1, batch=8, prompt_len=16, short=sizes.short, long=sizes.long)
        group = engine_steps(tiny, 2, batch=8, prompt_len=16, short=sizes.short, long=sizes.long)
    print("\nTiny Llama (4 layers, hidden 256, fp32): one decode step of batch 8")
    print("| engine | ms per step |\n|---|---|")
    print(f"| one process (tp=1) | {single * 1e3:.2f} |")
    print(f"| tp=2 group (2 Ray shard actors, gloo) | {group * 1e3:.2f} |")
    print(f"overhead of the group: {(group - single) * 1e3:.2f} ms per step")
    overhead_table("Tiny Llama", TINY, collective_costs(TINY, reps=sizes.collective_reps))
    overhead_table("SmolLM2-135M", SMOLLM2, collective_costs(SMOLLM2, reps=sizes.collective_reps))

    if not args.skip_smollm2:
        batch = sizes.smollm2_batch
        rates = {}
        for tp in (1, 2):
            step = engine_steps(
                "smollm2-135m-instruct",
                tp,
                batch=batch,
                prompt_len=64,
                short=sizes.smollm2_short,
                long=sizes.smollm2_long,
            )
            rates[tp] = batch / step
        print(f"\nSmolLM2-135M (fp32), decode of batch {batch}")
        print("| tensor_parallel_size | decode tok/s |\n|---|---|")
        for tp, rate in rates.items():
            print(f"| {tp} | {rate:.1f} |")
        print(f"ratio tp=2 / tp=1: {rates[2] / rates[1]:.2f}x")


if __name__ == "__main__":
    main()
