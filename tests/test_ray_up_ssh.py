"""`ray up` for real: Ray's cluster launcher (the `local` provider) brings kvray up over SSH
on three nodes made of network namespaces, each with its own sshd, home and PID namespace
(cluster/ray-up/netns.yaml), and `ray down` takes it away.

The launcher SSHes into the head, runs the setup commands, starts Ray there with the
autoscaler, which SSHes into the two workers and starts Ray on them; the head deploys the
colocated preset in the background. The app must then answer greedy completions exactly
as the offline engine does, and after `ray down` no Ray process is left on any node.
`make test-ray-up` runs this module alone.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import pytest

from kvray.cluster.netns import NamespaceCluster
from kvray.cluster.netns_ssh import node_home, start_ssh, write_ray_up_config
from kvray.cluster.netns_tools import check_can_run, ray_command
from kvray.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow
if why := check_can_run():
    pytest.skip(why, allow_module_level=True)

PROMPT = "The capital of France is"
MAX_TOKENS = 24
RAY_PROCESSES = ("raylet", "gcs_server")
# Ray 2.60's v2 autoscaler, which `ray up` turns on, starts only the first of the local
# provider's workers (seen: the second stays pending); the v1 autoscaler starts them all
LAUNCHER_ENV = {"RAY_UP_enable_autoscaler_v2": "0"}


@pytest.fixture(scope="module")
def launched():
    subnet = f"10.216.{uuid.uuid4().int % 200 + 20}"
    cluster = NamespaceCluster(f"kvu{uuid.uuid4().hex[:5]}", nodes=3, subnet=subnet)
    try:
        cluster.up(start_ray=False)
        start_ssh(cluster)
        config = write_ray_up_config(cluster, "smollm2-cpu")
        cluster.run(
            0, [ray_command(), "up", "-y", "--no-config-cache", str(config)], env=LAUNCHER_ENV, timeout=600
        )
        yield cluster, config
    finally:
        cluster.down()


def _completion(cluster: NamespaceCluster) -> str:
    body = json.dumps(
        {
            "model": "smollm2-135m-instruct",
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }  # fmt: skip
    ).encode()

    def post() -> str:
        request = urllib.request.Request(
            f"http://{cluster.ip(0)}:8000/v1/completions", body, {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as r:
            return json.loads(r.read())["choices"][0]["text"]

    return cluster.call(0, post).result()


def _wait_deployed(cluster: NamespaceCluster, timeout_s: float = 600) -> None:
    log = node_home(cluster, 0) / "kvray-deploy.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if "kvray: deployed at" in text:
            return
        if "Traceback" in text or "kvray: error" in text:
            raise AssertionError(text[-3000:])
        time.sleep(2)
    text = log.read_text()[-3000:] if log.exists() else "(no log)"
    raise AssertionError(f"not deployed after {timeout_s} s: {text}")


def _updater_log(cluster: NamespaceCluster) -> str:
    """The raylets found per node and the head autoscaler's lines on setting the workers up."""
    raylets = [cluster.process(n, "raylet") for n in range(cluster.nodes)]
    logs = sorted((cluster.root / "tmp0").glob("ray/session_*/logs/monitor.out"))
    lines = logs[-1].read_text(errors="replace").splitlines() if logs else ["(no monitor.out)"]
    wanted = [
        line for line in lines if any(w in line for w in ("updater", "NodeUpdater", "Exception", "rror"))
    ]
    return f"raylet per node: {raylets}\n" + "\n".join(wanted[-30:])


def test_ray_up_over_ssh_serves_and_ray_down_removes_it(launched, smollm2_path):
    cluster, config = launched
    _wait_deployed(cluster)
    # every node joined: the head's autoscaler started Ray on the workers over SSH
    deadline = time.monotonic() + 300
    while not all(cluster.process(n, "raylet") for n in range(cluster.nodes)):
        assert time.monotonic() < deadline, _updater_log(cluster)
        time.sleep(2)
    expected = LLM(model=str(smollm2_path), dtype="auto", quantization="gguf").generate(  # as the preset
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )[0]
    assert _completion(cluster) == expected.outputs[0].text

    cluster.run(0, [ray_command(), "down", "-y", str(config)], env=LAUNCHER_ENV, timeout=300)
    # `ray down` stops the head's Ray; a worker's raylet exits once the GCS has been gone
    # for Ray's reconnect timeout (gcs_rpc_server_reconnect_timeout_s, 60 s)
    deadline = time.monotonic() + 180
    left = []
    while time.monotonic() < deadline:
        left = [(n, name) for n in range(cluster.nodes) for name in RAY_PROCESSES if cluster.process(n, name)]
        if not left:
            break
        time.sleep(2)
    assert not left, f"Ray processes left after ray down: {left}"
