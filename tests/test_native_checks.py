"""The checked build of the native kernels (KVRAY_NATIVE_CHECKS=1, which the whole suite
runs on: tests/conftest.py): a block id or a slot outside the cache stops the process with
a message naming it, before a kernel reads or writes there. Each bad call runs in a process
of its own (it aborts); a cache of 2 blocks of 4 tokens, so the bounds are by hand."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvray.kernels import cpu_native

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no native kernels here")

SETUP = """
import torch
from kvray.kernels import cpu_native
torch.manual_seed(0)
k = torch.randn(2, 4, 1, 32)  # 2 blocks of 4 tokens, 1 KV head of 32
v, q, out = torch.randn(2, 4, 1, 32), torch.randn(1, 1, 32), torch.empty(1, 1, 32)
"""
DECODE = (
    SETUP
    + """
table = torch.tensor([[{a}, {b}]], dtype=torch.int32)  # a 6-token sequence: both entries used
cpu_native.paged_decode(q, out, k, v, table, torch.tensor([6], dtype=torch.int32),
                        torch.tensor([0]), 32 ** -0.5, None)
print("ran", out.abs().sum().item() > 0)
"""
)
LAYERS = (
    SETUP
    + """
from kvray.kernels import cpu_fused
shape = cpu_fused.DecodeShape(hidden=32, num_q_heads=1, num_kv_heads=1, head_dim=32, intermediate=32,
                              block_size=4, num_blocks=2)
x, cs = torch.zeros(1, 32), torch.zeros(1, 16)
cpu_fused.decode_layers((cpu_fused.DecodeLayer * 0)(), shape, x, cs, cs, torch.tensor([{slot}]),
                        torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32),
                        torch.tensor([0]))
"""
)


def _run(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVRAY_NATIVE_CHECKS": "1"}
    cmd = [sys.executable, "-c", script]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_a_valid_table_runs_and_an_id_past_the_cache_stops_the_process_naming_it():
    ok = _run(DECODE.format(a=1, b=0))
    assert ok.returncode == 0 and "ran True" in ok.stdout, ok.stderr[-2000:]
    for a, b, bad in ((0, 2, "block 1: id 2"), (-1, 0, "block 0: id -1")):
        done = _run(DECODE.format(a=a, b=b))
        assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-2000:])
        assert f"sequence 0, {bad} outside the cache's [0, 2)" in done.stderr


def test_a_slot_past_the_cache_stops_the_fused_layers_naming_it():
    done = _run(LAYERS.format(slot=8))  # 2 blocks x 4 tokens: slots 0-7
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-2000:])
    assert "row 0: slot 8 outside the cache's [0, 8)" in done.stderr
