"""Node faults under load, timed: three Ray nodes in network namespaces (cluster/netns.py),
the PD app with its prefill worker on node 1 and its decode worker on node 2
(`smollm2-cpu-pd-nodes`, every prompt handed off), four clients streaming greedy
completions from the head while one fault happens:

* the prefill node or the decode node killed (SIGKILL to every process in it), Ray started
  on it again 3 s later (a machine that reboots);
* the decode node cut off for 20 s (every packet dropped) and healed.

For each: requests lost, streams equal to the offline engine's, the longest gap between
two tokens of one stream, and from the fault: when the Router stopped listing the lost
worker (detected), when a new worker of that role was listed (replaced), and when every
request in flight at the fault had finished.

    sudo python benchmarks/node_faults.py [--faults prefill-kill decode-kill decode-cut]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request
import uuid

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_harness import cpu_banner  # noqa: E402

from kvray.cluster.netns import NamespaceCluster  # noqa: E402
from kvray.cluster.netns_tools import kvray_command  # noqa: E402
from kvray.engine import LLM, SamplingParams  # noqa: E402
from kvray.router.ingress_parts import PRESETS  # noqa: E402

HEAD, PREFILL, DECODE = 0, 1, 2
PROMPTS = [f"Write a short story about a {w} who learns to sail." for w in
           ("cat", "robot", "baker", "pilot", "child", "giant", "poet", "farmer")]  # fmt: skip
MAX_TOKENS = 96


def deploy(cluster: NamespaceCluster, engine: dict) -> None:
    preset = yaml.safe_load((PRESETS / "smollm2-cpu-pd-nodes.yaml").read_text())
    preset["engine"].update(engine)
    preset["router"].update(num_replicas=1, max_local_prefill_length=0)
    path = cluster.root / "app.yaml"
    path.write_text(yaml.safe_dump(preset))
    argv = [kvray_command(), "deploy", "--address", cluster.head_address, "--config", str(path)]
    cluster.run(HEAD, [*argv, "--host", cluster.ip(HEAD), "--port", "8000"], timeout=600)


def workers(cluster: NamespaceCluster) -> dict[str, str]:
    """worker id -> role, as the Router lists them in /metrics."""

    def get() -> str:
        url = f"http://{cluster.ip(HEAD)}:8000/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    out = {}
    for line in cluster.call(HEAD, get).result().splitlines():
        if line.startswith("kvray:num_requests_running{"):
            labels = dict(
                part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            out[labels["worker"].strip('"')] = labels["role"].strip('"')
    return out


def stream(cluster: NamespaceCluster, prompt: str, log: list) -> None:
    """One streamed completion; appends (prompt, text, token times, error)."""

    def run() -> None:
        body = json.dumps({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": MAX_TOKENS,
                           "temperature": 0, "ignore_eos": True, "stream": True}).encode()  # fmt: skip
        request = urllib.request.Request(
            f"http://{cluster.ip(HEAD)}:8000/v1/completions", body, {"content-type": "application/json"}
        )
        text, times, error = "", [], None
        try:
            with urllib.request.urlopen(request, timeout=900) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("error"):
                            error = chunk["error"]["message"]
                        elif chunk.get("choices"):
                            text += chunk["choices"][0].get("text", "")
                            times.append(time.monotonic())
        except Exception as e:  # noqa: BLE001 (a lost request, counted)
            error = repr(e)
        log.append((prompt, text, times, error))

    cluster.call(HEAD, run).result()


def one_fault(cluster: NamespaceCluster, fault: str, offline: dict[str, str]) -> str:
    role = "prefill" if fault.startswith("prefill") else "decode"
    node = PREFILL if role == "prefill" else DECODE
    before = {w for w, r in workers(cluster).items() if r == role}
    log: list = []
    clients = [threading.Thread(target=stream, args=(cluster, p, log)) for p in PROMPTS]
    for c in clients:
        c.start()
    time.sleep(3)  # every stream is running
    fault_at = time.monotonic()
    if fault.endswith("kill"):
        cluster.kill(node)
        threading.Timer(3, cluster.restart, args=(node,)).start()
    else:
        cluster.partition(node)
        threading.Timer(20, cluster.heal, args=(node,)).start()
    detected = replaced = None
    while replaced is None and any(c.is_alive() for c in clients) and time.monotonic() - fault_at < 600:
        try:
            listed = {w for w, r in workers(cluster).items() if r == role}
        except OSError:
            listed = before
        now = time.monotonic() - fault_at
        if detected is None and not (before & listed):
            detected = now
        if listed - before:
            replaced = now
        time.sleep(0.5)
    for c in clients:
        c.join()
    finished = max(t[-1] for _, _, t, _ in log if t) - fault_at
    lost = sum(1 for _, text, _, error in log if error or not text)
    same = sum(1 for prompt, text, _, _ in log if text == offline[prompt])
    gap = max(max(b - a for a, b in zip(t, t[1:])) for _, _, t, _ in log if len(t) > 1)

    def secs(x):
        return "-" if x is None else f"{x:.1f}"

    return (f"| {fault} | {len(log)} | {lost} | {same}/{len(log)} | {gap:.1f} | {secs(detected)} | "
            f"{secs(replaced)} | {finished:.1f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", nargs="+", default=["prefill-kill", "decode-kill", "decode-cut"])
    args = parser.parse_args()
    print(cpu_banner())
    engine = {"dtype": "float32", "max_model_len": 1024}
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = LLM(model="smollm2-135m-instruct", **engine).generate(PROMPTS, greedy)
    offline = {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}
    cluster = NamespaceCluster(f"kvf{uuid.uuid4().hex[:5]}", 3, "10.218.0",
                               [{}, {"kvray_prefill": 1}, {"kvray_decode": 1}], rate="1gbit")  # fmt: skip
    try:
        cluster.up()
        deploy(cluster, engine)
        rows = [
            "| fault | requests | lost | equal to offline | longest token gap (s) | "
            "detected (s) | replaced (s) | all done (s) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for fault in args.faults:
            rows.append(one_fault(cluster, fault, offline))
            print(rows[-1], flush=True)
            time.sleep(5)
        print("\n".join(rows))
    finally:
        cluster.down()


if __name__ == "__main__":
    main()
