"""The embedding pool as a Serve deployment: one replica per embedding worker, each running
the pool's embedding model in-process (engine/embedder.py) behind one batching queue
(engine/embedding_batcher.py), so concurrent requests share forward passes.

The ingress calls `embed` through Serve's handle, which spreads calls over the replicas
(a replica takes up to MAX_ONGOING at once, enough that a burst waits in its batching
queue, where it is counted, rather than at the caller). A replica reports its queued input
tokens to kvray's autoscaling policy (`record_autoscaling_stats`, the `embedding` signals
of router/autoscaling.py). An embedding needs no KV cache and no peer, so a worker is its
replica: no placement group, no separate actor.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from ray import serve

from kvray.configs import ServeConfig
from kvray.errors import InvalidArgumentError
from kvray.tracing import PROMPT_TOKENS, Tracing, traces_endpoint

MAX_ONGOING = 256  # embed calls a replica takes at once (they queue in its batcher)
HEALTH_CHECK_S = 2.0


@serve.deployment(max_ongoing_requests=MAX_ONGOING, health_check_period_s=HEALTH_CHECK_S)
class EmbeddingReplica:
    def __init__(self, config: dict):
        import torch

        from kvray.engine.config import EngineConfig
        from kvray.engine.embedder import build_embedder
        from kvray.engine.embedding_batcher import EmbeddingBatcher

        cfg = ServeConfig(**config)
        pool = cfg.embedding
        endpoint = traces_endpoint(cfg.otlp_traces_endpoint)
        self.tracing = Tracing(endpoint, "embedding") if endpoint else None
        if pool.torch_threads is not None:
            torch.set_num_threads(pool.torch_threads)
        engine = EngineConfig(**pool.engine)
        # the GPU only where the pool reserved one (a GPU node's other workers size its memory)
        device = "cuda" if pool.num_gpus > 0 and torch.cuda.is_available() else "cpu"
        embedder = build_embedder(engine, device)
        if embedder is None:
            raise InvalidArgumentError(
                "embedding.engine.model", engine.model, "an embedding model (e.g. all-minilm-l6-v2)"
            )
        self.batcher = EmbeddingBatcher(embedder)

    async def embed(
        self, inputs: list[str | list[int]], trace: dict[str, str] | None = None
    ) -> tuple[np.ndarray, list[int]]:
        """[len(inputs), dimensions] fp32 embeddings and each input's token count. A bad
        input (too long, token ids out of the vocabulary) is an InvalidArgumentError naming
        `input[i]`. `trace`: the request's trace context (an `embed` span from the call's
        arrival to its vectors)."""
        arrived = time.time_ns()
        embedder = self.batcher.embedder
        token_ids = await asyncio.to_thread(embedder.token_ids, inputs, "input")
        vectors = await self.batcher.embed(token_ids)
        counts = [len(ids) for ids in token_ids]
        if self.tracing is not None and trace is not None:
            attributes = {"kvray.role": "embedding", "kvray.inputs": len(counts), PROMPT_TOKENS: sum(counts)}
            self.tracing.record("embed", trace, arrived, time.time_ns(), attributes)
        return vectors.numpy(), counts

    def model_info(self) -> dict:
        return {
            "max_model_len": self.batcher.embedder.max_tokens,
            "dimensions": self.batcher.embedder.dimensions,
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"queued_prompt_tokens": float(self.batcher.queued_tokens)}

    def check_health(self) -> None:
        if not self.batcher.alive:
            raise RuntimeError("the embedding thread has stopped")

    def __del__(self):
        batcher = getattr(self, "batcher", None)
        if batcher is not None:
            batcher.close()
        if getattr(self, "tracing", None) is not None:
            self.tracing.shutdown()  # export what is buffered


def embedding_deployment(cfg: ServeConfig) -> serve.Application:
    """The embedding pool bound for the app: a fixed `num_workers`, or autoscaled on the
    queued input tokens."""
    from kvray.router.autoscaling import autoscaling_config

    pool = cfg.embedding
    actor = {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus}
    if pool.resources:
        actor["resources"] = dict(pool.resources)
    options = {"name": f"{cfg.app_name}-embedding", "ray_actor_options": actor}
    if pool.autoscaling is None:
        options["num_replicas"] = pool.num_workers
    else:
        options["autoscaling_config"] = autoscaling_config("embedding", pool, cfg.app_name, pool.engine)
    return EmbeddingReplica.options(**options).bind(cfg.model_dump())
