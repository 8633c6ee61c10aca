"""What arrives: requests with a time, a prompt length, an output length and an optional
shared prefix, from a length mix and an arrival process, or from a trace file.

The length mixes are lognormal fits to the means and spreads the DistServe paper reports
for its workloads (ShareGPT chat, LongBench summarisation, HumanEval code) and to the
32-request mix of kvray's own benchmarks; they are stand-ins for the datasets, which
are not on this machine.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    prefix_id: int | None = None  # requests with the same id share their first prefix_len tokens
    prefix_len: int = 0


@dataclass(frozen=True)
class LengthMix:
    """Lognormal prompt and output lengths (mean and coefficient of variation), clipped."""

    name: str
    prompt_mean: float
    prompt_cv: float
    output_mean: float
    output_cv: float
    max_prompt: int = 4096
    max_output: int = 1024
    min_len: int = 4

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return (
            _lognormal(rng, self.prompt_mean, self.prompt_cv, self.min_len, self.max_prompt),
            _lognormal(rng, self.output_mean, self.output_cv, 1, self.max_output),
        )


def _lognormal(rng: random.Random, mean: float, cv: float, lo: int, hi: int) -> int:
    sigma2 = math.log(1 + cv * cv)
    mu = math.log(mean) - sigma2 / 2
    return int(min(hi, max(lo, round(rng.lognormvariate(mu, math.sqrt(sigma2))))))


MIXES: dict[str, LengthMix] = {
    # DistServe's chatbot workload (ShareGPT): prompts ~ 760 tokens, outputs ~ 200
    "chatbot": LengthMix("chatbot", 760, 1.0, 200, 1.0, max_prompt=4096, max_output=1024),
    # DistServe's summarisation workload (LongBench): long prompts ~ 1,740, short outputs ~ 90
    "summarization": LengthMix("summarization", 1740, 0.5, 90, 0.7, max_prompt=7168, max_output=512),
    # DistServe's code-completion workload (HumanEval): short prompts ~ 170, outputs ~ 100
    "code": LengthMix("code", 170, 0.4, 100, 0.6, max_prompt=1024, max_output=512),
    # kvray's CPU benchmark load: prompts 32-384, outputs 16-160 (uniform there)
    "cpu-mix": LengthMix("cpu-mix", 208, 0.5, 88, 0.5, max_prompt=384, max_output=160, min_len=16),
}


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Gamma inter-arrival gaps with mean 1/rate (burstiness 1: Poisson; below 1: burstier),
    `vllm bench serve`'s --request-rate / --burstiness. rate inf: all at time 0."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(t)
    return times


def synthetic(
    mix: LengthMix,
    n: int,
    rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
    num_prefixes: int = 0,
    prefix_len: int = 0,
) -> list[SimRequest]:
    """n requests of the mix; with num_prefixes > 0 each shares one of that many prefixes
    of prefix_len tokens (capped at its prompt length minus one)."""
    rng = random.Random(seed + 1)
    out = []
    for i, t in enumerate(arrival_times(n, rate, burstiness, seed)):
        prompt, output = mix.sample(rng)
        prefix = rng.randrange(num_prefixes) if num_prefixes else None
        out.append(
            SimRequest(f"r{i}", t, prompt, output, prefix, min(prefix_len, prompt - 1) if prefix_len else 0)
        )
    return out


def load_trace(path: str | Path) -> list[SimRequest]:
    """A trace: CSV with a header, or JSON lines, with fields `time` (seconds),
    `prompt_len`, `output_len` and optionally `prefix_id` and `prefix_len`."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for i, row in enumerate(rows):
        try:
            prefix = row.get("prefix_id")
            out.append(
                SimRequest(
                    f"r{i}",
                    float(row["time"]),
                    int(row["prompt_len"]),
                    int(row["output_len"]),
                    None if prefix in (None, "") else int(prefix),
                    int(row.get("prefix_len") or 0),
                )
            )
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}: row {i + 1}: needs time, prompt_len, output_len ({e})") from None
        if out[-1].prompt_len < 1 or out[-1].output_len < 1:
            raise ValueError(f"{path}: row {i + 1}: prompt_len and output_len must be >= 1")
        if out[-1].prefix_len >= out[-1].prompt_len:
            raise ValueError(
                f"{path}: row {i + 1}: prefix_len must be below prompt_len ({out[-1].prompt_len})"
            )
    return sorted(out, key=lambda r: r.arrival_s)


def prompt_token_ids(req: SimRequest) -> list[int]:
    """Token ids standing in for the prompt: the shared prefix's are the same for every
    request of its prefix id, the rest unique to the request (so the prefix cache and the
    router's prefix affinity see exactly the sharing the workload describes)."""
    prefix_rng = random.Random(f"prefix-{req.prefix_id}")
    own_rng = random.Random(f"own-{req.request_id}")
    n_prefix = req.prefix_len if req.prefix_id is not None else 0
    return [prefix_rng.getrandbits(31) for _ in range(n_prefix)] + [
        own_rng.getrandbits(31) for _ in range(req.prompt_len - n_prefix)
    ]
