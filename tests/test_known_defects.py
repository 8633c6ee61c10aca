"""Regression tests of defects found by reading the code (issue 12): each failed before
its fix. No Ray: a tiny random Llama saved by transformers stands in for a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from kvray.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from kvray.errors import InvalidArgumentError


def _tiny_config(**extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        architectures=["LlamaForCausalLM"],
        **extra,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved tiny Llama: (folder, its tensors by HF name)."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(_tiny_config()).save_pretrained(folder)
    return folder, load_file(folder / "model.safetensors")


def _variant(tmp_path, checkpoint, tensors=None, config_changes=None):
    from safetensors.torch import save_file

    folder, original = checkpoint
    config = json.loads((folder / "config.json").read_text())
    config.update(config_changes or {})
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(original if tensors is None else tensors, tmp_path / "model.safetensors")
    return tmp_path


def _load(path):
    from kvray.models.loader import build_model, load_config

    return build_model(load_config(path), path, torch.float32, torch.device("cpu"), 128)


def test_a_complete_checkpoint_loads_every_tensor(checkpoint):
    folder, tensors = checkpoint
    model = _load(folder)
    ours = dict(model.named_parameters())
    assert torch.equal(ours["embed_tokens.weight"], tensors["model.embed_tokens.weight"])


def test_missing_tensors_are_an_error_naming_them(tmp_path, checkpoint):
    tensors = dict(checkpoint[1])
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.norm.weight"]
    path = _variant(tmp_path, checkpoint, tensors)
    with pytest.raises(InvalidArgumentError, match=r"layers\.1\.self_attn\.k_proj.*|norm\.weight") as e:
        _load(path)
    assert "k_proj" in str(e.value) and "norm.weight" in str(e.value)


def test_unknown_tensors_are_an_error_naming_them(tmp_path, checkpoint):
    tensors = dict(checkpoint[1])
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    tensors["model.layers.7.input_layernorm.weight"] = torch.ones(32)  # past the last layer
    path = _variant(tmp_path, checkpoint, tensors)
    with pytest.raises(InvalidArgumentError, match="extra_proj") as e:
        _load(path)
    assert "layers.7" in str(e.value)


def test_a_quantization_kvray_cannot_run_is_an_error_naming_it(tmp_path, checkpoint):
    path = _variant(
        tmp_path, checkpoint, config_changes={"quantization_config": {"quant_method": "awq", "bits": 4}}
    )
    with pytest.raises(InvalidArgumentError, match="awq"):
        _load(path)


def test_llm_rejects_an_unknown_keyword_naming_the_closest():
    with pytest.raises(InvalidArgumentError, match="max_num_seqs"):
        LLM(max_num_seq=4)


def test_a_pulled_prompt_is_not_a_prefix_cache_query_on_the_decode_side():
    """The prefill side looked the prompt up in its cache; the decode side only receives
    its KV. A pull that fails makes the decode side recompute: that is a real query."""
    engine = LLMEngine(
        EngineConfig(model="tiny", dtype="float32", kv_cache_memory_bytes=1 << 20), hf_config=_tiny_config()
    )
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, 40))
    assert engine.add_prefilled_request("pulled", prompt, params, first_token=7) is not None
    engine.finish_kv_pull("pulled", ok=True)
    assert engine.kv.prefix_queries == 0
    assert engine.add_prefilled_request("failed", list(range(50, 90)), params, first_token=7) is not None
    engine.finish_kv_pull("failed", ok=False)  # recomputed here
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.prefix_queries == 41  # 40 prompt tokens + the first token, looked up once
    assert engine.kv_cache_stats().used_blocks == 0


def test_node_ip_raises_instead_of_guessing_loopback(monkeypatch):
    import ray

    from kvray.actors import net

    def broken():
        raise RuntimeError("no network")

    monkeypatch.setattr(ray.util, "get_node_ip_address", broken)
    monkeypatch.delenv("KVRAY_HOST", raising=False)
    with pytest.raises(RuntimeError, match="KVRAY_HOST"):
        net.node_ip()
    monkeypatch.setenv("KVRAY_HOST", "10.0.0.7")
    assert net.node_ip() == "10.0.0.7"


def test_a_pull_whose_sender_never_answers_gives_up_at_the_pull_timeout():
    """receive_packed waits at most the pull timeout it is given, whatever the group's
    own timeout (NCCL's was none: a stuck pull tripped its watchdog and killed the worker)."""
    import datetime
    from concurrent.futures import ThreadPoolExecutor

    from kvray.actors.kv_transport import receive_packed
    from kvray.actors.pair_group import host_store, join_pair_groups
    from kvray.engine.kv_transfer import KVLayout, KVTicket
    from kvray.engine.kv_views import KVViews

    store = host_store("127.0.0.1", 30)
    with ThreadPoolExecutor(2) as pool:
        ours = pool.submit(join_pair_groups, store, "127.0.0.1", store.port, 0, "t", "gloo", 600)
        theirs = pool.submit(join_pair_groups, None, "127.0.0.1", store.port, 1, "t", "gloo", 600)
        groups, _peer = ours.result(), theirs.result()
    layout = KVLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32")
    ticket = KVTicket("prefill-0", "r", (0,), 4, (), layout, 0.0)
    into = KVViews(torch.zeros(layout.packed_shape(2))).of([1])
    with pytest.raises(RuntimeError, match="(?i)timed? ?out"):
        receive_packed(groups.data, ticket, into, 8, datetime.timedelta(seconds=0.5))
