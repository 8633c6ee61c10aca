"""A request's way into the engine: its prompt tokenized and checked, then made into the
`Request`s the scheduler runs (one per sample), each with its grammar brought up to the
tokens it already has.

Everything here raises `InvalidArgumentError` naming the field and what it allows, before
the scheduler sees the request, so a bad request never disturbs the others.
"""

from __future__ import annotations

import time

from kvray.engine.request import Request, SampleGroup
from kvray.engine.request_limits import RequestLimits
from kvray.engine.sampling_params import SamplingParams
from kvray.engine.structured_outputs import GrammarCompiler
from kvray.errors import InvalidArgumentError

PromptInput = str | dict | list  # text, {"prompt_token_ids": [...]}, or token ids


def eos_token_ids(hf_config, model_path, tokenizer) -> frozenset[int]:
    """Every end-of-sequence id the model's config, tokenizer and generation config name."""
    ids: set[int] = set()

    def add(eos) -> None:
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    for source in (hf_config, tokenizer):
        add(getattr(source, "eos_token_id", None))
    if model_path is not None:
        from transformers import GenerationConfig

        try:
            add(GenerationConfig.from_pretrained(model_path).eos_token_id)
        except OSError:
            pass
    return frozenset(ids)


class RequestIntake:
    def __init__(self, tokenizer, hf_config, model_path, limits: RequestLimits, block_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = hf_config.vocab_size
        self.limits = limits
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids(hf_config, model_path, tokenizer)
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(the prompt's text where it has one, its token ids)"""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError("prompt", prompt, "token ids (this engine has no tokenizer)")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidArgumentError("prompt", prompt, "a string, token ids, or {'prompt_token_ids': [...]}")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.limits.check(prompt_ids, params)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # a bad grammar fails here (cached)

    def samples(
        self,
        sample_ids: list[str],
        text: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int,
        deadline: float | None,
        made_elsewhere: list[int],
        matchers: list | None = None,
    ) -> list[Request]:
        """One Request per sample id, with the tokens `made_elsewhere` (generated on an
        engine that has gone, or the first token of a prefill elsewhere) replayed through
        its grammar. `matchers`: one grammar matcher per sample, built by the caller (else
        built here, where the request has a grammar)."""
        group = SampleGroup(params.n) if params.n > 1 else None
        so = params.structured_outputs
        if so is not None and matchers is None:
            matchers = [self.grammars.matcher(so) for _ in sample_ids]
        now = time.monotonic()
        samples = [
            Request(
                request_id=sample_id,
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
                block_size=self.block_size,
                prompt=text,
                arrival_time=now,
                priority=priority,
                deadline=deadline,
                sample_index=i,
                group=group,
                grammar=matchers[i] if so is not None else None,
            )
            for i, sample_id in enumerate(sample_ids)
        ]
        for s in samples:
            self._replay_grammar(s, made_elsewhere)
        return samples

    @staticmethod
    def _replay_grammar(req: Request, token_ids: list[int]) -> None:
        if req.grammar is None:
            return
        for token in token_ids:
            if not req.grammar.accept(token):
                raise InvalidArgumentError(
                    "generated_token_ids", token, "tokens its structured_outputs grammar allows"
                )
