"""The served engine's step trace (`EngineConfig.step_trace_dir`): what each loop step
cost, for kvray.sim's step-time fit (`kvray bench step-times --from-trace`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


class StepTrace:
    """Each step of the loop (commands, the step, handing out its outputs) as one JSON line
    {"batch": [[new tokens, context, samples], ...], "seconds": s, "cpu_seconds": c, "end": t}
    (t: the wall clock at the step's end, to line up several workers' traces), after
    a first line naming the torch threads: the served engine's real step costs, for
    kvray.sim's fit. `cpu_seconds` is the loop thread's own CPU time in the step (its OMP
    helpers not counted): far below `seconds`, the thread waited (for the GIL, or off a
    core); near it, the step itself ran slow."""

    def __init__(self, folder: str):
        path = Path(folder) / f"steps-{os.getpid()}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", buffering=1)  # line by line: a killed worker keeps its steps
        self.file.write(json.dumps({"threads": torch.get_num_threads()}) + "\n")

    def write(self, shape: list[tuple[int, int, bool]], seconds: float, cpu_seconds: float) -> None:
        line = {"batch": shape, "seconds": seconds, "cpu_seconds": cpu_seconds, "end": time.time()}
        self.file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self.file.close()
