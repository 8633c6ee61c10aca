"""Batched token sampling: penalties, temperature, min-p, top-k, top-p, per-request seeds.

All requests of a step are sampled in one pass over a [B, V] logits tensor, by inverting
each row's CDF at one uniform draw (one random number per row: on a CPU, drawing a
[B, V] noise tensor as `multinomial` does costs more than the model's matmuls). Rows
without a seed share one batched draw; a request with a seed draws from its own
generator, so it gets the same tokens whatever else is in the batch.
Logprobs are those of the model's raw distribution (log_softmax of the logits), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvray.engine.outputs import TokenLogprobs
from kvray.engine.sampling_params import SamplingParams, sample_seed
from kvray.engine.structured_outputs import apply_token_bitmask
from kvray.kernels import cpu_native


@dataclass
class SampleRow:
    """What the sampler needs of one request (it may run on another shard than the
    scheduler: the last pipeline stage). Token lists travel only for penalties."""

    request_id: str
    sampling_params: SamplingParams
    sample_index: int
    num_output_tokens: int
    all_token_ids: list[int]  # for repetition_penalty, else empty
    output_token_ids: list[int]  # for presence/frequency penalties, else empty
    token_bitmask: torch.Tensor | None = None  # a grammar's allowed tokens (structured outputs)
    suppressed_token_ids: list[int] = field(default_factory=list)  # e.g. EOS before min_tokens


def sample_rows(req, drafts: list[int]) -> list[SampleRow]:
    """The request's sampling state at its next position and, for each draft, at the
    position after it (as if the drafts before it were already output)."""
    p = req.sampling_params
    penalised = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    rows = []
    for j in range(len(drafts) + 1):
        ahead = drafts[:j]
        num_output = req.num_output_tokens + j
        mask, terminated = _grammar_after(req.grammar, ahead)
        rows.append(
            SampleRow(
                req.request_id,
                p,
                req.sample_index,
                num_output,
                req.all_token_ids + ahead if p.repetition_penalty != 1.0 else [],
                req.output_token_ids + ahead if penalised else [],
                mask,
                _suppressed(req, num_output, terminated),
            )
        )
    return rows


def _grammar_after(grammar, ahead: list[int]) -> tuple[torch.Tensor | None, bool]:
    """The grammar's allowed tokens after `ahead` (drafts it accepts: the proposer checks)
    and whether it is complete there, leaving the grammar where it was."""
    if grammar is None:
        return None, False
    for token in ahead:
        grammar.accept(token)
    mask, terminated = grammar.token_bitmask(), grammar.is_terminated
    if ahead:
        grammar.rollback(len(ahead))
    return mask, terminated


def _suppressed(req, num_output: int, grammar_done: bool) -> list[int]:
    """Tokens it may not sample yet: end-of-sequence and stop tokens before `min_tokens`
    (unless its grammar is complete: then it may only end)."""
    p = req.sampling_params
    if num_output >= p.min_tokens or grammar_done:
        return []
    return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids)))


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # per row: (logprob of the sampled token, its rank, [(token, logprob), ...] top-k) or None
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.generators: dict[str, torch.Generator] = {}  # per seeded request

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def save_generators(self, requests: list[SampleRow]) -> dict[str, torch.Tensor | None]:
        """The seeded rows' generator states before a pass (None: not made yet), so that a
        pass that fails can be redone drawing the same numbers (`restore_generators`)."""
        return {
            r.request_id: (g.get_state() if (g := self.generators.get(r.request_id)) is not None else None)
            for r in requests
            if r.sampling_params.seed is not None and not r.sampling_params.greedy
        }

    def restore_generators(self, saved: dict[str, torch.Tensor | None]) -> None:
        for request_id, state in saved.items():
            if state is None:
                self.generators.pop(request_id, None)
            else:
                self.generators[request_id].set_state(state)

    def __call__(
        self, logits: torch.Tensor, requests: list[SampleRow], greedy: torch.Tensor | None = None
    ) -> SamplerOutput:
        """logits fp32 [B, V], row i belongs to requests[i]; `greedy`: each row's argmax of
        these logits where the caller has it (the native decode step finds it as it writes
        them), taken as the greedy tokens when nothing here changes the logits."""
        raw = logits[:, : self.vocab_size]
        logits = self.process(raw, requests)
        params = [r.sampling_params for r in requests]
        if all(p.greedy for p in params):
            unchanged = greedy is not None and logits is raw and raw.shape[1] == self.vocab_size
            tokens = greedy if unchanged else _argmax(logits)
        else:
            tokens = self._sample(logits, requests)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self.logprobs(raw, token_list, params))

    def process(self, logits: torch.Tensor, requests: list[SampleRow]) -> torch.Tensor:
        """Penalties, logit bias, suppressed tokens and grammar masks applied to [B, V]
        logits (a copy where anything changes)."""
        logits = self._apply_penalties(logits, requests)
        logits = self._apply_logit_bias(logits, requests)
        masks = {i: m for i, r in enumerate(requests) if (m := getattr(r, "token_bitmask", None)) is not None}
        if masks:  # the grammar's mask last: nothing after it re-allows a token
            logits = apply_token_bitmask(logits, list(masks), list(masks.values()))
        narrowed = [
            i
            for i, r in enumerate(requests)
            if i in masks
            or r.sampling_params.allowed_token_ids is not None
            or getattr(r, "suppressed_token_ids", None)
        ]
        if narrowed:
            _check_some_token_left(logits, narrowed, requests)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, requests: list[SampleRow]) -> torch.Tensor:
        rows = [
            i
            for i, r in enumerate(requests)
            if r.sampling_params.repetition_penalty != 1.0
            or r.sampling_params.presence_penalty != 0.0
            or r.sampling_params.frequency_penalty != 0.0
        ]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            p, r = requests[i].sampling_params, requests[i]
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long, device=row.device)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if r.output_token_ids and (p.presence_penalty or p.frequency_penalty):
                out = torch.tensor(r.output_token_ids, dtype=torch.long, device=row.device)
                counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, requests: list[SampleRow]) -> torch.Tensor:
        """OpenAI's logit_bias (added), vLLM's allowed_token_ids (every other token -inf),
        then the suppressed tokens (-inf): one indexed op each for the whole batch, whatever
        the number of entries (the ids were checked against the vocabulary at intake)."""
        bias: tuple[list, list, list] = ([], [], [])  # rows, token ids, values
        allowed: tuple[list, list] = ([], [])  # rows, token ids
        suppressed: tuple[list, list] = ([], [])
        vocab = logits.shape[1]
        for i, r in enumerate(requests):
            p = r.sampling_params
            if p.logit_bias:
                bias[0].extend([i] * len(p.logit_bias))
                bias[1].extend(p.logit_bias)
                bias[2].extend(p.logit_bias.values())
            if p.allowed_token_ids is not None:
                allowed[0].extend([i] * len(p.allowed_token_ids))
                allowed[1].extend(p.allowed_token_ids)
            for t in getattr(r, "suppressed_token_ids", None) or ():  # SampleRows have them
                if t < vocab:  # (the model's own EOS ids included: never trust them past the vocab)
                    suppressed[0].append(i)
                    suppressed[1].append(t)
        if not (bias[0] or allowed[0] or suppressed[0]):
            return logits
        logits = logits.clone()
        dev = logits.device

        def index(rows: list, cols: list) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tensor(rows, device=dev), torch.tensor(cols, dtype=torch.long, device=dev)

        if bias[0]:
            values = torch.tensor(bias[2], dtype=logits.dtype, device=dev)
            logits.index_put_(index(bias[0], bias[1]), values, accumulate=True)
        if allowed[0]:
            forbidden = torch.zeros_like(logits, dtype=torch.bool)
            forbidden[sorted(set(allowed[0]))] = True
            forbidden[index(*allowed)] = False
            logits.masked_fill_(forbidden, float("-inf"))
        if suppressed[0]:
            logits[index(*suppressed)] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[SampleRow]):
        params = [r.sampling_params for r in requests]
        device = logits.device
        probs = self.probabilities(logits, params)
        uniform = self.uniform(requests, device)
        sampled = invert_cdf(probs, uniform)
        greedy = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution each row samples from: temperature, then min-p, top-k, top-p
        (unnormalised after the filters). Greedy rows come out at temperature 1."""
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)
        probs = (logits / temps[:, None]).softmax(dim=-1)
        probs = _filter_min_p(probs, [p.min_p for p in params])
        return _filter_top_k_top_p(probs, [p.top_k for p in params], [p.top_p for p in params])

    def uniform(self, requests: list[SampleRow], device: torch.device) -> torch.Tensor:
        """One U[0, 1) draw per row, [B, 1]: seeded requests' from their own generator."""
        uniform = torch.rand(len(requests), 1, device=device)
        for i, r in enumerate(requests):
            p = r.sampling_params
            if p.seed is not None and not p.greedy:
                uniform[i] = torch.rand(1, device=device, generator=self._generator(r, device))
        return uniform

    def _generator(self, r: SampleRow, device: torch.device) -> torch.Generator:
        g = self.generators.get(r.request_id)
        if g is None:
            g = torch.Generator(device=device).manual_seed(
                sample_seed(r.sampling_params.seed, r.sample_index)
            )
            for _ in range(r.num_output_tokens):  # tokens sampled elsewhere (a prefill worker)
                torch.rand(1, device=device, generator=g)
            self.generators[r.request_id] = g
        return g

    @staticmethod
    def logprobs(raw: torch.Tensor, tokens: list[int], params) -> list:
        """Per row: its token's TokenLogprobs from the raw logits, or None where the
        request asked for no logprobs."""
        wanted = [p.logprobs for p in params]
        if all(k is None for k in wanted):
            return [None] * len(tokens)
        logprobs = raw.log_softmax(dim=-1)
        k_max = max(k or 0 for k in wanted)
        top_vals, top_ids = logprobs.topk(max(k_max, 1), dim=-1)
        out = []
        for i, k in enumerate(wanted):
            if k is None:
                out.append(None)
                continue
            lp = logprobs[i, tokens[i]]
            rank = int((logprobs[i] > lp).sum()) + 1
            top = list(zip(top_ids[i, :k].tolist(), top_vals[i, :k].tolist()))
            out.append(TokenLogprobs(float(lp), rank, top))
        return out


def _check_some_token_left(logits: torch.Tensor, rows: list[int], requests: list[SampleRow]) -> None:
    """A row whose allowed tokens, grammar and suppressed tokens leave it nothing to sample
    (e.g. allowed_token_ids all stop tokens before min_tokens) raises, naming its request:
    sampling it would return token 0 (the step's containment then ends that request alone)."""
    best = logits[torch.tensor(rows, device=logits.device)].amax(dim=-1)
    dead = (best == float("-inf")).nonzero().flatten().tolist()
    if dead:
        names = [requests[rows[i]].request_id for i in dead]
        raise ValueError(f"no token is left to sample for {', '.join(names)}")


def invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Row i's token at quantile uniform[i] of its (unnormalised) distribution, [B]."""
    cdf = probs.cumsum(dim=-1)
    sampled = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
    # never land on a zero-probability token through rounding at the top of the CDF
    return torch.minimum(sampled, (probs > 0).cumsum(-1).argmax(-1))


def _filter_min_p(probs: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    if not any(min_ps):
        return probs
    min_p = torch.tensor(min_ps, device=probs.device)[:, None]
    keep = probs >= min_p * probs.max(dim=-1, keepdim=True).values
    return probs * keep


def _filter_top_k_top_p(probs: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Zero every token outside each row's top-k set and outside its top-p nucleus.

    The nucleus is the smallest set of most likely tokens whose mass reaches top_p
    (after top-k); the token that crosses top_p is kept.
    """
    if all(k == -1 for k in top_ks) and all(p >= 1.0 for p in top_ps):
        return probs
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ks = torch.tensor([vocab if k == -1 else min(k, vocab) for k in top_ks], device=probs.device)
    position = torch.arange(vocab, device=probs.device)[None, :]
    keep = position < ks[:, None]
    sorted_probs = sorted_probs * keep
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    total = sorted_probs.sum(dim=-1, keepdim=True)
    top_p = torch.tensor(top_ps, device=probs.device)[:, None]
    keep &= mass_before < top_p * total
    keep[:, 0] = True
    mask = torch.zeros_like(keep).scatter_(-1, order, keep)
    return probs * mask


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: the native kernel on fp32 CPU rows (3x torch's argmax at
    32-192 rows of a 49k vocabulary), else torch."""
    if logits.dtype == torch.float32 and logits.dim() == 2 and cpu_native.usable(logits):
        return cpu_native.argmax(logits)
    return logits.argmax(dim=-1)
