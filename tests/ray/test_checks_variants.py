"""Real Ray checks of the parallelism families whose reassembly is the most particular: VPP and CP on
llama_tiny (one shared reference set) and MoE/EP+TP on moe_tiny (bf16: routing and grad signs
replayed) pass clean, and one bug switch per family (the MoE one under both replays) exits 1 naming
the module the catalog says. (Every layout and bug switch of these models is compared with one process in
test_variant_numerics.py; llama's TP/PP and tied embedding go through a real check in
test_reference_layout.py; the whole catalog: `make bench-bugs`.)"""

import pytest

from orchestrator.check import run_checks
from orchestrator.recipe import compose

CLEAN = ["pp2_vpp2", "cp2"]
BUGGY = {  # bug: (trigger recipe, expected first-divergent module, kind)
    "vpp_layer_offset_wrong": ("pp2_vpp2", "layers.1.norm1", "output"),
    "cp_attention_backward_wrong": ("cp2", "layers.3.attn.kv", "grad_output"),
}
MOE_CLEAN = ["ep2_tp2"]
MOE_BUGGY = {"moe_router_grad_unreduced": ("ep2_tp2", "layers.0.mlp.router", "param_grad")}


@pytest.fixture(scope="module")
def results(ray_cluster, tmp_path_factory):
    work = tmp_path_factory.mktemp("variant_checks")
    # One step (forward, backward, optimizer step: every kind the bugs show in), R=2 perturbed runs.
    common = ["model=llama_tiny", "tracking.enabled=false", "localize=false", "steps=1",
              "tolerance.perturbations=2", f"cluster.address={ray_cluster}"]
    items = [(compose([f"parallel={p}", *common]), work / f"clean-{p}") for p in CLEAN]
    items += [(compose([f"parallel={p}", f"bug={b}", *common]), work / b) for b, (p, _, _) in BUGGY.items()]
    # MoE in bf16: the perturbed references and the candidate replay the reference's routing
    moe = ["model=moe_tiny", "precision=bf16", *common[1:]]
    items += [(compose([f"parallel={p}", *moe]), work / f"clean-{p}") for p in MOE_CLEAN]
    items += [(compose([f"parallel={p}", f"bug={b}", *moe]), work / b) for b, (p, _, _) in MOE_BUGGY.items()]
    out = run_checks(items, base_dir=str(work))
    names = [f"clean-{p}" for p in CLEAN] + list(BUGGY) + [f"clean-{p}" for p in MOE_CLEAN] + list(MOE_BUGGY)
    return dict(zip(names, out, strict=True))


@pytest.mark.parametrize("parallel", CLEAN + MOE_CLEAN)
def test_clean_family_passes(results, parallel):
    res = results[f"clean-{parallel}"]
    assert res.verdict == "pass" and res.exit_code == 0, res.report.get("first_divergence") or res.message


@pytest.mark.parametrize("bug", list(BUGGY) + list(MOE_BUGGY))
def test_bug_is_named(results, bug):
    res = results[bug]
    assert res.verdict == "fail" and res.exit_code == 1, res.message
    fd = res.report["first_divergence"]
    _, module, kind = {**BUGGY, **MOE_BUGGY}[bug]
    assert (fd["module"], fd["kind"]) == (module, kind), fd


@pytest.mark.parametrize("check", [f"clean-{p}" for p in MOE_CLEAN] + list(MOE_BUGGY))
def test_moe_checks_in_bf16_replay_the_reference_routing_and_grad_signs(results, check):
    ref = results[check].report["reference"]
    assert ref.get("routing") == "replay" and ref.get("grad_signs") == "replay"
