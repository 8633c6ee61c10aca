"""Several nodes for real: the PD app across three Ray nodes made of network namespaces,
and node and network faults under streaming load.

Node 0 is the head (the OpenAI endpoint, the Router, Serve's controller, its GCS keeping
its state in a Redis on the head), node 1 offers `kvray_prefill` and node 2
`kvray_decode` (the `smollm2-cpu-pd-nodes` preset), so every KV pull crosses a link.
Greedy streams from a client on the head must equal the offline engine's text whatever
happens: the prefill node or the decode node killed (every process in it) and brought
back, the decode node cut off for 20 s and healed, 5 % packet loss, a 100 Mbit link, the
head's GCS killed and restarted. Afterwards no worker holds a used or pinned block and
both pools are back to one worker.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
import uuid

import pytest
import yaml

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvray.cluster.netns import NamespaceCluster  # noqa: E402
from kvray.cluster.netns_tools import check_can_run, kvray_command  # noqa: E402
from kvray.engine import LLM, SamplingParams  # noqa: E402
from kvray.router.ingress_parts import PRESETS  # noqa: E402

pytestmark = pytest.mark.slow
if why := check_can_run():
    pytest.skip(why, allow_module_level=True)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a town by the sea,",
    "Rain falls",
    "A list of prime numbers: 2, 3, 5,",
    "The best way to learn a language is",
]
MAX_TOKENS = 64
HEAD, PREFILL, DECODE = 0, 1, 2
REDIS_PORT, REDIS_PASSWORD = 6380, "kvray-test"


@pytest.fixture(scope="module")
def offline(engine_args) -> list[str]:
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in LLM(**engine_args).generate(PROMPTS, greedy)]


@pytest.fixture(scope="module")
def nodes(engine_args, tmp_path_factory):
    """Three nodes, the PD app deployed on them; torn down whatever happens."""
    cluster = NamespaceCluster(
        f"kvt{uuid.uuid4().hex[:5]}",
        nodes=3,
        subnet=f"10.214.{uuid.uuid4().int % 200 + 20}",
        resources=[{}, {"kvray_prefill": 1, "kvray_shard": 1}, {"kvray_decode": 1, "kvray_shard": 1}],
        rate="1gbit",
        # Ray's GCS fault tolerance: the head's GCS keeps its state in Redis on the head
        head_env={"RAY_REDIS_ADDRESS": f"{{head}}:{REDIS_PORT}"},
        head_args=["--redis-password", REDIS_PASSWORD, "--redis-username", "default"],
    )
    cluster.head_env["RAY_REDIS_ADDRESS"] = cluster.head_env["RAY_REDIS_ADDRESS"].format(
        head=cluster.ip(HEAD)
    )
    preset = yaml.safe_load((PRESETS / "smollm2-cpu-pd-nodes.yaml").read_text())
    preset["engine"] = engine_args
    preset["router"].update(num_replicas=1, max_local_prefill_length=0)  # every prompt handed off
    config = tmp_path_factory.mktemp("nodes") / "pd-nodes.yaml"
    config.write_text(yaml.safe_dump(preset))
    try:
        cluster.up(start_ray=False)
        cluster.start_redis(HEAD, REDIS_PORT, REDIS_PASSWORD)
        for node in range(cluster.nodes):
            cluster.start_ray(node)
        deploy = [kvray_command(), "deploy", "--address", cluster.head_address, "--config", str(config)]
        cluster.run(HEAD, [*deploy, "--host", cluster.ip(HEAD), "--port", "8000"], timeout=300)
        yield cluster
    finally:
        cluster.down()


def _base(cluster: NamespaceCluster) -> str:
    return f"http://{cluster.ip(HEAD)}:8000"


def _stream(cluster: NamespaceCluster, prompt: str):
    def run() -> str:
        client = openai.OpenAI(base_url=f"{_base(cluster)}/v1", api_key="-", max_retries=0, timeout=600)
        stream = client.completions.create(
            model="smollm2-135m-instruct",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    return cluster.call(HEAD, run)


def _metrics(cluster: NamespaceCluster) -> dict[tuple[str, str], float]:
    """(metric, worker role) -> its sum over the workers the Router knows; ("workers", role)
    -> how many there are."""

    def get() -> str:
        with urllib.request.urlopen(f"{_base(cluster)}/metrics", timeout=30) as r:
            return r.read().decode()

    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(cluster.call(HEAD, get).result()):
        for s in family.samples:
            if "role" in s.labels and "le" not in s.labels:
                key = (s.name, s.labels["role"])
                out[key] = out.get(key, 0.0) + s.value
                if s.name == "kvray:num_requests_running":
                    out[("workers", key[1])] = out.get(("workers", key[1]), 0) + 1
    return out


def _settled(cluster: NamespaceCluster, timeout_s: float = 240) -> dict:
    """Wait until one prefill and one decode worker serve and none holds a block."""
    deadline = time.monotonic() + timeout_s
    seen: dict = {}
    while time.monotonic() < deadline:
        try:
            seen = _metrics(cluster)
        except OSError:
            seen = {}
        if (
            seen.get(("workers", "prefill")) == 1
            and seen.get(("workers", "decode")) == 1
            and seen.get(("kvray:kv_cache_usage_perc", "prefill")) == 0
            and seen.get(("kvray:kv_cache_usage_perc", "decode")) == 0
        ):
            return seen
        time.sleep(1)
    raise AssertionError(f"pools not back to one idle worker each: {seen}")


def _under_fault(cluster: NamespaceCluster, fault, heal, first: bool = False) -> list[str]:
    """Stream every prompt; once they have started (or before, if `first`), `fault()`;
    then `heal()`; the texts."""
    if first:
        fault()
    futures = [_stream(cluster, p) for p in PROMPTS]
    if not first:
        time.sleep(1.5)
        fault()
    heal()
    return [f.result(timeout=900) for f in futures]


def _moved(before: dict, after: dict) -> tuple[float, float]:
    """KV bytes the decode pool pulled, prompts it recomputed, between two readings."""

    def delta(name: str) -> float:
        return after.get((name, "decode"), 0) - before.get((name, "decode"), 0)

    return delta("kvray:kv_transfer_bytes_total"), delta("kvray:kv_recompute_total")


def test_pd_across_nodes_pulls_kv_over_the_link(nodes, offline):
    before = _settled(nodes)
    texts = _under_fault(nodes, lambda: None, lambda: None)
    assert texts == offline
    moved, recomputed = _moved(before, _settled(nodes))
    assert moved > 0 and recomputed == 0  # every prompt's KV crossed the link


@pytest.mark.parametrize("link", ["5% loss", "100 Mbit"])
def test_pulls_cross_a_lossy_or_slow_link(nodes, offline, link):
    shape = {"5% loss": {"rate": "1gbit", "loss": 0.05}, "100 Mbit": {"rate": "100mbit"}}[link]
    before = _settled(nodes)
    try:
        texts = _under_fault(
            nodes, lambda: [nodes.shape(n, **shape) for n in (PREFILL, DECODE)], lambda: None, first=True
        )
    finally:
        for n in (PREFILL, DECODE):
            nodes.shape(n, rate="1gbit")
    assert texts == offline
    moved, recomputed = _moved(before, _settled(nodes))
    assert moved > 0 and recomputed == 0


@pytest.mark.parametrize(
    "fault", ["prefill node killed", "decode node killed", "decode node cut off for 20 s"]
)
def test_streams_survive_a_lost_or_cut_off_node(nodes, offline, fault):
    def back(node, after_s):
        return lambda: (time.sleep(after_s), nodes.restart(node))

    plans = {
        "prefill node killed": (lambda: nodes.kill(PREFILL), back(PREFILL, 3)),
        "decode node killed": (lambda: nodes.kill(DECODE), back(DECODE, 3)),
        "decode node cut off for 20 s": (
            lambda: nodes.partition(DECODE),
            lambda: (time.sleep(20), nodes.heal(DECODE)),
        ),
    }
    texts = _under_fault(nodes, *plans[fault])
    assert texts == offline  # none lost, no token missing or twice
    _settled(nodes)  # both pools back to one worker, no block used or pinned


def test_streams_finish_across_a_restart_of_the_heads_gcs(nodes, offline):
    """With the GCS's state in Redis, its process killed and started again (as a supervisor
    would) while requests stream: the workers, the ingress and their streams live on."""

    def kill_then_restart():
        argv, env = nodes.kill_gcs()
        time.sleep(5)
        nodes.start_gcs(argv, env)

    texts = _under_fault(nodes, kill_then_restart, lambda: None)
    assert texts == offline
    assert nodes.process(HEAD, "gcs_server") is not None, nodes.log_tail(HEAD, "gcs_server.out")
    _settled(nodes)
    assert _under_fault(nodes, lambda: None, lambda: None) == offline  # and new requests are served


PIPELINE_DRIVER = """
import json, sys
import ray
from ray.util.placement_group import placement_group_table
from kvray.cluster.local import launch
from kvray.engine import SamplingParams

engine, prompts, max_tokens = json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
ray.init(address=sys.argv[1])
# one bundle per stage, each needing `kvray_shard`, which nodes 1 and 2 offer once each
pool = {"num_workers": 1, "num_cpus": 0.25, "torch_threads": 1, "resources": {"kvray_shard": 1}}
cluster = launch({"engine": {**engine, "pipeline_parallel_size": 2}, "disaggregated": False, "mixed": pool})
((_, _, pg),) = cluster.workers.values()
nodes = set(placement_group_table(pg)["bundles_to_node_id"].values())
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
texts = [cluster.complete(p, params).outputs[0].text for p in prompts]
cluster.shutdown()
print("RESULT " + json.dumps({"nodes": len(nodes), "texts": texts}))
"""


def test_a_pipeline_parallel_worker_whose_stages_are_on_two_nodes(nodes, offline, engine_args):
    """A pp=2 worker (local launch, no Serve) whose two stages sit on nodes 1 and 2: its
    process group and the hidden states between stages cross the link; the tokens are the
    offline engine's (a pipeline splits layers, not sums)."""
    argv = [sys.executable, "-c", PIPELINE_DRIVER, nodes.head_address, json.dumps(engine_args)]
    out = nodes.run(HEAD, [*argv, json.dumps(PROMPTS), str(MAX_TOKENS)], timeout=600).stdout
    result = json.loads(out.split("RESULT ", 1)[1])
    assert result["nodes"] == 2
    assert result["texts"] == offline
