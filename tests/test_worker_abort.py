"""An abort that reaches a worker before its request (Ray's async actors may run one
caller's calls out of order) still stops the request: it is refused when it comes, and
no block is held for it. The worker runs in this process, on a real engine."""

from __future__ import annotations

import asyncio

import pytest

from kvray.actors.messages import EngineRequest
from kvray.actors.worker import MixedWorker, RequestAbortedError
from kvray.engine import SamplingParams
from kvray.engine.sampling_params import RequestOutputKind


def test_an_abort_that_comes_first_refuses_its_request(engine_args):
    worker = MixedWorker("w0", engine_args, torch_threads=1)
    params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def go():
        await worker.abort("late")
        with pytest.raises(RequestAbortedError, match="late"):
            await worker.generate(EngineRequest("late", [1, 2, 3, 4], params, "front"))
        await worker.generate(EngineRequest("other", [1, 2, 3, 4], params, "front"))  # others run
        running = await worker.stats()
        await worker.abort("other")
        for _ in range(100):
            stats = await worker.stats()
            if stats.num_running == 0 and stats.used_blocks == 0:
                return running, stats
            await asyncio.sleep(0.05)
        return running, stats

    try:
        running, stats = asyncio.run(go())
    finally:
        worker.llm.shutdown()
    assert running.num_running + running.num_waiting == 1  # only "other" was taken
    assert (stats.num_running, stats.num_waiting, stats.used_blocks) == (0, 0, 0)
