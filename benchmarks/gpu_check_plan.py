"""What the GPU check measures, and how: its sizes (GPU and CPU smoke), timer and tables.

The GPU and CPU-smoke runs share every code path and differ only in the `Plan` they get.
The smoke plan keeps each Triton launch to a few programs (interpreted, a 64-program
launch takes about a second) yet still takes both decode paths: a 640-key context at batch <= 2
is split (see kvray.kernels.triton_decode_split.choose_num_splits).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Case:
    """One correctness check: a batch shape, a window, and which decode path to force."""

    name: str
    q_lens: list[int]
    seq_lens: list[int]
    num_kv_heads: int
    group: int
    head_dim: int
    block_size: int = 16
    window: int | None = None
    force_split: bool | None = None  # None: the launcher's rule


@dataclass(frozen=True)
class Plan:
    """Every size the check uses; GPU and CPU-smoke differ only here."""

    device: torch.device
    check_dtypes: tuple[torch.dtype, ...]
    bench_dtype: torch.dtype
    cases: list[Case]
    heads: tuple[int, int, int]  # (q heads, KV heads, head dim) for (b) and (c)
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    target: tuple[int, int]  # (batch, context) the targets are judged at
    prefill_len: int
    model: dict = field(default_factory=dict)  # LlamaConfig kwargs for (d)
    engine_batch: int = 64
    engine_kv_bytes: int = 2 << 30
    prompt_len: int = 128
    decode_steps: int = 64
    warmup: int = 3
    reps: int = 20


GPU_PLAN = Plan(
    device=torch.device("cuda"),
    check_dtypes=(torch.bfloat16, torch.float16),
    bench_dtype=torch.bfloat16,
    cases=[
        Case("mixed decode + chunks", [1, 300, 1, 77, 1, 513], [1500, 900, 33, 77, 4000, 513], 8, 4, 128),
        Case(
            "mixed, window 256",
            [1, 300, 1, 77, 1, 513],
            [1500, 900, 33, 77, 4000, 513],
            8,
            4,
            128,
            window=256,
        ),
        Case("mixed, D 80, block 32", [1, 200, 1, 64], [700, 450, 3000, 64], 4, 3, 80, block_size=32),
        Case("decode, split rule", [1, 1, 1, 1], [5000, 2047, 17, 9000], 8, 4, 128),
        Case("decode, plain forced", [1, 1, 1, 1], [5000, 2047, 17, 9000], 8, 4, 128, force_split=False),
    ],
    heads=(32, 8, 128),
    decode_batches=(1, 16, 64),
    decode_contexts=(1024, 4096, 16384),
    target=(64, 4096),
    prefill_len=4096,
    model=dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    ),
)

SMOKE_PLAN = Plan(
    device=torch.device("cpu"),
    check_dtypes=(torch.float32, torch.float16),
    bench_dtype=torch.float32,
    cases=[
        Case("mixed decode + chunks", [1, 19, 13, 1], [37, 50, 13, 1], 1, 4, 64),
        Case("mixed, window 8", [1, 19, 13, 1], [37, 50, 13, 1], 1, 4, 64, window=8),
        Case("decode, split rule", [1, 1], [600, 9], 1, 4, 64),
        Case("decode, plain forced", [1, 1], [600, 9], 1, 4, 64, force_split=False),
    ],
    heads=(4, 2, 64),
    decode_batches=(1, 2),
    decode_contexts=(128, 640),
    target=(2, 640),
    prefill_len=64,
    model=dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    ),
    engine_batch=4,
    engine_kv_bytes=16 << 20,
    prompt_len=8,
    decode_steps=3,
    warmup=1,
    reps=2,
)


class Timer:
    """Median wall time of a callable: CUDA events with an L2 flush, or perf_counter on CPU."""

    def __init__(self, device: torch.device, warmup: int, reps: int):
        self.device, self.warmup, self.reps = device, warmup, reps
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.cuda else None

    def median_ms(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.cuda:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def table(header: list[str], rows: list[list[object]]) -> list[str]:
    fmt = [" | ".join(header), " | ".join("---" for _ in header)]
    return ["| " + line + " |" for line in fmt] + ["| " + " | ".join(map(str, r)) + " |" for r in rows]
