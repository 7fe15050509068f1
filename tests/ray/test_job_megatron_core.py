"""job=megatron_core: megatron-core's real GPTModel, DDP, schedules and grad finalization on CPU.

Unit (no Ray, two gloo processes): the plan read from megatron's module attributes gives the Megatron
layouts, and the fused QKV projection's TP=2 shards reassemble into the TP=1 output (per-group
layout). Integration (real Ray checks, one shared reference): the clean TP+SP check passes with
megatron's own full activation recomputation, and a bug injected into megatron-core (run without
recomputation) exits 1 at the module the catalog names, which the isolation pass confirms; and under
megatron's DistributedOptimizer (zero1) the clean check passes and a misplaced param all-gather is named,
and so for its interleaved pipeline (pp2 x vpp2) and chunks numbered by the non-interleaved formula.
"""

import fnmatch

import pytest
import torch

pytest.importorskip("megatron.core")

import worker_processes  # noqa: E402
from recomputation import assert_recomputed_and_traced_as_without  # noqa: E402

from orchestrator.check import run_checks  # noqa: E402
from orchestrator.rank_tasks import free_port  # noqa: E402
from orchestrator.recipe import compose  # noqa: E402
from workloads import bugs  # noqa: E402

MODEL = {"name": "gpt_tiny", "vocab": 128, "hidden": 64, "heads": 4, "layers": 4, "seq_len": 32,
         "ffn_hidden": 256}


PHASES = {"tp2_sp": (2, 1, True), "single": (1, 1, False), "pp2": (1, 2, False)}   # (tp, pp, sp) on 2 ranks


def _worker(rank: int, world: int, port: int, queue) -> None:  # noqa: ANN001
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    from tracer import param_layouts
    from tracer.integrations.megatron_core import layer_renaming, plan_for, tied_renaming
    from tracer.parameters import init_parameters
    from workloads.adapters import megatron_core as adapter
    from workloads.adapters import megatron_shims

    megatron_shims.install()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = {}
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, MODEL["vocab"], (2, MODEL["seq_len"]), generator=gen)
        pos = torch.arange(MODEL["seq_len"])[None].expand(2, -1)
        for phase, (t, p, s) in PHASES.items():
            mps.initialize_model_parallel(tensor_model_parallel_size=t, pipeline_model_parallel_size=p)
            model = adapter._build({"model": MODEL}, adapter._config({"model": MODEL}, t, p, s))
            plan, rename = plan_for(model), layer_renaming(model)
            coords = {"tp": mps.get_tensor_model_parallel_rank(),
                      "pp": mps.get_pipeline_model_parallel_rank()}
            init_parameters(model, param_layouts(model, plan), 7, coords, {"tp": t, "pp": p}, rename=rename)
            qkv = {}

            def keep(module, args, output, qkv=qkv):  # noqa: ANN001
                qkv["out"] = output[0].detach().clone()

            if p == 1:
                model.decoder.layers[0].self_attention.linear_qkv.register_forward_hook(keep)
                with torch.no_grad():
                    model(ids, pos, megatron_shims.causal_mask(MODEL["seq_len"]))
            out[phase] = {
                "coords": coords, "qkv": qkv.get("out"),
                "plan": {n: (type(m).__name__, plan[n].output.to_json(),
                             {k: v.to_json() for k, v in plan[n].params.items()})
                         for n, m in model.named_modules() if n in plan},
                "rename": {n: rename(n) for n, _ in model.named_modules()},
            }
            mps.destroy_model_parallel()
        # Tied embeddings over two stages: the last stage's output layer holds its own copy of the word
        # embedding, named as it (tied_renaming), so both stages' copies are initialized alike.
        tied = {**MODEL, "tie_embeddings": True}
        mps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
        with megatron_shims.cpu_tensors_as_cuda():   # megatron syncs the copies at build, as on a GPU
            model = adapter._build({"model": tied}, adapter._config({"model": tied}, 1, 2, False))
        plan, rename = plan_for(model), tied_renaming(layer_renaming(model))
        init_parameters(model, param_layouts(model, plan), 7, {"pp": rank}, {"pp": 2}, rename=rename)
        out["pp2_tied"] = {"names": [rename(n) for n, _ in model.named_parameters()], "plan": sorted(plan),
                           "weight": model.shared_embedding_or_output_weight().detach().clone()}
        mps.destroy_model_parallel()
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def plans() -> dict:
    """Each of two gloo ranks builds the model under every PHASES layout: plans, renamings, QKV outputs."""
    world = 2
    ctx = worker_processes.context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def _layout(shard=(), partial=()):
    return {"shard": [list(s) for s in shard], "partial": list(partial)}


def test_attribute_plan_tp2_sp_layouts_and_fused_qkv_reassembly(plans):
    from tracer import Layout
    from tracer.layouts import Piece, assemble

    got = plans
    plan = got[0]["tp2_sp"]["plan"]
    seq, feat, rep = _layout([(0, "tp")]), _layout([(-1, "tp")]), _layout()
    col = {"weight": _layout([(0, "tp")]), "bias": _layout([(0, "tp")])}
    expect = {
        "embedding": ("LanguageModelEmbedding", seq, {}),
        "embedding.word_embeddings": ("VocabParallelEmbedding", rep, {"weight": _layout([(0, "tp")])}),
        "decoder.layers.0": ("TransformerLayer", seq, {}),
        "decoder.layers.0.input_layernorm": ("LayerNorm", seq, {}),
        "decoder.layers.0.self_attention.linear_qkv": ("ColumnParallelLinear", feat, col),
        "decoder.layers.0.self_attention.core_attention": ("DotProductAttention", feat, {}),
        "decoder.layers.0.self_attention.linear_proj": ("RowParallelLinear", seq,
                                                        {"weight": _layout([(1, "tp")])}),
        "decoder.layers.3.mlp.linear_fc2": ("RowParallelLinear", seq, {"weight": _layout([(1, "tp")])}),
        "decoder.final_layernorm": ("LayerNorm", seq, {}),
        "output_layer": ("ColumnParallelLinear", feat, {"weight": _layout([(0, "tp")])}),
    }
    for name, want in expect.items():
        assert tuple(plan[name]) == want, name
    # The reference (TP=1, no SP) plan of the same model: nothing sharded on the sequence.
    assert got[0]["single"]["plan"]["decoder.layers.0.input_layernorm"][1] == rep
    # Fused QKV [s, b, groups*(q_per_group+2)*head_dim]: the TP=2 shards concatenate into TP=1's output.
    pieces = [Piece(got[r]["tp2_sp"]["coords"], got[r]["tp2_sp"]["qkv"], rank=r) for r in (0, 1)]
    full = assemble("qkv", Layout.from_json(feat), pieces, {"tp": 2}).tensor
    ref = got[0]["single"]["qkv"]
    assert full.shape == ref.shape == (MODEL["seq_len"], 2, 3 * MODEL["hidden"])
    assert torch.allclose(full, ref, rtol=1e-5, atol=1e-6), (full - ref).abs().max()


def test_layer_renaming_pp2_from_layer_numbers(plans):
    got = plans
    last = got[1]["pp2"]
    assert last["rename"]["decoder.layers.0.mlp.linear_fc1"] == "decoder.layers.2.mlp.linear_fc1"
    assert last["rename"]["decoder.layers.1"] == "decoder.layers.3"
    assert got[0]["pp2"]["rename"]["decoder.layers.1"] == "decoder.layers.1"
    assert len([n for n in last["plan"] if n.count(".") == 2 and ".layers." in n]) == 2   # 2 layers per stage
    assert "output_layer" in last["plan"] and "embedding" not in last["plan"]


def test_tied_embeddings_over_two_stages_are_one_tensor_in_both(plans):
    """The last stage's output layer has no weight of its own to plan, and its copy of the word embedding
    is named as the embedding: initialized as it, and a replica the comparison checks bit for bit."""
    first, last = plans[0]["pp2_tied"], plans[1]["pp2_tied"]
    assert "embedding.word_embeddings.weight" in first["names"] and "output_layer.weight" not in last["names"]
    assert "embedding.word_embeddings.weight" in last["names"] and "output_layer" in last["plan"]
    assert torch.equal(first["weight"], last["weight"]) and first["weight"].abs().sum() > 0


# -- real Ray checks ----------------------------------------------------------------------------
# One catalog bug injected into megatron-core, with the isolation pass (every rank a fresh process
# importing megatron-core, ~6 s of CPU each); the other megatron bugs: `make bench-bugs`.
BUGGY = [n for n, b in bugs.CATALOG.items() if b.job == "megatron_core"][:1]
ZERO1_BUG = "megatron_zero1_gather_offset_wrong"
BF16 = ["parallel=tp2_dp2", "++parallel.zero1=true", "precision=bf16"]
VPP_BUG = "megatron_vpp_layer_offset_wrong"


@pytest.fixture(scope="module")
def results(ray_cluster, tmp_path_factory):
    work = tmp_path_factory.mktemp("megatron_checks")
    common = ["job=megatron_core", "tracking.enabled=false", "tolerance.perturbations=2",
              f"cluster.address={ray_cluster}"]
    # The clean check recomputes every layer in backward (megatron's CheckpointFunction): all of TP+SP's
    # tracing, and the recomputation besides.
    items = [(compose(["parallel=tp2_sp", "parallel.recompute=full", *common]), work / "clean-tp2_sp")]
    items += [(compose([*bugs.CATALOG[b].trigger, f"bug={b}", *common]), work / b) for b in BUGGY]
    # megatron's DistributedOptimizer (ZeRO-1 over dp=2) with its param all-gather misplaced, its clean
    # counterpart the bf16 check below (localize=false: the isolation pass on megatron's modules is the
    # bug above's to show). And its interleaved pipeline (pp=2 x vpp=2), clean and with its chunks' layer
    # numbers wrong.
    items += [(compose([*bugs.CATALOG[ZERO1_BUG].trigger, f"bug={ZERO1_BUG}", "localize=false", *common]),
               work / ZERO1_BUG),
              (compose(["parallel=pp2_vpp2", *common]), work / "clean-pp2_vpp2"),
              (compose([*bugs.CATALOG[VPP_BUG].trigger, f"bug={VPP_BUG}", "localize=false", *common]),
               work / VPP_BUG)]
    # Megatron-LM's bf16 (Float16Module, FP32 main grads and params) under TP and its distributed optimizer,
    # judged on the 3 perturbed runs bf16's tolerance is calibrated on.
    items += [(compose([*BF16, *common, "tolerance.perturbations=3"]), work / "clean-bf16")]
    out = run_checks(items, base_dir=str(work))
    return dict(zip(["clean-tp2_sp", *BUGGY, ZERO1_BUG, "clean-pp2_vpp2", VPP_BUG, "clean-bf16"], out,
                    strict=True))


def test_clean_megatron_tp2_sp_passes(results):
    res = results["clean-tp2_sp"]
    assert res.verdict == "pass" and res.exit_code == 0, res.report.get("first_divergence") or res.message
    assert len(res.report["tensors"]) > 500
    # Recomputed forwards trace nothing new: the tensors of the bug's check, which runs without it (its
    # report lists every tensor); each rank's log says it recomputed.
    assert_recomputed_and_traced_as_without(res, results[BUGGY[0]])


@pytest.mark.parametrize("bug", BUGGY)
def test_megatron_bug_is_localized(results, bug):
    res = results[bug]
    assert res.verdict == "fail" and res.exit_code == 1, res.message
    fd = res.report["first_divergence"]
    assert fnmatch.fnmatch(f"{fd['module']}/{fd['kind']}", bugs.CATALOG[bug].expect), fd
    # The isolation pass on megatron-core's own modules (plan read from their attributes).
    culprit = res.report["culprit"]
    assert culprit["resolved"] and fnmatch.fnmatch(f"{culprit['module']}/{culprit['kind']}",
                                                   bugs.CATALOG[bug].expect), culprit
    assert res.report["blame_window"]["size"] == 1


def test_megatron_distributed_optimizer_clean_passes_and_its_misplaced_gather_is_named(results):
    """Under zero1 each rank records only the grad ranges megatron's DistributedOptimizer owns (zeros
    elsewhere, a partial sum over dp): the clean check (the bf16 one, tp2_dp2) passes only if those ranges
    add up to the reduced grad, and the bug (fp32 dp2: it patches the distributed optimizer's own
    all-gather, so it acts only if that optimizer runs) fails at the first parameter after the first
    update, its grads all within tolerance: there too the ranges add up."""
    clean, buggy = results["clean-bf16"], results[ZERO1_BUG]
    assert clean.verdict == "pass" and clean.exit_code == 0, (clean.report.get("first_divergence")
                                                              or clean.message)
    grads = [t for t in clean.report["tensors"] if t["kind"] == "param_grad"]
    assert len(grads) > 20 and all(t["ok"] for t in grads)
    assert buggy.verdict == "fail" and buggy.exit_code == 1, buggy.message
    fd = buggy.report["first_divergence"]
    assert fnmatch.fnmatch(f"{fd['module']}/{fd['kind']}", bugs.CATALOG[ZERO1_BUG].expect), fd
    assert fd["name"].startswith("0/") and all(t["ok"] for t in buggy.report["tensors"]
                                               if t["kind"] == "param_grad" and t["step"] == 0)


def test_megatron_interleaved_pipeline_clean_passes_and_misnumbered_chunks_are_named(results):
    """megatron's interleaved 1F1B over two chunks per rank, traced as one model whose names drop the
    chunk index (tracer.integrations.megatron_core.chunks_renaming): every layer of the reference is
    matched, and chunks numbered by the non-interleaved formula fail at the first layer run out of place."""
    clean, buggy = results["clean-pp2_vpp2"], results[VPP_BUG]
    assert clean.verdict == "pass" and clean.exit_code == 0, (clean.report.get("first_divergence")
                                                              or clean.message)
    layers = {t["module"].split(".")[2] for t in clean.report["tensors"]
              if t["module"].startswith("decoder.layers.")}
    assert layers == {"0", "1", "2", "3"}
    assert buggy.verdict == "fail" and buggy.exit_code == 1, buggy.message
    fd = buggy.report["first_divergence"]
    assert fnmatch.fnmatch(f"{fd['module']}/{fd['kind']}", bugs.CATALOG[VPP_BUG].expect), fd


def test_megatron_bf16_under_tp_and_its_distributed_optimizer_passes_as_megatron_lm_runs_it(results):
    """precision=bf16 is Megatron-LM's: BF16 parameters and activations (Float16Module), FP32 main grads
    (DDP's grad buffer) that the distributed optimizer steps as FP32 main params, GEMMs as a GPU computes
    them (workloads/bf16_dispatch.py), and perturbed references that draw GEMM roundings. The clean check
    passes only if grad-sign replay reaches the ranges the distributed optimizer steps (without it the
    candidate stepped its own signs: 22 word-embedding elements failed)."""
    import json
    from pathlib import Path

    res = results["clean-bf16"]
    assert res.verdict == "pass" and res.exit_code == 0, res.report.get("first_divergence") or res.message
    store, refs = Path(res.report["store"]), Path(res.report["reference"]["url"])
    cand = [json.loads(m.read_text()) for m in sorted((store / "candidate").glob("rank*/manifest.json"))]
    pert = json.loads((refs / "perturbed-1" / "rank00000" / "manifest.json").read_text())
    assert len(cand) == 4
    for m in (*cand, pert):
        dtypes = {(e["kind"], e["dtype"]) for e in m["entries"]}
        assert {("param", "bfloat16"), ("param_grad", "float32"), ("grad_output", "bfloat16"),
                ("output", "bfloat16")} <= dtypes and ("param", "float32") not in dtypes, dtypes
        assert m["meta"]["perturbation"] == "gemm" and m["meta"]["precision"] == "bf16", m["meta"]
    # the distributed optimizer's ranges: each param grad a disjoint partial sum over dp
    layouts = {json.dumps(e["layout"], sort_keys=True) for e in cand[0]["entries"]
               if e["kind"] == "param_grad"}
    assert all('"disjoint": ["dp"]' in lay for lay in layouts), layouts
