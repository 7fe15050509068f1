"""Issue-4 layouts reassembled against hand-built full tensors: GQA KV heads replicated over the TP
ranks sharing them (and their partial-sum grads), ZeRO-sharded optimizer views, VPP layer renaming,
the tied embedding's pipeline replicas."""

import torch

from tracer import LayerRenaming, Layout, Replicate, Shard
from tracer.layouts import Piece, assemble
from workloads.plan import llama_plan
from workloads.zero import shard_layout


def _tp_coords(tp: int, kv_heads: int) -> list[dict]:
    shards = min(kv_heads, tp)
    rep = tp // shards
    return [{"tp": t, "kv": t // rep, "kvr": t % rep} for t in range(tp)]


def test_kv_projection_shared_by_tp_ranks_reassembles_and_its_grad_sums_over_the_sharers():
    tp, kv_heads, d = 4, 2, 3
    sizes = {"tp": 4, "kv": 2, "kvr": 2}
    plan = llama_plan(sp=False)["layers.*.attn.kv"]
    full_w = torch.arange(kv_heads * 2 * d * 5, dtype=torch.float64).view(kv_heads * 2 * d, 5)
    # By hand: ranks 0,1 hold KV head 0 (rows 0..5), ranks 2,3 KV head 1 (rows 6..11).
    pieces = [Piece(c, full_w[6 * c["kv"]: 6 * (c["kv"] + 1)].clone(), rank=c["tp"])
              for c in _tp_coords(tp, 2)]
    for p in pieces:
        assert torch.equal(plan.params["weight"].local(full_w, p.coords, sizes), p.tensor)
    out = assemble("w", plan.params["weight"], pieces, sizes)
    assert torch.equal(out.tensor, full_w) and out.replica_err == 0.0
    # A copy that drifted (grads not reduced) is caught as a replica disagreement.
    pieces[1] = Piece(pieces[1].coords, pieces[1].tensor * 1.1, rank=1)
    assert assemble("w", plan.params["weight"], pieces, sizes).replica_err > 0.05

    # Output grad [b, s, 2*kv*d]: each sharing rank holds the grad of its own query heads.
    full_g = torch.randn(2, 3, 12, dtype=torch.float64)
    parts = {0: 0.25, 1: 0.75}
    grad_pieces = [Piece(c, full_g[..., 6 * c["kv"]: 6 * (c["kv"] + 1)] * parts[c["kvr"]], rank=c["tp"])
                   for c in _tp_coords(tp, 2)]
    got = assemble("g", plan.grad_layout, grad_pieces, sizes).tensor
    assert torch.allclose(got, full_g)
    assert plan.output == Shard(2, "kv")


def test_single_kv_head_is_replicated_over_all_tp_ranks():
    sizes = {"tp": 2, "kv": 1, "kvr": 2}
    full = torch.randn(8, 4)
    lay = llama_plan(sp=True)["layers.*.attn.kv"].params["weight"]
    pieces = [Piece(c, lay.local(full, c, sizes), rank=c["tp"]) for c in _tp_coords(2, 1)]
    assert all(torch.equal(p.tensor, full) for p in pieces)
    assert torch.equal(assemble("w", lay, pieces, sizes).tensor, full)


def test_zero1_optimizer_view_is_the_plan_layout_with_dp_nested_inside():
    sizes = {"tp": 2, "dp": 2}
    full = torch.arange(8 * 3, dtype=torch.float64).view(8, 3)
    lay = shard_layout(Shard(0, "tp"))
    assert lay == Layout(shard=((0, "tp"), (0, "dp")))
    # By hand: tp rank t holds rows 4t..4t+3; dp rank d of it holds 2 of those rows.
    pieces = [Piece({"tp": t, "dp": d}, full[4 * t + 2 * d: 4 * t + 2 * d + 2].clone(), rank=2 * t + d)
              for t in range(2) for d in range(2)]
    assert torch.equal(assemble("g", lay, pieces, sizes).tensor, full)
    rep = shard_layout(Replicate())   # a replicated parameter: only the DP shard
    rep_pieces = [Piece({"tp": t, "dp": d}, full[4 * d: 4 * d + 4], rank=2 * t + d)
                  for t in range(2) for d in range(2)]
    out = assemble("r", rep, rep_pieces, sizes)
    assert torch.equal(out.tensor, full) and out.replica_err == 0.0


def test_vpp_renaming_maps_each_chunk_to_its_interleaved_global_layers():
    from workloads.vpp import chunk_offsets

    per_chunk = 2   # 8 layers, pp=2, vpp=2: rank 1 holds layers 2,3 (chunk 0) and 6,7 (chunk 1)
    table = tuple(o + j for o in chunk_offsets(8, 2, 2, 1) for j in range(per_chunk))
    rn = LayerRenaming(table)
    assert [rn(f"layers.{i}.attn.q") for i in range(4)] == [
        "layers.2.attn.q", "layers.3.attn.q", "layers.6.attn.q", "layers.7.attn.q"]
    assert rn("embedding.word.weight") == "embedding.word.weight"


def test_tied_embedding_copies_are_pipeline_replicas():
    sizes = {"tp": 1, "pp": 2}
    lay = llama_plan(sp=False, tied=True)["embedding"].params["word.weight"]
    w = torch.randn(16, 4)
    same = [Piece({"pp": 0}, w, 0), Piece({"pp": 1}, w.clone(), 1)]
    assert assemble("e", lay, same, sizes).replica_err == 0.0
    lost = [Piece({"pp": 0}, w, 0), Piece({"pp": 1}, 0.5 * w, 1)]   # the stages' grads were never summed
    assert assemble("e", lay, lost, sizes).replica_err > 0.4
    assert "weight" not in llama_plan(sp=False, tied=True)["head"].params


def test_zigzag_sequence_layout_by_hand_and_nested_with_tp():
    # seq 8 over cp=2: 4 chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    sizes = {"cp": 2, "tp": 2}
    full = torch.arange(8.0).view(1, 8, 1).expand(1, 8, 4).contiguous() + 100 * torch.arange(4.0)
    lay = Layout(shard=((1, "cp"), (2, "tp")), zigzag=("cp",))
    assert lay.local(full, {"cp": 0, "tp": 0}, sizes)[0, :, 0].tolist() == [0.0, 1.0, 6.0, 7.0]
    assert lay.local(full, {"cp": 1, "tp": 1}, sizes)[0, :, 0].tolist() == [202.0, 203.0, 204.0, 205.0]
    by_hand = {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}
    pieces = [Piece({"cp": c, "tp": t}, full[:, by_hand[c], 2 * t: 2 * t + 2].clone(), rank=2 * c + t)
              for c in range(2) for t in range(2)]
    assert torch.equal(assemble("x", lay, pieces, sizes).tensor, full)
    assert Layout.from_json(lay.to_json()) == lay


def test_zigzag_matches_the_workload_token_split():
    from workloads.context_parallel import with_cp, zigzag_index
    from workloads.plan import gpt_plan

    assert zigzag_index(12, 3, 1).tolist() == [2, 3, 8, 9]
    lay = with_cp(gpt_plan(sp=False))["layers.*.attn.qkv"].output
    sizes = {"cp": 3, "tp": 1}
    full = torch.randn(2, 12, 6)
    for c in range(3):
        assert torch.equal(lay.local(full, {"cp": c, "tp": 0}, sizes), full[:, zigzag_index(12, 3, c)])
    assert with_cp(gpt_plan(sp=False))["loss"].output == Replicate()   # gathered over CP


def test_expert_renaming_gives_global_expert_numbers_after_pipeline_renaming():
    from tracer import PipelineRenaming
    from workloads.moe import ExpertRenaming

    rn = ExpertRenaming(first_expert=2, inner=PipelineRenaming(offset=2))   # ep rank 1 of 2, 4 experts
    assert rn("layers.0.mlp.experts.1.gate.weight") == "layers.2.mlp.experts.3.gate.weight"
    assert rn("layers.1.mlp.router") == "layers.3.mlp.router"
    # Expert weights from two EP ranks reassemble per global name; EDP ranks are replicas.
    sizes = {"tp": 2, "ep": 2, "edp": 2}
    lay = Shard(0, "tp")
    full = torch.randn(8, 4)
    pieces = [Piece({"tp": t, "ep": 1, "edp": e}, full[4 * t: 4 * t + 4].clone(), rank=t + 4 * e)
              for t in range(2) for e in range(2)]
    out = assemble(rn("layers.0.mlp.experts.1.up.weight"), lay, pieces, sizes)
    assert torch.equal(out.tensor, full) and out.replica_err == 0.0
