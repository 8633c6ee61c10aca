"""`quantization="int8"`: weight-only int8 linears on the native CPU kernels
(kernels/cpu_linear_q8.c).

The kernel against a float64 matmul of the de-quantized weight (codes x scales), for the
shapes of decode steps and prompt chunks, fp32 and bf16 activations, with and without a
bias, partial last panels; a row's result does not depend on the step's other rows. The
quantizer against hand-checkable numbers. The engine: SmolLM2 with int8 linears gives
transformers' greedy tokens when transformers runs the same de-quantized weights (fp32,
the near-tie rule), holds a quarter of the fp32 linears' bytes, and names the field for a
value it does not know.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvray.kernels import cpu_native

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels not built here")


def test_the_quantizer_keeps_one_scale_per_output_channel():
    w = torch.tensor([[1.0, -2.0, 0.5, 127.0], [0.0, 0.0, 0.0, 0.0], [-0.3, 0.1, 0.2, 0.15]])
    panels = cpu_native.to_panels_int8(w)
    assert panels.data.dtype == torch.int8 and panels.data.shape == (1, 16 * 4 + 64)
    got = cpu_native.dequantized(panels)
    # row 0: scale 1, codes round half away from zero (0.5 -> 1); row 1: all zero stays zero;
    # row 2: scale 0.3 / 127, each code within half a step
    assert torch.equal(got[0], torch.tensor([1.0, -2.0, 1.0, 127.0]))
    assert torch.equal(got[1], torch.zeros(4))
    assert (got[2] - w[2]).abs().max() <= 0.3 / 127 / 2 + 1e-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(5, 64), (17, 96), (100, 300), (576, 576), (1536, 576)])
def test_int8_panels_match_a_float64_matmul_of_the_dequantized_weight(dtype, n, k):
    torch.manual_seed(n * k)
    panels = cpu_native.to_panels_int8(torch.randn(n, k))
    weight = cpu_native.dequantized(panels).double()
    for m in (1, 2, 5, 6, 7, 13, 64, 70):  # decode rows, a tile and a half, a prompt chunk
        for bias in (None, torch.randn(n).to(dtype)):
            x = torch.randn(m, k).to(dtype)
            got = cpu_native.linear(x, panels, bias)
            want = x.double() @ weight.T + (0 if bias is None else bias.double())
            assert got.dtype == dtype and got.shape == (m, n)
            scale = want.abs().max().item()
            # fp32: the sums' rounding; bf16: the output rounded once (2^-8 relative)
            tol = 1e-5 if dtype == torch.float32 else 2**-8
            assert (got.double() - want).abs().max().item() <= tol * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_steps_other_rows(dtype):
    torch.manual_seed(3)
    panels = cpu_native.to_panels_int8(torch.randn(200, 640))
    x = torch.randn(20, 640).to(dtype)
    together = cpu_native.linear(x, panels, None)
    for i in (0, 7, 19):
        assert torch.equal(cpu_native.linear(x[i : i + 1].contiguous(), panels, None)[0], together[i])


@pytest.fixture(scope="module")
def int8_llm(smollm2_path):
    from kvray.engine import LLM

    return LLM(model=str(smollm2_path), dtype="float32", quantization="int8", max_model_len=512)


def test_int8_smollm2_gives_transformers_tokens_on_the_same_dequantized_weights(int8_llm, smollm2_path):
    from conftest import assert_no_leaks, greedy_agreement
    from transformers import AutoTokenizer

    from kvray.engine import SamplingParams
    from kvray.kernels.kv_quant import QUANTS, dequantize, quantize
    from kvray.models.loader import transformers_model

    hf = transformers_model(Path(smollm2_path), torch.float32)
    with torch.no_grad():  # every layer's linears and the head as kvray holds them; the embedding as it is
        for layer in hf.model.layers:
            for lin in (*layer.self_attn.children(), *layer.mlp.children()):
                if isinstance(lin, torch.nn.Linear):
                    lin.weight.copy_(dequantize(*quantize(lin.weight, QUANTS["int8"])))
        head = dequantize(*quantize(hf.lm_head.weight, QUANTS["int8"]))
        hf.lm_head.weight = torch.nn.Parameter(head)  # untied: the embedding keeps its rows
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a town by the sea,"]
    prompts = [tok(t).input_ids for t in texts]
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    outs = int8_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    got = [o.outputs[0].token_ids for o in outs]
    agreed, total, _ = greedy_agreement(hf, prompts, got, want)
    assert agreed == total, (got, want)
    assert_no_leaks(int8_llm)


def test_int8_linears_hold_a_quarter_of_their_fp32_bytes_and_bad_values_name_the_field(int8_llm):
    from kvray.engine import LLM
    from kvray.errors import InvalidArgumentError

    model = int8_llm.engine.runner.model
    layers = [m for m in model.modules() if hasattr(m, "panels") and m.panels is not None]
    assert layers and all(m.panels.data.dtype == torch.int8 and m.weight is None for m in layers)
    held = sum(m.panels.data.numel() for m in layers)
    fp32 = sum(4 * m.panels.n * m.panels.k for m in layers)
    # codes (a byte a weight, columns padded to 16) and a 4-byte scale per column
    assert held == sum(-(-m.panels.n // 16) * (16 * m.panels.k + 64) for m in layers)
    assert held < 0.26 * fp32
    with pytest.raises(InvalidArgumentError, match="quantization.*int8"):
        LLM(model="smollm2-135m-instruct", quantization="awq")


def test_int8_without_the_native_kernels_is_an_error_naming_the_field(monkeypatch):
    from kvray.errors import InvalidArgumentError
    from kvray.models import cpu_linear

    monkeypatch.setattr(cpu_native, "takes", lambda dtype, device: False)  # no compiler here, say
    with pytest.raises(InvalidArgumentError, match="quantization.*native CPU kernels"):
        cpu_linear.pack_model(torch.nn.Linear(4, 4), torch.float32, torch.device("cpu"), "int8")
    assert cpu_linear.pack_model(torch.nn.Linear(4, 4), torch.float32, torch.device("cpu")) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_chunks_multiply_the_dequantized_weight(dtype):
    """Above INT8_DENSE_ROWS rows a layer multiplies its de-quantized weight (oneDNN):
    the same float64 reference, for a prompt chunk's rows in the model's layout [1, T, k]."""
    from kvray.models import cpu_linear

    torch.manual_seed(5)
    panels = cpu_native.to_panels_int8(torch.randn(300, 256))
    x = torch.randn(1, cpu_linear.INT8_DENSE_ROWS + 36, 256).to(dtype)
    bias = torch.randn(300).to(dtype)
    assert cpu_linear.int8_dense(x, panels) and not cpu_linear.int8_dense(x[:, :64], panels)
    got = cpu_linear.linear(x, None, bias, None, panels)
    want = x.double() @ cpu_native.dequantized(panels).double().T + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # bf16: the weight rounded to bf16, then the output
    assert got.shape == (1, 100, 300) and (got.double() - want).abs().max() <= tol * want.abs().max()
