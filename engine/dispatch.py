"""The engine thread's side of AsyncLLM (engine/async_engine.py): it runs the commands
callers queue (engine/engine_commands.py) between steps, keeps where each request's
outputs go and which prefilled requests wait for blocks to pull into, and hands each
caller's sink its outputs of a step in one call on the caller's loop.

Everything here runs on the loop thread but `fail`, which a watchdog may call while the
loop thread is still inside a slow step.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future, InvalidStateError

from kvray.engine.engine_commands import Abort, AddPrefilled, AddRequest, Call
from kvray.engine.llm_engine import LLMEngine
from kvray.engine.output_stream import OutputSink
from kvray.engine.outputs import RequestOutput
from kvray.errors import EngineDeadError


class Dispatcher:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.streams: dict[str, OutputSink] = {}  # request id -> where its outputs go
        self.rooms: dict[str, Future] = {}  # prefilled request waiting for blocks -> its future

    def drain(self, commands: queue.SimpleQueue) -> None:
        """Run every queued command, in order."""
        while True:
            try:
                command = commands.get_nowait()
            except queue.Empty:
                return
            match command:
                case Call(fn, args, done):
                    try:
                        result = fn(*args)
                    except Exception as e:
                        settle(done, error=e)
                    else:
                        settle(done, result)  # a caller that went away still had its call run
                case AddPrefilled():
                    self._add_prefilled(command)
                case AddRequest():
                    self._add(command)
                case Abort(request_id):
                    self.publish(self.engine.abort_request([request_id]))

    def _add(self, add: AddRequest) -> None:
        try:
            self.engine.add_request(
                add.request_id,
                add.prompt,
                add.params,
                priority=add.priority,
                deadline=add.deadline,
                pin_kv=add.pin_kv,
                generated_token_ids=add.generated_token_ids,
                matchers=add.matchers,
            )
        except Exception as e:
            settle(add.accepted, error=e)
            return
        self._accepted(add.request_id, add.sink, add.accepted)

    def _add_prefilled(self, add: AddPrefilled) -> None:
        engine, rid, room = self.engine, add.request_id, add.room
        try:
            blocks = engine.add_prefilled_request(
                rid,
                add.prompt,
                add.params,
                add.first_token,
                add.first_logprobs,
                priority=add.priority,
                pull_deadline=add.pull_deadline,
                matchers=add.matchers,
            )
        except Exception as e:
            settle(add.accepted, error=e)
            return
        if not self._accepted(rid, add.sink, add.accepted):  # nobody will pull or read
            if blocks is not None:
                engine.finish_kv_pull(rid, ok=False)
            blocks = None
        if engine.waits_for_room(rid):
            self.rooms[rid] = room  # settled by grant_rooms
        else:
            self._give_room(rid, room, blocks)

    def _accepted(self, rid: str, sink: OutputSink, accepted: Future) -> bool:
        """The engine took the request: its outputs go to `sink` and its caller hears so;
        False (the request aborted) when the caller was cancelled meanwhile."""
        self.streams[rid] = sink
        if settle(accepted, None):
            return True
        self.publish(self.engine.abort_request([rid]))
        return False

    def grant_rooms(self, rooms: list[tuple[str, list[int] | None]]) -> None:
        """Blocks freed since the last step go to the prefilled requests waiting to pull."""
        for rid, blocks in rooms:
            room = self.rooms.pop(rid, None)
            if room is not None:  # (None: the engine failed meanwhile, its waiters released)
                self._give_room(rid, room, blocks)

    def _give_room(self, rid: str, room: Future, blocks: list[int] | None) -> None:
        if not settle(room, blocks) and blocks is not None:  # nobody left to pull into them
            self.engine.finish_kv_pull(rid, ok=False)

    def release_rooms(self) -> None:
        """No blocks will come (the engine stopped or failed; the prefill pins lapse)."""
        for rid in list(self.rooms):
            room = self.rooms.pop(rid, None)
            if room is not None:
                settle(room, None)

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Hand each sink its outputs of this step in one call on its loop."""
        batches: dict[int, tuple[OutputSink, list[RequestOutput]]] = {}
        for out in outputs:
            sink = self.streams.get(out.request_id)
            if sink is None:
                continue
            batches.setdefault(id(sink), (sink, []))[1].append(out)
            if out.finished:
                self.streams.pop(out.request_id, None)  # (the watchdog may have taken it)
        for sink, batch in batches.values():
            sink.loop.call_soon_threadsafe(sink.put_many, batch)

    def fail(self, error: EngineDeadError) -> None:
        """Fail every request's sink, each once (any thread: the loop thread may still be
        finishing a slow step when the watchdog gives up on it; the loop sweeps again as it
        ends, for a request it took in meanwhile)."""
        failed: dict[int, tuple[OutputSink, list[str]]] = {}
        for rid in list(self.streams):
            sink = self.streams.pop(rid, None)
            if sink is not None:
                failed.setdefault(id(sink), (sink, []))[1].append(rid)
        for sink, rids in failed.values():
            sink.loop.call_soon_threadsafe(sink.fail, rids, error)
        self.release_rooms()


def settle(future: Future, result=None, error: BaseException | None = None) -> bool:
    """Resolve a caller's future; False when the caller had already cancelled it (an actor
    task cancelled by Ray), which must not take the loop thread down."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
        return True
    except InvalidStateError:
        return False
