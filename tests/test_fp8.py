"""`quantization="fp8"` (models/fp8_linear.py): e4m3 weights with a scale per output
channel, activations per row, torch._scaled_mm; against a float64 product of the same
codes, and SmolLM2 against transformers (on a CPU, torch's reference fp8 GEMM)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvray.models.fp8_linear import FP8_MAX, Fp8Weight


def test_fp8_linear_matches_a_float64_product_of_its_codes():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g) * torch.linspace(0.01, 2, 96)[:, None]
    x = torch.randn(7, 160, generator=g) * 3
    bias = torch.randn(96, generator=g)
    fp8 = Fp8Weight.of(w)
    assert fp8.data.dtype == torch.float8_e4m3fn and fp8.scales.shape == (1, 96)
    odd = Fp8Weight.of(w[:90, :150])  # padded to 16s for cuBLASLt: the same products
    assert odd.data.shape == (96, 160) and odd.dequantized().shape == (90, 150)
    x_odd = x[:, :150]
    xs_odd = x_odd.abs().amax(1, keepdim=True) / FP8_MAX
    want_odd = (
        (x_odd / xs_odd).to(torch.float8_e4m3fn).double() * xs_odd.double() @ odd.dequantized().double().T
    )
    got_odd = odd.matmul(x_odd, None).double()
    assert (
        got_odd.shape == (7, 90) and ((got_odd - want_odd).abs().max() / want_odd.abs().max()).item() < 1e-5
    )
    # each channel's largest value is the largest code; every value within e4m3's step
    assert torch.allclose(fp8.dequantized().abs().amax(1), w.abs().amax(1), rtol=1e-6)
    assert ((fp8.dequantized() - w).abs() <= w.abs().amax(1, keepdim=True) / FP8_MAX * 32 + 1e-7).all()
    out = fp8.matmul(x, bias)
    xs = x.abs().amax(1, keepdim=True) / FP8_MAX
    xq = (x / xs).to(torch.float8_e4m3fn).double() * xs.double()
    want = xq @ fp8.dequantized().double().T + bias.double()
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    exact = x.double() @ w.double().T + bias.double()
    assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 0.05
    assert fp8.matmul(x[None], None).shape == (1, 7, 96)


def test_smollm2_in_fp8_predicts_as_transformers(smollm2_path, hf_smollm2):
    from conftest import assert_no_leaks
    from test_quant_groups import TEXT
    from transformers import AutoTokenizer

    from kvray.engine import LLM, SamplingParams

    llm = LLM(model=str(smollm2_path), dtype="float32", quantization="fp8", max_model_len=256)
    model = llm.engine.runner.model
    down = model.layers[2].mlp.down_proj
    assert isinstance(down.panels, Fp8Weight) and down.weight is None
    assert isinstance(model.panels_head, Fp8Weight)
    ids = AutoTokenizer.from_pretrained(Path(smollm2_path))(TEXT).input_ids[:48]
    with torch.no_grad():
        want = hf_smollm2(torch.tensor([ids])).logits[0, 3:-1].argmax(-1)
    prompts = [{"prompt_token_ids": ids[:i]} for i in range(4, len(ids))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    got = torch.tensor([o.outputs[0].token_ids[0] for o in outs])
    assert (got == want).float().mean().item() >= 0.85, (got, want)
    assert_no_leaks(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_linear_on_cuda():
    w, x = torch.randn(256, 512, device="cuda"), torch.randn(5, 512, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8Weight.of(w)
    out = fp8.matmul(x, None).double()
    exact = x.double() @ w.double().T
    assert ((out - exact).abs().max() / exact.abs().max()).item() < 0.05
