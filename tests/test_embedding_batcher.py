"""The embedding batcher (engine/embedding_batcher.py): callers that arrive while a batch
runs share the next one, each gets its own rows in order, a caller that left is dropped
before its batch, an error reaches every caller of its batch, and the queued-token count
(autoscaling's signal) is hand-checkable. A recording embedder stands in for the model
(its first call held until the test lets it go); one test runs the real model."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvray.engine.embedding_batcher import EmbeddingBatcher


class Recording:
    """Embeds input i as [sum of its ids, its length]; the first call waits for `release`."""

    def __init__(self, fail_on: int | None = None):
        self.calls: list[list[list[int]]] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.fail_on = fail_on

    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        self.calls.append(token_ids)
        if len(self.calls) == 1:
            self.started.set()
            self.release.wait(30)
        if self.fail_on is not None and any(self.fail_on in ids for ids in token_ids):
            raise ValueError("bad batch")
        return torch.tensor([[float(sum(ids)), float(len(ids))] for ids in token_ids])


async def _until(condition, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def test_requests_arriving_during_a_batch_share_the_next_and_get_their_rows():
    async def run():
        model = Recording()
        batcher = EmbeddingBatcher(model, max_batch_inputs=5)
        first = asyncio.create_task(batcher.embed([[1, 2]]))
        await _until(model.started.is_set)
        later = [asyncio.create_task(batcher.embed([[i], [i, i]])) for i in (10, 20, 30)]
        leaving = asyncio.create_task(batcher.embed([[99] * 7]))
        await _until(lambda: batcher.queued_tokens == 3 * 3 + 7)  # 3 tokens a request, + 7
        leaving.cancel()
        model.release.set()
        assert (await first).tolist() == [[3.0, 2.0]]
        got = [(await t).tolist() for t in later]
        assert got == [[[i, 1.0], [2 * i, 2.0]] for i in (10.0, 20.0, 30.0)]
        # batch 2 took 10's and 20's inputs (4 <= 5); 30's would make 6: batch 3. The
        # caller that left was dropped, never embedded.
        assert model.calls[1:] == [[[10], [10, 10], [20], [20, 20]], [[30], [30, 30]]]
        assert batcher.batches == 3 and batcher.queued_tokens == 0
        batcher.close()
        assert not batcher.alive

    asyncio.run(run())


def test_an_error_reaches_each_caller_of_its_batch_and_the_batcher_goes_on():
    async def run():
        model = Recording(fail_on=666)
        batcher = EmbeddingBatcher(model)
        first = asyncio.create_task(batcher.embed([[1]]))
        await _until(model.started.is_set)
        bad = asyncio.create_task(batcher.embed([[666]]))
        good = asyncio.create_task(batcher.embed([[5]]))
        await _until(lambda: batcher.queued_tokens == 2)
        model.release.set()
        await first
        for task in (bad, good):  # one batch: both see its error
            with pytest.raises(ValueError, match="bad batch"):
                await task
        assert (await batcher.embed([[4, 4]])).tolist() == [[8.0, 2.0]]
        batcher.close()
        with pytest.raises(RuntimeError, match="closed"):
            await batcher.embed([[1]])

    asyncio.run(run())


def test_the_real_model_batched_equals_it_alone():
    from kvray.engine import EngineConfig
    from kvray.engine.embedder import build_embedder

    embedder = build_embedder(EngineConfig(model="all-minilm-l6-v2"))
    ids = embedder.token_ids(["a river of stone", "seven quiet gardens in winter light", "x"])

    async def run():
        batcher = EmbeddingBatcher(embedder)
        outs = await asyncio.gather(*(batcher.embed([i]) for i in ids))
        batcher.close()
        return torch.cat(outs)

    together = asyncio.run(run())
    alone = torch.cat([embedder.embed([i]) for i in ids])
    assert together.shape == (3, 384) and torch.allclose(together, alone, atol=1e-5)


def test_passes_are_cut_where_padding_costs_more_than_a_pass():
    from kvray.engine.embedder import padded_batches

    # three short and two long inputs: one pass would pad 5 x 100 = 500 (+10); two cost
    # 3 x 1 + 10 + 2 x 100 + 10 = 223
    assert padded_batches([1, 1, 1, 100, 100], 32, 8192, 10) == [(0, 3), (3, 5)]
    # close lengths stay together: splitting saves 2 padded tokens, a pass costs 10
    assert padded_batches([9, 10, 10, 10], 32, 8192, 10) == [(0, 4)]
    # the bounds: at most 2 inputs a pass; at most 250 padded tokens (one input alone may pass it)
    assert padded_batches([5, 5, 5, 5], 2, 8192, 10) == [(0, 2), (2, 4)]
    assert padded_batches([100, 100, 300], 32, 250, 10) == [(0, 2), (2, 3)]
    assert padded_batches([], 32, 8192) == []
