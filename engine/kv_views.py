"""What a KV transport may touch of an engine's cache: one job's blocks at a time.

The engine's cache tensor [num_layers, 2, num_blocks, block_size, Hkv, row] stays with
the engine; its worker gets `KVViews`, which hands out a `BlockView` of the blocks one
transfer reads or writes, and nothing wider:

- `pinned(request_id)`: a prefilled prompt's pinned blocks while a pull reads them (the
  pin cannot lapse meanwhile: engine/kv_handoff.py PinTable);
- `hold` / `unhold`: a sharded pull's driver keeps the pin while its shards send their
  pieces of the same blocks (until released, or the lease policy's `hold_s`);
- `of(blocks)`: the blocks the engine reserved for a pulled prompt (the decode side), or
  the blocks a driver holds (a shard's pieces).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvray.engine.kv_handoff import PinTable
from kvray.engine.kv_transfer import pack_blocks, unpack_blocks


class BlockView:
    """Blocks `blocks` of a KV cache: packed into one tensor, or filled from one
    (engine/kv_transfer.py's packed layout), a range of layers and heads at a time."""

    def __init__(self, cache: torch.Tensor, blocks: list[int]):
        self._cache = cache
        self.blocks = list(blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def device(self) -> torch.device:
        return self._cache.device

    def pack(self, layers: range | None = None, heads: range | None = None) -> torch.Tensor:
        return pack_blocks(self._cache, self.blocks, layers, heads)

    def unpack(self, packed: torch.Tensor, layers: range | None = None, heads: range | None = None) -> None:
        unpack_blocks(self._cache, self.blocks, packed, layers, heads)

    def empty_piece(
        self, layers: range, heads: range, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """A buffer for layers x heads of these blocks (a multi-shard pull's piece)."""
        c = self._cache
        shape = (len(layers), 2, len(self.blocks), c.shape[3], len(heads), c.shape[5])
        return torch.empty(shape, dtype=c.dtype, device=device if device is not None else c.device)


class KVViews:
    """An engine's cache as views of one job's blocks; `pins` None on a shard that is
    not its worker's driver (the driver holds the pins)."""

    def __init__(self, cache: torch.Tensor, pins: PinTable | None = None):
        self._cache = cache
        self._pins = pins

    @property
    def device(self) -> torch.device:
        return self._cache.device

    def of(self, blocks: list[int]) -> BlockView:
        return BlockView(self._cache, blocks)

    @contextmanager
    def pinned(self, request_id: str) -> Iterator[BlockView | None]:
        """The request's pinned blocks, read until the block ends; None where its lease
        ended (or it never had one)."""
        blocks = self._pins.begin_read(request_id)
        try:
            yield None if blocks is None else self.of(blocks)
        finally:
            if blocks is not None:
                self._pins.end_read(request_id)

    def hold(self, request_id: str) -> list[int] | None:
        """Hold the request's pinned blocks for a multi-shard pull (None: lease over, or
        held already); `unhold` (the decode side's release) or the hold's end lets go."""
        return self._pins.hold(request_id)

    def unhold(self, request_id: str) -> None:
        self._pins.unhold(request_id)
