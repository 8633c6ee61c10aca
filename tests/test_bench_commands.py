"""The README's `kvray bench` commands run as a user types them, at their smallest size
(issue 52, item 7): a documented command that dies is a defect a test must catch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _kvray() -> list[str]:
    script = Path(sys.executable).with_name("kvray")  # the console script pip installed
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvray.cluster.cli"]


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
