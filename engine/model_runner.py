"""Owns the model, its paged KV cache and the sampler; runs one scheduled step.

The step packs every scheduled request's new tokens back to back::

    input_ids   [ r0: t0 t1 t2 t3 | r1: t9 | r2: t4 t5 ]     T = 7 tokens
    positions   [ 0  1  2  3      | 9     | 4  5     ]
    slot_mapping: block_table[pos // block_size] * block_size + pos % block_size

and computes logits only at the last token of each request that reaches its last known
token this step (a prompt chunk that is not the prompt's end samples nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvray.engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from kvray.engine.cpu_allocator import keep_freed_memory_in_heap
from kvray.engine.sampler import Sampler, SamplerOutput
from kvray.engine.scheduler import SchedulerOutput
from kvray.errors import InvalidArgumentError
from kvray.kernels.backend import AttentionMetadata, get_backend
from kvray.models.layers import head_dim_of

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class StepResult:
    request_ids: list[str]  # requests that sampled a token, in batch order
    sampled: SamplerOutput


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        hf_config,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ):
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        if device.type == "cpu":
            keep_freed_memory_in_heap()
        self.backend = get_backend(config.attention_backend, device)
        self.sampler = Sampler(hf_config.vocab_size)
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = head_dim_of(hf_config)
        self.num_blocks = self._num_blocks(max_model_len)
        # One tensor for every layer's K and V, so a KV transfer packs or unpacks all
        # layers' blocks in one indexing op; each layer's caches are contiguous views.
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(self.num_layers)]

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _num_blocks(self, max_model_len: int) -> int:
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            budget = DEFAULT_CPU_KV_BYTES if self.device.type != "cuda" else self._gpu_budget()
        num_blocks = budget // self.bytes_per_block
        blocks_needed = -(-max_model_len // self.block_size)
        if num_blocks < blocks_needed:
            raise InvalidArgumentError(
                "kv_cache_memory_bytes",
                budget,
                f">= {blocks_needed * self.bytes_per_block} bytes ({blocks_needed} blocks of "
                f"{self.bytes_per_block} B, one max_model_len={max_model_len} sequence); "
                "or lower max_model_len",
            )
        return num_blocks

    def _gpu_budget(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free
        return max(int(total * self.config.gpu_memory_utilization) - used_by_others, 0)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> StepResult:
        input_ids, positions, slots = [], [], []
        query_lens, seq_lens, logit_rows, sampling = [], [], [], []
        bs = self.block_size
        row = 0
        for i, req in enumerate(out.requests):
            n = out.num_scheduled_tokens[i]
            start = req.num_computed_tokens
            table = block_tables[i]
            input_ids.extend(req.all_token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            query_lens.append(n)
            seq_lens.append(start + n)
            row += n
            if out.samples(i):
                logit_rows.append(row - 1)
                sampling.append(req)
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            cu_seqlens_q=torch.tensor([0, *_cumsum(query_lens)], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            query_lens=query_lens,
            seq_lens_host=seq_lens,
            block_size=bs,
        )
        self.backend.prepare(meta)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv_caches,
            self.backend,
            meta,
        )
        if not sampling:
            return StepResult([], SamplerOutput([], []))
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=dev)])
        return StepResult([r.request_id for r in sampling], self.sampler(logits, sampling))


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out
