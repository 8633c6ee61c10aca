"""The async engine: the engine's step loop in its own thread, per-request output streams.

Callers on an asyncio loop `generate(...)` and iterate cumulative RequestOutputs as the
loop produces them; leaving the iteration early (or cancelling) aborts the request and
frees its blocks. Only the loop thread touches the engine: callers validate their input
up front (so errors raise in the caller) and hand the rest over through a command queue.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvray.engine.config import EngineConfig
from kvray.engine.llm_engine import LLMEngine, PromptInput
from kvray.engine.outputs import RequestOutput
from kvray.engine.sampling_params import SamplingParams


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput | BaseException

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    def __init__(self, config: EngineConfig, **engine_kwargs):
        self.engine = LLMEngine(config, **engine_kwargs)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="kvray-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        deadline: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes (last one has finished=True)."""
        if self._stopped:
            raise RuntimeError("AsyncLLM is shut down")
        request_id = request_id or uuid.uuid4().hex
        _, ids = self.engine.tokenize(prompt)
        self.engine.validate(ids, sampling_params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt, sampling_params, priority, deadline))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its stream ends with a finished `abort` output."""
        self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopped:
            self._drain_commands()
            if not engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a failed step fails the requests in it, not the loop
                self._fail_all(e)
                continue
            self._publish(outputs)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, rid, prompt, params, priority, deadline = command
                try:
                    self.engine.add_request(rid, prompt, params, priority=priority, deadline=deadline)
                except Exception as e:
                    self._deliver(rid, e)
            else:
                self._publish(self.engine.abort_request([command[1]]))

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)

    def _fail_all(self, error: Exception) -> None:
        ids = list(self.engine.outputs.tracked)
        self.engine.abort_request(ids)
        for rid in ids:
            self._deliver(rid, error)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
