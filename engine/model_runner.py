"""Owns the model, its paged KV cache and the sampler; runs one scheduled step.

The step packs every scheduled request's new tokens back to back::

    input_ids   [ r0: t0 t1 t2 t3 | r1: t9 | r2: t4 t5 ]     T = 7 tokens
    positions   [ 0  1  2  3      | 9     | 4  5     ]
    slot_mapping: block_table[pos // block_size] * block_size + pos % block_size

and computes logits only at the last token of each request that reaches its last known
token this step (a prompt chunk that is not the prompt's end samples nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from kvray.engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from kvray.engine.cpu_allocator import keep_freed_memory_in_heap
from kvray.engine.dtype import resolve_dtype
from kvray.engine.sampler import Sampler, SampleRow, sample_rows
from kvray.engine.scheduler import SchedulerOutput
from kvray.engine.step_sampling import StepResult, cause, sample_step
from kvray.errors import InvalidArgumentError
from kvray.kernels import cpu_native
from kvray.kernels.backend import AttentionMetadata, LayerKV, get_backend
from kvray.kernels.cpu_fused import StepLogits
from kvray.kernels.cpu_memory import huge_page_zeros
from kvray.kernels.kv_quant import resolve_kv_cache_dtype, split_cache
from kvray.kernels.torch_backend import TorchBackend
from kvray.models.cpu_linear import pack_model
from kvray.models.fetch import ALIASES
from kvray.models.gguf_file import GGUF_NAME
from kvray.models.layers import head_dim_of
from kvray.models.loader import build_model
from kvray.models.parallel import ShardContext


def engine_device(config: EngineConfig) -> torch.device:
    return torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def build_runner(
    config: EngineConfig,
    hf_config,
    model_path,
    shard: ShardContext | None = None,
    *,
    num_blocks: int | None = None,
    extra_bytes_per_block: Callable[[torch.dtype], int] | None = None,
):
    """This shard's model (weights from `model_path`, random when None) and its runner.

    `num_blocks`: that many KV blocks (a draft model's cache, as many as its target's);
    `extra_bytes_per_block(dtype)`: bytes each block also costs elsewhere (the draft's
    cache), taken out of the budget before counting blocks."""
    model, device, dtype, max_model_len = load_model(config, hf_config, model_path, shard)
    extra = extra_bytes_per_block(dtype) if extra_bytes_per_block is not None else 0
    return ModelRunner(config, model, hf_config, device, dtype, max_model_len, shard, num_blocks, extra)


def load_model(config: EngineConfig, hf_config, model_path, shard: ShardContext | None = None):
    """(model, device, dtype, max_model_len): this shard's weights on their device."""
    device = engine_device(config)
    dtype = resolve_dtype(config.dtype, device)
    max_model_len = resolve_max_model_len(config, hf_config)
    path = Path(model_path) if model_path is not None else None
    ignore, quantization = config.quantization_ignore, resolve_quantization(config, path, dtype, device)
    model = build_model(hf_config, path, dtype, device, max_model_len, shard, quantization, ignore)
    policy = cpu_native.machine_policy(config.fused_decode)
    group = config.quantization_group_size
    pack_model(model, dtype, device, quantization, ignore, policy, group)  # CPU: weights packed once
    return model, device, dtype, max_model_len


def resolve_quantization(
    config: EngineConfig, path: Path | None, dtype: torch.dtype, device: torch.device
) -> str | None:
    """`quantization=None`, the checkpoint's own: "gguf" where `model` names a GGUF (an
    alias, a .gguf file) whose folder `path` holds the file, and the native CPU kernels
    take the dtype on this device; else None (random weights, an old folder without it)."""
    if config.quantization is not None:
        return config.quantization
    gguf = config.model in ALIASES or config.model.endswith(".gguf")
    held = path is not None and (path / GGUF_NAME).exists()
    return "gguf" if gguf and held and cpu_native.takes(dtype, device) else None


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    native = getattr(hf_config, "max_position_embeddings", None) or 2048
    wanted = config.max_model_len
    if wanted is None:
        return native
    if wanted > native:
        raise InvalidArgumentError("max_model_len", wanted, f"[1, {native}] (the model's context)")
    return wanted


@dataclass
class StepPlan:
    """One step's batch, built by the driver shard and run by every shard of the group."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]  # padded to one width
    logit_rows: list[int]  # rows of the tokens that sample, one per SampleRow
    samples: list[SampleRow]  # one per logit row: a request with k drafts has k + 1
    forget: list[str]  # requests whose sampler state can go
    drafts: list[list[int]] | None = None  # per sampling request, when any has drafts
    failed: dict[str, str] = field(default_factory=dict)  # rows that could not be made: id -> cause

    @property
    def request_ids(self) -> list[str]:
        """The sampling requests, in order (a request's rows are consecutive)."""
        if self.drafts is None:
            return [r.request_id for r in self.samples]
        starts = _cumsum([0] + [len(d) + 1 for d in self.drafts[:-1]])
        return [self.samples[i].request_id for i in starts]


class ModelRunner:
    """Runs steps of this shard's part of the model.

    In a group of tp x pp shards (`shard.spec.world_size > 1`) the driver (rank 0) calls
    `execute`, which broadcasts the step's plan once; every other shard waits in `serve`
    and runs the same plan. Stage boundaries pass hidden states with send/recv; the last
    stage computes logits (gathered over its tensor ranks) and its first tensor rank
    samples and, under pipeline parallelism, sends the tokens back to the driver.
    """

    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        hf_config,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        shard: ShardContext | None = None,
        num_blocks: int | None = None,
        extra_bytes_per_block: int = 0,
    ):
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.shard = shard or ShardContext()
        self.spec = self.shard.spec
        self.block_size = config.block_size
        if device.type == "cpu":
            keep_freed_memory_in_heap()
        self.backend = get_backend(config.attention_backend, device)
        self.sampler = Sampler(hf_config.vocab_size)
        self.hidden_size = hf_config.hidden_size
        self.num_layers = len(model.layer_range)
        heads = self.spec.kv_heads(hf_config.num_attention_heads, hf_config.num_key_value_heads)
        self.num_kv_heads = len(heads)
        self.head_dim = head_dim_of(hf_config)
        self.kv_quant = resolve_kv_cache_dtype(config.kv_cache_dtype, device)
        self.extra_bytes_per_block = extra_bytes_per_block
        self.num_blocks = num_blocks if num_blocks is not None else self._num_blocks(max_model_len)
        # One tensor for every layer's K and V, so a KV transfer packs or unpacks all
        # layers' blocks in one indexing op; each layer's caches are views of it. An
        # 8-bit cache's rows carry their scales (kv_quant.py): the views are strided.
        # On a CPU in huge-page memory (kernels/cpu_memory.py: decode attention reads it
        # block by block), its pages taken as blocks are first written.
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.row_width)
        if device.type == "cpu":
            self.kv_cache = huge_page_zeros(shape, self.cache_storage_dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.cache_storage_dtype, device=device)
        self.kv_caches = [self._layer_kv(i) for i in range(self.num_layers)]
        self._forget: list[str] = []

    @property
    def row_width(self) -> int:
        """Elements of one (token, KV head) row of the cache tensor."""
        return self.head_dim if self.kv_quant is None else self.kv_quant.row_bytes(self.head_dim)

    @property
    def cache_storage_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_quant is None else torch.int8

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.cache_storage_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.row_width * elem

    def _layer_kv(self, layer: int) -> LayerKV:
        k, v = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        if self.kv_quant is None:
            return LayerKV(k, v)
        (k_codes, k_scale), (v_codes, v_scale) = split_cache(k, self.kv_quant), split_cache(v, self.kv_quant)
        return LayerKV(k_codes, v_codes, k_scale, v_scale)

    def _num_blocks(self, max_model_len: int) -> int:
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            budget = DEFAULT_CPU_KV_BYTES if self.device.type != "cuda" else self._gpu_budget()
        per_block = self.bytes_per_block + self.extra_bytes_per_block
        num_blocks = budget // per_block
        if self.spec.world_size > 1:  # one block table for the group: the smallest shard's count
            count = torch.tensor([num_blocks], dtype=torch.int64)
            dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.shard.cpu_group)
            num_blocks = int(count.item())
        blocks_needed = -(-max_model_len // self.block_size)
        if num_blocks < blocks_needed:
            raise InvalidArgumentError(
                "kv_cache_memory_bytes",
                budget,
                f">= {blocks_needed * per_block} bytes ({blocks_needed} blocks of "
                f"{per_block} B, one max_model_len={max_model_len} sequence); "
                "or lower max_model_len",
            )
        return num_blocks

    def _gpu_budget(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free
        return max(int(total * self.config.gpu_memory_utilization) - used_by_others, 0)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's sampler state (with the next step's plan)."""
        self._forget.append(request_id)

    # ---- the driver -------------------------------------------------------------------

    def plan(self, out: SchedulerOutput, block_tables: list[list[int]]) -> StepPlan:
        input_ids, positions, slots = [], [], []
        query_lens, seq_lens, logit_rows, samples, drafts = [], [], [], [], []
        failed: dict[str, str] = {}
        bs = self.block_size
        row = 0
        for i, req in enumerate(out.requests):
            n = out.num_scheduled_tokens[i]
            d = out.draft_token_ids[i]
            start = req.num_computed_tokens
            table = block_tables[i]
            input_ids.extend(req.all_token_ids[start : start + n - len(d)])
            input_ids.extend(d)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            query_lens.append(n)
            seq_lens.append(start + n)
            row += n
            if out.samples(i):
                logit_rows.extend(range(row - 1 - len(d), row))
                try:
                    samples.extend(sample_rows(req, d))
                except Exception as e:  # its grammar failed: it alone ends (the engine sees `failed`)
                    failed[req.request_id] = cause(e)
                    samples.extend(
                        SampleRow(req.request_id, req.sampling_params, req.sample_index, 0, [], [])
                        for _ in range(len(d) + 1)
                    )
                drafts.append(d)
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        forget, self._forget = self._forget, []
        return StepPlan(
            input_ids,
            positions,
            slots,
            query_lens,
            seq_lens,
            padded,
            logit_rows,
            samples,
            forget,
            drafts if any(drafts) else None,
            failed,
        )

    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> StepResult:
        plan = self.plan(out, block_tables)
        if self.spec.world_size > 1:
            dist.broadcast_object_list([plan], src=0, group=self.shard.cpu_group)
        result = self.run(plan)
        if self.spec.world_size > 1 and self.spec.sampler_rank != 0 and plan.samples:
            box = [None]
            dist.recv_object_list(box, src=self.spec.sampler_rank, group=self.shard.cpu_group)
            result = box[0]
        result = result or StepResult([], [], [])
        result.errors.update(plan.failed)
        return result

    def stop_shards(self) -> None:
        """Driver: let every other shard's `serve` loop return."""
        if self.spec.world_size > 1:
            dist.broadcast_object_list([None], src=0, group=self.shard.cpu_group)

    # ---- every shard ------------------------------------------------------------------

    def serve(self) -> None:
        """A non-driver shard: run the driver's plans until it sends None."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.shard.cpu_group)
            if box[0] is None:
                return
            result = self.run(box[0])
            if result is not None and self.spec.rank == self.spec.sampler_rank and box[0].samples:
                dist.send_object_list([result], dst=0, group=self.shard.cpu_group)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepResult | None:
        """This shard's part of a step; the StepResult on the sampling rank, else None."""
        dev = self.device
        spec = self.spec
        native = self._native_decode_step(plan)
        logits, greedy = (None, None) if native is None else native
        hidden = self._forward(plan) if logits is None else None
        if logits is None and hidden is None:  # not the last stage
            return None
        if spec.rank == spec.sampler_rank:
            for rid in plan.forget:
                self.sampler.forget(rid)
        if not plan.samples:
            return StepResult([], [], [])
        if logits is None:
            # the rows that sample, in order, each once: all of them in a decode step (no gather)
            rows = plan.logit_rows
            picked = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=dev)]
            logits = self.model.compute_logits(picked)
        if spec.rank != spec.sampler_rank:
            return None
        if logits.is_cuda:  # a fault of the forward pass surfaces here (asynchronous), as the
            torch.cuda.synchronize(logits.device)  # step's failure, not inside the sampling's containment
        return sample_step(self.sampler, logits, plan.samples, plan.request_ids, plan.drafts, greedy)

    def _native_decode_step(self, plan: StepPlan) -> StepLogits | None:
        """A CPU step of one token a sequence, no drafts, one shard, the torch attention
        backend (whose decode rows the fused layers are), every row sampling: token ids to
        the step's fp32 logits and their argmax in one native call where the model takes it
        (its own `decode_step`), without the attention metadata's tensors and plan; else
        None."""
        if self.device.type != "cpu" or self.spec.world_size != 1 or plan.drafts is not None:
            return None
        if not isinstance(self.backend, TorchBackend) or not plan.input_ids:
            return None
        if any(n != 1 for n in plan.query_lens) or len(plan.logit_rows) != len(plan.input_ids):
            return None  # a row that does not sample: its logits are not asked for
        return self.model.decode_step(plan, self.kv_caches)

    def _forward(self, plan: StepPlan) -> torch.Tensor | None:
        """The step through this shard's modules: the hidden states on the last stage, else
        None (sent on to the next stage)."""
        dev = self.device
        spec = self.spec
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(plan.slot_mapping, dtype=torch.int64, device=dev),
            cu_seqlens_q=torch.tensor([0, *_cumsum(plan.query_lens)], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(plan.seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(plan.block_tables, dtype=torch.int32, device=dev),
            query_lens=plan.query_lens,
            seq_lens_host=plan.seq_lens,
            block_size=self.block_size,
        )
        self.backend.prepare(meta)
        hidden = None
        if not spec.is_first_stage:
            hidden = torch.empty(len(plan.input_ids), self.hidden_size, dtype=self.dtype, device=dev)
            dist.recv(hidden, src=spec.stage_peer(spec.pp_rank - 1))
        hidden = self.model(
            torch.tensor(plan.input_ids, dtype=torch.int64, device=dev),
            torch.tensor(plan.positions, dtype=torch.int64, device=dev),
            self.kv_caches,
            self.backend,
            meta,
            hidden,
        )
        if not spec.is_last_stage:
            dist.send(hidden.contiguous(), dst=spec.stage_peer(spec.pp_rank + 1))
            return None
        return hidden


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out
