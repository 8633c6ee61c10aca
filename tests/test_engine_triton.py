"""The engine on the Triton attention backend generates what it generates on the torch backend.

A 2-layer random-weight Llama (weights scaled up so greedy logits are peaked and tie-free)
runs the same requests on both backends in fp32: prompts of several lengths prefilled in
16-token chunks next to decode rows (mixed batches), then a prompt whose first two blocks
come from the prefix cache, so the kernels read a cached prefix they did not write in the
same step. Without CUDA the kernels run under the Triton interpreter (conftest.py sets
TRITON_INTERPRET=1 before any kernel module is imported).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from kvray.engine import LLM, SamplingParams  # noqa: E402

# head_dim 64: a size the kernels are specified for; GQA group 2.
TINY = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
PROMPTS = [[7, 3, 250, 11], list(range(40, 77)), [(5 * i) % 256 for i in range(21)]]
PREFIX_HIT_PROMPT = list(range(40, 72)) + [9, 8, 7]  # first 32 tokens = 2 cached blocks of PROMPTS[1]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_llama_path(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(**TINY)
    config.architectures = ["LlamaForCausalLM"]
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    return path


def _generate(path, backend: str) -> tuple[list[list[int]], list[float], int]:
    """Greedy tokens and their summed logprobs for PROMPTS then PREFIX_HIT_PROMPT (last), and
    how many of PREFIX_HIT_PROMPT's tokens came from the prefix cache."""
    llm = LLM(
        model=str(path),
        dtype="float32",
        attention_backend=backend,
        block_size=16,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=4 << 20,
    )
    assert llm.engine.runner.backend.name == backend
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    outs += llm.generate([{"prompt_token_ids": PREFIX_HIT_PROMPT}], params)
    assert llm.kv_cache_stats().used_blocks == 0
    return (
        [o.outputs[0].token_ids for o in outs],
        [o.outputs[0].cumulative_logprob for o in outs],
        outs[-1].num_cached_tokens,
    )


def test_triton_backend_matches_torch_backend(tiny_llama_path):
    want_tokens, want_logprobs, want_cached = _generate(tiny_llama_path, "torch")
    got_tokens, got_logprobs, got_cached = _generate(tiny_llama_path, "triton")
    assert got_tokens == want_tokens
    # Same tokens can hide a wrong softmax: measured gap 7e-6; a 0.1% softmax-scale error gives 1e-3.
    assert got_logprobs == pytest.approx(want_logprobs, abs=1e-4)
    assert got_cached == want_cached == 32  # PROMPTS[1]'s two full blocks were reused
    assert all(len(t) == MAX_TOKENS for t in got_tokens)
    assert len({tuple(t) for t in got_tokens}) == len(got_tokens)  # not a degenerate output
