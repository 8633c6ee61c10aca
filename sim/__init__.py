"""kvray.sim: a discrete-event simulator of a kvray cluster that runs kvray's own scheduler
and router policy, with step times from a roofline model fitted to measured steps.

No Ray and no model: `Simulator(ClusterSpec(...)).run(requests)` gives each request's
token times; `studies` compares PD with colocated serving, `planner` picks the P:D ratio."""

from kvray.sim.cluster import ClusterSpec, PoolSpec, Simulator, simulate
from kvray.sim.cost_model import HARDWARE, MODELS, Hardware, ModelSpec, RequestWork, StepTimeModel, fit
from kvray.sim.results import SLO, RequestRecord, SimResult
from kvray.sim.worker import SimEngineConfig, SimWorker
from kvray.sim.workload import MIXES, LengthMix, SimRequest, load_trace, synthetic

__all__ = [
    "ClusterSpec",
    "PoolSpec",
    "Simulator",
    "simulate",
    "HARDWARE",
    "MODELS",
    "Hardware",
    "ModelSpec",
    "RequestWork",
    "StepTimeModel",
    "fit",
    "SLO",
    "RequestRecord",
    "SimResult",
    "SimEngineConfig",
    "SimWorker",
    "MIXES",
    "LengthMix",
    "SimRequest",
    "load_trace",
    "synthetic",
]
