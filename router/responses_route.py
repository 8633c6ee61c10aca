"""POST /v1/responses in an ingress replica: the request through the chat path
(router/responses_api.py translates both ways), its answer as a Response object or as
OpenAI's Responses stream events, and the stored conversations for `previous_response_id`.

Events, in OpenAI's names and order: `response.created`, `response.in_progress`; per
output item `response.output_item.added`, then for a message `response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`,
and for a function call `response.function_call_arguments.delta` / `.done`; then
`response.output_item.done`; last `response.completed` (or `response.incomplete` when it ran
into `max_output_tokens`). Every event has a `sequence_number`; an error after the stream
began is one `error` event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvray.router.api_error import APIError
from kvray.router.responses_api import (
    Reply,
    ResponsesRequest,
    ResponseStore,
    call_item,
    key_of,
    message_item,
    new_id,
    now,
    output_items,
    parse_responses_request,
    renamed,
    response_body,
    to_chat_body,
)
from kvray.router.streams import unless_disconnected


class ResponseEvents:
    """A chat stream's chunks in, the Responses events they make out."""

    def __init__(self, req: ResponsesRequest, rid: str, created: int):
        self.req, self.rid, self.created = req, rid, created
        self.seq = 0
        self.items: list[dict] = []  # finished output items
        self.message_id: str | None = None  # the message item being written
        self.reply = Reply()
        self.body: dict | None = None  # the final Response object

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def started(self) -> list[dict]:
        body = response_body(self.req, self.rid, self.created, None, [])
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def on_chunk(self, chunk: dict) -> list[dict]:
        events = []
        if chunk.get("usage"):
            self.reply.input_tokens = chunk["usage"]["prompt_tokens"]
            self.reply.output_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._open_message()
                self.reply.text += delta["content"]
                events.append(
                    self._text_event("response.output_text.delta", delta=delta["content"], logprobs=[])
                )
            for call in delta.get("tool_calls") or []:
                events += self._close_message() + self._call(call)
            if choice.get("finish_reason"):
                self.reply.finish_reason = choice["finish_reason"]
        return events

    def finished(self) -> list[dict]:
        if not self.items and self.message_id is None:  # nothing written: an empty message
            events = self._open_message() + self._close_message()
        else:
            events = self._close_message()
        self.body = response_body(self.req, self.rid, self.created, self.reply, self.items)
        kind = "response.incomplete" if self.body["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self.body)]

    def failed(self, error: dict) -> list[dict]:
        """An error after the stream began: the `error` event, then `response.failed`."""
        e = error["error"]
        body = response_body(self.req, self.rid, self.created, self.reply, self.items)
        body.update(status="failed", error={"code": e.get("code") or "server_error", "message": e["message"]})
        return [
            self._event("error", code=e.get("code"), message=e["message"], param=e.get("param")),
            self._event("response.failed", response=body),
        ]

    def _text_event(self, kind: str, **fields) -> dict:
        where = {"item_id": self.message_id, "output_index": len(self.items), "content_index": 0}
        return self._event(kind, **where, **fields)

    def _open_message(self) -> list[dict]:
        if self.message_id is not None:
            return []
        self.message_id = new_id("msg")
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = message_item(self.message_id, "", "in_progress")
        return [
            self._event("response.output_item.added", output_index=len(self.items), item=item),
            self._text_event("response.content_part.added", part=part),
        ]

    def _close_message(self) -> list[dict]:
        if self.message_id is None:
            return []
        item = message_item(self.message_id, self.reply.text, self.reply.message_status)
        events = [
            self._text_event("response.output_text.done", text=self.reply.text, logprobs=[]),
            self._text_event("response.content_part.done", part=item["content"][0]),
            self._event("response.output_item.done", output_index=len(self.items), item=item),
        ]
        self.items.append(item)
        self.message_id = None
        return events

    def _call(self, call: dict) -> list[dict]:
        call = {"id": call["id"], "type": "function", "function": call["function"]}
        item_id, index, fn = new_id("fc"), len(self.items), call["function"]
        item = call_item(item_id, call)
        self.items.append(item)
        self.reply.calls.append(call)
        where = {"item_id": item_id, "output_index": index}
        return [
            self._event(
                "response.output_item.added", output_index=index, item=call_item(item_id, call, "in_progress")
            ),
            self._event("response.function_call_arguments.delta", **where, delta=fn["arguments"]),
            self._event(
                "response.function_call_arguments.done", **where, name=fn["name"], arguments=fn["arguments"]
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]


class ResponsesRoute:
    """The route's work, given the ingress's chat path: `complete(body, headers)` -> a chat
    completion body, `stream(body, headers)` -> None once admitted, then its chunks (the
    HTTP headers: a trace's parent)."""

    def __init__(
        self,
        complete: Callable[..., Awaitable[dict]],
        stream: Callable[..., AsyncIterator[dict | None]],
        store: ResponseStore | None = None,
    ):
        self.complete, self.stream = complete, stream
        self.store = store or ResponseStore()

    async def http(self, request: Request, body: dict) -> Response:
        key = key_of(request.headers.get("authorization"))
        if body.get("stream"):
            events = self.events(body, key, request.headers)
            await anext(events)  # validated and admitted: errors so far are plain HTTP errors
            return StreamingResponse(_sse(events), media_type="text/event-stream")
        answer = await unless_disconnected(request, self.answer(body, key, request.headers))
        return Response(status_code=499) if answer is None else JSONResponse(answer)

    def _prepare(self, body: dict, key: str) -> tuple[ResponsesRequest, dict, list[dict]]:
        req = parse_responses_request(body)
        history = self.store.get(key, req.previous_response_id) if req.previous_response_id else []
        chat = to_chat_body(req, history)
        return req, chat, chat["messages"][1:] if req.instructions else chat["messages"]

    def _keep(
        self, req: ResponsesRequest, key: str, body: dict, conversation: list[dict], reply: Reply
    ) -> None:
        if req.store:
            self.store.put(key, body["id"], [*conversation, reply.assistant_message()])

    async def answer(self, body: dict, key: str = "", headers=None) -> dict:
        """The Response object of a request body (not streamed)."""
        req, chat, conversation = await asyncio.to_thread(self._prepare, body, key)
        chat["stream"] = False
        try:
            reply = Reply.of_chat(await self.complete(chat, headers))
        except APIError as e:
            raise renamed(e) from None
        answer = response_body(req, new_id("resp"), now(), reply, output_items(reply))
        await asyncio.to_thread(self._keep, req, key, answer, conversation, reply)
        return answer

    async def events(self, body: dict, key: str = "", headers=None) -> AsyncIterator[dict | None]:
        """None once validated and admitted, then the Responses events."""
        req, chat, conversation = await asyncio.to_thread(self._prepare, body, key)
        chat.update(stream=True, stream_options={"include_usage": True})  # (a handle's body may not say)
        chunks = self.stream(chat, headers)
        try:
            try:
                await anext(chunks)
            except APIError as e:
                raise renamed(e) from None
            yield None
            state = ResponseEvents(req, new_id("resp"), now())
            for event in state.started():
                yield event
            async for chunk in chunks:
                if "error" in chunk:
                    for event in state.failed(chunk):
                        yield event
                    return
                for event in state.on_chunk(chunk):
                    yield event
            events = state.finished()
            await asyncio.to_thread(self._keep, req, key, state.body, conversation, state.reply)
            for event in events:  # stored before the last event: a follow-up may come at once
                yield event
        finally:
            await chunks.aclose()


async def _sse(events: AsyncIterator[dict | None]) -> AsyncIterator[str]:
    """Server-sent events with the event's type as `event:` (OpenAI's framing for them)."""
    try:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
    finally:
        await events.aclose()  # a client that left: close the chat stream, which aborts it
