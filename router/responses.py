"""OpenAI response bodies and stream chunks.

A whole response is built from each choice's cumulative `CompletionOutput`; a stream's
chunks from each choice's deltas as the front passes them on (`Delta`: the new text, the
new tokens and their logprobs, the finish reason on the last). Per choice a stream keeps
only what it must: how much text went out (the logprobs' text offsets), whether the first
chunk went out (chat's role, completions' echo), and with tools the text so far (the
parser decides from it what may go out as content, and reads the calls from it at the
end). Completions and chat differ only in object names, where the text goes (`text` vs
`delta.content`) and the logprobs' shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvray.actors.messages import Delta
from kvray.engine import CompletionOutput, Logprob
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
class _Streamed:
    """One choice of a stream: what went out so far."""

    num_chars: int = 0  # characters of text already streamed
    started: bool = False  # the first chunk went out (chat: the role; completions: the echo)
    text: str = ""  # with tools only: the text so far, streamed or held back


@dataclass
class ResponseBuilder:
    chat: bool
    model: str
    request_id: str
    tokenizer: object
    tools: ToolCallParser | None = None  # chat with tools: read tool calls out of the text
    echo: dict[int, str] = field(default_factory=dict)  # completions with echo: choice -> its prompt's text
    created: int = field(default_factory=lambda: int(time.time()))
    streamed: dict[int, _Streamed] = field(default_factory=dict)

    @property
    def _object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    # ---- whole responses ----------------------------------------------------------------

    def body(self, choices: dict[int, CompletionOutput], usage: Usage) -> dict:
        out = []
        for index in sorted(choices):
            c = choices[index]
            logprobs = None
            if c.logprobs is not None:
                logprobs = self._logprobs(c.token_ids[: len(c.logprobs)], c.logprobs, 0)
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

    def chunk(self, index: int, delta: Delta, include_usage: bool, usage: Usage | None = None) -> dict | None:
        """The chunk for choice `index`'s `delta` (None: nothing to send yet). `usage`:
        the request's so far, when every chunk carries it."""
        streamed = self.streamed.setdefault(index, _Streamed())
        finished = delta.finish_reason is not None
        text = delta.text
        if self.tools is not None:
            streamed.text += delta.text
            shown = len(streamed.text)
            if not finished:
                shown = self.tools.streamable(streamed.text)  # what may be a tool call waits for the end
            text = streamed.text[streamed.num_chars : shown]
        logprobs = None
        if delta.logprobs:
            tokens = delta.token_ids[: len(delta.logprobs)]  # (one entry a token)
            logprobs = self._logprobs(tokens, delta.logprobs, streamed.num_chars)
        if not text and logprobs is None and not finished and streamed.started:
            return None
        before = streamed.num_chars  # (the text that went out before this chunk)
        streamed.num_chars += len(text)
        finish_reason = delta.finish_reason
        if self.chat:
            said = {"content": text}
            if not streamed.started:
                said["role"] = "assistant"
            if self.tools is not None and finished:
                said, finish_reason = self._final_tool_delta(said, streamed.text, before, finish_reason)
            choice = {"index": index, "delta": said}
        else:
            if not streamed.started:
                text = self.echo.get(index, "") + text
            choice = {"index": index, "text": text}
        streamed.started = True
        choice.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=delta.stop_reason)
        return self._envelope([choice], usage.body() if usage is not None else None, include_usage)

    def _final_tool_delta(self, delta: dict, text: str, sent: int, finish_reason: str) -> tuple[dict, str]:
        """The last delta of a chat with tools, given the whole `text` (`sent` characters
        of it streamed): with calls in it, the role (if not sent yet), the content before
        the calls not streamed yet (it came with them), then the calls, each whole; without
        calls, `delta` as it is."""
        _, calls = self.tools.parse(text)
        if not calls:
            return delta, finish_reason
        held = text[sent : self.tools.streamable(text)].rstrip()
        delta = {k: v for k, v in delta.items() if k == "role"}
        if held:
            delta["content"] = held
        delta["tool_calls"] = [{"index": i, **t.body()} for i, t in enumerate(calls)]
        return delta, "tool_calls" if finish_reason == "stop" else finish_reason

    def usage_chunk(self, usage: Usage) -> dict:
        return self._envelope([], usage.body(), True)

    def _envelope(self, choices: list, usage: dict | None, include_usage: bool) -> dict:
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

    def _logprobs(self, tokens: list[int], entries: list[dict[int, Logprob]], text_offset: int) -> dict:
        """The logprobs of `tokens` (one entry each) in OpenAI's completions or chat shape;
        `text_offset`: where the first token's text starts in the choice's text."""
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
