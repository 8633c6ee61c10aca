"""Two builds of the native CPU kernels on the same fused decode step, alternated in one process.

On a shared VM the machine's speed drifts by 10-30 % between runs, more than most kernel
changes gain, so timing one build, then the other, says little. Here both builds' libraries
are loaded side by side and one captured decode step (SmolLM2, `--dtype`, default `auto`, `--rows`
sequences of `--context` tokens, every layer in one kvray_decode_layers_* call) is replayed
on each in turn, ABBA, so the drift hits both alike:

    python benchmarks/kernel_ab.py --b /path/to/other/kernels [--a kernels] [--rows 32]

`--a`/`--b`: folders holding the kernel sources (kernels/cpu_*.c and .h; a copy of the
folder with one change, a worktree's, ...). Each is compiled as kvray.kernels.cpu_build
compiles the product's; the captured step's tensors (the model's weights and KV caches, the
step's inputs) and its DecodeLayer / DecodeShape structs come from this checkout, so both
builds must lay those structs out as this checkout's cpu_layer.c does. Prints min / p25 /
median ms of each build.

    python benchmarks/kernel_ab.py --phases [--a kernels] [--rows 16]

`--phases` (no `--b`): build A once more with `-DKVRAY_PHASE_TIMES` and print where the
step's time goes, phase by phase (norm, qkv, RoPE, attention, ..., summed over the layers;
thread 0's clock, so a phase's time includes waiting for the other threads' share of it).

`--quick` (with either): the smallest step (4 rows of 32 tokens, 6 replays), a smoke run.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from serve_harness import cpu_banner

from kvray.engine import LLM, SamplingParams
from kvray.kernels import cpu_build, cpu_fused

PHASES = (
    "norm",
    "qkv",
    "RoPE + cache write",
    "attention",
    "attention merge",
    "o",
    "norm 2",
    "gate/up",
    "SiLU x up",
    "down",
)
QUICK = {"rows": 4, "context": 32, "reps": 6}  # --quick's sizes


def build(folder: Path, out: Path, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    sources = [str(folder / s.name) for s in cpu_build.SOURCES]
    compiler = os.environ.get("CC") or shutil.which("cc") or "gcc"  # as cpu_build picks it
    flags = [*cpu_build.FLAGS, *(f"-D{d}" for d in defines)]
    subprocess.run([compiler, *flags, *sources, "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def capture_step(rows: int, context: int, dtype: str = "auto", model: str = "smollm2-135m-instruct") -> tuple:
    """The arguments of one fused decode step of `rows` sequences (`context` tokens each)."""
    llm = LLM(
        model=model,
        dtype=dtype,
        max_model_len=context + 64,
        max_num_seqs=rows,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    prompts = [{"prompt_token_ids": list(range(100 + i, 100 + i + context))} for i in range(rows)]
    captured = []
    real = cpu_fused.decode_layers

    def grab(layers, shape, x, *tensors):
        if x.shape[0] == rows and not captured:
            captured.extend([layers, shape, x.clone(), *(t.clone() for t in tensors)])
        return real(layers, shape, x, *tensors)

    cpu_fused.decode_layers = grab
    runner = llm.engine.runner
    runner._native_decode_step = lambda plan: None  # the modules' path: its fused call takes tensors
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    finally:
        cpu_fused.decode_layers = real
        del runner._native_decode_step
    if not captured:
        raise SystemExit(f"no fused decode step of {rows} rows ran (too many rows for the fused layers?)")
    return llm, captured  # the engine holds the weights and caches the captured pointers name


def replay(lib: ctypes.CDLL, step: list, threads: int) -> float:
    layers, shape, x0, cos, sin, slots, tables, lens, rows = step
    fn = getattr(lib, "kvray_decode_layers_" + ("bf16" if x0.dtype == torch.bfloat16 else "f32"))
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    fn.restype, fn.argtypes = None, [ptr, i32, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, i32, i32]
    x = x0.clone()
    start = time.perf_counter()
    fn(
        ctypes.addressof(layers), len(layers), ctypes.addressof(shape), x.data_ptr(), x.shape[0],
        cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), rows.data_ptr(), len(rows), threads,
    )  # fmt: skip
    return time.perf_counter() - start


def main() -> None:
    here = Path(__file__).resolve().parent.parent / "kernels"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, default=here, help="kernel sources A (default: this checkout's)")
    parser.add_argument("--b", type=Path, help="kernel sources B (or --phases)")
    parser.add_argument("--phases", action="store_true", help="time each phase of build A's step instead")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--reps", type=int, default=120)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto, float32, bfloat16)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quick", action="store_true", help=f"smallest sizes ({QUICK}; flags given win)")
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    if (args.b is None) == (not args.phases):
        parser.error("give --b (an A/B of two builds) or --phases (one build, phase by phase)")
    torch.set_num_threads(args.threads)
    if args.phases:
        phases(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(folder, Path(tmp) / f"{name}.so") for name, folder in (("a", args.a), ("b", args.b))]
        _llm, step = capture_step(args.rows, args.context, args.dtype, args.model)
        times: list[list[float]] = [[], []]
        for rep in range(args.reps):
            for which in (0, 1) if rep % 2 else (1, 0):
                times[which].append(replay(libs[which], step, args.threads))
    print(cpu_banner())
    shape = f"{args.rows} rows x {args.context} context, {step[2].dtype}"
    print(f"a fused decode step: {shape}, {args.reps} times each build, ABBA")
    print("\n| build | min ms | p25 ms | median ms |\n|---|---|---|---|")
    for name, folder, t in zip("ab", (args.a, args.b), times):
        ms = [x * 1e3 for x in sorted(t)]
        print(f"| {name}: {folder} | {ms[0]:.2f} | {ms[len(ms) // 4]:.2f} | {ms[len(ms) // 2]:.2f} |")


def phases(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(args.a, Path(tmp) / "phases.so", ("KVRAY_PHASE_TIMES",))
        _llm, step = capture_step(args.rows, args.context, args.dtype, args.model)
        for _ in range(10):  # warm up
            replay(lib, step, args.threads)
        sums = (ctypes.c_double * len(PHASES)).in_dll(lib, "kvray_phase_seconds")
        for i in range(len(PHASES)):
            sums[i] = 0.0
        total = sum(replay(lib, step, args.threads) for _ in range(args.reps))
    print(cpu_banner())
    print(
        f"a fused decode step: {args.rows} rows x {args.context} context, {step[2].dtype}, {args.reps} times"
    )
    print("\n| phase | ms a step | share |\n|---|---|---|")
    print(f"| the whole step | {1e3 * total / args.reps:.2f} | |")
    for name, seconds in zip(PHASES, sums):
        print(f"| {name} | {1e3 * seconds / args.reps:.2f} | {100 * seconds / total:.0f} % |")


if __name__ == "__main__":
    main()
