"""kvray.engine: paged KV cache, prefix caching, continuous batching, offline and async APIs.

The public names are imported on first use, so that the pure-Python parts (the scheduler,
the KV cache manager, the requests: what `kvray.sim` runs) load without torch."""

from __future__ import annotations

import importlib

_NAMES = {
    "LLM": "kvray.engine.llm",
    "AsyncLLM": "kvray.engine.async_engine",
    "EngineConfig": "kvray.engine.config",
    "LLMEngine": "kvray.engine.llm_engine",
    "SamplingParams": "kvray.engine.sampling_params",
    "RequestOutputKind": "kvray.engine.sampling_params",
    "StructuredOutputsParams": "kvray.engine.structured_outputs",
    "RequestOutput": "kvray.engine.outputs",
    "CompletionOutput": "kvray.engine.outputs",
    "Logprob": "kvray.engine.outputs",
    "EmbeddingRequestOutput": "kvray.engine.embedder",
}
__all__ = list(_NAMES)


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'kvray.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
