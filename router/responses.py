"""OpenAI response bodies and stream chunks, built from the engine's cumulative outputs.

A stream turns each choice's cumulative `CompletionOutput`s into deltas: the new text,
the new tokens' logprobs, and the finish reason once. Completions and chat differ only in
object names, where the text goes (`text` vs `delta.content`) and the logprobs' shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvray.engine import CompletionOutput
from kvray.router.tool_calls import ToolCallParser


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass
class _Sent:
    text: int = 0  # characters of text already streamed
    logprobs: int = 0  # tokens whose logprobs were streamed
    started: bool = False  # chat: the role delta went out
    finished: bool = False  # the finish reason went out


@dataclass
class ResponseBuilder:
    chat: bool
    model: str
    request_id: str
    tokenizer: object
    tools: ToolCallParser | None = None  # chat with tools: read tool calls out of the text
    echo: dict[int, str] = field(default_factory=dict)  # completions with echo: choice -> its prompt's text
    created: int = field(default_factory=lambda: int(time.time()))
    sent: dict[int, _Sent] = field(default_factory=dict)

    @property
    def _object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    # ---- whole responses ----------------------------------------------------------------

    def body(self, choices: dict[int, CompletionOutput], usage: Usage) -> dict:
        out = []
        for index in sorted(choices):
            c = choices[index]
            logprobs = self._logprobs(c, 0, 0) if c.logprobs is not None else None
            finish_reason = c.finish_reason
            if self.chat:
                message = {"role": "assistant", "content": c.text}
                if self.tools is not None:
                    content, calls = self.tools.parse(c.text)
                    message = {
                        "role": "assistant",
                        "content": content,
                        "tool_calls": [t.body() for t in calls],
                    }
                    finish_reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
                choice = {"index": index, "message": message}
            else:
                choice = {"index": index, "text": self.echo.get(index, "") + c.text}
            choice.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=c.stop_reason)
            out.append(choice)
        return {
            "id": self.request_id,
            "object": self._object,
            "created": self.created,
            "model": self.model,
            "choices": out,
            "usage": usage.body(),
        }

    # ---- streams ------------------------------------------------------------------------

    def delta_chunk(
        self, index: int, c: CompletionOutput, include_usage: bool, usage: Usage | None = None
    ) -> dict | None:
        """The chunk for what `c` adds to choice `index` since the last one (None: nothing
        new). `usage`: the request's so far, when every chunk carries it."""
        sent = self.sent.setdefault(index, _Sent())
        shown = len(c.text)
        if self.tools is not None and c.finish_reason is None:
            shown = self.tools.streamable(c.text)  # what may be a tool call waits for the end
        text = c.text[sent.text : shown] if shown >= sent.text else ""
        logprobs = None
        if c.logprobs is not None and len(c.logprobs) > sent.logprobs:
            logprobs = self._logprobs(c, sent.logprobs, sent.text)
            sent.logprobs = len(c.logprobs)
        if not text and logprobs is None and c.finish_reason is None and sent.started:
            return None
        sent.text = max(sent.text, shown)
        finish_reason = c.finish_reason
        if self.chat:
            delta = {"content": text}
            if not sent.started:
                delta["role"] = "assistant"
            if self.tools is not None and c.finish_reason is not None:
                delta, finish_reason = self._final_tool_delta(delta, c, sent)
            choice = {"index": index, "delta": delta}
        else:
            if not sent.started:
                text = self.echo.get(index, "") + text
            choice = {"index": index, "text": text}
        sent.started = True
        choice.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=c.stop_reason)
        return self._chunk([choice], usage.body() if usage is not None else None, include_usage)

    def _final_tool_delta(self, delta: dict, c: CompletionOutput, sent: _Sent) -> tuple[dict, str]:
        """The last delta of a chat with tools: content not yet sent (what preceded the
        calls, or all of it when there were none), then the calls, each whole."""
        _, calls = self.tools.parse(c.text)
        if not calls:
            return delta, c.finish_reason
        held = c.text[sent.text : self.tools.streamable(c.text)].rstrip()
        delta = {k: v for k, v in delta.items() if k == "role"}
        if held:
            delta["content"] = held
        delta["tool_calls"] = [{"index": i, **t.body()} for i, t in enumerate(calls)]
        return delta, "tool_calls" if c.finish_reason == "stop" else c.finish_reason

    def usage_chunk(self, usage: Usage) -> dict:
        return self._chunk([], usage.body(), True)

    def _chunk(self, choices: list, usage: dict | None, include_usage: bool) -> dict:
        chunk = {
            "id": self.request_id,
            "object": self._object + ".chunk" if self.chat else self._object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if include_usage:
            chunk["usage"] = usage
        return chunk

    # ---- logprobs -----------------------------------------------------------------------

    def _logprobs(self, c: CompletionOutput, start: int, text_offset: int) -> dict:
        """Logprobs of tokens start.. in OpenAI's completions or chat shape."""
        tokens = c.token_ids[start : len(c.logprobs)]
        entries = c.logprobs[start:]
        decode = self._token_text
        if self.chat:
            content = []
            for tid, entry in zip(tokens, entries):
                tops = sorted(entry.items(), key=lambda kv: kv[1].rank)
                content.append(
                    {
                        **_chat_token(decode(tid), entry[tid].logprob),
                        "top_logprobs": [_chat_token(decode(t), lp.logprob) for t, lp in tops],
                    }
                )
            return {"content": content}
        texts = [decode(t) for t in tokens]
        offsets, at = [], text_offset
        for t in texts:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": texts,
            "token_logprobs": [e[t].logprob for t, e in zip(tokens, entries)],
            "top_logprobs": [{decode(t): lp.logprob for t, lp in e.items()} for e in entries],
            "text_offset": offsets,
        }

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
