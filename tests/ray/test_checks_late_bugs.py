"""Issue 18's late bugs as real Ray checks at their early step (Bug.early: step 1 of 2): each fails
with its first divergence where the catalog says, its clean counterpart (same recipe, bug=none) passes,
and before its step the buggy candidate's trace is bitwise the clean one's (silent until it acts)."""

import pytest
import torch

from orchestrator.check import run_checks
from orchestrator.recipe import compose
from tracer.logical import load_logical
from workloads.bugs import CATALOG

LAYERS = 2   # gpt_tiny cut to 2 layers: the stale DP bucket (bucket 1) is then layers.1's fc1
EXPECT = {"late_grad_bucket_stale": ("layers.1.mlp.fc1", "param_grad"),   # Bug.expect at 4 layers: layers.3
          "lr_schedule_local_samples": ("embedding.word", "param")}


@pytest.fixture(scope="module")
def results(ray_cluster, tmp_path_factory):
    work = tmp_path_factory.mktemp("late_bugs")
    common = [f"model.layers={LAYERS}", "localize=false", "tracking.enabled=false",
              "tolerance.perturbations=2", f"cluster.address={ray_cluster}"]
    items, names = [], []
    for bug in EXPECT:
        for name in (bug, "none"):
            items.append((compose([*CATALOG[bug].recipe, f"bug={name}", *common]), work / f"{bug}-{name}"))
            names.append((bug, name))
    return dict(zip(names, run_checks(items, base_dir=str(work)), strict=True))


@pytest.mark.parametrize("bug", list(EXPECT))
def test_late_bug_fails_at_its_step_where_the_catalog_says(results, bug):
    res, clean = results[(bug, bug)], results[(bug, "none")]
    assert clean.verdict == "pass" and clean.exit_code == 0, (
        clean.report.get("first_divergence") or clean.message)
    assert res.verdict == "fail" and res.exit_code == 1, res.message
    fd = res.report["first_divergence"]
    assert (fd["module"], fd["kind"]) == EXPECT[bug] and fd["name"].startswith("1/"), fd   # at step 1
    assert CATALOG[bug].expect.split("/")[1] == fd["kind"]


@pytest.mark.parametrize("bug", list(EXPECT))
def test_late_bug_is_bitwise_silent_before_its_step(results, bug):
    runs = [load_logical(results[(bug, n)].report["store"], "candidate", 4) for n in (bug, "none")]
    buggy, clean = runs
    assert buggy.order == clean.order
    steps = {n: buggy.info[n]["step"] for n in buggy.order}
    before = [n for n in buggy.order if steps[n] < 1]
    assert len(before) > 100
    for n in before:
        assert torch.equal(buggy.tensors[n].tensor, clean.tensors[n].tensor), n
    module, kind = EXPECT[bug]
    acted = [n for n in buggy.order if steps[n] == 1
             and (buggy.info[n]["module"], buggy.info[n]["kind"]) == (module, kind)]
    assert acted and not all(torch.equal(buggy.tensors[n].tensor, clean.tensors[n].tensor) for n in acted)
