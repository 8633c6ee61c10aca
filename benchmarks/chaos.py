"""Chaos as a user meets it: `kvray serve` (the PD preset by default) under `kvray bench
serve` load while worker processes are killed with SIGKILL at given times; how many
requests failed, how many moved, and how long the pools took to come back.

The default is the measurement of issue 12: 8 streaming clients, 24 requests, the decode
worker killed at 30 s and the prefill worker 25 s later.

    python benchmarks/chaos.py [--config smollm2-cpu-pd] [--kill decode:30,prefill:55]
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

from serve_harness import Server, cpu_banner, run_load

TITLES = {"decode": "DecodeWorker", "prefill": "PrefillWorker", "mixed": "MixedWorker"}


def worker_pids(leader: int, role: str) -> list[int]:
    """Processes of `leader`'s session whose title names the role's worker actor."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(fields[3]) == leader and TITLES[role] in title:
            pids.append(int(entry.name))
    return sorted(pids)


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def killer(leader: int, plan: list[tuple[str, float]], log: list, start: float) -> None:
    for role, at in plan:
        time.sleep(max(0.0, start + at - time.monotonic()))
        pids = worker_pids(leader, role)
        if pids:
            os.kill(pids[0], signal.SIGKILL)
        log.append((role, round(time.monotonic() - start, 1), pids[:1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="smollm2-cpu-pd")
    ap.add_argument("--kill", default="decode:30,prefill:55")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=96)
    args = ap.parse_args()
    plan = [(r, float(t)) for r, t in (item.split(":") for item in args.kill.split(","))]
    load = [
        "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
        "--ignore-eos", "--disable-tqdm", "--seed", "1",
    ]  # fmt: skip
    with Server(args.config, log="/tmp/kvray-chaos.log") as server:
        killed: list = []
        start = time.monotonic()
        thread = threading.Thread(target=killer, args=(server.proc.pid, plan, killed, start), daemon=True)
        thread.start()
        result = run_load(server.url, "smollm2-135m-instruct", load)
        elapsed = time.monotonic() - start
        thread.join()
        migrations = metric(server.url, "kvray:request_migrations_total")
        back = None
        while back is None and time.monotonic() - start < elapsed + 180:
            if all(worker_pids(server.proc.pid, role) for role, _ in plan):
                back = time.monotonic() - start
            time.sleep(1)
    failed = result["num_prompts"] - result["completed"]
    print(cpu_banner())
    print(f"config {args.config}; {args.num_prompts} streamed requests, {args.max_concurrency} concurrent, "
          f"{args.output_len} tokens each; killed (role, s, pid): {killed}\n")  # fmt: skip
    print("| requests | completed | failed | moved mid-stream | load took s | workers all back at s |")
    print("|---|---|---|---|---|---|")
    print(f"| {result['num_prompts']} | {result['completed']} | {failed} | {migrations:g} | {elapsed:.0f} | "
          f"{back if back is None else round(back)} |")  # fmt: skip
    for err in [e for e in result.get("errors") or [] if e][:5]:
        print("error:", err)


if __name__ == "__main__":
    main()
