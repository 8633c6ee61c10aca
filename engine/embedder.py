"""Sentence embeddings (`LLM.embed`, vLLM's name) from a sentence-transformers folder: its
encoder (models/bert.py), then the folder's own pooling (`1_Pooling/config.json`: the mean
of the tokens' hidden states, or the [CLS] token's) and, where `modules.json` lists it,
normalizing to unit length. Texts are tokenized with the folder's tokenizer, [CLS] and
[SEP] included, and at most its `max_seq_length` tokens (`sentence_bert_config.json`); a
longer input is an error naming it, not cut. Inputs are sorted by length and cut into
forward passes with the fewest padded tokens (`padded_batches`), so short texts do not pay
for long ones' padding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvray.engine.config import EngineConfig
from kvray.errors import InvalidArgumentError
from kvray.models.bert import EMBEDDING_ARCHITECTURES, BertEncoder
from kvray.models.loader import load_config, load_tokenizer

MAX_BATCH_TOKENS = 8192  # padded tokens one forward pass takes
MAX_BATCH = 32  # ... and inputs
PASS_TOKENS = 32  # a forward pass's fixed cost, in padded tokens (how batches are cut)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's shape: one input's embedding."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def is_embedding_model(path: Path) -> bool:
    """Whether the folder holds an encoder kvray embeds with (not a generative model)."""
    architectures = getattr(load_config(path), "architectures", None) or []
    return any(a in EMBEDDING_ARCHITECTURES for a in architectures)


def build_embedder(config: EngineConfig, device: str | None = None) -> Embedder | None:
    """The Embedder of `config.model` when it is an embedding model (fp32 unless `dtype`
    says otherwise; on `device`, default the GPU where there is one), else None (a
    generative model)."""
    from kvray.models.loader import resolve_model_path

    path = resolve_model_path(config.model)
    if not is_embedding_model(path):
        return None
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise InvalidArgumentError(
            "tensor_parallel_size", config.tensor_parallel_size, "1 for an embedding model"
        )
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(config.dtype, torch.float32)
    return Embedder(path, dtype, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))


class Embedder:
    def __init__(
        self,
        path: Path,
        dtype: torch.dtype = torch.float32,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        device: str = "cpu",
    ):
        config = load_config(path)
        self.tokenizer = load_tokenizer(path)
        self.model = BertEncoder(config).eval()
        self.model.load(path)
        self.model.to(device=device, dtype=dtype)
        self.device = device
        self.dtype = dtype
        self.dimensions = config.hidden_size
        self.max_batch_tokens = max_batch_tokens
        self.pooling, self.normalize = _pooling(path)
        st_config = path / "sentence_bert_config.json"
        limit = json.loads(st_config.read_text()).get("max_seq_length") if st_config.exists() else None
        self.max_tokens = min(limit or config.max_position_embeddings, config.max_position_embeddings)

    def token_ids(self, inputs: list[str | list[int]], field: str = "input") -> list[list[int]]:
        """Each input's token ids ([CLS] text [SEP]; token-id lists as given), checked
        against the model's vocabulary and max_seq_length."""
        out = []
        vocab = self.tokenizer.vocab_size
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                ids = self.tokenizer(x).input_ids
            elif isinstance(x, list) and all(isinstance(t, int) and 0 <= t < vocab for t in x):
                ids = list(x)
            else:
                raise InvalidArgumentError(f"{field}[{i}]", "<input>", f"text or token ids in [0, {vocab})")
            if not ids or len(ids) > self.max_tokens:
                raise InvalidArgumentError(
                    f"{field}[{i}]", f"{len(ids)} tokens", f"1 to {self.max_tokens} tokens"
                )
            out.append(ids)
        return out

    @torch.no_grad()
    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """[N, dimensions] fp32 embeddings of the inputs, in order."""
        order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))
        out = torch.empty(len(token_ids), self.dimensions)
        lengths = [len(token_ids[i]) for i in order]
        for start, end in padded_batches(lengths, MAX_BATCH, self.max_batch_tokens):
            batch = [token_ids[i] for i in order[start:end]]
            out[order[start:end]] = self._forward(batch)
        return out

    def _forward(self, batch: list[list[int]]) -> torch.Tensor:
        width = max(len(ids) for ids in batch)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([x + [pad] * (width - len(x)) for x in batch], device=self.device)
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in batch], device=self.device)
        hidden = self.model(ids, mask).float()
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            pooled = (hidden * mask[:, :, None]).sum(1) / mask.sum(1, keepdim=True)
        pooled = torch.nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled
        return pooled.cpu()


def padded_batches(
    lengths: list[int], max_batch: int, max_tokens: int, pass_tokens: int = PASS_TOKENS
) -> list[tuple[int, int]]:
    """The forward passes for inputs of these ascending `lengths`: runs [start, end) that
    cover them in order, each of at most `max_batch` inputs and `max_tokens` padded tokens
    (one input alone may exceed it), with the fewest padded tokens counting `pass_tokens`
    for each pass (its fixed cost). A pass pads to its longest input, its last; so a burst of
    a few short and a few long texts runs as two passes, not one padded to the longest."""
    n = len(lengths)
    best = [0] + [None] * n  # best[end]: the least cost of covering lengths[:end]
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        width = lengths[end - 1]
        for start in range(max(0, end - max_batch), end):
            size = end - start
            if size > 1 and size * width > max_tokens:
                continue
            cost = best[start] + size * width + pass_tokens
            if best[end] is None or cost < best[end]:
                best[end], cut[end] = cost, start
    runs, end = [], n
    while end > 0:
        runs.append((cut[end], end))
        end = cut[end]
    return runs[::-1]


def _pooling(path: Path) -> tuple[str, bool]:
    """(mean or cls, whether to normalize) from the folder's modules."""
    modules = json.loads((path / "modules.json").read_text()) if (path / "modules.json").exists() else []
    kinds = {m["type"].rsplit(".", 1)[-1]: m for m in modules}
    pooling = "mean"
    if "Pooling" in kinds:
        config = json.loads((path / kinds["Pooling"]["path"] / "config.json").read_text())
        if config.get("pooling_mode_cls_token"):
            pooling = "cls"
        elif not config.get("pooling_mode_mean_tokens", True):
            raise InvalidArgumentError(
                "model", str(path), "a sentence-transformers folder pooling by mean or CLS"
            )
    return pooling, "Normalize" in kinds
