"""POST /v1/embeddings on the colocated test app's embedding pool (tests/serve_fixtures.py:
one `all-minilm-l6-v2` worker) with the official `openai` client: floats and base64
against transformers' BertModel + the folder's pooling (mean, unit length), the usage
counted in the model's tokens, concurrent requests each getting their own vectors, the
errors OpenAI-shaped and naming the field, the card in /v1/models, the handle call."""

from __future__ import annotations

import base64
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

httpx = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")
pytest.importorskip("ray")
from serve_fixtures import API_KEY, EMBEDDING_MODEL, MODEL  # noqa: E402

WORDS = "river stone light quiet market paper seven garden winter answer bridge silver music".split()
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def reference():
    """text -> (its token count, its embedding from transformers, float64)."""
    from transformers import AutoModel, AutoTokenizer

    from kvray.models.loader import resolve_model_path

    path = resolve_model_path(EMBEDDING_MODEL)
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()

    def embed(text: str) -> tuple[int, torch.Tensor]:
        ids = tokenizer(text).input_ids
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
        return len(ids), torch.nn.functional.normalize(hidden.mean(0), dim=0)

    return embed


@pytest.fixture(scope="module")
def colo_client(colo_server):
    return openai.OpenAI(base_url=f"{colo_server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 4, 30, 120]))) for _ in range(n)]


def _cosine(a, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float64), b, dim=0).item()


def test_embeddings_match_transformers_as_floats_and_base64(colo_client, reference):
    texts = _texts(6, seed=3)
    got = colo_client.embeddings.create(model=EMBEDDING_MODEL, input=texts)
    want = [reference(t) for t in texts]
    assert [d.index for d in got.data] == list(range(6)) and got.model == EMBEDDING_MODEL
    for d, (_, vector) in zip(got.data, want):
        assert len(d.embedding) == 384 and _cosine(d.embedding, vector) >= 0.9999
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(n for n, _ in want)
    # the client asked for base64 (its default) and decoded it; floats are the same numbers
    floats = colo_client.embeddings.create(model=EMBEDDING_MODEL, input=texts[2], encoding_format="float")
    assert np.allclose(floats.data[0].embedding, got.data[2].embedding, atol=1e-6)
    b64 = colo_client.embeddings.create(model=EMBEDDING_MODEL, input=texts[2], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")  # as given: a string
    assert np.array_equal(decoded, np.asarray(floats.data[0].embedding, dtype="<f4"))


def test_token_id_inputs_and_concurrent_requests_get_their_own_vectors(colo_client, reference):
    texts = _texts(8, seed=11)
    with ThreadPoolExecutor(8) as pool:  # at once: they share the worker's batches
        answers = list(
            pool.map(lambda t: colo_client.embeddings.create(model=EMBEDDING_MODEL, input=t), texts)
        )
    for text, answer in zip(texts, answers):
        assert _cosine(answer.data[0].embedding, reference(text)[1]) >= 0.9999
    from transformers import AutoTokenizer

    from kvray.models.loader import resolve_model_path

    ids = AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDING_MODEL))(texts[0]).input_ids
    by_ids = colo_client.embeddings.create(model=EMBEDDING_MODEL, input=[ids, ids])
    assert by_ids.usage.prompt_tokens == 2 * len(ids)
    assert np.allclose(by_ids.data[1].embedding, answers[0].data[0].embedding, atol=1e-5)


def test_bad_embeddings_requests_are_openai_errors_naming_the_field(colo_client):
    def error(**kwargs):
        with pytest.raises(openai.APIStatusError) as e:
            colo_client.embeddings.create(**{"model": EMBEDDING_MODEL, "input": "hi", **kwargs})
        return e.value.status_code, e.value.body["param"], e.value.body["message"]

    status, param, message = error(input=["fine", "word " * 300])
    assert (status, param) == (400, "input[1]") and "1 to 256 tokens" in message
    assert error(input=[[1, 2, 10**6]])[:2] == (400, "input[0]")
    assert error(input=[])[:2] == (400, "input")
    assert error(input=[""])[:2] == (400, "input")
    assert error(input=["fine", ""])[:2] == (400, "input")
    assert error(encoding_format="int8")[:2] == (400, "encoding_format")
    status, param, message = error(dimensions=128)
    assert (status, param) == (400, "dimensions") and "384" in message
    assert error(model=MODEL)[:2] == (404, "model")  # the generative model embeds nothing
    assert error(extra_body={"truncate": 3})[:2] == (400, "truncate")
    r = httpx.post(f"{colo_client.base_url}embeddings", json={"model": EMBEDDING_MODEL, "input": "hi"})
    assert r.status_code == 401  # no key
    assert colo_client.embeddings.create(model=EMBEDDING_MODEL, input="still serving").data  # nothing broke


def test_an_app_without_an_embedding_pool_answers_404(client, server):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=EMBEDDING_MODEL, input="hi")
    assert "embedding" not in httpx.get(f"{server}/health").json()


def test_models_list_the_embedding_model_and_the_handle_embeds(colo_client, colo_server):
    cards = {m.id: m for m in colo_client.models.list().data}
    assert set(cards) == {MODEL, EMBEDDING_MODEL}
    assert cards[EMBEDDING_MODEL].model_extra["max_model_len"] == 256
    import ray

    # the handle in a task of its own, not in this driver: the README's handle example
    # (tests/test_serve_openai.py) later makes the driver's first Serve handle, and one made
    # here first left that one waiting forever on Serve's router thread (a CI run hung)
    @ray.remote(num_cpus=0)
    def through_a_handle(body: dict) -> dict:  # (local: pickled by value for the task)
        from ray import serve

        return serve.get_app_handle("colo").embeddings.remote(body).result(timeout_s=120)

    body = {"model": EMBEDDING_MODEL, "input": ["a", "b"]}
    answer = ray.get(through_a_handle.remote(body), timeout=180)
    assert [d["index"] for d in answer["data"]] == [0, 1] and answer["usage"]["prompt_tokens"] == 6
    health = httpx.get(f"{colo_server}/health").json()
    assert health["status"] == "ok" and health["embedding"] is True  # the pool is part of /health
    doc = httpx.get(f"{colo_server}/openapi.json").json()
    schema = doc["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["$ref"].endswith("/EmbeddingsRequest")
    assert {"input", "encoding_format", "dimensions"} <= set(
        doc["components"]["schemas"]["EmbeddingsRequest"]["properties"]
    )
