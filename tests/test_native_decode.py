"""The fused decode layers (kernels/cpu_layer.c, models/native_decode.py) against the
modules they stand in for, and against transformers.

Small random models whose heads the decode kernel takes (head_dim 32): Llama with GQA,
Qwen2's q/k/v biases, Mistral's sliding window. Logits at every position of a prompt
prefilled in chunks (the modules) and continued a token at a time (the fused layers),
in fp32 against transformers and in bf16 against the modules' own bf16 path. Then the
engine on SmolLM2: greedy tokens with the fused layers equal those without, a batch of
sequences at once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import assert_no_leaks
from test_models_hf import _kvray_logits
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from kvray.engine import LLM, SamplingParams
from kvray.engine.dtype import cpu_has_native_bf16
from kvray.engine.model_runner import StepPlan
from kvray.kernels import cpu_groups, cpu_native
from kvray.kernels.backend import LayerKV
from kvray.kernels.kv_quant import QUANTS, SCALE_BYTES, split_cache
from kvray.models import native_decode
from kvray.models.cpu_linear import pack_model
from kvray.models.loader import build_model, load_config

pytestmark = pytest.mark.skipif(
    cpu_native.library() is None, reason="no C compiler: native kernels not built"
)

SMALL = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,  # int4's groups of 128 divide every linear's k
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(**SMALL),
    "qwen2-bias": lambda: Qwen2Config(**SMALL),
    "mistral-window": lambda: MistralConfig(**SMALL, sliding_window=8),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved_model(request, tmp_path_factory):
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
            if p.dim() == 1 and p.abs().sum() == 0:  # biases: non-zero, so that they count
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, path, hf


def _model(path, dtype):
    model = build_model(load_config(path), path, dtype, torch.device("cpu"), 256)
    pack_model(model, dtype, torch.device("cpu"))
    return model


def fuse_fp32_steps(monkeypatch) -> None:
    """Engines built from now on send fp32 decode steps of up to 64 rows to the fused
    layers, and their modules' own linears take the panels at those rows, on any CPU (this
    CPU's policy, on an AVX-512 one, sends fp32 to oneDNN from 3 rows on)."""
    machine = cpu_native.machine_policy()
    policy = dataclasses.replace(machine, fp32_rows=max(64, machine.fp32_rows))
    monkeypatch.setattr(cpu_native, "machine_policy", lambda fused_decode=True: policy)


def _count_fused(monkeypatch):
    """The rows of each step the fused layers ran (0: a step they declined), from the
    modules' hidden states (`run`) or from the step's tokens (`step`, the runner's path)."""
    rows = []
    real_run, real_step = native_decode.NativeDecode.run, native_decode.NativeDecode.step

    def run(self, x, rope, meta):
        out = real_run(self, x, rope, meta)
        rows.append(x.shape[0] if out is not None else 0)
        return out

    def step(self, embed, rotary, plan, head):
        out = real_step(self, embed, rotary, plan, head)
        rows.append(len(plan.input_ids) if out is not None else 0)
        return out

    monkeypatch.setattr(native_decode.NativeDecode, "run", run)
    monkeypatch.setattr(native_decode.NativeDecode, "step", step)
    return rows


def test_fused_decode_matches_transformers_fp32(saved_model, monkeypatch):
    name, path, hf = saved_model
    ran = _count_fused(monkeypatch)
    ids = torch.randint(0, 256, (52,), generator=torch.Generator().manual_seed(1)).tolist()
    got = _kvray_logits(_model(path, torch.float32), load_config(path), ids, [18, 18])
    assert ran == [0, 0] + [1] * 16, name  # prompt chunks declined, every decode step fused
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, name


def test_fused_decode_bf16_matches_the_modules_bf16(saved_model, monkeypatch):
    """The same roundings as the bf16 modules: logits within a few bf16 steps of theirs."""
    name, path, _ = saved_model
    ids = torch.randint(0, 256, (52,), generator=torch.Generator().manual_seed(2)).tolist()
    config = load_config(path)
    ran = _count_fused(monkeypatch)
    fused = _kvray_logits(_model(path, torch.bfloat16), config, ids, [18, 18], dtype=torch.bfloat16)
    assert ran == [0, 0] + [1] * 16, name
    monkeypatch.setattr(native_decode, "for_model", lambda *a: None)
    modules = _kvray_logits(_model(path, torch.bfloat16), config, ids, [18, 18], dtype=torch.bfloat16)
    assert ((fused - modules).abs().max() / modules.abs().max()).item() < 2e-2, name
    assert torch.equal(fused.argmax(-1), modules.argmax(-1)), name


@pytest.mark.parametrize(
    ("dtype", "quantization", "group"),
    [(d, q, 32) for q in (None, "int8", "int4") for d in ("float32", "bfloat16")]
    + [("float32", "int4", 128)],
)
def test_a_step_from_its_tokens_is_the_modules_step_bit_for_bit(
    saved_model, monkeypatch, dtype, quantization, group
):
    """The runner's one-call decode step (the embedding's rows, the RoPE tables' rows,
    every layer, the final norm and the LM head, from the plan's lists) gives the logits
    the model's forward and compute_logits give through the same fused layers, bit for
    bit, and their argmax, step after step of a batch (int8 and int4 layers too: the same
    kernels through either path); a token or a position outside its table declines it (None: the
    modules then raise or run it)."""
    if dtype == "bfloat16" and not cpu_has_native_bf16():
        pytest.skip("bf16 runs natively only where the CPU multiplies it")
    fuse_fp32_steps(monkeypatch)  # fp32 batches fuse on any CPU
    name, path, _ = saved_model
    args = {"max_model_len": 256, "enable_prefix_caching": False, "quantization": quantization}
    llm = LLM(model=str(path), dtype=dtype, quantization_group_size=group, **args)
    runner = llm.engine.runner
    if quantization:
        panels = runner.model.layers[0].mlp.down_proj.panels
        assert panels.data.dtype in cpu_native.QUANTIZED
        if quantization == "int4":
            assert cpu_groups.layout(panels.data).group == group
    real = runner._native_decode_step
    same = []

    def both(plan):
        out = real(plan)
        if out is not None:
            # the modules' step and compute_logits (writing the same K/V again)
            want = runner.model.compute_logits(runner._forward(plan))
            same.append(torch.equal(out.logits, want) and torch.equal(out.argmax, want.argmax(-1)))
        return out

    monkeypatch.setattr(runner, "_native_decode_step", both)
    lengths = (5, 37, 70)
    prompts = [{"prompt_token_ids": list(range(3 + 40 * i, 3 + 40 * i + n))} for i, n in enumerate(lengths)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(same) >= 7 and all(same), (name, same)
    native, model = native_decode.for_model(runner.model, runner.kv_caches), runner.model
    plan = StepPlan([256], [0], [0], [1], [1], [[0]], [0], [], [])  # token 256: past the vocabulary
    head = (model.norm.weight, model.panels_head)
    assert native.step(model.embed_tokens.weight, model.rotary, plan, head) is None
    plan.input_ids, plan.positions = [5], [256]  # past max_model_len's RoPE tables
    assert native.step(model.embed_tokens.weight, model.rotary, plan, head) is None
    plan.positions = [0]
    assert native.step(model.embed_tokens.weight, model.rotary, plan, head) is not None
    assert_no_leaks(llm)


def test_fused_bf16_rows_do_not_depend_on_the_step_around_them(saved_model, monkeypatch):
    """A position's logits are bitwise the same whether its step has one row or it is one
    of a short query's rows (a decode verifying drafts): the bf16 kernels round each row
    alike at any row count and split attention by position and head alone."""
    name, path, _ = saved_model
    ids = torch.randint(0, 256, (52,), generator=torch.Generator().manual_seed(3)).tolist()
    config = load_config(path)
    ran = _count_fused(monkeypatch)
    single = _kvray_logits(_model(path, torch.bfloat16), config, ids, [18, 18], dtype=torch.bfloat16)
    ran.clear()
    short = _kvray_logits(_model(path, torch.bfloat16), config, ids, [18, 18, 5, 9, 2], dtype=torch.bfloat16)
    assert ran == [0, 0, 5, 9, 2], name  # the short chunks ran fused, several rows a step
    assert torch.equal(single, short), name


INT8 = QUANTS["int8"]


def _int8_caches(config, block_size=4, num_blocks=64):
    """Empty int8 caches (kv_quant's rows: codes, then the fp32 scale) and the layers' views."""
    head_dim = config.hidden_size // config.num_attention_heads
    shape = (num_blocks, block_size, config.num_key_value_heads, head_dim + SCALE_BYTES)
    tensors = [(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)) for _ in range(2)]
    views = []
    for k, v in tensors:
        (k_codes, k_scales), (v_codes, v_scales) = split_cache(k, INT8), split_cache(v, INT8)
        views.append(LayerKV(k_codes, v_codes, k_scales, v_scales))
    return tensors, views


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_with_an_int8_cache_matches_the_modules(saved_model, monkeypatch, dtype):
    """An int8 KV cache (kv_cache_dtype="int8"): the fused layers quantize each new K and V
    row as kv_quant.quantize does, to the same codes and scales as the modules write, and
    attend over them alike. The first layer's caches end bitwise the same; in bf16 (where
    the fused layers round as the modules do) every layer's and the logits too; in fp32 the
    layers' sums differ by an ulp or so, enough to move a code past a rounding boundary
    later on, and the logits agree as closely as without quantization."""
    name, path, _ = saved_model
    ids = torch.randint(0, 256, (52,), generator=torch.Generator().manual_seed(5)).tolist()
    config = load_config(path)
    ran = _count_fused(monkeypatch)
    fused_caches, views = _int8_caches(config)
    fused = _kvray_logits(_model(path, dtype), config, ids, [18, 18], dtype=dtype, caches=views)
    assert ran == [0, 0] + [1] * 16, name
    monkeypatch.setattr(native_decode, "for_model", lambda *a: None)
    module_caches, views = _int8_caches(config)
    modules = _kvray_logits(_model(path, dtype), config, ids, [18, 18], dtype=dtype, caches=views)
    exact_layers = fused_caches if dtype == torch.bfloat16 else fused_caches[:1]
    for (fk, fv), (mk, mv) in zip(exact_layers, module_caches):
        assert torch.equal(fk, mk) and torch.equal(fv, mv), name
        assert fk[:, :, :, -SCALE_BYTES:].abs().sum() > 0, name  # scales were written
    if dtype == torch.bfloat16:
        assert torch.equal(fused, modules), name
    else:
        assert ((fused - modules).abs().max() / modules.abs().max()).item() < 1e-5, name


@pytest.mark.parametrize("kv_int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_steps_are_the_same_when_waiting_threads_redo_items(saved_model, monkeypatch, dtype, kv_int8):
    """The fused phases' items are idempotent (kernels/cpu_share.h): with the straggler
    timeout at 0, a thread that finds a phase's items all claimed computes at once every
    one not yet done, so items run twice, concurrently, and the logits stay bitwise the same
    (an int8 cache's rows quantized twice too)."""
    name, path, _ = saved_model
    ids = torch.randint(0, 256, (52,), generator=torch.Generator().manual_seed(4)).tolist()
    config, lib = load_config(path), cpu_native.library()
    fuse_fp32_steps(monkeypatch)  # fp32 steps of several rows fuse too
    ran = _count_fused(monkeypatch)
    chunks = [18, 18, 5, 9, 2]

    def caches():
        return _int8_caches(config)[1] if kv_int8 else None

    plain = _kvray_logits(_model(path, dtype), config, ids, chunks, dtype=dtype, caches=caches())
    before = lib.kvray_set_share_redo_ns(0)
    try:
        redone = _kvray_logits(_model(path, dtype), config, ids, chunks, dtype=dtype, caches=caches())
    finally:
        lib.kvray_set_share_redo_ns(before)
    assert before == 50_000
    assert ran == [0, 0, 5, 9, 2] * 2, name
    assert torch.equal(plain, redone), name


@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        pytest.param(
            "bfloat16",
            marks=pytest.mark.skipif(not cpu_has_native_bf16(), reason="bf16 prompts emulated here: minutes"),
        ),
    ],
)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_greedy_tokens_are_the_same_with_and_without_fusion(
    smollm2_path, monkeypatch, dtype, kv_cache_dtype
):
    """SmolLM2, 5 prompts decoded together (batches of up to 5 decode rows, contexts past
    one attention span, so split spans are merged): the fused layers give the modules'
    greedy tokens, over a model-dtype cache and an int8 one."""
    fuse_fp32_steps(monkeypatch)  # fp32 batches fuse on any CPU
    ran = _count_fused(monkeypatch)
    lengths = (3, 40, 130, 600, 9)
    prompts = [
        {"prompt_token_ids": [1 + i, *range(100 + 7 * i, 100 + 7 * i + n)]} for i, n in enumerate(lengths)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = LLM(
        model=str(smollm2_path),
        dtype=dtype,
        max_model_len=1024,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert sum(1 for n in ran if n) >= 19  # every step after the prompts' was fused
    assert_no_leaks(llm)
    monkeypatch.setattr(native_decode, "for_model", lambda *a: None)
    modules = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    agree = sum(a == b for f, m in zip(fused, modules) for a, b in zip(f, m))
    if dtype == "float32":
        assert fused == modules
    else:  # bf16: the same roundings, but a near-tie may still flip a token
        assert agree >= 0.9 * 100, (fused, modules)
    assert_no_leaks(llm)


def test_long_contexts_split_across_threads_redo_to_the_same_tokens(smollm2_path, monkeypatch):
    """Contexts past one attention span (their partial results merged) and 5 decode rows a
    step, with the straggler timeout at 0, so items, split spans' included, run twice at
    once: the same greedy tokens and logprobs as with the timeout as shipped."""
    fuse_fp32_steps(monkeypatch)  # fp32 batches fuse on any CPU
    lib = cpu_native.library()
    lengths = (3, 600, 130, 700, 9)
    prompts = [{"prompt_token_ids": [1 + i, *range(100 + i, 100 + i + n)]} for i, n in enumerate(lengths)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    llm = LLM(model=str(smollm2_path), dtype="float32", max_model_len=1024, enable_prefix_caching=False)

    def run():
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        logprobs = [[e[t].logprob for e, t in zip(o.logprobs, o.token_ids)] for o in outs]
        return [o.token_ids for o in outs], logprobs

    plain = run()
    before = lib.kvray_set_share_redo_ns(0)
    try:
        redone = run()
    finally:
        lib.kvray_set_share_redo_ns(before)
    assert redone == plain
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        pytest.param(
            "bfloat16",
            marks=pytest.mark.skipif(not cpu_has_native_bf16(), reason="bf16 prompts emulated here: minutes"),
        ),
    ],
)
def test_speculation_verified_by_the_fused_layers_gives_plain_decodings_tokens(
    smollm2_path, monkeypatch, dtype
):
    """n-gram drafts verified in multi-row fused steps (each row attends causally to its
    own position): the same greedy tokens as plain decoding, in bf16 too (the kernels
    round a row alike at any row count). Every prompt is prefilled in the first step, so
    the later steps are all decode steps in both runs."""
    from test_spec_engine import ARGS, NGRAM, PROMPTS

    fuse_fp32_steps(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    args = {**ARGS, "dtype": dtype, "max_num_batched_tokens": 512}
    plain = LLM(model=str(smollm2_path), **args)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    spec = LLM(model=str(smollm2_path), speculative_config=NGRAM, **args)
    rows = _count_fused(monkeypatch)
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)]
    assert got == want
    assert spec.engine.spec_stats.num_accepted_tokens > 0
    assert sum(1 for n in rows if n > len(PROMPTS)) > 0  # steps with drafts' rows went fused
    assert_no_leaks(spec)
