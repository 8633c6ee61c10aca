"""Tensor- and pipeline-parallel shards: the partition arithmetic (hand-checked), every
rank's weight slices against the full tensors, and sharded engines on local Ray against
transformers' tokens.

Parity rule for sharded runs: an all-reduce sums partial products in another order than
one matmul does, which can flip a near-tie. A sharded run may therefore leave the
reference's greedy tokens only at a step where the reference's two top logits are within
0.05 of each other; from that step on the two continuations are different texts and are
not compared further.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from conftest import hf_greedy

from kvray.engine.kv_transfer import KVLayout, KVPiece, plan_kv_pull
from kvray.models.loader import build_model, load_config
from kvray.models.parallel import ShardContext, ShardSpec, even_split

NEAR_TIE = 0.05


# ---- partition arithmetic -------------------------------------------------------------


def test_even_split_gives_the_remainder_to_the_first_parts():
    assert [even_split(9, 2, i) for i in range(2)] == [range(0, 5), range(5, 9)]
    assert [even_split(30, 4, i) for i in range(4)] == [
        range(0, 8),
        range(8, 16),
        range(16, 23),
        range(23, 30),
    ]
    assert [even_split(3, 3, i) for i in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]


def test_smollm2_heads_over_two_tensor_ranks():
    # 9 query heads in 3 KV groups of 3: rank 0 takes KV heads 0-1 (q 0-5), rank 1 KV head 2 (q 6-8)
    r0, r1 = ShardSpec(2, 1, 0), ShardSpec(2, 1, 1)
    assert (r0.kv_heads(9, 3), r0.q_heads(9, 3)) == (range(0, 2), range(0, 6))
    assert (r1.kv_heads(9, 3), r1.q_heads(9, 3)) == (range(2, 3), range(6, 9))


def test_kv_heads_replicate_when_tp_exceeds_them():
    # 8 query heads, 2 KV heads, tp=4: each KV head on 2 ranks, which split its 4 query heads
    specs = [ShardSpec(4, 1, r) for r in range(4)]
    assert [s.kv_heads(8, 2) for s in specs] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [s.q_heads(8, 2) for s in specs] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ShardSpec(3, 1, 0).kv_heads(8, 2)  # 3 is neither <= 2 nor a multiple of 2


def test_ranks_stages_and_vocab():
    spec = ShardSpec(2, 2, 3)
    assert (spec.tp_rank, spec.pp_rank, spec.sampler_rank, spec.stage_peer(0)) == (1, 1, 2, 1)
    assert spec.layers(30) == range(15, 30) and ShardSpec(2, 2, 0).layers(30) == range(0, 15)
    assert [ShardSpec(2, 1, r).vocab(49153) for r in range(2)] == [range(0, 24577), range(24577, 49153)]


def test_kv_pull_plan_reshards_heads_and_layers():
    smol = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32", num_heads=9)
    tp2, tp1, pp2 = KVLayout(**smol, tp_size=2), KVLayout(**smol), KVLayout(**smol, pp_size=2)
    assert plan_kv_pull(tp1, tp1) == [KVPiece(0, 0, range(0, 30), range(0, 3))]
    assert plan_kv_pull(tp2, tp1) == [
        KVPiece(0, 0, range(0, 30), range(0, 2)),
        KVPiece(1, 0, range(0, 30), range(2, 3)),
    ]
    assert plan_kv_pull(tp2, tp2) == [
        KVPiece(0, 0, range(0, 30), range(0, 2)),
        KVPiece(1, 1, range(0, 30), range(2, 3)),
    ]
    assert plan_kv_pull(pp2, tp2) == [
        KVPiece(0, 0, range(0, 15), range(0, 2)),
        KVPiece(1, 0, range(15, 30), range(0, 2)),
        KVPiece(0, 1, range(0, 15), range(2, 3)),
        KVPiece(1, 1, range(15, 30), range(2, 3)),
    ]
    # a piece in the shards' own numbering: prefill rank 1 holds head 2 as its head 0
    piece = plan_kv_pull(tp2, tp1)[1]
    assert piece.local(tp2, 1) == (range(0, 30), range(0, 1))
    assert piece.local(tp1, 0) == (range(0, 30), range(2, 3))


# ---- weight slices ---------------------------------------------------------------------


def _shard_params(path, spec: ShardSpec) -> dict[str, torch.Tensor]:
    config = load_config(path)
    model = build_model(config, path, torch.float32, torch.device("cpu"), 64, ShardContext(spec))
    return {k: v for k, v in model.state_dict().items()}


def test_tensor_rank_slices_concatenate_to_the_full_tensors(smollm2_path, hf_smollm2):
    full = {k.removeprefix("model."): v for k, v in hf_smollm2.state_dict().items()}
    ranks = [_shard_params(smollm2_path, ShardSpec(2, 1, r)) for r in range(2)]
    d = 64
    for layer in (0, 17, 29):
        pre = f"layers.{layer}"
        q = torch.cat(
            [r[f"{pre}.self_attn.qkv_proj.weight"][: 6 * d if i == 0 else 3 * d] for i, r in enumerate(ranks)]
        )
        assert torch.equal(q, full[f"{pre}.self_attn.q_proj.weight"])
        for j, name in enumerate(("k_proj", "v_proj")):
            parts = []
            for i, r in enumerate(ranks):
                nq, nkv = (6, 2) if i == 0 else (3, 1)
                start = (nq + j * nkv) * d
                parts.append(r[f"{pre}.self_attn.qkv_proj.weight"][start : start + nkv * d])
            assert torch.equal(torch.cat(parts), full[f"{pre}.self_attn.{name}.weight"])
        o = torch.cat([r[f"{pre}.self_attn.o_proj.weight"] for r in ranks], dim=1)
        assert torch.equal(o, full[f"{pre}.self_attn.o_proj.weight"])
        gate_up = [r[f"{pre}.mlp.gate_up_proj.weight"] for r in ranks]
        assert torch.equal(torch.cat([g[:768] for g in gate_up]), full[f"{pre}.mlp.gate_proj.weight"])
        assert torch.equal(torch.cat([g[768:] for g in gate_up]), full[f"{pre}.mlp.up_proj.weight"])
        down = torch.cat([r[f"{pre}.mlp.down_proj.weight"] for r in ranks], dim=1)
        assert torch.equal(down, full[f"{pre}.mlp.down_proj.weight"])
        for norm in ("input_layernorm", "post_attention_layernorm"):  # replicated
            assert all(torch.equal(r[f"{pre}.{norm}.weight"], full[f"{pre}.{norm}.weight"]) for r in ranks)
    embed = torch.cat([r["embed_tokens.weight"] for r in ranks])
    assert torch.equal(embed, full["embed_tokens.weight"])


def test_pipeline_stages_hold_disjoint_layers(smollm2_path, hf_smollm2):
    full = {k.removeprefix("model."): v for k, v in hf_smollm2.state_dict().items()}
    first, last = (_shard_params(smollm2_path, ShardSpec(1, 2, r)) for r in range(2))
    assert "norm.weight" not in first and torch.equal(last["norm.weight"], full["norm.weight"])
    # SmolLM2 ties its LM head to the embedding: both stages hold the embedding
    assert torch.equal(first["embed_tokens.weight"], last["embed_tokens.weight"])
    assert {k.split(".")[1] for k in first if k.startswith("layers.")} == {str(i) for i in range(15)}
    assert torch.equal(
        last["layers.0.mlp.down_proj.weight"], full["layers.15.mlp.down_proj.weight"]
    )  # stage 1's layer 0 is the model's layer 15


# ---- sharded engines on local Ray -------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from kvray.cluster.local import ensure_ray

    started = ensure_ray(num_cpus=2, temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(hf_smollm2, smollm2_tokenizer):
    prompts = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    return prompts, [hf_greedy(hf_smollm2, p, MAX_TOKENS) for p in prompts]


def assert_matches_reference(model, prompt_ids, got: list[int], want: list[int]) -> None:
    """Equal tokens, except from a step where the reference's top two logits are a near-tie."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + want[:i]])).logits[0, -1]
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < NEAR_TIE, f"token {i}: got {g}, reference {w} with a top-2 gap of {gap:.3f}"
        return
    assert len(got) == len(want)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_sharded_llm_gives_transformers_tokens(local_ray, engine_args, reference, hf_smollm2, tp, pp):
    from kvray.engine import LLM, SamplingParams, StructuredOutputsParams

    prompts, want = reference
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    # tp 2 x pp 2 also speculates: drafts travel in the plan, the last stage verifies them
    spec = {"method": "ngram", "num_speculative_tokens": 3} if (tp, pp) == (2, 2) else None
    with LLM(
        **engine_args, tensor_parallel_size=tp, pipeline_parallel_size=pp, speculative_config=spec
    ) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        )
        if spec is not None:
            import ray

            assert ray.get(llm._group.worker.stats.remote()).spec_decode.num_draft_tokens > 0
        # a grammar's mask travels with the step's plan to the sampling rank (the last stage)
        constrained = SamplingParams(
            temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)
        )
        answer = llm.generate("A number as JSON:", constrained)[0].outputs[0].text
        stats = llm.kv_cache_stats()
    assert isinstance(json.loads(answer)["n"], int), answer
    for p, out, w in zip(prompts, outs, want):
        assert_matches_reference(hf_smollm2, p, out.outputs[0].token_ids, w)
    assert stats.used_blocks == 0 and stats.free_blocks + stats.cached_free_blocks == stats.total_blocks


@pytest.mark.slow
def test_sharded_llm_with_a_draft_model_gives_transformers_tokens(
    local_ray, engine_args, reference, hf_smollm2, smollm2_path
):
    """A tp=2 target verifies the proposals of an unsharded draft (SmolLM2 itself, beside
    the driver shard, on the target's block tables): the tokens are transformers' greedy
    ones, the draft is almost always right, and no block is left used."""
    import ray

    from kvray.engine import LLM, SamplingParams

    prompts, want = reference
    draft = {"method": "draft_model", "model": str(smollm2_path), "num_speculative_tokens": 3}
    with LLM(**engine_args, tensor_parallel_size=2, speculative_config=draft) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        )
        spec = ray.get(llm._group.worker.stats.remote()).spec_decode
        stats = llm.kv_cache_stats()
    for p, out, w in zip(prompts, outs, want):
        assert_matches_reference(hf_smollm2, p, out.outputs[0].token_ids, w)
    assert spec.num_draft_tokens > 0 and spec.acceptance_rate > 0.8, spec
    assert stats.used_blocks == 0 and stats.free_blocks + stats.cached_free_blocks == stats.total_blocks


@pytest.mark.slow
def test_sharded_llm_rejects_bad_input_and_keeps_serving(local_ray, engine_args):
    from kvray.engine import LLM, SamplingParams
    from kvray.errors import InvalidArgumentError

    with LLM(**engine_args, tensor_parallel_size=2) as llm:
        with pytest.raises(InvalidArgumentError, match="prompt"):
            llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [10**9]}])
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
        assert llm.kv_cache_stats().used_blocks == 0


# ---- an idle group stays up ---------------------------------------------------------------


def _idle_rank(rank: int, port: int, idle_s: float, out) -> None:
    from kvray.actors import shard_group

    shard_group.GROUP_TIMEOUT_S = 1  # the collectives' timeout, far below the idle spell
    store = None
    if rank == 0:
        store = torch.distributed.TCPStore("127.0.0.1", port, 2, True)
    shard = shard_group.init_shard_context(ShardSpec(2, 1, rank), "127.0.0.1", port, "gloo", store)
    box = [None]
    if rank == 0:
        time.sleep(idle_s)  # a driver with no requests sends no plan
        box = [{"step": 1}]
    torch.distributed.broadcast_object_list(box, src=0, group=shard.cpu_group)
    out.put((rank, box[0]))
    torch.distributed.destroy_process_group()


def test_shards_wait_for_the_next_plan_longer_than_the_group_timeout():
    """A shard waits for the driver's next step plan however long the worker is idle
    (the plan group has no practical timeout); a step's own collectives keep theirs."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29300 + os.getpid() % 500
    procs = [ctx.Process(target=_idle_rank, args=(r, port, 3.0, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == {0: {"step": 1}, 1: {"step": 1}}
