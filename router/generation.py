"""An ingress replica's work on completions and chat (Responses come through chat): the
body validated, templated and tokenized off the event loop, admitted, its engine requests
(prompts x n) driven through the Frontend, the answer or the stream of chunks built, and
kvray's errors turned into OpenAI-shaped ones. A stream hands each delta the Frontend
yields (`Frontend.stream`) to the ResponseBuilder as it is (`ResponseBuilder.chunk`); only
an answer that is not streamed folds each choice's deltas into its whole output
(`frontend.grow`). With tracing on, each request is one trace (kvray/tracing.py): its root
span here, `ingress` and `finish` spans beside the Frontend's `route` spans and the
workers' spans.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import ray

from kvray import tracing as attr
from kvray.configs import ServeConfig
from kvray.errors import KvrayError
from kvray.router.api_error import APIError, internal_error
from kvray.router.frontend import Frontend, grow, new_output
from kvray.router.ingest import Ingest
from kvray.router.ingress_parts import Admission, api_error_of, cause, num_prompt_tokens, prepare
from kvray.router.responses import Usage
from kvray.router.streams import all_or_none, merge
from kvray.tracing import RequestTrace, Tracing

logger = logging.getLogger(__name__)
INGEST_THREADS = 2  # per ingress replica: one long grammar compile does not hold up the rest


class Generation:
    def __init__(
        self,
        config: ServeConfig,
        ingest: Ingest,
        admission: Admission,
        frontend: Frontend,
        tracing: Tracing | None = None,
    ):
        self.config = config
        self.ingest = ingest
        self.admission = admission
        self.frontend = frontend
        self.tracing = tracing
        # templating, tokenizing and compiling grammars off the event loop: a large body
        # never stalls the streams this replica serves
        self.ingest_thread = ThreadPoolExecutor(INGEST_THREADS, thread_name_prefix="kvray-ingest")

    async def close(self) -> None:
        self.ingest_thread.shutdown(wait=False)
        if self.tracing is not None:  # (its flush may wait on the collector: off the loop)
            await asyncio.to_thread(self.tracing.shutdown)

    async def off_loop(self, fn, *args):
        """fn(*args) on the ingest threads (templating, tokenizing, compiling grammars).
        Bodies waiting for them count against `max_queued_requests` too (503 past it)."""
        with self.admission.ingesting():
            return await asyncio.get_running_loop().run_in_executor(self.ingest_thread, fn, *args)

    async def complete(self, body: dict, chat: bool, headers: Mapping[str, str] | None = None) -> dict:
        """The response body. `headers`: the HTTP request's (a `traceparent` there is the
        trace's parent)."""
        trace = self._trace(headers)
        try:
            req, builder, jobs = await self._prepared(body, chat, trace)
            with self.admission.admitted(len(jobs)):
                try:
                    finals = await all_or_none([self._final(*job, trace=trace) for job in jobs])
                except KvrayError as e:
                    raise api_error_of(e, builder.request_id) from None
                except APIError:
                    raise
                except Exception as e:  # noqa: BLE001 (logged with the request's id; the client gets the id)
                    logger.error("kvray ingress: request %s failed", builder.request_id, exc_info=e)
                    raise internal_error(builder.request_id) from None
            finishing = time.time_ns()
            usage = Usage(num_prompt_tokens(jobs, req.n), sum(len(f.token_ids) for f in finals))
            answer = builder.body(dict(enumerate(finals)), usage)
            _finished(trace, finishing, usage, [f.finish_reason for f in finals])
            return answer
        except BaseException as e:
            _end(trace, e)
            raise
        finally:
            _end(trace)

    async def stream(
        self, body: dict, chat: bool, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[dict | None]:
        """None once validated and admitted, then the chunks. An error after that ends
        the stream with one OpenAI error event (the SSE framing then sends [DONE])."""
        trace = self._trace(headers)
        try:
            req, builder, jobs = await self._prepared(body, chat, trace)
            prompt_tokens = num_prompt_tokens(jobs, req.n)
            with self.admission.admitted(len(jobs)):
                yield None  # validated and admitted: the caller may start the response now
                num_tokens, reasons = {}, {}  # choice -> tokens so far; its finish reason
                try:
                    async for index, delta in merge([self._deltas(*job, trace=trace) for job in jobs]):
                        num_tokens[index] = num_tokens.get(index, 0) + len(delta.token_ids)
                        reasons[index] = delta.finish_reason
                        so_far = None
                        if req.continuous_usage:
                            so_far = Usage(prompt_tokens, sum(num_tokens.values()))
                        chunk = builder.chunk(index, delta, req.include_usage, so_far)
                        if chunk is not None:
                            yield chunk
                except KvrayError as e:
                    _end(trace, e)
                    yield api_error_of(e, builder.request_id).body()
                    return
                except Exception as e:  # noqa: BLE001 (logged with the request's id; the client gets the id)
                    logger.error("kvray ingress: stream %s failed", builder.request_id, exc_info=e)
                    _end(trace, e)
                    yield internal_error(builder.request_id).body()
                    return
                finishing = time.time_ns()
                usage = Usage(prompt_tokens, sum(num_tokens.values()))
                chunk = builder.usage_chunk(usage) if req.include_usage else None
                _finished(trace, finishing, usage, list(reasons.values()))
                if chunk is not None:
                    yield chunk
        except BaseException as e:
            _end(trace, e)
            raise
        finally:
            _end(trace)

    def _trace(self, headers: Mapping[str, str] | None) -> RequestTrace | None:
        return self.tracing.request(headers) if self.tracing is not None else None

    async def _prepared(self, body: dict, chat: bool, trace: RequestTrace | None):
        """ingress_parts.prepare on the ingest threads (traced as `ingress`)."""
        prepared = await self.off_loop(prepare, self.config, self.ingest, self.ingest.tokenizer, body, chat)
        if trace is not None:
            req, builder, jobs = prepared
            trace.record("ingress", trace.start_ns)
            trace.set(
                {
                    attr.REQUEST_ID: builder.request_id,
                    attr.RESPONSE_MODEL: self.config.model_name,
                    attr.MAX_TOKENS: jobs[0][2].max_tokens,
                    attr.TEMPERATURE: req.temperature,
                    attr.TOP_P: req.top_p,
                    attr.N: req.n,
                    attr.PROMPT_TOKENS: num_prompt_tokens(jobs, req.n),
                }
            )
        return prepared

    async def _deltas(
        self, rid: str, prompt_token_ids: list[int], params, timeout_s=None, priority: int = 0, trace=None
    ):
        """One engine request's deltas as the Frontend yields them; leaving early aborts
        it everywhere."""
        gen = self.frontend.stream(rid, prompt_token_ids, params, timeout_s, priority, trace)
        try:
            async for delta in gen:
                if trace is not None and not trace.first_token_seen and delta.token_ids:
                    trace.first_token()
                yield delta
        except ray.exceptions.RayTaskError as e:
            raise cause(e) from None
        finally:
            await gen.aclose()

    async def _final(self, rid: str, prompt_token_ids: list[int], params, *rest, trace=None):
        """One engine request's whole output."""
        out = new_output(params)
        async for delta in self._deltas(rid, prompt_token_ids, params, *rest, trace=trace):
            grow(out, delta)
        return out


def _finished(trace: RequestTrace | None, finishing: int, usage: Usage, reasons: list) -> None:
    if trace is not None:
        trace.record(
            "finish", finishing, attributes={"gen_ai.response.finish_reasons": [str(r) for r in reasons]}
        )
        trace.set({attr.COMPLETION_TOKENS: usage.completion_tokens})


def _end(trace: RequestTrace | None, error: BaseException | None = None) -> None:
    if trace is not None:
        trace.end(error)
