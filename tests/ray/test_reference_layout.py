"""A reference at a trusted smaller layout (`reference.parallel`, issue 17): tp2_pp2 against a tp2
reference passes clean, its reference and perturbed runs traced by 2 ranks each, and the tied-embedding
PP bug (which a tp2 reference does not share) exits 1 where the catalog says."""

from fnmatch import fnmatch

import pytest

from orchestrator.check import run_checks
from orchestrator.recipe import compose
from tracer.store import world_size_of
from workloads.bugs import CATALOG

BUG = "tied_embedding_grad_lost_pp"


@pytest.fixture(scope="module")
def results(ray_cluster, tmp_path_factory):
    work = tmp_path_factory.mktemp("reference_layout")
    common = ["parallel=tp2_pp2", "reference.parallel=tp2", "tracking.enabled=false", "localize=false",
              f"cluster.address={ray_cluster}"]
    items = [(compose(common), work / "clean"),
             (compose(["model=llama_tiny", f"bug={BUG}", *common]), work / "bug")]
    clean, bug = run_checks(items, base_dir=str(work))
    return clean, bug


def test_clean_check_against_a_tp2_reference_passes(results):
    clean, _ = results
    assert clean.verdict == "pass" and clean.exit_code == 0, (clean.report.get("first_divergence")
                                                              or clean.message)
    ref = clean.report["reference"]
    assert ref["parallel"] == {"name": "tp2", "world_size": 2, "sizes": {"tp": 2}}
    assert "only what the candidate tp2_pp2 adds (pp=2) is under test" in ref["trusted"]
    runs = ["reference", "perturbed-1", "perturbed-2", "perturbed-3"]
    assert [world_size_of(ref["url"], run) for run in runs] == [2, 2, 2, 2]


def test_pp_bug_is_caught_at_the_catalogued_module(results):
    _, bug = results
    assert bug.verdict == "fail" and bug.exit_code == 1, bug.message
    assert bug.report["reference"]["parallel"]["world_size"] == 2
    fd = bug.report["first_divergence"]
    assert fnmatch(f"{fd['module']}/{fd['kind']}", CATALOG[BUG].expect), fd
