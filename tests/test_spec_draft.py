"""Draft-model speculation on the real SmolLM2: greedy tokens identical to plain decoding
with a tiny random-weight draft of SmolLM2's vocabulary (its proposals are almost all
rejected) and with SmolLM2 as its own draft (almost all kept); the draft's cache shares
the target's blocks, so after aborts and preemptions nothing is left used.
"""

from __future__ import annotations

import pytest
from conftest import assert_no_leaks

from kvray.engine import LLM, SamplingParams
from kvray.errors import InvalidArgumentError

pytestmark = pytest.mark.slow

PROMPTS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "Tell me a story about a dragon who learns to paint.",
    "The three primary colors are",
    "Copy the list: apples, pears, plums, cherries, grapes, lemons.\nCopy: apples,",
    "What is the best way to learn a new language?",
    "1, 1, 2, 3, 5, 8,",
    "Write a haiku about winter mornings.",
]
ARGS = dict(dtype="float32", max_model_len=384, max_num_batched_tokens=64, kv_cache_memory_bytes=96 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def plain_tokens(smollm2_path):
    llm = LLM(model=str(smollm2_path), **ARGS)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def draft_llm(target, draft, k=3, **overrides) -> LLM:
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    return LLM(model=str(target), speculative_config=spec, **{**ARGS, **overrides})


def test_a_random_draft_is_mostly_rejected_and_changes_no_token(smollm2_path, tiny_draft, plain_tokens):
    llm = draft_llm(smollm2_path, tiny_draft)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == plain_tokens
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate < 0.2
    assert_no_leaks(llm)


def test_the_target_as_its_own_draft_is_mostly_kept(smollm2_path, plain_tokens):
    llm = draft_llm(smollm2_path, smollm2_path, k=4)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == plain_tokens
    assert llm.engine.spec_stats.acceptance_rate > 0.8
    # sampled requests, n > 1: every sample runs to its length, and nothing stays used
    outs = llm.generate(
        PROMPTS[:2], SamplingParams(temperature=0.8, n=2, max_tokens=16, seed=1, ignore_eos=True)
    )
    assert all(len(c.token_ids) == 16 for o in outs for c in o.outputs)
    assert_no_leaks(llm)


def test_preempted_requests_recompute_their_draft_cache(smollm2_path, plain_tokens):
    """18 blocks of target + draft K/V for 8 requests of ~40 tokens: preemptions free
    blocks whose draft K/V the request must then compute again."""
    llm = draft_llm(smollm2_path, smollm2_path, max_model_len=256, kv_cache_memory_bytes=18 * 2 * 737_280)
    assert llm.kv_cache_stats().total_blocks == 18
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == plain_tokens
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


def test_a_draft_of_another_vocabulary_is_refused(smollm2_path, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    config.architectures = ["LlamaForCausalLM"]
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(InvalidArgumentError) as e:
        draft_llm(smollm2_path, tmp_path)
    assert e.value.field == "speculative_config.model" and "49152" in e.value.allowed


def test_a_draft_of_a_shorter_context_is_refused(smollm2_path, tiny_draft):
    """The tiny draft covers 2,048 positions; a target run at 4,096 needs more."""
    with pytest.raises(InvalidArgumentError) as e:
        draft_llm(smollm2_path, tiny_draft, max_model_len=4096, kv_cache_memory_bytes=1 << 30)
    assert e.value.field == "speculative_config.model" and "4096" in e.value.allowed


def test_long_prompts_catch_the_draft_up_in_chunks_of_the_budget(smollm2_path, tiny_draft):
    """Three 150-token prompts reach decoding together: the draft's catch-up (450 tokens)
    runs as forwards of at most max_num_batched_tokens = 64, and the tokens still equal
    plain decoding's."""
    prompts = [{"prompt_token_ids": list(range(1000 + 150 * i, 1150 + 150 * i))} for i in range(3)]
    want = [o.outputs[0].token_ids for o in LLM(model=str(smollm2_path), **ARGS).generate(prompts, GREEDY)]
    llm = draft_llm(smollm2_path, tiny_draft)
    sizes = []
    real = llm.engine.speculator.drafter.runner.run
    llm.engine.speculator.drafter.runner.run = lambda plan: sizes.append(len(plan.input_ids)) or real(plan)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert max(sizes) <= 64 and sum(sizes) >= 450
    assert_no_leaks(llm)
