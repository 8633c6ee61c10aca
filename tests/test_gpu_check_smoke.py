"""`benchmarks/gpu_check.py` works before a GPU ever sees it.

`--cpu-smoke` runs every section's code path on tiny shapes under the Triton interpreter.
It runs in a fresh process (the script sets TRITON_INTERPRET itself) with the packages a
lent GPU machine lacks made unimportable, so an import that would break the one-shot GPU
run fails here first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
ABSENT_ON_GPU_MACHINE = ("ray", "pydantic", "gguf", "fastapi", "accelerate")
RUNNER = (
    "import runpy, sys\n"
    "for name in {absent!r}:\n"
    "    sys.modules[name] = None  # `import name` raises ImportError\n"
    "sys.path.insert(0, {folder!r})\n"
    "sys.argv = [{script!r}, *{args!r}]\n"
    "runpy.run_path({script!r}, run_name='__main__')\n"
)
HEADERS = [
    "## Kernel correctness vs float64",
    "| case | dtype | max rel err | bound | result |",
    "## Decode attention",
    "| batch | context | path | kvray ms | KV MB read | GB/s | of copy BW | SDPA ms | kvray/SDPA |",
    "## Prefill chunk attention",
    "| tokens | kvray ms | kvray TFLOP/s | SDPA ms | SDPA TFLOP/s | kvray/SDPA | matches SDPA |",
    "## Decode attention over 8-bit KV caches",
    "| kv_cache_dtype | ms | KV MB read | GB/s | time / model dtype's | rel err | cache writes | result |",
    "## Grouped low-bit weights (GGUF layouts) against cuBLAS bf16",
    "| format | rows | weight MB | grouped ms | cuBLAS dense ms | speed vs dense | GB/s | rel err | result |",
    "## Engine decode throughput",
    "| model | batch | prompt | dtype | kvray decode tok/s | transformers decode tok/s | ratio |",
    "## Targets",
]


def run_gpu_check(*args: str) -> subprocess.CompletedProcess:
    code = RUNNER.format(
        absent=ABSENT_ON_GPU_MACHINE, folder=str(SCRIPT.parent), script=str(SCRIPT), args=list(args)
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_cpu_smoke_writes_every_table(tmp_path):
    out = tmp_path / "gpu_check.md"
    result = run_gpu_check("--cpu-smoke", "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = out.read_text()
    for header in HEADERS:
        assert header in report, header
    assert "crashed" not in report and "FAIL" not in report and "| NO |" not in report
    assert "| split x" in report and "| plain |" in report  # both decode paths timed
    # 4 attention cases + cache writes, in 2 dtypes; the model-dtype and int8 caches; 6
    # grouped layouts (5 GGUF formats, int4 in groups of 128) at 2 row counts
    assert report.count("| ok |") == 24
    assert "| ok | ok |" in report  # the int8 cache's Triton writes agree with kv_quant
    # the engine's steps for kvray.sim's fit: 3 decode steps of the batch of 4 (8-token
    # prompts), then prompt steps of 1, 2 and 4 prompts
    steps = json.loads((tmp_path / "gpu_step_times.json").read_text())
    shapes = [[tuple(w) for w in s["batch"]] for s in steps["samples"]]
    # 8 prompt tokens + the token sampled by the prompt step, the warm-up step and 3 timed ones:
    # the next step computes position 13
    assert shapes[0] == [(1, 8 + 1 + 1 + 3, True)] * 4
    assert shapes[3:] == [[(8, 8, True)] * n for n in (1, 2, 4)]
    assert all(s["seconds"] > 0 for s in steps["samples"]) and steps["hf_config"]["hidden_size"] == 128


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_gpu_says_so_and_succeeds(tmp_path):
    result = run_gpu_check("--out", str(tmp_path / "never.md"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "No CUDA GPU" in result.stdout
    assert not (tmp_path / "never.md").exists()
