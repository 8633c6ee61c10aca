"""Grouped low-bit codes (kernels/cpu_groups.py, kernels/cpu_linear_qg.c): `quantization=
"int4"` and `"gguf"`. The kernel against a float64 matmul of the weight its panels stand
for; GGUF blocks against `gguf.quants.dequantize`; SmolLM2 from its own GGUF file against
transformers holding the same weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvray.engine.config import EngineConfig
from kvray.kernels import cpu_groups, cpu_native
from kvray.models import gguf_groups

pytestmark = pytest.mark.skipif(
    cpu_native.library() is None, reason="no C compiler: native kernels not built"
)

Layout = cpu_groups.Layout
LAYOUTS = [  # every code width and group, fp32 and fp16 scales, stored and implied mins
    Layout(4, 32),
    Layout(4, 16, half=True),
    Layout(4, 32, True, 8),
    Layout(5, 32),
    Layout(5, 32, True, 16),
    Layout(6, 16, False, 32),
    Layout(6, 32, True),
    Layout(8, 32, True, 128),
    Layout(8, 16),
]


def _weight(n: int, k: int, layout: Layout, seed: int = 0) -> tuple[torch.Tensor, ...]:
    bits, group = layout.bits, layout.group
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.02
    mins = -(2 ** (bits - 1)) * scales + torch.randn(n, k // group, generator=g) * 0.01
    if layout.half:
        scales, mins = scales.half().float(), mins.half().float()
    if layout.offset:
        mins = -layout.offset * scales
    return codes, scales, mins


def _reference(x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """float64 x_q W^T, x quantized per group as the kernel quantizes it"""
    codes, d = cpu_groups.quantize_rows(x, group)
    xq = (codes.view(x.shape[0], -1, group).double() * d.double()[:, :, None]).view(x.shape)
    return xq @ w.double().T


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(5, 64), (37, 96), (200, 128)])
def test_grouped_panels_match_a_float64_matmul(layout, dtype, n, k):
    _check_panels(layout, dtype, n, k)


@pytest.mark.parametrize("layout", [Layout(4, 128), Layout(4, 128, True), Layout(8, 128, True, 128)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(5, 128), (37, 384)])
def test_groups_of_128_match_a_float64_matmul(layout, dtype, n, k):
    """int4's quantization_group_size=128: a scale and min per 128 values, the activations
    quantized per 128 too (their integer sums still exact in int32)"""
    _check_panels(layout, dtype, n, k)


def _check_panels(layout: Layout, dtype: torch.dtype, n: int, k: int) -> None:
    group = layout.group
    codes, scales, mins = _weight(n, k, layout)
    panels = cpu_native.Panels(cpu_groups.to_panels(codes, scales, mins, layout), n, k)
    assert panels.data.numel() == cpu_groups.HEADER + -(-n // 16) * (k // group) * layout.block_bytes
    w = (codes.float().view(n, -1, group) * scales[:, :, None] + mins[:, :, None]).view(n, k)
    assert torch.equal(cpu_native.dequantized(panels), w)  # the layout round-trips
    # an embedding's rows looked up in the codes: code * scale + min rounded once (fmaf)
    fused = codes.double().view(n, -1, group) * scales.double()[:, :, None] + mins.double()[:, :, None]
    ids = torch.tensor([[n - 1, 0], [n // 2, 3 % n]])
    assert torch.equal(cpu_native.embedding_rows(panels, ids, torch.float32), fused.view(n, k).float()[ids])
    bias = torch.randn(n).to(dtype)
    for m in (1, 5, 8, 9, 64, 100):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        out = cpu_native.linear(x, panels, bias).double()
        want = _reference(x, w, group) + bias.double()
        # fp32: the integer sums are exact, the groups' fp32 sums within ~1e-6; bf16: the
        # output's rounding
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert ((out - want).abs().max() / want.abs().max()).item() < tol, (m, dtype)
        # and what quantizing x costs against its float64 product: ~0.5 %
        exact = x.double() @ w.double().T + bias.double()
        assert ((out - exact).abs().max() / exact.abs().max()).item() < 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_steps_other_rows(dtype):
    codes, scales, mins = _weight(70, 256, Layout(5, 32, True, 16))
    panels = cpu_native.Panels(cpu_groups.to_panels(codes, scales, mins, Layout(5, 32, True, 16)), 70, 256)
    x = torch.randn(13, 256).to(dtype)
    together = cpu_native.linear(x, panels, None)
    for i in range(13):
        assert torch.equal(cpu_native.linear(x[i : i + 1].contiguous(), panels, None)[0], together[i])


@pytest.mark.parametrize("group", [32, 128])
def test_int4_keeps_each_weight_within_half_a_step_of_its_group(group):
    k = 5 * group
    w = torch.randn(48, k) * torch.linspace(0.1, 3, k)
    codes, scales, mins = cpu_groups.quantize_int4(w, group)
    assert codes.max() <= 15 and scales.shape == mins.shape == (48, 5)
    back = (codes.float().view(48, 5, group) * scales[:, :, None] + mins[:, :, None]).view(48, k)
    step = scales.repeat_interleave(group, 1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    # each group's min and max are codes 0 and 15
    assert torch.allclose(back.view(48, 5, group).amin(2), w.view(48, 5, group).amin(2))
    assert torch.allclose(back.view(48, 5, group).amax(2), w.view(48, 5, group).amax(2), atol=1e-5)


def _random_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Valid blocks of a GGUF format: random bytes, the fp16 scales made finite and small"""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[kind]
    per, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n * k // per, size), dtype=np.uint8)
    halves = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(
        kind, (0, 2) if kind.endswith("_1") else (0,)
    )
    for at in halves:
        blocks[:, at : at + 2] = (
            (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
    return blocks.reshape(n, -1)


class _Tensor:  # what gguf_groups.grouped reads of a GGUFReader tensor
    def __init__(self, kind: str, data: np.ndarray, n: int, k: int):
        from gguf import GGMLQuantizationType

        self.tensor_type, self.data, self.shape, self.name = GGMLQuantizationType[kind], data, [k, n], "t"


@pytest.mark.parametrize("kind", gguf_groups.FORMATS)
def test_gguf_blocks_repack_to_the_values_gguf_dequantizes_bit_for_bit(kind):
    from gguf.quants import dequantize

    n, k = 24, 512
    data = _random_blocks(kind, n, k, seed=len(kind))
    want = torch.from_numpy(dequantize(data, _Tensor(kind, data, n, k).tensor_type).astype(np.float32))
    g = gguf_groups.grouped(_Tensor(kind, data, n, k))
    assert torch.equal(cpu_native.dequantized(g.panels()), want), kind
    # stacked with a part of another layout (q|k|v of mixed formats): the same values
    other = gguf_groups.grouped(_Tensor("Q6_K", _random_blocks("Q6_K", 8, k, 1), 8, k))
    both = cpu_native.dequantized(gguf_groups.stacked([g, other]).panels())
    assert torch.equal(both, torch.cat([want, cpu_native.dequantized(other.panels())]))


@pytest.fixture(scope="module")
def gguf_llm(smollm2_path):
    from kvray.engine import LLM

    return LLM(model=str(smollm2_path), dtype="float32", quantization="gguf", max_model_len=512)


TEXT = (  # Dickens, public domain
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven."
)


def test_smollm2_from_its_gguf_holds_the_files_codes_and_predicts_as_transformers(gguf_llm, smollm2_path):
    """The file's Q4_1 linears and Q8_0 tied head, repacked: the weights transformers'
    converter de-quantized (the folder's safetensors) bit for bit, ~4.6x fewer bytes than
    fp32, the embedding's rows looked up in the head's codes; and teacher-forced next tokens
    as transformers predicts them with those weights (what the activations' quantization per
    group of 32 changes, on one text: 98-99 %; llama.cpp quantizes them alike)."""
    from conftest import assert_no_leaks
    from transformers import AutoTokenizer

    from kvray.engine import SamplingParams
    from kvray.models.loader import transformers_model

    model = gguf_llm.engine.runner.model
    hf = transformers_model(Path(smollm2_path), torch.float32)
    layer, hf_layer = model.layers[3], hf.model.layers[3]
    q, k, v = cpu_native.dequantized(layer.self_attn.qkv_proj.panels).split([576, 192, 192])
    assert torch.equal(q, hf_layer.self_attn.q_proj.weight) and torch.equal(
        k, hf_layer.self_attn.k_proj.weight
    )
    assert torch.equal(v, hf_layer.self_attn.v_proj.weight)
    assert torch.equal(cpu_native.dequantized(layer.mlp.down_proj.panels), hf_layer.mlp.down_proj.weight)
    assert torch.equal(cpu_native.dequantized(model.panels_head), hf.lm_head.weight)
    assert layer.mlp.down_proj.panels.data.nbytes * 4.6 < hf_layer.mlp.down_proj.weight.nbytes
    # the tied embedding's rows are looked up in the head's codes: no dense copy
    embed = model.embed_tokens
    assert embed.weight is None and embed.panels.data.data_ptr() == model.panels_head.data.data_ptr()
    ids = torch.tensor([[0, 5, 49151], [17, 17, 300]])
    assert torch.equal(embed(ids), hf.model.embed_tokens.weight[ids])
    with pytest.raises(IndexError):
        embed(torch.tensor([49152]))

    ids = AutoTokenizer.from_pretrained(smollm2_path)(TEXT).input_ids
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, 3:-1].argmax(-1)
    prompts = [{"prompt_token_ids": ids[:i]} for i in range(4, len(ids))]
    outs = gguf_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    got = torch.tensor([o.outputs[0].token_ids[0] for o in outs])
    assert (got == want).float().mean().item() >= 0.95, (got, want)
    assert_no_leaks(gguf_llm)


def test_gguf_needs_a_gguf_model_and_int4_a_k_in_its_groups():
    from kvray.errors import InvalidArgumentError
    from kvray.models import cpu_linear

    with pytest.raises(InvalidArgumentError, match="quantization.*GGUF"):
        cpu_linear.pack_model(torch.nn.Linear(64, 64), torch.float32, torch.device("cpu"), "gguf")
    with pytest.raises(InvalidArgumentError, match="quantization.*groups of 32"):
        cpu_linear.quantized_panels(torch.randn(8, 40), "int4")
    assert cpu_linear.quantized_panels(torch.randn(8, 64), "int4").data.dtype == torch.uint8
    # SmolLM2's 576 inputs do not divide into groups of 128
    with pytest.raises(InvalidArgumentError, match="quantization_group_size.*groups of 128.*k=576"):
        cpu_linear.quantized_panels(torch.randn(8, 576), "int4", group_size=128)
    panels = cpu_linear.quantized_panels(torch.randn(8, 640), "int4", group_size=128)
    assert cpu_groups.layout(panels.data) == Layout(4, 128)
    with pytest.raises(InvalidArgumentError, match="quantization_group_size.*one of \\[32, 128\\]"):
        EngineConfig(quantization="int4", quantization_group_size=64)


def test_a_folder_converted_before_the_gguf_was_kept_gets_it_or_serves_without_it(tmp_path, monkeypatch):
    from kvray.models import fetch

    monkeypatch.setenv("KVRAY_CACHE", str(tmp_path))
    folder = tmp_path / "models" / "old"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")

    def offline(tmp):
        raise OSError("no network")

    assert fetch._converted("old", offline) == folder and not (folder / fetch.GGUF_NAME).exists()
    source = tmp_path / "elsewhere.gguf"
    source.write_bytes(b"GGUF")
    assert fetch._converted("old", lambda tmp: source) == folder  # a local file: linked
    assert (folder / fetch.GGUF_NAME).resolve() == source.resolve()


def test_quantization_ignore_keeps_the_named_modules_in_the_dtype(smollm2_path, hf_smollm2):
    """Per-module precision: the LM head and layer 0 stay fp32 (read from the file, the
    values transformers reads), the other layers keep the file's codes; the tied embedding
    follows its head, and the mixed model generates (its fused decode step steps aside).
    int8 likewise; a pattern naming no module is an error naming the field."""
    from conftest import assert_no_leaks

    from kvray.engine import LLM, SamplingParams
    from kvray.errors import InvalidArgumentError

    args = {"model": str(smollm2_path), "dtype": "float32", "max_model_len": 256}
    llm = LLM(**args, quantization="gguf", quantization_ignore=["lm_head", "layers.0.*"])
    model = llm.engine.runner.model
    dense, coded = model.layers[0].mlp.down_proj, model.layers[1].mlp.down_proj
    assert dense.panels.data.dtype == torch.float32 and coded.panels.data.dtype == torch.uint8
    assert model.panels_head.data.dtype == torch.float32 and model.embed_tokens.weight is not None
    hf_down = hf_smollm2.model.layers[0].mlp.down_proj.weight
    assert torch.equal(dense(torch.eye(hf_down.shape[1])).T, hf_down)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8
    assert_no_leaks(llm)
    # a tied head is the embedding's rows: naming either keeps both in the dtype
    tied = LLM(**args, quantization="gguf", quantization_ignore=["embed_tokens"]).engine.runner.model
    assert tied.embed_tokens.weight is not None and tied.panels_head.data.dtype == torch.float32
    assert tied.layers[0].mlp.down_proj.panels.data.dtype == torch.uint8
    with pytest.raises(InvalidArgumentError, match="quantization_ignore.*layers.99"):
        LLM(**args, quantization="int8", quantization_ignore=["layers.99.*"])
    int8 = LLM(**args, quantization="int8", quantization_ignore=["lm_head"]).engine.runner.model
    assert int8.panels_head.data.dtype == torch.float32
    assert int8.layers[0].mlp.down_proj.panels.data.dtype == torch.int8
