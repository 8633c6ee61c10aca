"""Soak: `kvray serve` under a long mixed load, watching for leaks.

16 clients (by default) loop for `--minutes`: streamed and plain completions and chats,
clients that leave mid-stream, bad requests (which must get a 4xx), and `n > 1`. Every
`--sample-s` seconds the RSS of every process of the server's session (the CLI, Ray's
workers: Serve proxy, ingress, Routers, engine workers) is read from /proc. At the end:
requests by outcome, 5xx count, KV blocks still used or pinned on the workers (from
/metrics, after the load stops), and each process's RSS after warm-up (the first
`--warmup-s`) against its last sample (flat: within ±10 %).

    python benchmarks/soak.py [--config smollm2-cpu] [--minutes 20] [--plot DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

import aiohttp
from serve_harness import Server, cpu_banner

MODEL = "smollm2-135m-instruct"
WORDS = "the a river city engine paged block cache prefill decode token stream worker".split()


def session_rss(leader: int) -> dict[str, tuple[str, int]]:
    """pid -> (title, RSS bytes) of every process in `leader`'s session (a Ray worker's
    title changes with the method it runs: the pid is the key)."""
    page = os.sysconf("SC_PAGE_SIZE")
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != leader:
                continue
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:60].strip()
            rss = int((entry / "statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
        out[entry.name] = (title, rss)
    return out


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120)))


async def one_request(http: aiohttp.ClientSession, url: str, rng: random.Random) -> str:
    """One request of a random kind; returns its outcome."""
    kind = rng.choice(["stream", "plain", "chat", "leave", "bad", "n"])
    body = {"model": MODEL, "max_tokens": rng.randint(4, 48), "temperature": 0.7, "seed": rng.randint(0, 9)}
    path = "/v1/completions"
    if kind == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": _prompt(rng)}]
    else:
        body["prompt"] = _prompt(rng)
    if kind in ("stream", "leave"):
        body["stream"] = True
    if kind == "n":
        body["n"] = rng.choice([2, 3, 4])
    if kind == "bad":
        body[rng.choice(["temperature", "max_tokens", "top_p"])] = -5
    async with http.post(url + path, json=body) as r:
        if r.status >= 500:
            return f"{r.status}"
        if kind == "bad":
            return "bad-4xx" if 400 <= r.status < 500 else f"bad-{r.status}"
        if r.status != 200:
            return f"{r.status}"
        if kind == "leave":  # read a few chunks, then go
            for _ in range(3):
                if not await r.content.readline():
                    break
            return "left"
        await r.read()
        return "ok"


async def client(url: str, until: float, seed: int, counts: dict) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while time.monotonic() < until:
            try:
                outcome = await one_request(http, url, rng)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                outcome = type(e).__name__
            counts[outcome] = counts.get(outcome, 0) + 1


async def sampler(leader: int, until: float, every: float, samples: list) -> None:
    start = time.monotonic()
    while time.monotonic() < until:
        samples.append((time.monotonic() - start, session_rss(leader)))
        await asyncio.sleep(every)


def blocks_left(url: str) -> tuple[float, float]:
    """(used, pinned) KV blocks over every worker, from /metrics."""
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    used = pinned = 0.0
    for line in text.splitlines():
        if line.startswith("kvray:kv_cache_used_blocks"):
            used += float(line.split()[-1])
        elif line.startswith("kvray:kv_pinned_blocks") or line.startswith("kvray:kv_pinned_requests"):
            pinned += float(line.split()[-1])
    return used, pinned


async def soak(url: str, leader: int, args) -> tuple[dict, list]:
    until = time.monotonic() + args.minutes * 60
    counts: dict[str, int] = {}
    samples: list = []
    tasks = [client(url, until, i, counts) for i in range(args.clients)]
    await asyncio.gather(sampler(leader, until, args.sample_s, samples), *tasks)
    return counts, samples


def rss_table(samples: list, warmup_s: float) -> list[tuple[str, float, float, float]]:
    """(process, RSS MiB after warm-up, last RSS MiB, change %) for processes seen throughout."""
    after = next((rss for t, rss in samples if t >= warmup_s), samples[0][1])
    last = samples[-1][1]
    rows = []
    for pid in sorted(set(after) & set(last), key=int):
        a, b = after[pid][1] / 2**20, last[pid][1] / 2**20
        if a > 50:  # the processes that matter (Ray's small helpers are not kvray's)
            rows.append((f"{pid} {last[pid][0][:50]}", a, b, (b - a) / a * 100))
    return rows


def plot(samples: list, folder: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pids = sorted({p for _, rss in samples for p, (_, v) in rss.items() if v > 50 * 2**20}, key=int)
    fig, ax = plt.subplots(figsize=(9, 5))
    for pid in pids:
        pts = [(t / 60, rss[pid][1] / 2**20) for t, rss in samples if pid in rss]
        title = samples[-1][1].get(pid, ("?", 0))[0]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{pid} {title[:36]}")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.legend(fontsize=6)
    Path(folder).mkdir(parents=True, exist_ok=True)
    fig.savefig(Path(folder) / "soak_rss.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="smollm2-cpu")
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--sample-s", type=float, default=10)
    ap.add_argument("--warmup-s", type=float, default=120)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--save", default=None, help="write the samples and counts as JSON")
    args = ap.parse_args()
    with Server(args.config, log="/tmp/kvray-soak.log") as server:
        counts, samples = asyncio.run(soak(server.url, server.proc.pid, args))
        time.sleep(5)  # the last aborts land
        used, pinned = blocks_left(server.url)
    rows = rss_table(samples, args.warmup_s)
    print(cpu_banner())
    print(f"{args.minutes:g} min, {args.clients} clients, config {args.config}\n")
    print("| outcome | requests |\n|---|---|")
    for outcome, n in sorted(counts.items()):
        print(f"| {outcome} | {n} |")
    fivexx = sum(n for o, n in counts.items() if o.startswith("5"))
    print(f"\n5xx: {fivexx}; KV blocks used after the load: {used:g}, pinned: {pinned:g}\n")
    print("| process | RSS after warm-up MiB | RSS at end MiB | change |\n|---|---|---|---|")
    for name, a, b, pct in rows:
        print(f"| {name} | {a:.0f} | {b:.0f} | {pct:+.1f} % |")
    if args.save:
        Path(args.save).write_text(json.dumps({"counts": counts, "samples": samples, "used": used}))
    if args.plot:
        try:
            plot(samples, args.plot)
        except ImportError:
            print("--plot needs matplotlib (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
