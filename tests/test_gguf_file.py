"""A GGUF model's folder (config, tokenizer, the file; no full-precision copy) read as
weights (models/gguf_file.py), against transformers' own GGUF loader; and
`quantization="gguf"` building the model with its linears' codes only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvray.kernels import cpu_native
from kvray.models.gguf_file import GGUF_NAME, hf_name
from kvray.models.loader import build_model, iter_weights, load_config, transformers_model


def test_gguf_names_map_to_transformers_names():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.3.attn_q.bias", "qwen2") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.0.ffn_norm.weight", "gemma3") == "model.layers.0.pre_feedforward_layernorm.weight"
    post = "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.0.post_attention_norm.weight", "gemma3") == post
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("rope_freqs.weight") is None


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler: native kernels not built")
def test_smollm2s_gguf_reads_as_transformers_reads_it(smollm2_path):
    """Every tensor de-quantized one at a time from the file equals transformers' GGUF
    loader's (llama q/k rows un-permuted) bit for bit; building with quantization="gguf"
    reads only the norms and holds every linear, the head and the embedding as codes."""
    assert (smollm2_path / GGUF_NAME).exists()
    config = load_config(smollm2_path)
    want = transformers_model(smollm2_path, torch.float32).state_dict()
    got = dict(iter_weights(smollm2_path, config))
    assert set(want) - set(got) <= {"lm_head.weight"}  # tied: the embedding's rows
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name

    loaded = []

    def spy(path, config, skip):
        for name, tensor in iter_weights(path, config, skip):
            loaded.append(name)
            yield name, tensor

    import kvray.models.loader as loader

    original = loader.iter_weights
    loader.iter_weights = spy
    try:
        model = build_model(config, smollm2_path, torch.float32, torch.device("cpu"), 64, quantization="gguf")
    finally:
        loader.iter_weights = original
    assert loaded and all(name.endswith("norm.weight") for name in loaded), loaded
    dense = {n for n, p in model.named_parameters() if not p.is_meta}
    assert all(n.endswith("norm.weight") for n in dense), dense
    layer = model.layers[0].mlp.gate_up_proj
    assert layer.weight.is_meta and isinstance(layer.grouped, cpu_native.Panels)
    gate_up = torch.cat([want[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(cpu_native.dequantized(layer.grouped), gate_up)
    assert torch.equal(model.norm.weight, want["model.norm.weight"])


def test_a_gguf_model_keeps_its_codes_by_default_on_a_cpu(smollm2_path):
    """quantization=None is the checkpoint's own: "gguf" where `model` names a GGUF (an
    alias, a .gguf file) and the native kernels run; a folder's weights as they are."""
    from kvray.engine.config import EngineConfig
    from kvray.engine.model_runner import resolve_quantization

    cpu, bf16, at = torch.device("cpu"), torch.bfloat16, smollm2_path
    native = "gguf" if cpu_native.takes(bf16, cpu) else None
    resolve = resolve_quantization
    assert resolve(EngineConfig(model="smollm2-135m-instruct"), at, bf16, cpu) == native
    assert resolve(EngineConfig(model="/models/x.Q4_K_M.gguf"), at, bf16, cpu) == native
    assert resolve(EngineConfig(model=str(smollm2_path)), at, bf16, cpu) is None
    assert resolve(EngineConfig(model="smollm2-135m-instruct"), at, bf16, torch.device("cuda")) is None
    assert resolve(EngineConfig(model=str(smollm2_path), quantization="int8"), at, bf16, cpu) == "int8"
    # random weights (no folder), or a folder converted before the GGUF was kept: as they are
    assert resolve(EngineConfig(model="smollm2-135m-instruct"), None, bf16, cpu) is None
    assert resolve(EngineConfig(model="smollm2-135m-instruct"), Path("/nonexistent"), bf16, cpu) is None


def test_a_pipeline_stage_reads_only_its_own_tensors_from_the_gguf(smollm2_path, monkeypatch):
    """The second of two stages de-quantizes no tensor of the first's layers (nor the
    embedding a tied head on the last stage holds as codes): its loads equal the full model's."""
    import kvray.models.loader as loader
    from kvray.models.parallel import ShardContext, ShardSpec

    read: list[str] = []
    original = loader.iter_weights

    def spy(path, config, skip):
        for name, tensor in original(path, config, skip):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(loader, "iter_weights", spy)
    config = load_config(smollm2_path)
    stage = ShardContext(ShardSpec(tp_size=1, pp_size=2, rank=1))
    model = build_model(config, smollm2_path, torch.float32, torch.device("cpu"), 64, stage, "gguf")
    first = model.layer_range.start
    assert first > 0 and read
    assert all(int(n.split(".")[2]) >= first for n in read if n.startswith("model.layers.")), read
    assert "model.embed_tokens.weight" not in read  # the tied head: held as codes
    assert all(n.endswith("norm.weight") for n in read)


def test_the_gguf_index_finds_what_ggufs_reader_finds(smollm2_path):
    """GgufIndex steps over the metadata: the same tensors, shapes, types and bytes."""
    from gguf import GGUFReader

    from kvray.models.gguf_file import GgufIndex

    index, reader = GgufIndex(smollm2_path / GGUF_NAME), GGUFReader(str(smollm2_path / GGUF_NAME))
    assert index.arch == "llama" and len(index.tensors) == len(reader.tensors)
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert (ours.name, ours.tensor_type) == (theirs.name, theirs.tensor_type)
        assert ours.shape == tuple(int(v) for v in theirs.shape)
        assert (ours.data.reshape(-1) == theirs.data.reshape(-1).view("uint8")).all(), ours.name
