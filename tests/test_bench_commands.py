"""The README's `kvray bench` commands run as a user types them, at their smallest size
(issue 52, item 7): a documented command that dies is a defect a test must catch.

Each runs through the real `kvray` console script in a subprocess, `--quick` where the
benchmark has it, and its printed tables are read back: the rows it must print, with the
numbers that cannot be wrong at any size (counts, bytes, timings of a whole run) checked
as such. A decode rate or a step time measured as the slope between two short runs can
come out negative on a busy 2-core machine, so those are only checked to be numbers.
`kvray bench serve` runs against a live app in tests/test_serve_openai.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _kvray() -> list[str]:
    script = Path(sys.executable).with_name("kvray")  # the console script pip installed
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvray.cluster.cli"]


def _bench(*args: str, timeout: float = 600) -> str:
    """`kvray bench ARGS...`'s stdout; fails the test with its output's tail unless it exits 0.
    RAY_ADDRESS is dropped: a benchmark that needs Ray starts its own local one and stops it."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run(
        [*_kvray(), "bench", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run.stdout


def _table(stdout: str, header: str) -> list[list[str]]:
    """The body rows (cells stripped) of the first markdown table whose header row starts
    with `| header`."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header}"))
    rows = []
    for line in lines[start + 2 :]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _number(cell: str) -> float:
    """A table cell's number: `1,234.5`, `56 %`, `1.24x`, `**7.70**`."""
    return float(cell.strip("*").removesuffix("x").removesuffix("%").replace(",", "").strip())


@pytest.mark.slow
def test_bench_step_times_quick_writes_a_fitted_profile(tmp_path):
    """`kvray bench step-times --threads 2` (README: how to fit a machine's profile for
    `kvray sim`) once died passing a number where a buffer belongs."""
    out = tmp_path / "cpu-t2.json"
    run = subprocess.run(
        [*_kvray(), "bench", "step-times", "--threads", "2", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    profile = json.loads(out.read_text())
    assert "read bandwidth" in run.stdout and "fit:" in run.stdout
    assert profile and isinstance(profile, dict)


@pytest.mark.slow
def test_bench_offline_quick_times_kvray_against_the_roofline(smollm2_path):
    """`kvray bench offline` (`make bench`): the workload, the matmul roofline, kvray's run
    and transformers' `generate` on the same requests. vLLM's baseline is not run: it needs
    `--vllm PYTHON`, a vLLM install this machine lacks."""
    out = _bench("offline", "--model", str(smollm2_path), "--quick")
    # 4 requests of the mix (outputs 16-160 tokens), each capped at 16 output tokens
    assert "workload: 4 requests (mix)" in out and ", 64 output tokens" in out
    rows = {row[0]: [_number(c) for c in row[1:]] for row in _table(out, "engine")}
    assert list(rows) == ["kvray `LLM.generate`", "transformers `generate`, static batches of 16"]
    for seconds, useful, roofline, _ in rows.values():
        assert seconds >= 0 and useful > 0 and roofline >= 0  # printed to 0.1 s and 1 %
    assert "kvray / transformers: **" in out


@pytest.mark.slow
def test_bench_spec_quick_keeps_the_greedy_tokens(smollm2_path, tiny_draft):
    """`kvray bench spec`: plain, n-gram and a draft model's speculation (a tiny random
    draft: nearly all its proposals rejected) on both workloads at batches 1 and 2; every
    method's greedy tokens are plain decoding's, and n-gram lookup finds drafts in the
    grounded prompts (they ask the model to copy)."""
    out = _bench(
        "spec", "--model", str(smollm2_path), "--quick", "--draft", str(tiny_draft), "--draft-k", "2"
    )
    rows = _table(out, "workload")
    keys = [(r[0], r[1], r[2]) for r in rows]
    assert keys == [
        (w, b, m) for w in ("grounded", "open") for b in ("1", "2") for m in ("plain", "n-gram", "draft")
    ]
    for row in rows:
        assert _number(row[3]) > 0 and _number(row[5]) > 0, row  # tok/s and decode tok/s
        assert row[9] == "True", f"speculation changed the greedy tokens: {row}"
    grounded_ngram = [r for r in rows if r[0] == "grounded" and r[2] == "n-gram"]
    assert all(_number(r[7]) > 0 for r in grounded_ngram), grounded_ngram


@pytest.mark.slow
def test_bench_kv_int8_quick_halves_the_cache(smollm2_path):
    """`kvray bench kv-int8`: the int8 cache holds more blocks a GiB and pulls fewer bytes a
    token than the model-dtype one, its kernel runs, and both caches decode."""
    out = _bench("kv-int8", "--model", str(smollm2_path), "--quick")
    sizes = {row[0].split()[0]: [_number(c) for c in row[1:]] for row in _table(out, "cache | bytes")}
    assert list(sizes) == ["auto", "int8"]
    (auto_block, auto_blocks, auto_pull, auto_ms), (block, blocks, pull, ms) = sizes["auto"], sizes["int8"]
    assert 0 < block < auto_block and blocks > auto_blocks > 0 and 0 < pull < auto_pull
    assert auto_ms > 0 and ms > 0
    assert "| cache | decode tok/s, 4 x 32 | decode tok/s, 8 x 32 |" in out
    rates = _table(out, "cache | decode")
    assert [r[0] for r in rates] == ["auto", "int8"]
    assert all(math.isfinite(_number(c)) for r in rates for c in r[1:])


@pytest.mark.slow
def test_bench_tp_quick_runs_a_group_of_two(smollm2_path):
    """`kvray bench tp`: a tiny Llama at tp=1 and in a tp=2 group of Ray shard actors (a
    local Ray of its own, stopped when the group closes), the collectives alone between two
    gloo processes, and SmolLM2 at tp=1 and tp=2."""
    out = _bench("tp", "--quick")
    steps = _table(out, "engine | ms per step")
    assert [r[0] for r in steps] == ["one process (tp=1)", "tp=2 group (2 Ray shard actors, gloo)"]
    assert all(math.isfinite(_number(r[1])) for r in steps)
    assert out.count("| collective | per step |") == 2
    for model in ("Tiny Llama", "SmolLM2-135M"):
        rows = _table(out.split(f"{model}: collectives", 1)[1], "collective")
        assert [r[0] for r in rows][:3] == [
            "plan broadcast",
            "all-reduce [8, hidden] (p2p exchange)",
            "logits all-gather",
        ]
        assert all(_number(r[2]) > 0 for r in rows[:3]) and _number(rows[3][3]) > 0
    rates = _table(out, "tensor_parallel_size")
    assert [r[0] for r in rates] == ["1", "2"] and all(math.isfinite(_number(r[1])) for r in rates)


@pytest.mark.slow
def test_bench_kernel_ab_quick_builds_and_replays(smollm2_path):
    """`kvray bench kernel-ab --b DIR` (this checkout's kernels against themselves: both
    builds compile, one captured decode step replays on each) and `--phases` (the
    phase-timed build's table)."""
    kernels = str(ROOT / "kernels")
    out = _bench("kernel-ab", "--model", str(smollm2_path), "--b", kernels, "--quick")
    assert "a fused decode step: 4 rows x 32 context" in out
    builds = _table(out, "build")
    assert [r[0].split(":")[0] for r in builds] == ["a", "b"]
    assert all(_number(c) > 0 for r in builds for c in r[1:])

    out = _bench("kernel-ab", "--model", str(smollm2_path), "--phases", "--quick")
    phases = {r[0]: _number(r[1]) for r in _table(out, "phase")}
    assert phases.pop("the whole step") > 0
    assert len(phases) == 10 and phases["attention"] > 0 and phases["gate/up"] > 0


@pytest.mark.slow
def test_bench_planner_quick_serves_both_loads(smollm2_path):
    """`kvray bench planner`: the PD preset served under the planner (`kvray serve` in its
    own process group, with its own local Ray, stopped at the end), both loads through it
    and the pools' sizes read off /metrics. Too small a load to grow a pool: one worker each."""
    out = _bench("planner", "--quick")
    rows = _table(out, "load")
    assert [r[0] for r in rows] == ["long prompts", "long outputs"]
    for _, _, rate, prefill, decode in rows:
        assert _number(rate) > 0 and int(prefill) >= 1 and int(decode) >= 1
