"""kvray's Llama-family model against transformers' own classes, on small random weights.

Covers what differs between the architectures: Llama 3 RoPE scaling, Mistral's sliding
window, Qwen2's QKV bias, tied and untied embeddings, GQA. Logits are compared at every
position for a prompt prefilled in chunks and then continued one token at a time through
the paged cache (non-contiguous blocks), so both attention paths are exercised.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

from kvray.engine import LLM, SamplingParams
from kvray.kernels.backend import AttentionMetadata, LayerKV, get_backend
from kvray.models.layers import head_dim_of
from kvray.models.loader import build_model, load_config

SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

CONFIGS = {
    "llama3-rope": lambda: LlamaConfig(
        **SMALL,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama-tied-mha": lambda: LlamaConfig(**{**SMALL, "num_key_value_heads": 4}, tie_word_embeddings=True),
    "mistral-window": lambda: MistralConfig(**SMALL, sliding_window=8, tie_word_embeddings=False),
    "qwen2-bias": lambda: Qwen2Config(**SMALL, tie_word_embeddings=False),
    # local and global layers with RoPE bases of their own, a head_dim that is not
    # hidden / heads, a query scalar that is not head_dim, GeGLU, four norms a layer
    "gemma3-local-global": lambda: Gemma3TextConfig(
        **{**SMALL, "num_hidden_layers": 3},
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved_model(request, tmp_path_factory):
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    config.architectures = [config.architectures[0] if config.architectures else _arch(config)]
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # larger weights than the init give peaked, tie-free logits
        for name, p in hf.named_parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
            if "norm" in name and config.model_type == "gemma3_text":  # Gemma scales by 1 + w
                p.uniform_(-0.5, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, path, hf


def _arch(config) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
    }[config.model_type]


def _kvray_logits(
    model, config, ids: list[int], prefill_chunks: list[int], block_size=4, dtype=torch.float32, caches=None
):
    """Logits at every position: prompt prefilled in the given chunks, the rest decoded
    (into `caches` where given: 64 blocks of `block_size` a layer)."""
    head_dim = head_dim_of(config)
    num_blocks = 64
    caches = caches or [
        LayerKV(
            torch.zeros(num_blocks, block_size, config.num_key_value_heads, head_dim, dtype=dtype),
            torch.zeros(num_blocks, block_size, config.num_key_value_heads, head_dim, dtype=dtype),
        )
        for _ in range(config.num_hidden_layers)
    ]
    table = list(range(num_blocks - 1, 0, -3))  # non-contiguous, descending blocks
    backend = get_backend("torch", torch.device("cpu"))
    steps = list(prefill_chunks) + [1] * (len(ids) - sum(prefill_chunks))
    logits, done = [], 0
    for n in steps:
        pos = list(range(done, done + n))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([table[p // block_size] * block_size + p % block_size for p in pos]),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([done + n], dtype=torch.int32),
            block_tables=torch.tensor([table], dtype=torch.int32),
            query_lens=[n],
            seq_lens_host=[done + n],
            block_size=block_size,
        )
        backend.prepare(meta)
        with torch.no_grad():
            hidden = model(torch.tensor(ids[done : done + n]), torch.tensor(pos), caches, backend, meta)
            logits.append(model.compute_logits(hidden))
        done += n
    return torch.cat(logits)


def test_logits_match_transformers(saved_model):
    name, path, hf = saved_model
    config = load_config(path)
    model = build_model(config, path, torch.float32, torch.device("cpu"), 256)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = _kvray_logits(model, config, ids, prefill_chunks=[13, 11])
    scale = want.abs().max()
    assert (got - want).abs().max() / scale < 1e-5, name


def test_engine_greedy_matches_transformers(saved_model):
    name, path, hf = saved_model
    llm = LLM(model=str(path), dtype="float32", block_size=8, max_num_batched_tokens=16)
    prompts = [[5, 17, 99, 3], list(range(30, 60)), [200] * 9]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    )
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
            )
        assert out.outputs[0].token_ids == ref[0, len(p) :].tolist(), name
    assert llm.kv_cache_stats().used_blocks == 0
