"""GPU check: are the Triton paged-attention kernels exact and near the bandwidth limit?

One command, no network, under 8 minutes on an H200; needs only torch, triton,
transformers and numpy (kvray installed with `pip install --no-deps -e .`):

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu_check.md] [--cpu-smoke]

Sections, each a markdown table printed and written to --out (sizes: gpu_check_plan.py;
(a)-(c): gpu_check_kernels.py; (d): here):
  (a) kernel correctness, bf16 and fp16, against a float64 reference (paged_batch.py);
  (b) decode attention, batch {1, 16, 64} x context {1K, 4K, 16K}, Llama-3-8B attention
      shape (32 q heads, 8 KV heads, head dim 128), block 16, bf16: median time, KV bytes
      read, GB/s, fraction of the copy bandwidth measured in this run (read + write bytes
      of a large device-to-device copy), and time against torch SDPA on the same data
      laid out contiguously (decode has no mask, so the GQA group folds into q's length);
  (c) a 4K-token prefill chunk, same shape: TFLOP/s against SDPA (K/V expanded to 32 heads);
  (d) engine decode tokens/s, random-weight Llama-shaped 1B at batch 64, bf16, against
      transformers' generate on a model of the same shape.
Times are medians of CUDA events, the L2 cache flushed before every repetition. Targets
(batch 64 x 4K decode): >= 70% of copy bandwidth and <= 1.2x contiguous SDPA time.
Exit status 1 if a correctness check fails, a timed kernel's output differs from SDPA's, or
a section crashes (the other sections still run); a missed speed target is reported, not
an error.

Without a GPU it says so and exits 0. `--cpu-smoke` runs the same code paths on tiny shapes
on the CPU under the Triton interpreter (fp32/fp16: the interpreter's bf16 arithmetic is
wrong), timed with perf_counter; its numbers mean nothing, it proves the script runs.
kvray's kernel modules are imported inside the sections, after TRITON_INTERPRET is set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_check_grouped import bench_grouped_linear
from gpu_check_kernels import bench_decode, bench_prefill, bench_quantized_decode, check_correctness
from gpu_check_plan import GPU_PLAN, SMOKE_PLAN, Plan, Timer, table


def bench_engine(plan: Plan, timer: Timer, steps: list[dict], quantization: str | None = None) -> list[str]:
    """(d) Steady-state decode steps of the whole engine, and transformers' generate.
    Each engine step's batch and seconds go to `steps` (kvray.sim's StepSample shape: what
    `kvray bench step-times --from-gpu` fits the GPU's step-time model to). `quantization`
    ("int4": the linears' grouped codes through the Triton kernels, models/triton_linear.py)
    runs the same steps beside transformers' unquantized model."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvray.engine import EngineConfig, LLMEngine, SamplingParams

    cfg = LlamaConfig(**plan.model)
    cfg.architectures = ["LlamaForCausalLM"]
    batch, prompt_len, num_steps = plan.engine_batch, plan.prompt_len, plan.decode_steps
    dtype_name = str(plan.bench_dtype)[6:]
    config = EngineConfig(
        model="random-llama",
        dtype=dtype_name,
        device=plan.device.type,
        attention_backend="triton",
        max_num_seqs=batch,
        max_num_batched_tokens=batch * prompt_len,
        enable_prefix_caching=False,
        max_model_len=prompt_len + 3 * num_steps + 8,
        kv_cache_memory_bytes=plan.engine_kv_bytes,
        quantization=quantization,
        quantization_group_size=128 if quantization == "int4" else 32,
    )
    engine = LLMEngine(config, hf_config=cfg)
    with torch.no_grad():  # a plain init, whatever the engine leaves in fresh parameters
        for p in engine.runner.model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen)
    params = SamplingParams(temperature=0.0, max_tokens=3 * num_steps, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": prompts[i].tolist()}, params)

    def timed_step(engine: LLMEngine) -> None:
        shape = [(r.num_tokens - r.num_computed_tokens, r.num_tokens, True) for r in engine.scheduler.running]
        shape += [(r.num_tokens, r.num_tokens, True) for r in engine.scheduler.waiting]
        timer.sync()
        start = time.perf_counter()
        engine.step()
        timer.sync()
        steps.append({"batch": shape, "seconds": time.perf_counter() - start})

    engine.step()  # every prompt in one prefill step (the first call: not a sample)
    for _ in range(max(plan.warmup, 1)):
        engine.step()
    timer.sync()
    t0 = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
        assert engine.last_step.num_batched_tokens == batch, "a timed step was not pure decode"
    timer.sync()
    kvray_tps = batch * num_steps / (time.perf_counter() - t0)
    for _ in range(min(num_steps, 16)):  # then one at a time, synchronised, for the fit
        timed_step(engine)
    for i in range(batch):  # and prompt steps: 1, half and all of the batch's prompts at once
        engine.abort_request([str(i)])
    for n in sorted({1, max(batch // 2, 1), batch}):
        for i in range(n):
            engine.add_request(f"p{n}-{i}", {"prompt_token_ids": prompts[i].tolist()}, params)
        timed_step(engine)
        engine.abort_request([f"p{n}-{i}" for i in range(n)])
    del engine
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()

    with torch.device(plan.device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=plan.bench_dtype).eval()
    ids = prompts.to(plan.device)

    def hf_generate(new_tokens: int) -> None:
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        timer.sync()

    hf_generate(2)
    t_first = time.perf_counter()
    hf_generate(1)
    t_all = time.perf_counter()
    hf_generate(num_steps + 1)
    t_end = time.perf_counter()
    hf_tps = batch * num_steps / max((t_end - t_all) - (t_all - t_first), 1e-9)
    header = ["model", "batch", "prompt", "dtype", "kvray decode tok/s", "transformers decode tok/s", "ratio"]
    shape = f"Llama {cfg.num_hidden_layers}L h{cfg.hidden_size} (random)"
    dtype_name += f", {quantization}/128 weights" if quantization else ""
    return table(
        header,
        [
            [
                shape,
                batch,
                prompt_len,
                dtype_name,
                f"{kvray_tps:.0f}",
                f"{hf_tps:.0f}",
                f"{kvray_tps / hf_tps:.2f}",
            ]
        ],
    )


def run(plan: Plan, smoke: bool, steps_path: Path | None = None) -> tuple[list[str], bool]:
    """Every section in order; a crash is recorded in the report and the next one runs.
    The engine's step times go to `steps_path` (JSON) when given."""
    timer = Timer(plan.device, plan.warmup, plan.reps)
    if plan.device.type == "cuda":
        where = torch.cuda.get_device_name(plan.device)
    else:
        where = f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"
    import triton  # after main() has set TRITON_INTERPRET (or not)

    report = [
        f"# kvray GPU check{' (CPU smoke: tiny shapes, timings meaningless)' if smoke else ''}",
        "",
        f"{where}; torch {torch.__version__}, triton {triton.__version__}; {time.strftime('%Y-%m-%d %H:%M')}",
        "",
    ]
    print("\n".join(report), flush=True)
    ok = True
    verdict: list[str] = []

    def section(title: str, fn: Callable[[], list[str]]) -> None:
        nonlocal ok
        t0 = time.perf_counter()
        try:
            lines = fn()
        except Exception:
            ok = False
            lines = ["**crashed:**", "", "```", *traceback.format_exc().splitlines()[-12:], "```"]
        lines = [f"## {title}", "", *lines, "", f"_{time.perf_counter() - t0:.1f} s_", ""]
        print("\n".join(lines), flush=True)
        report.extend(lines)

    def correctness() -> list[str]:
        nonlocal ok
        lines, passed = check_correctness(plan)
        ok &= passed
        return lines

    def decode() -> list[str]:
        nonlocal ok
        lines, judged, matched = bench_decode(plan, timer)
        verdict.extend(judged)
        ok &= matched
        return lines

    def prefill() -> list[str]:
        nonlocal ok
        lines, matched = bench_prefill(plan, timer)
        ok &= matched
        return lines

    def quantized() -> list[str]:
        nonlocal ok
        lines, passed = bench_quantized_decode(plan, timer)
        ok &= passed
        return lines

    def grouped() -> list[str]:
        nonlocal ok
        lines, passed = bench_grouped_linear(plan, timer)
        ok &= passed
        return lines

    heads = "{} q heads, {} KV heads, head dim {}".format(*plan.heads)
    dtype = str(plan.bench_dtype)[6:]
    section("Kernel correctness vs float64", correctness)
    section(f"Decode attention ({heads}, block 16, {dtype})", decode)
    section(f"Prefill chunk attention ({heads}, {dtype})", prefill)
    section("Decode attention over 8-bit KV caches", quantized)
    section("Grouped low-bit weights (GGUF layouts) against cuBLAS bf16", grouped)
    steps: list[dict] = []
    section("Engine decode throughput", lambda: bench_engine(plan, timer, steps))
    if plan.device.type == "cuda":  # the CPU's smoke run takes int4 on its native kernels
        section(
            "Engine decode throughput, int4 weights on Triton", lambda: bench_engine(plan, timer, [], "int4")
        )
    if steps and steps_path is not None:
        dtype_bytes = torch.tensor([], dtype=plan.bench_dtype).element_size()
        body = {"device": where, "dtype_bytes": dtype_bytes, "hf_config": plan.model, "samples": steps}
        steps_path.parent.mkdir(parents=True, exist_ok=True)
        steps_path.write_text(json.dumps(body))
        report += [f"Engine step times for kvray.sim: {steps_path.name} ({len(steps)} steps)", ""]
    verdict = verdict or ["- not measured: the decode section did not finish"]
    report += ["## Targets" + (" (smoke: not judged)" if smoke else ""), "", *verdict, ""]
    print("\n".join(report[-len(verdict) - 3 :]))
    return report, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_check.md")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter"
    )
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kvray kernel module is imported
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        plan = SMOKE_PLAN
    elif torch.cuda.is_available():
        plan = GPU_PLAN
    else:
        print(
            "No CUDA GPU here: nothing to check. `--cpu-smoke` runs the same code paths on tiny "
            "shapes under the Triton interpreter."
        )
        return 0
    report, ok = run(plan, args.cpu_smoke, args.out.with_name("gpu_step_times.json"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(report))
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
