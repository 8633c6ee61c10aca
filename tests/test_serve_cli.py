"""`kvray serve` as a user runs it: the front door, end to end.

A subprocess runs `kvray serve --config <colocated CPU preset, small limits, two ingress
replicas> --port N` and starts a Ray of its own (RAY_ADDRESS unset; temp dir under a folder
of this test's). It answers /health, a chat completion and embeddings through the official
`openai` client; both ingress replicas answer and every /metrics scrape shows the whole app (one
Router behind them). SIGINT then stops it: it exits 0 and every process it started, Ray's
included, is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvray.cluster.ports import free_port  # noqa: E402

pytestmark = pytest.mark.slow

PRESET = Path(__file__).resolve().parent.parent / "configs" / "smollm2-cpu.yaml"
MODEL = "smollm2-135m-instruct"
STARTUP_SECONDS = 150


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _kvray_command() -> list[str]:
    script = Path(sys.executable).with_name("kvray")  # the console script pip installed
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvray.cluster.cli"]


def _wait_healthy(proc: subprocess.Popen, base: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"kvray serve exited with {proc.returncode}:\n{log.read_text()}"
        try:
            if _get(f"{base}/health")[0] == 200:
                return
        except OSError:  # not listening yet
            pass
        time.sleep(0.5)
    raise AssertionError(f"no healthy /health after {STARTUP_SECONDS} s:\n{log.read_text()}")


def _ours(ray_tmp: str, started: list[psutil.Process]) -> list[psutil.Process]:
    """Processes still alive that the server started, or that run in its Ray temp dir."""
    alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(ray_tmp in arg for arg in p.info["cmdline"] or []) and p not in alive:
                alive.append(p)
        except psutil.Error:
            pass
    return alive


def _metric(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_kvray_serve_answers_then_sigint_stops_everything_it_started(tmp_path, smollm2_path):
    config = yaml.safe_load(PRESET.read_text())
    config["engine"].update(model=str(smollm2_path), max_model_len=512, kv_cache_memory_bytes=48 << 20)
    config["num_replicas"] = 2
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(yaml.safe_dump(config))
    ray_tmp = tempfile.mkdtemp(prefix="kvt-")  # short: Ray's socket paths must fit in 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, not a test's
    env.update(TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    started: list[psutil.Process] = []
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*_kvray_command(), "serve", "--config", str(config_path), "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C of pytest reaches it only through this test
        )
    try:
        _wait_healthy(proc, base, log)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0
        )
        assert r.choices[0].message.content and 0 < r.usage.completion_tokens <= 8
        vectors = client.embeddings.create(model="all-minilm-l6-v2", input=["a cat", "a dog"]).data
        assert [len(v.embedding) for v in vectors] == [384, 384]  # the preset's embedding worker

        replicas = set()
        for _ in range(60):  # the proxy spreads requests over both ingress replicas
            status, body = _get(f"{base}/health")
            health = json.loads(body) if body.startswith(b"{") else {}  # an error page: shown below
            assert status == 200 and "workers" in health, (status, body, log.read_text()[-3000:])
            workers = health["workers"]
            assert list(workers) == ["mixed"] and len(workers["mixed"]) == 1
            replicas.add(health["replica"])
            if len(replicas) == 2:
                break
        assert len(replicas) == 2, replicas
        # The replica that served it publishes within 0.2 s, so the other one may show 0 until
        # then: wait for 8 answers in a row that show it (the proxy picks a replica each time).
        deadline, streak = time.monotonic() + 20, 0
        while streak < 8:
            seen = _metric(_get(f"{base}/metrics")[1].decode(), "kvray:request_success_total")
            streak = streak + 1 if seen == 1 else 0
            assert time.monotonic() < deadline, "the other replica's metrics never arrived"
            time.sleep(0.1)
        for _ in range(8):  # whichever replica answers, it shows the whole app
            text = _get(f"{base}/metrics")[1].decode()
            assert _metric(text, "kvray:request_success_total") == 1
            assert _metric(text, "kvray:request_queue_time_seconds_count") == 1
            assert _metric(text, "kvray:generation_tokens_total") == r.usage.completion_tokens

        started = psutil.Process(proc.pid).children(recursive=True)
        assert started, "no Ray processes under kvray serve"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, log.read_text()
        deadline = time.monotonic() + 30
        while _ours(ray_tmp, started) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [(p.pid, p.cmdline()) for p in _ours(ray_tmp, started)]
        assert not left, left
        assert "kvray: shutting down" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in _ours(ray_tmp, started):  # only what this test's server started, by pid
            try:
                p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
