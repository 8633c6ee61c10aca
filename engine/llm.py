"""The offline API, shaped like vLLM's `LLM`: build once, `generate` batches to completion."""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Sequence

from kvray.engine.config import EngineConfig
from kvray.engine.embedder import EmbeddingOutput, EmbeddingRequestOutput, build_embedder
from kvray.engine.llm_engine import LLMEngine, PromptInput
from kvray.engine.outputs import RequestOutput
from kvray.engine.sampling_params import RequestOutputKind, SamplingParams
from kvray.errors import InvalidArgumentError, no_chat_template

ENGINE_OBJECTS = ("hf_config", "tokenizer")  # objects for tests and benchmarks, not config


def _check_keywords(kwargs: dict) -> None:
    """Every keyword must be an EngineConfig field (or an engine object): a typo is an
    error naming the closest valid name, never a silently default engine."""
    import difflib

    valid = set(EngineConfig.__dataclass_fields__) | set(ENGINE_OBJECTS)
    for name in kwargs:
        if name not in valid:
            close = difflib.get_close_matches(name, sorted(valid), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise InvalidArgumentError(name, kwargs[name], f"a keyword LLM accepts{hint}")


_E = EngineConfig  # the defaults below are its own, stated nowhere else


class LLM:
    def __init__(
        self,
        model: str = _E.model,
        dtype: str = _E.dtype,
        block_size: int = _E.block_size,
        max_num_seqs: int = _E.max_num_seqs,
        max_num_batched_tokens: int = _E.max_num_batched_tokens,
        max_model_len: int | None = _E.max_model_len,
        enable_prefix_caching: bool = _E.enable_prefix_caching,
        kv_cache_memory_bytes: int | None = _E.kv_cache_memory_bytes,
        attention_backend: str | None = _E.attention_backend,
        tensor_parallel_size: int = _E.tensor_parallel_size,
        pipeline_parallel_size: int = _E.pipeline_parallel_size,
        seed: int = _E.seed,
        kv_cache_dtype: str = _E.kv_cache_dtype,
        speculative_config: dict | None = _E.speculative_config,
        quantization: str | None = _E.quantization,
        **kwargs,
    ):
        """vLLM's engine arguments by name: those above, and any other EngineConfig field."""
        _check_keywords(kwargs)
        fields = EngineConfig.__dataclass_fields__
        named = {k: v for k, v in locals().items() if k in fields}  # (the arguments above)
        config = EngineConfig(**named, **{k: v for k, v in kwargs.items() if k in fields})
        engine_kwargs = {k: kwargs[k] for k in ENGINE_OBJECTS if k in kwargs}
        self._model = model
        self._ids = itertools.count()
        self.engine: LLMEngine | None = None
        self._group = None  # a sharded engine on Ray (tp x pp > 1)
        # an embedding model: LLM.embed only (engine objects: a random-weight generative model)
        self.embedder = None if engine_kwargs else build_embedder(config)
        if self.embedder is not None:
            return
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            if engine_kwargs:
                raise InvalidArgumentError(
                    "hf_config" if "hf_config" in engine_kwargs else "tokenizer",
                    "<object>",
                    "only with tensor_parallel_size = pipeline_parallel_size = 1 (shards load `model`)",
                )
            # The shards are Ray actors; the engine package never imports Ray itself,
            # so the group comes from the cluster layer, loaded only here.
            self._group = importlib.import_module("kvray.cluster.offline").ShardedEngine(config)
        else:
            self.engine = LLMEngine(config, **engine_kwargs)

    @property
    def tokenizer(self):
        if self.embedder is not None:
            return self.embedder.tokenizer
        return self._group.tokenizer if self._group is not None else self.engine.tokenizer

    def embed(self, prompts: str | list[int] | Sequence[str | list[int]]) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (text, or token ids), in order: an embedding model's
        (e.g. the `all-minilm-l6-v2` alias; engine/embedder.py)."""
        if self.embedder is None:
            raise InvalidArgumentError(
                "model", self._model, "an embedding model (e.g. all-minilm-l6-v2) for embed"
            )
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        token_ids = self.embedder.token_ids(list(prompts), "prompts")
        vectors = self.embedder.embed(token_ids)
        return [
            EmbeddingRequestOutput(str(next(self._ids)), ids, EmbeddingOutput(v.tolist()))
            for ids, v in zip(token_ids, vectors)
        ]

    def close(self) -> None:
        """Stop the shard actors of a tensor/pipeline-parallel model (no-op otherwise)."""
        if self._group is not None:
            self._group.close()
            self._group = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: Ray may be gone already
            pass

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order.

        Every prompt and parameter set is validated before any is scheduled.
        """
        if self.embedder is not None:
            raise InvalidArgumentError(
                "model", self._model, "a generative model (this one embeds: LLM.embed)"
            )
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidArgumentError(
                    "sampling_params",
                    f"<{len(params)} items>",
                    f"one SamplingParams or {len(prompts)} of them",
                )
        for p in params:
            if p.output_kind is RequestOutputKind.DELTA:
                raise InvalidArgumentError(
                    "output_kind", "DELTA", "CUMULATIVE or FINAL_ONLY (generate returns final outputs)"
                )
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if self._group is not None:
            ids = [str(next(self._ids)) for _ in prompts]
            return self._group.generate(ids, prompts, params, priorities)
        engine = self.engine
        prepared = []
        for prompt, p in zip(prompts, params):
            text, token_ids = engine.tokenize(prompt)
            engine.validate(token_ids, p)
            prepared.append({"prompt": text, "prompt_token_ids": token_ids})
        ids = [str(next(self._ids)) for _ in prompts]
        for rid, prompt, p, prio in zip(ids, prepared, params, priorities):
            engine.add_request(rid, prompt, p, priority=prio)
        return self._run(ids)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in finals])
            raise
        return [finals[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(c, chat_template, add_generation_prompt)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(
        self, conversation: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise no_chat_template()
        text = self.tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def kv_cache_stats(self):
        if self._group is not None:
            return self._group.kv_cache_stats()
        return self.engine.kv_cache_stats()
