"""The client half of `kvray bench serve`: one streamed OpenAI request, timed by chunk.

Server-sent events are parsed by hand (`data: {...}` lines, `data: [DONE]` at the end) so
the timing sees each chunk as it arrives. Text is a completions chunk's `text` or a chat
chunk's `delta.content`; the token count comes from the usage chunk
(`stream_options.include_usage`) when the server sends one.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp
from serve_datasets import SampleRequest
from serve_metrics import RequestOutput


@dataclass(frozen=True)
class RequestConfig:
    """What every request of a run shares."""

    url: str
    model: str
    chat: bool  # messages=[user prompt] to a chat endpoint, else prompt= to completions
    temperature: float
    ignore_eos: bool
    headers: dict[str, str]


def build_payload(cfg: RequestConfig, sample: SampleRequest) -> dict:
    body = {
        "model": cfg.model,
        "max_tokens": sample.expected_output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(chunk: dict) -> str:
    """The text a completions (`text`) or chat (`delta.content`) chunk carries."""
    choices = chunk.get("choices") or [{}]
    return choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""


async def send_request(
    session: aiohttp.ClientSession, cfg: RequestConfig, sample: SampleRequest
) -> RequestOutput:
    """One streamed request, timed chunk by chunk; failures are recorded, not raised."""
    out = RequestOutput(prompt_len=sample.prompt_len)
    parts: list[str] = []
    start = last = time.perf_counter()
    try:
        async with session.post(cfg.url, json=build_payload(cfg, sample), headers=cfg.headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, `event:` and `:` comment lines
                data = line[len(b"data:") :].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"server error: {chunk['error']}"
                    return out
                if text := chunk_text(chunk):
                    now = time.perf_counter()
                    if parts:
                        out.itl.append(now - last)
                    else:
                        out.ttft = now - start
                    last = now
                    parts.append(text)
                if (usage := chunk.get("usage")) and usage.get("completion_tokens") is not None:
                    out.output_tokens = usage["completion_tokens"]
        out.e2el = time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # ValueError: bad JSON
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.generated_text = "".join(parts)
    out.success = bool(parts)
    out.error = "" if parts else "Never received a valid chunk to calculate TTFT."
    return out
