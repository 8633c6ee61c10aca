"""Single-stream decode against the weight-read limit (issue 14, item 4).

One request at a time: a decode step reads every weight once (30 layers' linears and the
LM head) plus the request's K/V, so its speed is bounded by memory bandwidth. This
measures, in one run:

- the machine's read bandwidth: sums over a buffer far larger than the caches (in
  huge-page memory, as the model's weights are), with torch's threads;
- the bytes one decode step reads (weights from the loaded model, K/V at the context
  length reached);
- kvray's single-stream decode rate (a 1+N token generation driven step by step, its
  decode steps timed, prefix caching off) and its fraction of the limit, in `--rounds`
  rounds. These VMs' read bandwidth moves on a scale of seconds (34 GB/s most of the
  time on the 2-core Zen 4, with bursts of a few seconds at ~65), so each
  round samples it between its decode steps, one sum every 16 steps, and its limit comes
  from the mean of those samples: the bandwidth the decode had, not a burst before or
  after it. Memory also read faster some 10-20 s after it was first touched, so the
  rounds start `--settle` seconds (30) after the model and the buffer were allocated: the
  state a running server is in;
- where a step's time goes (torch.profiler over decode steps at batch 1; the native CPU
  kernels, the fused decode layers among them, are timed by wall clock around their calls).

    .venv/bin/python benchmarks/single_stream.py [--prompt-tokens 256] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from serve_harness import cpu_banner

from kvray.models.cpu_linear import PANEL_ATTRS


def read_bandwidth(buffer: torch.Tensor, reps: int = 5) -> float:
    """Bytes per second of the best pass summing `buffer` (fp32, far larger than the caches)."""
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best


def step_bytes(llm, context: int) -> tuple[int, int]:
    """(weight bytes, K/V bytes) one decode step reads at `context` tokens: every layer's
    projections and norms, the final norm and the LM head (the embedding gives one row);
    quantized weights: their panels of codes and scales as built."""
    cfg = llm.engine.hf_config
    size = llm.engine.dtype.itemsize
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv_width = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    norms = (2 * cfg.num_hidden_layers + 1) * hidden * size
    if llm.engine.config.quantization is not None:
        model = llm.engine.runner.model
        weights = norms + sum(
            getattr(m, a).data.nbytes for m in model.modules() for a in PANEL_ATTRS if getattr(m, a, None)
        )
    else:
        per_layer = hidden * (q + 2 * kv_width) + q * hidden + 3 * hidden * inter
        weights = norms + (cfg.num_hidden_layers * per_layer + cfg.vocab_size * hidden) * size
    kv = 2 * cfg.num_hidden_layers * kv_width * context * size
    return weights, kv


def timed(llm, prompt: list[int], new_tokens: int) -> float:
    from kvray.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params)
    return time.perf_counter() - start


def interleaved_round(llm, buffer: torch.Tensor, prompt: list[int], new_tokens: int, every: int = 16):
    """(decode tok/s, read bandwidth at the same moments): one 1 + `new_tokens` generation
    driven step by step, its decode steps timed one by one, and one pass over `buffer`
    every `every` of them, between steps (not timed as decode). On these VMs the read
    bandwidth comes in bursts of a few seconds (34 -> 65 GB/s and back, BENCHMARKS.md), so a
    limit from sums before and after a decode can come from a burst the decode never saw."""
    from kvray.engine import SamplingParams

    engine = llm.engine
    request_id = f"round-{time.monotonic_ns()}"
    params = SamplingParams(temperature=0.0, max_tokens=1 + new_tokens, ignore_eos=True)
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    engine.step()  # the prompt, to its first token
    while engine.last_step.num_batched_tokens != 1:
        engine.step()
    decode, steps, samples = 0.0, 1, [read_bandwidth(buffer, reps=1)]  # that step was a decode step
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        decode += time.perf_counter() - start
        steps += 1
        if steps % every == 0:
            samples.append(read_bandwidth(buffer, reps=1))
    return (steps - 1) / decode, sum(samples) / len(samples)


def profile_steps(llm, prompt: list[int], new_tokens: int) -> dict[str, float]:
    """Seconds per decode step by part: linears, attention, other torch ops, the rest."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from kvray.engine import SamplingParams
    from kvray.kernels import cpu_fused, cpu_native

    wrapped = {}
    modules = {name: cpu_native for name in ("paged_decode", "rms_norm", "rotary_", "linear")}
    modules |= {name: cpu_fused for name in ("decode_layers", "decode_step")}
    for name, module in modules.items():
        real = wrapped[name] = getattr(module, name)

        def call(*a, _real=real, _name=name, **k):
            with record_function(f"native::{_name}"):
                return _real(*a, **k)

        setattr(module, name, call)
    engine = llm.engine
    engine.add_request(
        "p", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    )
    engine.step()  # the prompt (an earlier run's last step says nothing about this one)
    while engine.last_step.num_batched_tokens != 1:
        engine.step()  # the prompt's further chunks
    steps = 0
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    wall = time.perf_counter() - start
    for name, real in wrapped.items():
        setattr(modules[name], name, real)
    parts: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.key.startswith("native::decode_step"):
            parts["one call: embedding, every layer, final norm, LM head (native)"] += e.self_cpu_time_total
        elif e.key.startswith("native::decode_layers"):
            parts["every layer, fused (native: matmuls, attention)"] += e.self_cpu_time_total
        elif e.key.startswith("native::paged_decode"):
            parts["attention (native kernel)"] += e.self_cpu_time_total
        elif e.key.startswith("native::linear"):
            parts["weight matmuls (native panels)"] += e.self_cpu_time_total
        elif "linear" in e.key:
            parts["weight matmuls (oneDNN packed)"] += e.self_cpu_time_total
        elif e.key.startswith("native::"):
            parts["RMSNorm, RoPE (native)"] += e.self_cpu_time_total
        else:
            parts["other torch ops"] += e.self_cpu_time_total
    out = {k: v / 1e6 / steps for k, v in parts.items()}
    out["Python and the rest"] = wall / steps - sum(out.values())
    out["step (under the profiler)"] = wall / steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="decode runs, each between two bandwidth runs")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds to wait before measuring")
    parser.add_argument("--quantization", default=None, choices=["int8"], help="the engine's quantization=")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from kvray.engine import LLM
    from kvray.kernels.cpu_memory import huge_page_zeros
    from kvray.models.loader import resolve_model_path

    llm = LLM(
        model=str(resolve_model_path(args.model)),
        dtype="auto",
        max_model_len=2048,
        seed=0,
        enable_prefix_caching=False,
        quantization=args.quantization,
    )
    vocab = llm.engine.hf_config.vocab_size
    prompt = [(i * 7919) % (vocab - 100) + 50 for i in range(args.prompt_tokens)]
    timed(llm, prompt[:16], 8)  # warm up
    prefill = min(timed(llm, prompt, 1) for _ in range(3))
    weights, kv = step_bytes(llm, args.prompt_tokens + args.new_tokens // 2)
    # 256 MB (8x the L3) in huge-page memory, as the weights are (kvray.kernels.cpu_memory):
    # what the machine reads at its best, the limit not flattered by small pages' TLB misses
    buffer = huge_page_zeros(((1 << 28) // 4,), torch.float32).uniform_()
    time.sleep(args.settle)  # memory reads faster once the VM's host has settled its pages (docstring)
    rounds = [interleaved_round(llm, buffer, prompt, args.new_tokens) for _ in range(args.rounds)]
    del buffer

    print(
        cpu_banner(),
        f"{args.threads} threads; dtype auto -> {str(llm.engine.dtype).removeprefix('torch.')}; "
        f"quantization={args.quantization}",
    )
    print(
        f"a decode step reads {weights / 1e6:.0f} MB of weights + {kv / 1e6:.1f} MB of K/V "
        f"(mid-run context); prefill of {args.prompt_tokens} tokens {prefill:.2f} s "
        f"({args.prompt_tokens / prefill:.0f} tok/s)"
    )
    print()
    print(
        f"| round | read bandwidth (a sum over 256 MB every 16 decode steps, {args.threads} threads; mean) "
        "| single-stream decode | weight-read limit (bandwidth ÷ bytes a step) | of the limit |"
    )
    print("|---|---|---|---|---|")
    fractions = []
    for i, (rate, bandwidth) in enumerate(rounds, 1):
        limit = bandwidth / (weights + kv)
        fractions.append(rate / limit)
        print(
            f"| {i} | {bandwidth / 1e9:.1f} GB/s | **{rate:.1f} tok/s** ({1e3 / rate:.1f} ms a token) "
            f"| {limit:.1f} tok/s | **{rate / limit:.0%}** |"
        )
    print()
    print(f"of the limit, median of {len(rounds)} rounds: **{sorted(fractions)[len(fractions) // 2]:.0%}**")
    print()
    print("where a decode step's time goes (torch.profiler, batch 1):")
    print()
    print("| part | ms a step |")
    print("|---|---|")
    for part, seconds in profile_steps(llm, prompt, args.new_tokens).items():
        print(f"| {part} | {seconds * 1e3:.1f} |")


if __name__ == "__main__":
    main()
