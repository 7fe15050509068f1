"""job=torch_native: a torchtitan-style Llama under torch's own TP/SP (parallelize_module), FSDP2 and
pipelining, traced with layouts read from DTensor placements (tracer/integrations/dtensor.py, no
plan). Unit tests of the placement -> Layout mapping (no Ray), then real Ray checks: clean tp2_sp
(fp32, recomputed), tp2_dp2 (bf16, FSDP2's mixed precision), pp2 (1F1B) and pp2_vpp2 at dp2 (zero-bubble
V, recomputed) pass; the injected wrong placement plan exits 1 at the K/V projection it breaks (bf16), the
pipeline's stage-local grad clipping at a param of step 0 (fp32). A reference on two TP ranks saves its
final state whole (checkpoint.save)."""

import pytest
import torch
from recomputation import assert_recomputed_and_traced_as_without
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tracer.integrations.dtensor import placements_to_layout
from tracer.layouts import Layout, Piece, assemble


def test_placements_map_to_layouts():
    names = ("dp", "tp")
    assert placements_to_layout((Replicate(), Replicate()), names) == Layout()
    assert placements_to_layout((Replicate(), Shard(0)), names) == Layout(shard=((0, "tp"),))
    assert placements_to_layout((Shard(0), Shard(1)), names) == Layout(shard=((0, "dp"), (1, "tp")))
    assert placements_to_layout((Replicate(), Partial()), names) == Layout(partial=("tp",))
    assert placements_to_layout((Replicate(), Shard(-1)), names, ndim=3) == Layout(shard=((2, "tp"),))
    # FSDP2 over TP: the dp shard of an already tp-sharded dim is nested inside the tp shard.
    assert placements_to_layout((_StridedShard(0, split_factor=2), Shard(0)), names) == \
        Layout(shard=((0, "tp"), (0, "dp")))


def test_layout_slices_and_reassembles_like_dtensor_sharding():
    """Layout.local follows DTensor's Shard(d) (torch.chunk along d), strided shards included."""
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    sizes = {"dp": 2, "tp": 2}
    for placements in ((Shard(0), Shard(1)), (_StridedShard(0, split_factor=2), Shard(0))):
        layout = placements_to_layout(placements, ("dp", "tp"))
        pieces = []
        for dp in range(2):
            for tp in range(2):
                coords = {"dp": dp, "tp": tp}
                local = layout.local(full, coords, sizes)
                if isinstance(placements[0], _StridedShard):   # tp chunk first, then dp chunk inside it
                    assert torch.equal(local, full.chunk(2, 0)[tp].chunk(2, 0)[dp])
                else:
                    assert torch.equal(local, full.chunk(2, 0)[dp].chunk(2, 1)[tp])
                pieces.append(Piece(coords, local, rank=dp * 2 + tp))
        assert torch.equal(assemble("t", layout, pieces, sizes).tensor, full)


def test_validate_names_what_is_unsupported():
    from orchestrator.recipe import compose, job_spec
    from tracer.errors import ConfigError
    from workloads.adapters import torch_native

    rec = compose(["job=torch_native", "parallel=tp2_sp"])
    assert rec["model"]["name"] == "llama_tiny"   # the job option's default model
    torch_native.validate(job_spec(rec, role="candidate", store_url=""))
    def spec(*over):
        return job_spec(compose(["job=torch_native", *over]), role="candidate", store_url="")

    with pytest.raises(ConfigError, match="model=llama_tiny"):
        torch_native.validate(spec("model=gpt_tiny"))
    with pytest.raises(ConfigError, match="TP, SP, FSDP2 data parallelism and pipelining"):
        torch_native.validate(spec("parallel=cp2"))
    torch_native.validate(spec("parallel=pp2_vpp2", "++model.tie_embeddings=false"))
    with pytest.raises(ConfigError, match="tied embeddings under pp"):   # llama_tiny ties them
        torch_native.validate(spec("parallel=pp2"))
    with pytest.raises(ConfigError, match="microbatches per DP rank"):
        torch_native.validate(spec("parallel=pp2", "++model.tie_embeddings=false", "data.global_batch=6"))
    with pytest.raises(ConfigError, match="runs one stage a rank: vpp must be 1"):
        torch_native.validate(spec("parallel=pp2_vpp2", UNTIED, "parallel.pp_schedule=GPipe"))
    with pytest.raises(ConfigError, match="is not one of 1F1B, GPipe"):
        torch_native.validate(spec("parallel=pp2", UNTIED, "parallel.pp_schedule=ZB1P"))
    from workloads.config import validate as builtin_validate

    with pytest.raises(ConfigError, match="job=torch_native runs"):   # other jobs run their own schedules
        builtin_validate(job_spec(compose(["parallel=pp2", "parallel.pp_schedule=GPipe"]), role="candidate",
                                  store_url=""))
    with pytest.raises(ConfigError, match="fp32 or bf16"):
        torch_native.validate(spec("precision=fp8"))
    with pytest.raises(ConfigError, match="BF16 cast"):   # bf16 perturbed runs draw GEMM roundings
        torch_native.validate(spec("precision=bf16", "tolerance.perturbation=weights"))


# The fp32 clean check runs with torchtitan's full activation checkpointing (each block
# checkpoint-wrapped): all of TP+SP's tracing, and the wrapper and recomputation besides (the bug's
# check runs without it, tests/ray/test_job_contract.py a clean DTensor TP+SP script without it).
# The bf16 one is torchtitan's mixed precision under TP and FSDP2 (its MixedPrecisionPolicy), judged
# on the 3 perturbed runs its tolerance is calibrated on: at 2, seed 1 of 4 tried failed clean.
# The pipelined ones run torch.distributed.pipelining's 1F1B (the bug's recipe, clean) and its
# zero-bubble V schedule (two stages a rank, each backward split into an input and a weight pass, both
# recomputing the blocks) under FSDP2 at dp2, each stage wrapped whole (torch_pipeline.fsdp_per_block),
# untied: the job refuses tied embeddings across stages.
UNTIED = "++model.tie_embeddings=false"
ZB_DP2 = ["parallel=pp2_vpp2", UNTIED, "parallel.world_size=4"]
CLEAN = {"tp2_sp_recompute": ["parallel=tp2_sp", "parallel.recompute=full"],
         "tp2_dp2_bf16": ["parallel=tp2_dp2", "precision=bf16", "tolerance.perturbations=3"],
         "pp2": ["parallel=pp2", UNTIED],
         "pp2_vpp2_zbv_dp2_recompute": [*ZB_DP2, "parallel.pp_schedule=ZBVZeroBubble",
                                        "parallel.recompute=full"]}
RECOMPUTED = {"tp2_sp_recompute": "tn_gqa_kv_gathered_output",   # -> a check without recomputation
              "pp2_vpp2_zbv_dp2_recompute": "tn_pp_zero_bubble_fsdp2_grads"}
# bug -> (overrides, first divergence's module pattern, its kind). The K/V plan's in bf16, the wider
# tolerance (fp32's detection: make bench-bugs); the pipeline's clipping in fp32, where Adam's first
# update still shows a clip coefficient (torchtitan #596); torch's own zero-bubble x per-block FSDP2
# bug, whose last stage's parameters get no grad at all.
BUGGY = {"tn_gqa_kv_gathered_output": (["parallel=tp2", "precision=bf16"], "layers.3.attention.w[kv]",
                                       "grad_output"),
         "tn_pp_grad_norm_stage_local": (["parallel=pp2", UNTIED], "*", "param"),
         "tn_pp_zero_bubble_fsdp2_grads": ([*ZB_DP2, "parallel.pp_schedule=InterleavedZeroBubble"],
                                           "layers.1.*", "param_grad")}
UNLOCALIZED = ("tn_pp_zero_bubble_fsdp2_grads",)


@pytest.fixture(scope="module")
def results(ray_cluster, tmp_path_factory):
    from orchestrator.check import run_checks
    from orchestrator.recipe import compose

    work = tmp_path_factory.mktemp("torch_native_checks")
    common = ["job=torch_native", "tracking.enabled=false", "tolerance.perturbations=2",
              f"cluster.address={ray_cluster}"]
    items = [(compose([*common, *over]), work / f"clean-{p}") for p, over in CLEAN.items()]
    # The bugs run the isolation pass (localize=true, the default): the job is DTensor-traced. Not torch's
    # zero-bubble one (4 ranks more): its culprit is its first divergence's module, pinned all the same.
    items += [(compose([*common, *over, f"bug={b}", *(["localize=false"] if b in UNLOCALIZED else [])]),
               work / b) for b, (over, _, _) in BUGGY.items()]
    # A reference on two TP ranks that saves its final state (checkpoint.save): gathered from DTensors.
    items += [(compose([*common, "parallel=tp2_sp", "reference.parallel=tp2",
                        f"checkpoint.save={work / 'ckpt-tp2'}"]), work / "save-tp2")]
    out = run_checks(items, base_dir=str(work))
    return dict(zip([f"clean-{p}" for p in CLEAN] + list(BUGGY) + ["save-tp2"], out, strict=True))


@pytest.mark.parametrize("parallel", CLEAN)
def test_clean_torch_native_passes(results, parallel):
    res = results[f"clean-{parallel}"]
    assert res.verdict == "pass" and res.exit_code == 0, res.report.get("first_divergence") or res.message
    assert len(res.report["tensors"]) > 500
    if parallel == "pp2_vpp2_zbv_dp2_recompute":   # the V split: pp rank r holds stages r and 3 - r
        import json
        from pathlib import Path

        held = {}
        for m in sorted(Path(res.report["store"]).glob("candidate/rank*/manifest.json")):
            manifest = json.loads(m.read_text())
            pp, dp, entries = manifest["coords"]["pp"], manifest["coords"]["dp"], manifest["entries"]
            held[pp, dp] = {e["module"].split(".attention")[0].split(".feed_forward")[0] for e in entries
                            if e["kind"] == "param" and ".attention." in e["module"]}
            # each DP rank's own microbatches of the global batch, named by their global index
            assert {e["microbatch"] for e in entries if e["kind"] == "output"} == {2 * dp, 2 * dp + 1}, m
        assert held == {(0, 0): {"layers.0", "layers.3"}, (0, 1): {"layers.0", "layers.3"},
                        (1, 0): {"layers.1", "layers.2"}, (1, 1): {"layers.1", "layers.2"}}, held
    if parallel in RECOMPUTED:
        # The wrapper's attribute is in no name: the tensors a check without recomputation traces
        # (the bug's: its report lists every tensor); each rank's log says it recomputed.
        # A zero-bubble weight pass recomputes its blocks again, matched to the same forwards.
        assert_recomputed_and_traced_as_without(res, results[RECOMPUTED[parallel]],
                                                ranks=4 if "dp2" in parallel else 2)


def test_bf16_runs_as_torchtitans_mixed_precision(results):
    """The bf16 check computed in BF16 and kept FP32 parameters and grads (FSDP2's policy: param_dtype
    bf16, reduce_dtype fp32), and its perturbed references drew GEMM roundings (a one-ulp move of an
    FP32 weight would mostly vanish in its BF16 cast)."""
    import json
    from pathlib import Path

    res = results["clean-tp2_dp2_bf16"]
    store = Path(res.report["store"])
    runs = {"candidate": store, "perturbed-1": Path(res.report["reference"]["url"])}
    for run, root in runs.items():
        manifests = sorted((root / run).glob("rank*/manifest.json"))
        assert len(manifests) == (4 if run == "candidate" else 1), (run, manifests)
        m = json.loads(manifests[0].read_text())
        dtypes = {(e["kind"], e["dtype"]) for e in m["entries"]}
        assert dtypes == {("output", "bfloat16"), ("grad_output", "bfloat16"), ("param", "float32"),
                          ("param_grad", "float32"), ("loss", "float32")}, (run, dtypes)
        assert m["meta"]["perturbation"] == "gemm", (run, m["meta"])


@pytest.mark.parametrize("bug", list(BUGGY))
def test_torch_native_bugs_are_named(results, bug):
    import fnmatch

    res = results[bug]
    assert res.verdict == "fail" and res.exit_code == 1, res.message
    fd, culprit = res.report["first_divergence"], res.report.get("culprit")
    _, module, kind = BUGGY[bug]
    assert fnmatch.fnmatch(fd["module"], module) and fd["kind"] == kind, fd
    # The isolation pass on a DTensor job: the culprit is the module itself, alone in its window.
    if bug not in UNLOCALIZED:
        assert culprit["resolved"] and fnmatch.fnmatch(culprit["module"], module), culprit
        assert culprit["kind"] == kind and res.report["blame_window"]["size"] == 1, res.report["blame_window"]
    if bug == "tn_pp_zero_bubble_fsdp2_grads":
        # The last stage's parameters were never trained: each param grad a FAIL of its own (step 0 and
        # 1: layers.3's 9 parameters), named as such, where the check once stopped with an error.
        untrained = [t["name"] for t in res.report["tensors"] if t["reason"].startswith("no gradient")]
        assert len(untrained) == 18, untrained
        assert all(n.split("/")[2].startswith("layers.3.") for n in untrained), untrained


def test_a_reference_on_two_tp_ranks_saves_the_whole_tensors_it_trained(results):
    """checkpoint.save from reference.parallel=tp2: every rank gathers the DTensor parameters and Adam
    state (full_tensor), rank 0 writes them. The checkpoint holds, bit for bit, the parameters the
    reference traced at its last step, reassembled from its two ranks."""
    from pathlib import Path

    from tracer.checkpoint import open_checkpoint
    from tracer.logical import load_logical

    res = results["save-tp2"]
    assert res.verdict == "pass" and res.exit_code == 0, res.report.get("first_divergence") or res.message
    ckpt = open_checkpoint(str(Path(res.report["recipe"]["checkpoint"]["save"])))
    ref = load_logical(res.report["reference"]["url"], "reference", 2)
    last = max(int(n.split("/")[0]) for n in ref.order)
    names = [n.split("/")[2] for n in ref.order if n.startswith(f"{last}/") and n.endswith("/param")]
    assert sorted(ckpt.index["tensors"]) == sorted(names) and len(names) > 30
    for name in names:
        assert torch.equal(ckpt.tensor(name), ref.tensors[f"{last}/-/{name}/param"].tensor), name
    wq = "layers.0.attention.wq.weight"   # sharded over tp in the run: whole in the checkpoint
    assert list(ckpt.tensor(wq).shape) == list(ref.tensors[f"{last}/-/{wq}/param"].tensor.shape)
    assert ckpt.step == last + 1 and ckpt.optimizer
    assert ckpt.adam_state(wq)["exp_avg"].shape == ckpt.tensor(wq).shape
