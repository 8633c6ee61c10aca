"""Shared by the serving benchmarks: start a `kvray serve` (of this checkout, or of another
kvray source tree as the baseline) on a free loopback port, drive it with `kvray bench
serve`'s run loop, and stop it and everything it started.

A baseline tree (`--baseline-src`, e.g. a `git worktree` of an older commit) runs with the
same interpreter: a folder holding a `kvray` link to that tree goes first on PYTHONPATH, so
`import kvray` finds it before this checkout's editable install, in the server and in every
Ray worker it starts (they inherit the environment).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import serve as bench  # benchmarks/serve.py: kvray bench serve

from kvray.cluster.ports import free_port

SERVER_START_S = 600.0
SERVE_MAIN = "import sys; from kvray.cluster.cli import main; sys.exit(main())"


def cpu_banner() -> str:
    """The CPU model (with its family and model numbers: a VM may name only the vendor) and
    its vector flags (this machine's kind decides the dtype's speed)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    shown = sorted(f for f in info.get("flags", "").split() if f.startswith(("avx", "amx", "fma")))
    ids = ""
    if "cpu family" in info and "model" in info:
        ids = f" (family {info['cpu family']}, model {info['model']})"
    return f"CPU: {info.get('model name', '?')}{ids}, {os.cpu_count()} cores, flags: {' '.join(shown) or '?'}"


def baseline_env(src: str | None) -> dict[str, str]:
    """The environment that makes `import kvray` load `src` (None: this checkout)."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    if src is None:
        return env
    shim = Path(tempfile.mkdtemp(prefix="kvray-baseline-"))
    (shim / "kvray").symlink_to(Path(src).resolve(), target_is_directory=True)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class Server:
    """`kvray serve --config <config>` in its own process group, until `stop()`."""

    def __init__(self, config: str, src: str | None = None, log: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log or os.devnull, "w")  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, "-c", SERVE_MAIN, "serve", "--config", config, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, env=baseline_env(src), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = SERVER_START_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvray serve exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"kvray serve not healthy after {timeout:.0f} s")

    def stop(self) -> None:
        """SIGINT (kvray serve tears down its Ray), then the whole group if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()

    def __enter__(self) -> Server:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_load(base_url: str, model: str, bench_args: list[str]) -> dict:
    """One `kvray bench serve` run against `base_url`; its result dict."""
    args = bench.build_parser().parse_args(["--base-url", base_url, "--model", model, *bench_args])
    return asyncio.run(bench.run_benchmark(args))


def preset_file(preset: str, edit: Callable[[dict], None], name: str) -> str:
    """`preset`'s fields as set there, changed in place by `edit`, written to
    /tmp/kvray-bench-<name>.yaml for `kvray serve --config`; returns the path."""
    import yaml

    from kvray.router.ingress_parts import load_config

    config = load_config(preset).model_dump(exclude_unset=True)
    edit(config)
    path = Path(f"/tmp/kvray-bench-{name}.yaml")
    path.write_text(yaml.safe_dump(config))
    return str(path)
