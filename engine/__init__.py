"""kvray.engine: paged KV cache, prefix caching, continuous batching, offline and async APIs."""

from kvray.engine.async_engine import AsyncLLM
from kvray.engine.config import EngineConfig
from kvray.engine.llm import LLM
from kvray.engine.llm_engine import LLMEngine
from kvray.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvray.engine.sampling_params import RequestOutputKind, SamplingParams
from kvray.engine.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineConfig",
    "LLMEngine",
    "SamplingParams",
    "RequestOutputKind",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]
