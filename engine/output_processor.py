"""Turns per-sample progress into user-facing RequestOutputs.

One user request with n samples is n scheduler requests; this module keeps, per user
request, a detokenizer per sample and emits one RequestOutput holding the n
CompletionOutputs, finished when every sample has finished. The request's
`output_kind` shapes it: everything so far (CUMULATIVE), only what is new since the
previous output (DELTA), or nothing until the request has finished (FINAL_ONLY).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvray.engine.detokenizer import IncrementalDetokenizer
from kvray.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from kvray.engine.request import Request
from kvray.engine.sampling_params import RequestOutputKind


@dataclass
class _Sent:
    """How much of one sample the request's outputs have carried so far (DELTA)."""

    num_chars: int = 0  # of its text
    num_tokens: int = 0
    num_logprobs: int = 0  # per-token logprob entries
    finished: bool = False  # its finish_reason has been sent


@dataclass
class _Tracked:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    detoks: list[IncrementalDetokenizer]
    logprobs: list[list[dict[int, Logprob]]] = field(default_factory=list)
    sent: list[_Sent] = field(default_factory=list)  # per sample (DELTA)
    prompt_sent: bool = False  # an output with the prompt has gone out


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tracked: dict[str, _Tracked] = {}
        self.sample_to_parent: dict[str, str] = {}

    def add(self, request_id: str, samples: list[Request]) -> None:
        first = samples[0]
        p = first.sampling_params
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer, p.skip_special_tokens, p.stop_strings, p.include_stop_str_in_output
            )
            for _ in samples
        ]
        self.tracked[request_id] = _Tracked(
            request_id,
            first.prompt,
            first.prompt_token_ids,
            samples,
            detoks,
            [[] for _ in samples],
            [_Sent() for _ in samples],
        )
        for s in samples:
            self.sample_to_parent[s.request_id] = request_id

    def on_token(self, sample: Request, logprobs: TokenLogprobs | None) -> str | None:
        """Feed the sample's newest token; returns a stop string if one completed."""
        t = self.tracked[self.sample_to_parent[sample.request_id]]
        i = sample.sample_index
        token = sample.output_token_ids[-1]
        if logprobs is not None:
            t.logprobs[i].append(logprobs.entry(token))
            sample.cumulative_logprob += logprobs.logprob
        if self.tokenizer is None:
            return None
        return t.detoks[i].add_token(token)

    def replay(self, sample: Request, token_ids: list[int]) -> None:
        """Tokens the request made on an engine that has gone (a migrated request): they
        become its output so far, as if sampled here, and count as sent (a DELTA output
        goes on from the next token; the caller has them and their logprobs)."""
        t = self.tracked[self.sample_to_parent[sample.request_id]]
        i = sample.sample_index
        for token in token_ids:
            sample.append_token(token)
            if self.tokenizer is not None:
                t.detoks[i].add_token(token)
        text = t.detoks[i].visible_text() if self.tokenizer is not None else ""
        t.sent[i] = _Sent(len(text), sample.num_output_tokens, 0, False)

    def output(self, request_id: str) -> RequestOutput | None:
        """The request's output now, shaped by its `output_kind`; None for an unfinished
        FINAL_ONLY request. A finished request is forgotten here."""
        t = self.tracked[request_id]
        kind = t.samples[0].sampling_params.output_kind
        finished = all(s.finished for s in t.samples)
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = [self._completion(t, i, kind) for i in range(len(t.samples))]
        with_prompt = kind is not RequestOutputKind.DELTA or not t.prompt_sent
        t.prompt_sent = True
        out = RequestOutput(
            request_id=request_id,
            prompt=t.prompt if with_prompt else None,
            prompt_token_ids=list(t.prompt_token_ids) if with_prompt else None,
            outputs=[c for c in completions if c is not None],
            finished=finished,
            num_cached_tokens=max(t.samples[0].num_cached_tokens, 0),
            metrics=_metrics(t.samples),
        )
        if finished:
            del self.tracked[request_id]
            for s in t.samples:
                del self.sample_to_parent[s.request_id]
        return out

    @staticmethod
    def _completion(t: _Tracked, i: int, kind: RequestOutputKind) -> CompletionOutput | None:
        """Sample i's CompletionOutput: all of it, or (DELTA) what is new since the last
        output, None when nothing is. A running sample shows its visible text only, a
        prefix of its final text, so DELTA pieces always add up to the final text."""
        s, d, lps = t.samples[i], t.detoks[i], t.logprobs[i]
        asked = s.sampling_params.logprobs is not None
        text = d.text if s.finished else d.visible_text()
        sent = _Sent()  # CUMULATIVE: from the start
        if kind is RequestOutputKind.DELTA:
            sent, now = t.sent[i], _Sent(len(text), s.num_output_tokens, len(lps), s.finished)
            if now == sent:
                return None
            t.sent[i] = now
        return CompletionOutput(
            index=s.sample_index,
            text=text[sent.num_chars :],
            token_ids=s.output_token_ids[sent.num_tokens :],
            cumulative_logprob=s.cumulative_logprob if asked else None,
            logprobs=lps[sent.num_logprobs :] if asked else None,
            finish_reason=s.status.value if s.finished else None,
            stop_reason=s.stop_reason,
        )

    def parent_of(self, sample_id: str) -> str:
        return self.sample_to_parent[sample_id]

    def samples_of(self, request_id: str) -> list[Request]:
        t = self.tracked.get(request_id)
        return t.samples if t else []


def _metrics(samples: list[Request]) -> RequestMetrics:
    """The user request's timings: its queue time ends when its first sample is scheduled."""
    scheduled = [s.first_scheduled_time for s in samples if s.first_scheduled_time is not None]
    first = [s.first_token_time for s in samples if s.first_token_time is not None]
    last = [s.last_token_time for s in samples if s.last_token_time is not None]
    step_seconds = sum(s.step_seconds for s in samples)
    return RequestMetrics(
        samples[0].arrival_time,
        min(scheduled, default=None),
        step_seconds,
        first_token_time=min(first, default=None),
        last_token_time=max(last, default=None),
    )
