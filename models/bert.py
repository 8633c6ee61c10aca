"""A BERT encoder for sentence embeddings (`BertModel` checkpoints, e.g. all-MiniLM-L6-v2):
token, position and segment embeddings, then post-norm layers of bidirectional attention
and a GELU MLP; the hidden states of a padded batch, its padding masked out of attention.
Pooling and normalizing are the sentence-transformers folder's own steps
(engine/embedder.py reads them from `modules.json` and `1_Pooling/config.json`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

EMBEDDING_ARCHITECTURES = ("BertModel",)


class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, intermediate)
        self.down = nn.Linear(intermediate, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, H]; mask [B, 1, 1, T]: True where a key is a token, False where padding."""
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.attention_norm(x + self.out(attended.transpose(1, 2).reshape(b, t, h)))
        return self.mlp_norm(x + self.down(F.gelu(self.up(x))))


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.word = nn.Embedding(config.vocab_size, h)
        self.position = nn.Embedding(config.max_position_embeddings, h)
        self.segment = nn.Embedding(config.type_vocab_size, h)
        self.norm = nn.LayerNorm(h, eps=eps)
        self.layers = nn.ModuleList(
            BertLayer(h, config.num_attention_heads, config.intermediate_size, eps)
            for _ in range(config.num_hidden_layers)
        )
        self.max_positions = config.max_position_embeddings

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """ids, attention_mask [B, T] (1 for tokens, 0 for padding) -> hidden [B, T, H]."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.norm(self.word(ids) + self.position(positions) + self.segment(torch.zeros_like(ids)))
        mask = (attention_mask != 0)[:, None, None, :]  # True where a key is a token
        for layer in self.layers:
            x = layer(x, mask)
        return x

    @torch.no_grad()
    def load(self, path: Path) -> None:
        """The checkpoint's tensors (Hugging Face BertModel names), q/k/v stacked into one."""
        w = load_file(str(path / "model.safetensors"))
        w = {k.removeprefix("bert."): v for k, v in w.items()}
        e = "embeddings."
        self.word.weight.copy_(w[e + "word_embeddings.weight"])
        self.position.weight.copy_(w[e + "position_embeddings.weight"])
        self.segment.weight.copy_(w[e + "token_type_embeddings.weight"])
        _norm(self.norm, w, e + "LayerNorm")
        for i, layer in enumerate(self.layers):
            p = f"encoder.layer.{i}."
            for kind in ("weight", "bias"):
                parts = [w[f"{p}attention.self.{n}.{kind}"] for n in ("query", "key", "value")]
                getattr(layer.qkv, kind).copy_(torch.cat(parts))
                getattr(layer.out, kind).copy_(w[f"{p}attention.output.dense.{kind}"])
                getattr(layer.up, kind).copy_(w[f"{p}intermediate.dense.{kind}"])
                getattr(layer.down, kind).copy_(w[f"{p}output.dense.{kind}"])
            _norm(layer.attention_norm, w, p + "attention.output.LayerNorm")
            _norm(layer.mlp_norm, w, p + "output.LayerNorm")


def _norm(norm: nn.LayerNorm, w: dict, name: str) -> None:
    norm.weight.copy_(w[name + ".weight"])
    norm.bias.copy_(w[name + ".bias"])
