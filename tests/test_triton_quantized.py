"""Grouped codes routed to the Triton kernels (models/triton_linear.py), as on a CUDA
device: here the route is forced on the CPU (`on_triton`, a test double of the device
check) and the kernels run under the Triton interpreter (conftest.py). The reference is
transformers' model with each linear's weight replaced by the weight its int4 codes stand
for (the Triton kernels multiply unquantized activations by it)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_engine_triton import TINY as ENGINE_TINY  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from kvray.engine import LLM, SamplingParams  # noqa: E402
from kvray.kernels import cpu_groups, cpu_native  # noqa: E402
from kvray.models import cpu_linear  # noqa: E402
from kvray.models.triton_linear import TritonGrouped  # noqa: E402

TINY = {**ENGINE_TINY, "intermediate_size": 384}  # a down_proj k of 3 groups of 128
PROMPTS = [[7, 3, 250, 11], list(range(40, 57))]  # a decode-sized step, a prompt chunk


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(**TINY)
    config.architectures = ["LlamaForCausalLM"]
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
    path = tmp_path_factory.mktemp("tiny-int4")
    hf.save_pretrained(path)
    return path, hf


def _int4(weight: torch.Tensor, group: int) -> torch.Tensor:
    """the fp32 weight int4's codes stand for"""
    n, k = weight.shape
    codes, scales, mins = cpu_groups.quantize_int4(weight, group)
    return (codes.float().view(n, -1, group) * scales[:, :, None] + mins[:, :, None]).view(n, k)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_on_the_triton_route_predicts_as_transformers_on_its_weights(tiny, monkeypatch, group):
    path, hf = tiny
    monkeypatch.setattr(cpu_linear, "on_triton", lambda device: True)
    llm = LLM(
        model=str(path),
        dtype="float32",
        quantization="int4",
        quantization_group_size=group,
        max_model_len=128,
        kv_cache_memory_bytes=4 << 20,
        enable_prefix_caching=False,
    )
    model = llm.engine.runner.model
    linears = [model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.down_proj]
    assert all(isinstance(lin.panels, TritonGrouped) and lin.weight is None for lin in linears)
    assert isinstance(model.panels_head, TritonGrouped)
    assert cpu_groups.layout(model.panels_head.data).group == group
    assert not any(isinstance(getattr(m, "panels", None), cpu_native.Panels) for m in model.modules())

    reference = AutoModelForCausalLM.from_config(hf.config, attn_implementation="eager").eval()
    reference.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(_int4(module.weight, group))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt + out.outputs[0].token_ids])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(prompt) - 1 : -1].double()
        want = logits.argmax(-1).tolist()
        assert out.outputs[0].token_ids == want
        logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(want)[:, None]).sum().item()
        assert out.outputs[0].cumulative_logprob == pytest.approx(logprobs, abs=1e-3)
    assert llm.kv_cache_stats().used_blocks == 0


def test_an_embedding_held_in_codes_gets_its_rows_back_on_the_triton_route():
    """A GGUF's tied embedding is looked up in its head's codes on a CPU; on the Triton
    route the head's codes move to the device once and the embedding holds the rows they
    stand for, in the dtype."""
    from kvray.models.layers import VocabParallelEmbedding
    from kvray.models.parallel import ShardContext

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = VocabParallelEmbedding(range(0, 48), 64, ShardContext())

    model = Tied()
    weight = torch.randn(48, 64)
    codes, scales, mins = cpu_groups.quantize_int4(weight, 32)
    panels = cpu_native.Panels(cpu_groups.to_panels(codes, scales, mins, cpu_groups.Layout(4, 32)), 48, 64)
    model.panels_head = panels
    model.embed_tokens.hold_codes(panels)
    cpu_linear.to_triton(model, torch.bfloat16, torch.device("cpu"))
    assert isinstance(model.panels_head, TritonGrouped)
    assert torch.equal(model.panels_head.data, panels.data)
    embed = model.embed_tokens
    assert embed.panels is None and embed.weight.dtype == torch.bfloat16
    assert torch.equal(embed.weight, _int4(weight, 32).to(torch.bfloat16))
    ids = torch.tensor([3, 47, 0])
    assert torch.equal(embed(ids), _int4(weight, 32).to(torch.bfloat16)[ids])
