"""The autoscaling policy's `planner:` block in a live `kvray serve` (issue 16).

Serves the PD preset with both pools under the planner alone (every other autoscaling
signal off, 1-2 workers each) and drives two contrasting loads through `kvray bench serve`:
long prompts with two output tokens, then short prompts with long outputs. While each load
runs, the pools' sizes are read off `/metrics` (the workers the Router knows, per role).
The SLOs are set from the step-time profile so that one worker of each pool takes little
of what the other load needs: ttft = 1.5 x one long prompt's predicted prefill, tpot =
1.3 x one sequence's predicted decode step. What to expect: the long-prompt load grows the
prefill pool and not the decode pool; the long-output load the decode pool and not the
prefill pool.

    kvray bench planner [--profile sim/profiles/cpu-t1-served.json] [--quick]

`--quick`: each load at its smallest (2 requests, 2 at a time), a smoke run of the whole
path (the app up, both loads through it, the pools read off /metrics, the app down) too
small to make the planner grow a pool.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml
from serve_harness import Server, cpu_banner, run_load

from kvray.sim.cost_model import RequestWork, StepTimeModel

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
LOADS = {  # name: (prompt tokens, output tokens)
    "long prompts": (430, 2),
    "long outputs": (8, 128),
}
QUICK = {"num_prompts": 2, "max_concurrency": 2}  # --quick's sizes


def workers_by_role(url: str) -> dict[str, int]:
    """Workers per role in the app's `/metrics` (one series per worker)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    seen: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("kvray:num_requests_running{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(","))
            seen.setdefault(labels["role"].strip('"'), set()).add(labels["worker"])
    return {role: len(ids) for role, ids in seen.items()}


class PoolWatch:
    """Samples the pools' sizes every half second; keeps the peaks since `reset`."""

    def __init__(self, url: str):
        self.url, self.peak, self.now = url, {}, {}
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.now = workers_by_role(self.url)
                for role, n in self.now.items():
                    self.peak[role] = max(self.peak.get(role, 0), n)
            except OSError:
                pass
            time.sleep(0.5)

    def reset(self) -> None:
        self.peak = dict(self.now)

    def settle(self, want: dict[str, int], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.now.get(r) == n for r, n in want.items()):
                return True
            time.sleep(0.5)
        return False


def slos(profile: Path) -> tuple[float, float]:
    cost = StepTimeModel.from_dict(json.loads(profile.read_text())["fit"])
    prompt, _ = LOADS["long prompts"]
    ttft = 1.5 * cost.predict([RequestWork(prompt, prompt, True)])
    tpot = 1.3 * cost.predict([RequestWork(1, 200, True)])
    return ttft, tpot


def config(profile: Path, ttft: float, tpot: float) -> dict:
    cfg = yaml.safe_load((ROOT / "configs" / "smollm2-cpu-pd.yaml").read_text())
    cfg["engine"]["max_num_seqs"] = 16
    off = {
        "target_queued_prompt_tokens": None,
        "target_ttft_seconds": None,
        "target_kv_cache_usage": None,
        "target_running_requests": None,
        "target_itl_seconds": None,
    }
    for role in ("prefill", "decode"):
        cfg[role]["autoscaling"] = {
            "min_workers": 1,
            "max_workers": 2,
            "upscale_delay_s": 2.0,
            "downscale_delay_s": 15.0,
            "look_back_period_s": 4.0,
            **off,
            "planner": {
                "ttft_seconds": round(ttft, 3),
                "tpot_seconds": round(tpot, 4),
                "profile": str(profile),
                "window_seconds": 10.0,
            },
        }
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=ROOT / "sim" / "profiles" / "cpu-t1-served.json")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help=f"smallest sizes ({QUICK}; flags given win)")
    if ap.parse_known_args()[0].quick:
        ap.set_defaults(**QUICK)
    args = ap.parse_args()
    ttft, tpot = slos(args.profile)
    path = Path(tempfile.mkdtemp(prefix="kvray-planner-")) / "pd-planner.yaml"
    path.write_text(yaml.safe_dump(config(args.profile, ttft, tpot)))
    print(cpu_banner())
    print(f"profile {args.profile.name}; SLOs: TTFT {ttft:.2f} s, TPOT {tpot * 1e3:.1f} ms\n")
    rows = []
    with Server(str(path), log="/tmp/kvray-bench-planner.log") as server:
        watch = PoolWatch(server.url)
        for name, (prompt, output) in LOADS.items():
            if not watch.settle({"prefill": 1, "decode": 1}, timeout=180):
                print(f"pools did not settle back to 1:1 before {name!r}: {watch.now}")
            watch.reset()
            load = [
                "--dataset-name", "random", "--random-input-len", str(prompt),
                "--random-output-len", str(output), "--num-prompts", str(args.num_prompts),
                "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--disable-tqdm",
            ]  # fmt: skip
            r = run_load(server.url, MODEL, load)
            rows.append((name, prompt, output, r["request_throughput"], dict(watch.peak)))
            print(f"{name}: {r['request_throughput']:.2f} req/s, pool peaks {watch.peak}", flush=True)
        watch.stop.set()
    print("\n| load | prompt / output tokens | req/s | prefill workers (peak) | decode workers (peak) |")
    print("|---|---|---|---|---|")
    for name, prompt, output, rate, peak in rows:
        print(f"| {name} | {prompt} / {output} | {rate:.2f} | {peak.get('prefill')} | {peak.get('decode')} |")


if __name__ == "__main__":
    main()
