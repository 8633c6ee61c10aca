"""The `draft_model` proposer: a small model of the same vocabulary drafts k tokens greedily.

The draft has its own paged KV cache with as many blocks as the target's and uses the
target's block tables, so a request's draft K/V for position p sits in the same block
and slot as its target K/V (vLLM does the same): nothing is allocated for the draft, and
blocks freed by the target free the draft's too.

Per engine step, for every decoding request the scheduler gave k draft slots:

    known tokens 0 .. N-1 (the target has computed 0 .. N-2)
    catch-up:     positions c .. N-2, from what the draft has computed (c), in forwards
                  of at most max_num_batched_tokens tokens
    draft step 1: the last known token at N-1 -> d_1, proposed for position N
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
from kvray.engine.model_runner import ModelRunner, StepPlan, load_model
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
        self,
        spec: SpeculativeConfig,
        target: EngineConfig,
        target_hf_config,
        max_model_len: int,
        draft_hf_config=None,
    ):
        """The draft's weights, loaded at once (before the target sizes its KV cache on a
        GPU: they count as used memory); its cache comes with `start`. `max_model_len`:
        the target's, which the draft must cover. `draft_hf_config` (tests): random
        draft weights of that config, no path."""
        path = None
        if draft_hf_config is None:
            path = resolve_model_path(spec.model)
            draft_hf_config = load_config(path)
        vocab, target_vocab = draft_hf_config.vocab_size, target_hf_config.vocab_size
        if vocab != target_vocab:
            raise InvalidArgumentError(
                "speculative_config.model",
                spec.model,
                f"a model of the target's vocabulary ({target_vocab} tokens; it has {vocab})",
            )
        native = getattr(draft_hf_config, "max_position_embeddings", None) or 2048
        if native < max_model_len:
            raise InvalidArgumentError(
                "speculative_config.model",
                spec.model,
                f"a model whose context ({native}) covers max_model_len={max_model_len} (or a lower one)",
            )
        self.hf_config = draft_hf_config
        self.config = dataclasses.replace(
            target,
            model=spec.model or target.model,
            max_model_len=max_model_len,
            kv_cache_dtype="auto",
            speculative_config=None,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
        )
        self.budget = target.max_num_batched_tokens  # tokens per draft forward, at most
        self.model, self.device, self.dtype, _ = load_model(self.config, draft_hf_config, path)
        self.runner: ModelRunner | None = None
        self.computed: dict[str, tuple[int, int]] = {}  # request -> (draft-computed tokens, preemptions)

    def start(self, num_blocks: int) -> None:
        """The draft's KV cache, of the target's block count."""
        self.runner = ModelRunner(
            self.config,
            self.model,
            self.hf_config,
            self.device,
            self.dtype,
            self.config.max_model_len,
            None,
            num_blocks,
        )

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.hf_config, self.config.block_size, dtype)

    def propose(self, requests: list[Request], tables: list[list[int]], ks: list[int]) -> list[list[int]]:
        """k_i draft tokens for each decoding request i, whose slots up to position
        N_i - 1 + k_i the target has allocated (`tables`)."""
        live = [i for i, k in enumerate(ks) if k > 0]
        self._catch_up([requests[i] for i in live], [tables[i] for i in live])
        drafts: list[list[int]] = [[] for _ in requests]
        while live:
            tokens = self._step(
                [requests[i] for i in live], [tables[i] for i in live], [drafts[i] for i in live]
            )
            for i, t in zip(live, tokens):
                drafts[i].append(t)
            live = [i for i in live if len(drafts[i]) < ks[i]]
        for req, d in zip(requests, drafts):
            if d:  # valid up to the last draft fed back in: position N + k - 2
                self.computed[req.request_id] = (req.num_tokens + len(d) - 1, req.num_preemptions)
        return drafts

    def _catch_up(self, requests: list[Request], tables: list[list[int]]) -> None:
        """The draft's K/V up to each request's last known token (excluded), in forwards of
        at most `budget` tokens (a first decode, or one after a preemption, brings the
        whole prompt)."""
        while True:
            chunks, left = [], self.budget
            for req, table in zip(requests, tables):
                start = self._computed(req)
                take = min(req.num_tokens - 1 - start, left)
                if take > 0:
                    chunks.append((req, table, start, take))
                    left -= take
            if not chunks:
                return
            self.runner.run(self._plan([(t, s, r.all_token_ids[s : s + n]) for r, t, s, n in chunks], []))
            for req, _, start, take in chunks:
                self.computed[req.request_id] = (start + take, req.num_preemptions)

    def _step(self, requests: list[Request], tables: list[list[int]], drafts: list[list[int]]) -> list[int]:
        """One draft forward and its greedy tokens: each request's last known token (no
        drafts yet) or its last draft."""
        pieces = []
        for req, table, d in zip(requests, tables, drafts):
            start = req.num_tokens - 1 + len(d)
            pieces.append((table, start, [d[-1]] if d else [req.all_token_ids[-1]]))
        samples = [SampleRow(r.request_id, GREEDY, 0, 0, [], []) for r in requests]
        return [t[0] for t in self.runner.run(self._plan(pieces, samples)).token_ids]

    def _plan(self, pieces: list[tuple[list[int], int, list[int]]], samples: list[SampleRow]) -> StepPlan:
        """A draft forward over (block table, first position, token ids) pieces; with
        `samples`, logits at each piece's last token."""
        bs = self.config.block_size
        input_ids, positions, slots, query_lens, seq_lens, logit_rows = [], [], [], [], [], []
        for table, start, ids in pieces:
            pos = range(start, start + len(ids))
            input_ids += ids
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            query_lens.append(len(ids))
            seq_lens.append(start + len(ids))
            logit_rows.append(len(input_ids) - 1)
        width = max(len(t) for t, _, _ in pieces)
        padded = [t + [0] * (width - len(t)) for t, _, _ in pieces]
        rows = logit_rows if samples else []
        return StepPlan(input_ids, positions, slots, query_lens, seq_lens, padded, rows, samples, [])

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
