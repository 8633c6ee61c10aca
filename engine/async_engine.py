"""The async engine: the engine's step loop in its own thread, per-request output streams.

Callers on an asyncio loop `add_request(...)` (or `generate(...)`) and iterate cumulative
RequestOutputs as the loop produces them; leaving `generate` early (or cancelling it)
aborts the request and frees its blocks. A caller that serves many requests (an engine
worker) passes one `sink` instead: after each step it gets the outputs of all its requests
in one call on its own loop, not one hand-over per request. Only the loop thread touches the engine (and
its tokenizer): callers hand commands over through a queue and await the answer, so a
bad request raises in the caller and never disturbs the requests already running. The
loop thread's side (running the commands, handing outputs to sinks) is engine/dispatch.py;
this module keeps the thread, its liveness and the callers' API.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future

import torch

from kvray.engine.block_pool import KVCacheStats
from kvray.engine.config import EngineConfig
from kvray.engine.dispatch import Dispatcher, settle
from kvray.engine.engine_commands import Abort, AddPrefilled, AddRequest, Call, Command
from kvray.engine.engine_stats import EngineStats
from kvray.engine.kv_transfer import KVLayout, KVTicket
from kvray.engine.kv_views import KVViews
from kvray.engine.llm_engine import LLMEngine, PromptInput
from kvray.engine.output_stream import OutputSink, OutputStream
from kvray.engine.outputs import RequestOutput, TokenLogprobs
from kvray.engine.request_limits import RequestLimits
from kvray.engine.sampling_params import SamplingParams
from kvray.engine.step_trace import StepTrace
from kvray.errors import EngineDeadError

logger = logging.getLogger(__name__)


class AsyncLLM:
    engine: LLMEngine  # built and stepped on the loop thread

    def __init__(self, config: EngineConfig, on_failure=None, **engine_kwargs):
        """`on_failure(error)`: called once when the engine can no longer serve (a step
        failed, the loop stopped on an error, or a step ran past `config.step_timeout_s`),
        before its requests are failed over; from the loop thread, or from the watchdog
        thread for a step that hangs. A worker stops taking requests there (a sharded one
        exits: its shards are out of step)."""
        self._on_failure = on_failure
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._dispatch: Dispatcher  # the loop thread's side (engine/dispatch.py), built with the engine
        self._stopped = False
        self.error: EngineDeadError | None = None  # set once the engine can no longer serve
        self._dying = threading.Lock()
        self._busy_since: float | None = None  # monotonic: when the loop last left its wait
        self.step_timeout_s = config.step_timeout_s
        # The engine is built on the loop thread, so that one thread is OpenMP's master for
        # the life of the engine: a second master (the caller, loading the weights) keeps a
        # team of its own, and libgomp, seeing more threads than cores, then puts its
        # helpers to sleep after every parallel region (BENCHMARKS.md, served against offline)
        built: Future = Future()  # settled once the loop thread has built self.engine
        self._thread = threading.Thread(
            target=self._run, args=(config, engine_kwargs, built), name="kvray-engine", daemon=True
        )
        self._thread.start()
        built.result()  # re-raises what building the engine raised
        self._watchdog = threading.Thread(target=self._watch, name="kvray-engine-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        sampling_params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
        pin_kv: bool = False,
        sink: OutputSink | None = None,
        generated_token_ids: list[int] | None = None,
    ) -> OutputStream | None:
        """Queue a request; raises the engine's validation error here, in the caller.
        `pin_kv`: a prefill for a decode worker; `generated_token_ids`: a request moved
        here from a worker that died (see LLMEngine.add_request). Returns the
        request's stream, or None when its outputs go to `sink`."""
        if self._stopped:
            raise RuntimeError("AsyncLLM is shut down")
        matchers = await self._matchers(sampling_params, sampling_params.n)
        stream = OutputStream(request_id, asyncio.get_running_loop()) if sink is None else None
        accepted: Future = Future()
        self._send(
            AddRequest(
                request_id=request_id,
                sink=stream or sink,
                prompt=prompt,
                params=sampling_params,
                priority=priority,
                deadline=deadline,
                pin_kv=pin_kv,
                generated_token_ids=generated_token_ids,
                matchers=matchers,
                accepted=accepted,
            )
        )
        await asyncio.wrap_future(accepted)
        return stream

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        deadline: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes (the last has finished=True)."""
        stream = await self.add_request(
            request_id or uuid.uuid4().hex, prompt, sampling_params, priority, deadline
        )
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    async def add_prefilled_request(
        self,
        request_id: str,
        prompt: PromptInput,
        sampling_params: SamplingParams,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        sink: OutputSink | None = None,
        pull_deadline: float | None = None,
        priority: int = 0,
    ) -> tuple[OutputStream | None, asyncio.Future]:
        """Continue a request prefilled elsewhere (see LLMEngine.add_prefilled_request);
        returns, once it is accepted, its stream (None with a `sink`) and a future of the
        blocks to pull the prompt's KV into (then `finish_kv_pull`), or of None for no
        pull: at once, or when blocks free up for a request that waits for room."""
        matchers = await self._matchers(sampling_params, 1)
        stream = OutputStream(request_id, asyncio.get_running_loop()) if sink is None else None
        accepted: Future = Future()
        room: Future = Future()
        self._send(
            AddPrefilled(
                request_id,
                stream or sink,
                prompt,
                sampling_params,
                first_token,
                first_logprobs,
                matchers,
                pull_deadline,
                accepted,
                room,
                priority,
            )
        )
        await asyncio.wrap_future(accepted)
        return stream, asyncio.wrap_future(room)

    async def _matchers(self, params: SamplingParams, count: int) -> list | None:
        """A structured-output request's grammar matchers (one per sample), compiled and
        built in a helper thread, so the step loop never waits on a grammar (a bad one
        raises InvalidArgumentError here, in the caller)."""
        so = params.structured_outputs
        if so is None:
            return None
        engine = self.engine

        def build() -> list:
            engine.limits.check_params(params)  # its size and depth first: then compile
            return [engine.grammars.matcher(so) for _ in range(count)]

        return await asyncio.to_thread(build)

    async def call(self, fn, *args):
        """Run `fn(*args)` on the loop thread, between steps, and return its result."""
        done: Future = Future()
        self._send(Call(fn, args, done))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        """Abort from any thread; the stream ends with a finished `abort` output. (An
        engine that can no longer serve runs nothing: there is nothing to stop.)"""
        if self.error is None:
            self._send(Abort(request_id))

    # ---- what a worker may see of the engine (nothing else reaches inside) ------------

    @property
    def kv_views(self) -> KVViews:
        """The cache as views of one transfer's blocks (pinned prompts, reserved blocks):
        all a KV transport reads or writes of it (engine/kv_views.py)."""
        return self._kv_views

    @property
    def kv_layout(self) -> KVLayout:
        return self.engine.kv_layout

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask of this engine (the ingress checks the same)."""
        return self.engine.limits

    async def stats(self) -> EngineStats:
        return await self.call(self.engine.stats)

    async def kv_cache_stats(self) -> KVCacheStats:
        return await self.call(self.engine.kv_cache_stats)

    async def validate(self, prompts: list[PromptInput], params: list[SamplingParams]) -> None:
        """Raise the engine's error for the first bad (prompt, params); queue nothing."""
        for p in params:
            if p.structured_outputs is not None:
                self.engine.limits.check_params(p)
                await asyncio.to_thread(self.engine.grammars.compile, p.structured_outputs)

        def check() -> None:
            for prompt, p in zip(prompts, params):
                self.engine.validate(self.engine.tokenize(prompt)[1], p)

        await self.call(check)

    async def kv_ticket(self, worker_id: str, request_id: str) -> KVTicket | None:
        return await self.call(self.engine.kv_ticket, worker_id, request_id)

    async def release_kv(self, request_id: str) -> bool:
        if self.error is not None:  # nothing runs there any more (its pins lapse)
            return False
        return await self.call(self.engine.release_kv, request_id)

    async def finish_kv_pull(self, request_id: str, ok: bool) -> None:
        if self.error is None:  # (else its request has already moved on)
            await self.call(self.engine.finish_kv_pull, request_id, ok)

    def _send(self, command: Command) -> None:
        with self._dying:  # (so no command slips into the queue after `_die` emptied it)
            if self.error is not None:
                raise self.error
            self._commands.put(command)
        self._wake.set()

    # ---- liveness -----------------------------------------------------------------------

    def check_health(self) -> None:
        """Raise EngineDeadError when the engine can no longer serve: its loop stopped on
        an error, its thread is gone, or a step has run past `step_timeout_s`."""
        if self.error is not None:
            raise self.error
        if not self._thread.is_alive() and not self._stopped:
            raise EngineDeadError("the engine thread has stopped")
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > self.step_timeout_s:
            raise EngineDeadError(f"a step has run past step_timeout_s={self.step_timeout_s:g} s")

    def _watch(self) -> None:
        """The watchdog: a step that runs past `step_timeout_s` (the loop thread stuck in
        it) fails the engine from here, as if the step had raised."""
        period = min(1.0, self.step_timeout_s / 4)
        while not self._stopped and self.error is None:
            time.sleep(period)
            busy = self._busy_since
            if busy is not None and time.monotonic() - busy > self.step_timeout_s:
                self._die(EngineDeadError(f"a step has run past step_timeout_s={self.step_timeout_s:g} s"))

    def _die(self, cause: BaseException) -> None:
        """The engine can no longer serve (from any thread; once): log the cause, tell the
        owner, then fail every request and waiting caller with EngineDeadError, so that
        fronts move the requests to other workers."""
        with self._dying:
            if self.error is not None:
                return
            error = (
                cause
                if isinstance(cause, EngineDeadError)
                else EngineDeadError(f"the engine failed: {cause!r}")
            )
            self.error = error
            stranded = []  # commands that will never run
            while True:
                try:
                    stranded.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        logger.error("kvray engine: can no longer serve (%s)", error, exc_info=cause)
        if self._on_failure is not None:
            self._on_failure(error)
        self._dispatch.fail(error)
        for command in stranded:  # their callers get the error
            for future in command.futures():
                settle(future, error=error)

    def _run(self, config: EngineConfig, engine_kwargs: dict, built: Future) -> None:
        try:
            self.engine = LLMEngine(config, **engine_kwargs)
        except BaseException as e:
            built.set_exception(e)
            return
        self._kv_views = KVViews(self.engine.runner.kv_cache, self.engine.pins)
        self._dispatch = Dispatcher(self.engine)
        built.set_result(None)
        self._loop(self.engine)

    def _loop(self, engine: LLMEngine) -> None:
        """Commands, then a step, until shut down. Anything that raises here ends the
        engine (`_die`): a failed forward pass or a broken loop leaves state nobody can
        vouch for, so its requests move to other workers instead (what one request's own
        rows get wrong is contained inside the step: LLMEngine.step)."""
        trace = StepTrace(engine.config.step_trace_dir) if engine.config.step_trace_dir else None
        dispatch = self._dispatch
        try:
            while not self._stopped and self.error is None:
                self._busy_since = start = time.monotonic()
                start_cpu = time.thread_time() if trace is not None else 0.0
                dispatch.drain(self._commands)
                dispatch.grant_rooms(engine.handoff_step())
                dispatch.publish(engine.take_pending_outputs())
                if not engine.has_unfinished_requests():
                    self._idle(0.5)
                    continue
                outputs = engine.step()
                dispatch.publish(outputs)
                if trace is not None and engine.last_shape:
                    trace.write(engine.last_shape, time.monotonic() - start, time.thread_time() - start_cpu)
                if engine.last_step is None or engine.last_step.num_batched_tokens == 0:
                    self._idle(0.005)  # nothing could run (e.g. only KV pulls in flight): wait for a command
        except BaseException as e:  # noqa: BLE001 (everything: the watchdog and health see it)
            self._die(e)
        finally:
            self._busy_since = None
            if self.error is not None:  # requests it took in while the watchdog gave up on it
                dispatch.fail(self.error)
            dispatch.release_rooms()  # stopped: no blocks will come (the pins lapse)
            if trace is not None:
                trace.close()
            if self.error is None:
                engine.shutdown()  # from this thread: never between a step's messages to the shards

    def _idle(self, timeout: float) -> None:
        self._busy_since = None
        self._wake.wait(timeout=timeout)
        self._wake.clear()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
