"""The `draft_model` proposer: a small model of the same vocabulary drafts k tokens greedily.

The draft has its own paged KV cache with as many blocks as the target's and uses the
target's block tables, so a request's draft K/V for position p sits in the same block
and slot as its target K/V (vLLM does the same): nothing is allocated for the draft, and
blocks freed by the target free the draft's too.

Per engine step, for every decoding request the scheduler gave k draft slots:

    known tokens 0 .. N-1 (the target has computed 0 .. N-2)
    draft step 1: positions c .. N-1 (catching up from what the draft has computed, c)
                  -> d_1, proposed for position N
    draft step j: d_{j-1} at position N+j-2 -> d_j                       (j = 2 .. k)

The draft's K/V is then valid up to position N+k-2; after verification only the positions
the target kept stay valid (`settle`), so a later catch-up recomputes the rest. The draft
starts from position 0 for every request (prefix-cache hits and pulled KV are target
K/V only) and again after a preemption (its blocks were freed).

Drafting is greedy (the proposal is the draft's argmax, so the proposer is deterministic):
verification is then exact for greedy and sampled requests alike.
"""

from __future__ import annotations

import dataclasses

import torch

from kvray.engine.config import EngineConfig
from kvray.engine.model_runner import ModelRunner, StepPlan, build_runner
from kvray.engine.request import Request
from kvray.engine.sampler import SampleRow
from kvray.engine.sampling_params import SamplingParams
from kvray.engine.spec_decode import SpeculativeConfig
from kvray.errors import InvalidArgumentError
from kvray.models.layers import head_dim_of
from kvray.models.loader import load_config, resolve_model_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    """K and V bytes of one block of a model's (unquantized, unsharded) cache."""
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim_of(hf_config)
    return per_token * block_size * dtype.itemsize


class DraftProposer:
    def __init__(
        self, spec: SpeculativeConfig, target: EngineConfig, target_vocab: int, draft_hf_config=None
    ):
        """`draft_hf_config` (tests): random draft weights of that config, no path."""
        path = None
        if draft_hf_config is None:
            path = resolve_model_path(spec.model)
            draft_hf_config = load_config(path)
        vocab = draft_hf_config.vocab_size
        if vocab != target_vocab:
            raise InvalidArgumentError(
                "speculative_config.model",
                spec.model,
                f"a model of the target's vocabulary ({target_vocab} tokens; it has {vocab})",
            )
        self.hf_config = draft_hf_config
        self.path = path
        self.config = dataclasses.replace(
            target,
            model=spec.model or target.model,
            kv_cache_dtype="auto",
            speculative_config=None,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
        )
        self.runner: ModelRunner | None = None
        self.computed: dict[str, tuple[int, int]] = {}  # request -> (draft-computed tokens, preemptions)

    def start(self, num_blocks: int) -> None:
        """Build the draft's model and a cache of the target's block count."""
        self.runner = build_runner(self.config, self.hf_config, self.path, num_blocks=num_blocks)

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.hf_config, self.config.block_size, dtype)

    def propose(self, requests: list[Request], tables: list[list[int]], ks: list[int]) -> list[list[int]]:
        """k_i draft tokens for each decoding request i, whose slots up to position
        N_i - 1 + k_i the target has allocated (`tables`)."""
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, k in enumerate(ks) if k > 0]
        step = 0
        while live:
            tokens = self._step(
                [requests[i] for i in live], [tables[i] for i in live], [drafts[i] for i in live]
            )
            for i, t in zip(live, tokens):
                drafts[i].append(t)
            step += 1
            live = [i for i in live if len(drafts[i]) < ks[i]]
        for req, d in zip(requests, drafts):
            if d:  # valid up to the last draft fed back in: position N + k - 2
                self.computed[req.request_id] = (req.num_tokens + len(d) - 1, req.num_preemptions)
        return drafts

    def _step(self, requests: list[Request], tables: list[list[int]], drafts: list[list[int]]) -> list[int]:
        """One draft forward: catch-up chunks (no drafts yet) or each request's last draft."""
        bs = self.config.block_size
        input_ids, positions, slots, query_lens, seq_lens, logit_rows, samples = [], [], [], [], [], [], []
        row = 0
        for req, table, d in zip(requests, tables, drafts):
            if d:
                start, ids = req.num_tokens + len(d) - 1, [d[-1]]
            else:
                start = self._computed(req)
                ids = req.all_token_ids[start:]
            pos = range(start, start + len(ids))
            input_ids += ids
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            query_lens.append(len(ids))
            seq_lens.append(start + len(ids))
            row += len(ids)
            logit_rows.append(row - 1)
            samples.append(SampleRow(req.request_id, GREEDY, 0, 0, [], []))
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        plan = StepPlan(input_ids, positions, slots, query_lens, seq_lens, padded, logit_rows, samples, [])
        return [t[0] for t in self.runner.run(plan).token_ids]

    def _computed(self, req: Request) -> int:
        """Tokens whose draft K/V is valid (0 after a preemption freed the blocks)."""
        done, preemptions = self.computed.get(req.request_id, (0, req.num_preemptions))
        return min(done, req.num_computed_tokens) if preemptions == req.num_preemptions else 0

    def settle(self, req: Request) -> None:
        """After verification: only positions the target kept hold the drafts it kept."""
        if req.request_id in self.computed:
            self.computed[req.request_id] = (self._computed(req), req.num_preemptions)

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)
