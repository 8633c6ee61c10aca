"""Turns per-sample progress into user-facing RequestOutputs.

One user request with n samples is n scheduler requests; this module keeps, per user
request, a detokenizer per sample and emits one cumulative RequestOutput holding all n
CompletionOutputs, finished when every sample has finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvray.engine.detokenizer import IncrementalDetokenizer
from kvray.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvray.engine.request import Request


@dataclass
class _Tracked:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    detoks: list[IncrementalDetokenizer]
    logprobs: list[list[dict[int, Logprob]]] = field(default_factory=list)


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
            request_id, first.prompt, first.prompt_token_ids, samples, detoks, [[] for _ in samples]
        )
        for s in samples:
            self.sample_to_parent[s.request_id] = request_id

    def on_token(self, sample: Request, logprobs) -> str | None:
        """Feed the sample's newest token; returns a stop string if one completed."""
        t = self.tracked[self.sample_to_parent[sample.request_id]]
        i = sample.sample_index
        token = sample.output_token_ids[-1]
        if logprobs is not None:
            lp, rank, top = logprobs
            entry = {tid: Logprob(v, r + 1) for r, (tid, v) in enumerate(top)}
            entry.setdefault(token, Logprob(lp, rank))
            t.logprobs[i].append(entry)
            sample.cumulative_logprob += lp
        if self.tokenizer is None:
            return None
        return t.detoks[i].add_token(token)

    def output(self, request_id: str) -> RequestOutput:
        t = self.tracked[request_id]
        completions = []
        for s, d, lps in zip(t.samples, t.detoks, t.logprobs):
            asked = s.sampling_params.logprobs is not None
            completions.append(
                CompletionOutput(
                    index=s.sample_index,
                    text=d.text if s.finished else d.visible_text(),
                    token_ids=list(s.output_token_ids),
                    cumulative_logprob=s.cumulative_logprob if asked else None,
                    logprobs=lps if asked else None,
                    finish_reason=s.status.value if s.finished else None,
                    stop_reason=s.stop_reason,
                )
            )
        finished = all(s.finished for s in t.samples)
        out = RequestOutput(
            request_id=request_id,
            prompt=t.prompt,
            prompt_token_ids=list(t.prompt_token_ids),
            outputs=completions,
            finished=finished,
            num_cached_tokens=max(t.samples[0].num_cached_tokens, 0),
            metrics=_metrics(t.samples),
        )
        if finished:
            del self.tracked[request_id]
            for s in t.samples:
                del self.sample_to_parent[s.request_id]
        return out

    def parent_of(self, sample_id: str) -> str:
        return self.sample_to_parent[sample_id]

    def samples_of(self, request_id: str) -> list[Request]:
        t = self.tracked.get(request_id)
        return t.samples if t else []


def _metrics(samples: list[Request]) -> RequestMetrics:
    """The user request's timings: its queue time ends when its first sample is scheduled."""
    scheduled = [s.first_scheduled_time for s in samples if s.first_scheduled_time is not None]
    return RequestMetrics(samples[0].arrival_time, min(scheduled, default=None))
