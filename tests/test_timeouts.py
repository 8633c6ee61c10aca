"""A cancelled caller stays cancelled, however its cancellation and the awaited result
line up (Python 3.10/3.11's asyncio.wait_for loses it when both land in one loop tick),
and a front whose caller leaves at any such moment aborts the request on its worker."""

from __future__ import annotations

import asyncio

import pytest
from test_migration_front import DyingWorker
from test_serve_metrics import FakeRouter, _Method, _ready

from kvray.actors.messages import Delta
from kvray.configs import DeploymentConfig
from kvray.engine import SamplingParams
from kvray.router.frontend import Frontend
from kvray.timeouts import wait_for

TICKS = range(6)  # loop ticks between the result and the cancellation


async def _cancel_after(task: asyncio.Task, ticks: int) -> str:
    for _ in range(ticks):
        await asyncio.sleep(0)
    task.cancel()
    try:
        await asyncio.wait_for(asyncio.shield(task), 5)
    except asyncio.CancelledError:
        return "cancelled"
    except TimeoutError:
        task.cancel()
        return "carried on"
    return "returned"


@pytest.mark.parametrize("ticks", TICKS)
def test_wait_for_never_loses_the_callers_cancellation(ticks):
    async def go():
        fut = asyncio.get_running_loop().create_future()

        async def caller():
            await wait_for(fut, 10)
            await asyncio.Event().wait()  # a lost cancellation leaves it here

        task = asyncio.ensure_future(caller())
        await asyncio.sleep(0)  # it is waiting now
        fut.set_result(1)
        return await _cancel_after(task, ticks)

    assert asyncio.run(go()) == "cancelled"


def test_wait_for_returns_the_result_and_times_out():
    async def go():
        assert await wait_for(_ready(7), 1) == 7
        slow = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(TimeoutError):
            await wait_for(slow, 0.01)
        await asyncio.sleep(0)
        return slow.cancelled()

    assert asyncio.run(go())


class StreamingWorker(DyingWorker):
    """Streams one delta each time the test asks (`send`), and records aborts."""

    def __init__(self, worker_id: str):
        super().__init__(worker_id)
        self.aborted = []
        self.abort = _Method(self.aborted.append)
        self.queue: asyncio.Queue = asyncio.Queue()

    def _outputs(self, destination):
        async def stream():
            while True:
                yield _ready([await self.queue.get()])

        return stream()

    def send(self, n: int) -> None:
        self.queue.put_nowait(Delta(self.requests[-1].request_id, [n], "x", None, None, None))


@pytest.mark.parametrize("ticks", TICKS)
def test_a_caller_that_leaves_as_a_delta_arrives_aborts_the_request(ticks):
    worker = StreamingWorker("mixed-0")
    front = Frontend(FakeRouter([worker]), DeploymentConfig(disaggregated=False), "front-0")

    async def go():
        first = asyncio.Event()

        async def caller():
            async for _ in front.generate("r0", [1, 2, 3], SamplingParams(max_tokens=100)):
                first.set()

        task = asyncio.ensure_future(caller())
        await worker.started.wait()
        worker.send(11)
        await first.wait()
        worker.send(12)
        result = await _cancel_after(task, ticks)
        for inbox in front.inboxes.values():
            inbox.task.cancel()
        return result

    assert asyncio.run(go()) == "cancelled"
    assert worker.aborted == ["r0"]
