"""How long one engine step takes: a roofline of the step's work plus fitted overheads.

A step is the batch the real `Scheduler` handed out: per request, the tokens it computes
(`q`) and its context once they are computed (`c`), and whether it samples. Its work is

* FLOPs: the linear layers on every token (2 x weights) and the LM head on sampling rows;
  attention over the context (4 x heads x head_dim per query and key pair, causal);
* bytes: the weights once, each request's K/V context read once, the new K/V written.

and its time, on `tp` devices joined by a link,

    t = max(matmul flops / (peak x eff_compute), bytes / (bandwidth x eff_memory))
        + attention flops / (peak x eff_attention)
        + overhead_s + per_seq_s x num_seqs + all-reduce(tp)

(attention apart: its kernels reach another fraction of the peak than the GEMMs, and on a
CPU a long context's attention is what the step waits for). The efficiencies and the
two overheads are fitted to step times measured on the machine
(`fit`); GPUs without a measurement use `GPU_DEFAULTS`, which say so in their name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from kvray.sim.results import percentile


@dataclass(frozen=True)
class ModelSpec:
    """The shapes that decide a Llama-family model's step work."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int = 2
    kv_dtype_bytes: float | None = None  # None: the model dtype's (8-bit caches: codes + scales)

    @classmethod
    def from_hf_config(cls, name: str, cfg: dict, dtype_bytes: int = 2) -> ModelSpec:
        heads = cfg["num_attention_heads"]
        return cls(
            name=name,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            dtype_bytes=dtype_bytes,
        )

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's matmuls (norms are noise)."""
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o; k, v
        return attention + 3 * h * self.intermediate_size  # gate, up, down

    @property
    def weight_bytes(self) -> int:
        """Bytes a step reads for the weights: the layers and the LM head."""
        return (self.num_layers * self.layer_params + self.hidden_size * self.vocab_size) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers (what a KV pull moves per prompt token)."""
        kv_bytes = self.kv_dtype_bytes or self.dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_bytes


# Published shapes (Hugging Face configs) of the models the studies use.
MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec("smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152, dtype_bytes=4),
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 32, 4096, 14336, 32, 8, 128, 128256),
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", 80, 8192, 28672, 64, 8, 128, 128256),
}


@dataclass(frozen=True)
class Hardware:
    """One device: dense peak FLOP/s of the model dtype, memory bandwidth (bytes/s), memory
    (bytes) and the link between devices of a TP group or a KV pull (bytes/s, seconds)."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: float
    link_bandwidth: float
    link_latency_s: float = 10e-6


# Datasheet peaks (dense bf16 tensor FLOP/s, HBM/GDDR bandwidth, NVLink or PCIe per direction).
HARDWARE: dict[str, Hardware] = {
    "H100": Hardware("H100", 989e12, 3.35e12, 80e9, 450e9),
    "H200": Hardware("H200", 989e12, 4.8e12, 141e9, 450e9),
    "A10G": Hardware("A10G", 125e12, 600e9, 24e9, 25e9, 20e-6),
    "L40S": Hardware("L40S", 362e12, 864e9, 48e9, 25e9, 20e-6),
}


@dataclass(frozen=True)
class RequestWork:
    """One request's part of a step."""

    num_new_tokens: int  # q: tokens computed this step
    context_len: int  # c: its tokens with KV once they are computed (q included)
    samples: bool = True  # does it reach its last known token (an LM-head row)?


def step_work(model: ModelSpec, batch: Sequence[RequestWork]) -> tuple[float, float, float]:
    """(matmul FLOPs, attention FLOPs, bytes) of one step over the whole model (before any
    TP split)."""
    tokens = sum(w.num_new_tokens for w in batch)
    rows = sum(1 for w in batch if w.samples)
    pairs = sum(
        w.num_new_tokens * w.context_len - w.num_new_tokens * (w.num_new_tokens - 1) / 2 for w in batch
    )
    attn_flops = 4 * model.num_layers * model.num_heads * model.head_dim * pairs
    flops = (
        2 * model.num_layers * model.layer_params * tokens + 2 * model.hidden_size * model.vocab_size * rows
    )
    kv_read = sum(w.context_len for w in batch) * model.kv_bytes_per_token
    kv_write = tokens * model.kv_bytes_per_token
    return flops, attn_flops, model.weight_bytes + kv_read + kv_write


@dataclass(frozen=True)
class StepTimeModel:
    """Predicts a step's seconds on `tp` devices of `hardware` running `model`."""

    model: ModelSpec
    hardware: Hardware
    tp: int = 1
    eff_compute: float = 0.55
    eff_memory: float = 0.8
    eff_attention: float = 0.4
    overhead_s: float = 3e-3  # per step: scheduling, launches, sampling, the host's share
    per_seq_s: float = 20e-6  # per request in the step: its metadata, outputs, detokenizing
    source: str = "GPU_DEFAULTS (not fitted)"  # where the numbers above come from

    def predict(self, batch: Sequence[RequestWork]) -> float:
        if not batch:
            return 0.0
        flops, attn_flops, nbytes = step_work(self.model, batch)
        hw = self.hardware
        roof = max(flops / (hw.peak_flops * self.eff_compute), nbytes / (hw.mem_bandwidth * self.eff_memory))
        attention = attn_flops / (hw.peak_flops * self.eff_attention)
        return (
            (roof + attention) / self.tp
            + self.overhead_s
            + self.per_seq_s * len(batch)
            + self.all_reduce_s(batch)
        )

    def all_reduce_s(self, batch: Sequence[RequestWork]) -> float:
        """Two ring all-reduces of the hidden states per layer (attention out, MLP out)."""
        if self.tp == 1:
            return 0.0
        tokens = sum(w.num_new_tokens for w in batch)
        nbytes = tokens * self.model.hidden_size * self.model.dtype_bytes
        ring = 2 * (self.tp - 1) / self.tp * nbytes / self.hardware.link_bandwidth
        return 2 * self.model.num_layers * (ring + self.hardware.link_latency_s)

    def kv_pull_s(
        self, num_tokens: int, bandwidth: float | None = None, latency_s: float | None = None
    ) -> float:
        """A prompt's KV moved rank to rank between two groups of `tp` devices, over the
        devices' own link unless another is given."""
        bandwidth = bandwidth or self.hardware.link_bandwidth
        latency_s = self.hardware.link_latency_s if latency_s is None else latency_s
        return latency_s + num_tokens * self.model.kv_bytes_per_token / self.tp / bandwidth

    def kv_cache_blocks(self, block_size: int, memory_fraction: float = 0.9) -> int:
        """Blocks the KV budget holds once this group's weights are loaded (vLLM's
        gpu_memory_utilization: the fraction of each device the engine may use)."""
        free = self.hardware.memory_bytes * memory_fraction - self.model.weight_bytes / self.tp
        per_block = self.model.kv_bytes_per_token * block_size / self.tp
        return max(0, int(free // per_block))

    def blocks_in(self, budget_bytes: float, block_size: int) -> int:
        """Blocks a KV budget of `budget_bytes` per device holds (`kv_cache_memory_bytes`)."""
        return int(budget_bytes * self.tp // (self.model.kv_bytes_per_token * block_size))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepTimeModel:
        return cls(**{**d, "model": ModelSpec(**d["model"]), "hardware": Hardware(**d["hardware"])})


@dataclass(frozen=True)
class StepSample:
    """One measured step: its batch and its seconds."""

    batch: tuple[RequestWork, ...]
    seconds: float

    @classmethod
    def from_dict(cls, d: dict) -> StepSample:
        return cls(tuple(RequestWork(*w) for w in d["batch"]), d["seconds"])

    def to_dict(self) -> dict:
        return {
            "batch": [(w.num_new_tokens, w.context_len, w.samples) for w in self.batch],
            "seconds": self.seconds,
        }


def _grid(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [bi] for row, bi in zip(a, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[r][n] / m[r][r] for r in range(n)]


def _nnls(gram: list[list[float]], atb: list[float], tt: float) -> tuple[list[float], float]:
    """Non-negative least squares for a few coefficients from the normal equations (gram =
    XᵀWX, atb = XᵀWt, tt = tᵀWt): every subset of them free (the rest 0), the best
    feasible one. Returns (coefficients, weighted squared error)."""
    k = len(atb)
    best = ([0.0] * k, tt)
    for mask in range(1, 1 << k):
        cols = [c for c in range(k) if mask >> c & 1]
        sol = _solve([[gram[i][j] for j in cols] for i in cols], [atb[i] for i in cols])
        if sol is None or min(sol) < 0:
            continue
        coef = [0.0] * k
        for c, v in zip(cols, sol):
            coef[c] = v
        quad = sum(coef[i] * gram[i][j] * coef[j] for i in range(k) for j in range(k))
        err = quad - 2 * sum(c * b for c, b in zip(coef, atb)) + tt
        if err < best[1]:
            best = (coef, err)
    return best


def fit(
    samples: Iterable[StepSample], model: ModelSpec, hardware: Hardware, tp: int = 1, source: str = "fitted"
) -> StepTimeModel:
    """The step-time model closest to the measured steps (least squared relative error):
    a grid over the two roofline efficiencies; for each, the attention cost and the two
    overheads by non-negative least squares."""
    samples = list(samples)
    if len(samples) < 4:
        raise ValueError(f"fit needs at least 4 measured steps, got {len(samples)}")
    base = StepTimeModel(model, hardware, tp, 1.0, 1.0, 1.0, 0.0, 0.0, source)
    works = [step_work(model, s.batch) for s in samples]
    times = [s.seconds - base.all_reduce_s(s.batch) for s in samples]
    weights = [1 / t**2 for t in times]
    features = [
        [a / hardware.peak_flops / tp, 1.0, float(len(s.batch))] for (_, a, _), s in zip(works, samples)
    ]
    gram = [[sum(w * x[i] * x[j] for w, x in zip(weights, features)) for j in range(3)] for i in range(3)]
    best = None
    for ec in _grid(0.02, 1.0, 40):
        for em in _grid(0.02, 1.0, 40):
            roofs = [
                max(f / (hardware.peak_flops * ec), b / (hardware.mem_bandwidth * em)) / tp
                for f, _, b in works
            ]
            rest = [t - r for t, r in zip(times, roofs)]
            atb = [sum(w * x[i] * y for w, x, y in zip(weights, features, rest)) for i in range(3)]
            coef, err = _nnls(gram, atb, sum(w * y * y for w, y in zip(weights, rest)))
            if best is None or err < best[0]:
                best = (err, ec, em, coef)
    _, ec, em, (attention, overhead, per_seq) = best
    return replace(
        base,
        eff_compute=ec,
        eff_memory=em,
        eff_attention=1 / max(attention, 1e-6),  # no measurable attention cost: 1e6 x the peak
        overhead_s=overhead,
        per_seq_s=per_seq,
    )


def relative_errors(model: StepTimeModel, samples: Iterable[StepSample]) -> list[float]:
    return [abs(model.predict(s.batch) - s.seconds) / s.seconds for s in samples]


def median(xs: Sequence[float]) -> float:
    return percentile(xs, 50)
