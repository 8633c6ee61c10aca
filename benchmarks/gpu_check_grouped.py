"""gpu_check's grouped low-bit weights section (issue 51, item 4): the Triton kernels over
the CPU kernel's panels (kernels/triton_linear_qg.py) against cuBLAS's bf16 matmul of the
same weight, decode (split-K GEMV) and prompt (tiled matmul) shapes, each checked against
float64."""

from __future__ import annotations

import torch
from gpu_check_plan import Plan, Timer, table

LAYOUTS = {  # a GGUF format each: bits, group, fp16 scales, implied min offset
    "Q4_0": (4, 32, True, 8),
    "Q4_K": (4, 32, False, 0),
    "Q5_0": (5, 32, True, 16),
    "Q6_K": (6, 16, False, 32),
    "Q8_0": (8, 32, True, 128),
    "int4/128": (4, 128, False, 0),  # quantization="int4", quantization_group_size=128
}


def bench_grouped_linear(plan: Plan, timer: Timer) -> tuple[list[str], bool]:
    from kvray.kernels import cpu_groups, triton_linear_qg

    cuda = plan.device.type == "cuda"
    n, k = (4096, 4096) if cuda else (48, 128)
    rows_list = (1, 8, 512) if cuda else (1, 20)
    dtype = plan.bench_dtype if cuda else torch.float32
    gen = torch.Generator().manual_seed(0)
    rows, ok = [], True
    for name, (bits, group, half, offset) in LAYOUTS.items():
        layout = cpu_groups.Layout(bits, group, half, offset)
        codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
        scales = torch.rand(n, k // group, generator=gen) * 0.02
        scales = scales.half().float() if half else scales
        mins = -offset * scales if offset else (-(2 ** (bits - 1)) * scales).half().float()
        data = cpu_groups.to_panels(codes, scales, mins, layout)
        w = cpu_groups.dequantized(data, n, k)
        data, dense = data.to(plan.device), w.to(plan.device, dtype)
        for m in rows_list:
            x = torch.randn(m, k, generator=gen).to(plan.device, dtype)
            ms = timer.median_ms(lambda x=x, data=data: triton_linear_qg.grouped_linear(x, data, n))
            base = timer.median_ms(lambda x=x, dense=dense: x @ dense.T)
            out = triton_linear_qg.grouped_linear(x, data, n).double().cpu()
            want = x.double().cpu() @ w.double().T
            err = ((out - want).abs().max() / want.abs().max()).item()
            passed = err < (2e-2 if dtype != torch.float32 else 1e-4)
            ok &= passed
            rows.append([name, str(m), f"{data.numel() / 1e6:.2f}", f"{ms:.3f}", f"{base:.3f}",
                         f"{base / ms:.2f}x", f"{data.numel() / (ms * 1e-3) / 1e9:.0f}", f"{err:.1e}",
                         "ok" if passed else "FAIL"])  # fmt: skip
    header = ["format", "rows", "weight MB", "grouped ms", "cuBLAS dense ms", "speed vs dense", "GB/s",
              "rel err", "result"]  # fmt: skip
    return [f"W [{n}, {k}], activations {str(dtype)[6:]}", "", *table(header, rows)], ok
