"""Verifies proposed tokens against the target model's distribution, exactly.

A request with k drafts d_0 .. d_{k-1} has k + 1 logit rows: row j is the target's
distribution p_j for the token after d_0 .. d_{j-1}. Walking j = 0, 1, ...:

* greedy: keep d_j while it is the argmax of row j; at the first miss emit the argmax
  (the token plain decoding would have chosen), so the tokens are those of plain greedy
  decoding, only more per step;
* sampled (Leviathan et al.'s rejection sampling): keep d_j with probability
  min(1, p_j(d_j) / q_j(d_j)); on a rejection emit a token drawn from the residual
  max(p_j - q_j, 0), renormalised. q_j is the proposer's distribution; an n-gram
  proposer is deterministic (q_j = one-hot at d_j), so it keeps d_j with probability
  p_j(d_j) and otherwise draws from p_j without d_j. The emitted tokens then follow the
  target's own distribution, whatever the proposals were.

When every draft is kept, row k gives one more token (the "bonus"), so a step emits
between 1 and k + 1 tokens per request. Rows carry their own position's sampling state
(penalty history, grammar mask, min_tokens), prepared by the model runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvray.engine.sampler import Sampler, SampleRow, invert_cdf


@dataclass
class VerifiedTokens:
    """Per request: the drafts it kept, then one token of the target's own."""

    token_ids: list[list[int]]
    logprobs: list[list]  # per token: its TokenLogprobs or None, as SamplerOutput.logprobs


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SampleRow],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None] | None = None,
) -> VerifiedTokens:
    """logits [sum(len(d) + 1), V]: request i's rows are consecutive, len(drafts[i]) + 1 of
    them, with `rows` alike. `draft_probs[i]`: [len(drafts[i]), V] proposer distributions
    (None: a deterministic proposer)."""
    raw = logits[:, : sampler.vocab_size]
    logits = sampler.process(raw, rows)
    params = [r.sampling_params for r in rows]
    argmax = logits.argmax(dim=-1).tolist()
    probs = None if all(p.greedy for p in params) else sampler.probabilities(logits, params)
    chosen_rows, chosen, counts = [], [], []
    first = 0
    for i, d in enumerate(drafts):
        q = draft_probs[i] if draft_probs is not None else None
        tokens = _walk(sampler, rows, first, d, q, argmax, probs)
        chosen_rows += range(first, first + len(tokens))
        chosen += tokens
        counts.append(len(tokens))
        first += len(d) + 1
    lps = sampler.logprobs(raw[chosen_rows], chosen, [params[r] for r in chosen_rows])
    token_ids, logprobs, at = [], [], 0
    for n in counts:
        token_ids.append(chosen[at : at + n])
        logprobs.append(lps[at : at + n])
        at += n
    return VerifiedTokens(token_ids, logprobs)


def _walk(sampler, rows, first, drafts, q, argmax, probs) -> list[int]:
    """One request's emitted tokens: its kept drafts, then a token of the target's."""
    row = rows[first]
    device = probs.device if probs is not None else None
    out = []
    for j, d in enumerate(drafts):
        r = first + j
        if row.sampling_params.greedy:
            if argmax[r] != d:
                return out + [argmax[r]]
            out.append(d)
            continue
        p = probs[r] / probs[r].sum()
        accept = p[d] if q is None else torch.clamp(p[d] / q[j, d], max=1.0)
        if float(sampler.uniform([rows[r]], device)[0, 0]) < float(accept):
            out.append(d)
            continue
        residual = p.clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = torch.clamp(p - q[j] / q[j].sum(), min=0.0)
        if float(residual.sum()) <= 0.0:  # rounding: p was all on d
            residual = p
        return out + [_draw(sampler, rows[r], residual)]
    r = first + len(drafts)
    if row.sampling_params.greedy:
        return out + [argmax[r]]
    return out + [_draw(sampler, rows[r], probs[r])]


def _draw(sampler: Sampler, row: SampleRow, probs: torch.Tensor) -> int:
    uniform = sampler.uniform([row], probs.device)
    return int(invert_cdf(probs[None, :], uniform)[0])
