"""A FAIL judged on fewer perturbed runs than the tolerance was calibrated on (R = 3) says so, with
what to do: at R = 2 a clean fp8 check has failed (docs/tolerance.md, Known gaps). Judged by
`ttrace compare`'s path on hand-built traces (no Ray); a check's report goes through the same
`orchestrator.outcome.finish`."""

import pytest

from orchestrator.compare_cli import compare_stored
from orchestrator.recipe import compose
from tests.tracer.test_store_compare import write_run

WARNS = "fewer than the 3 the tolerance is calibrated on"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("few_perturbations")
    write_run(root, "reference")
    for i, scale in enumerate((1 + 2**-22, 1 - 2**-22, 1 + 2**-21), 1):
        write_run(root, f"perturbed-{i}", fc_scale=scale)
    write_run(root, "candidate", tp=2)
    write_run(root, "buggy", tp=2, fc_scale=1.01)
    return root


@pytest.mark.parametrize(("candidate", "perturbed", "verdict", "warned"), [
    ("buggy", ["perturbed-1", "perturbed-2"], "fail", True),
    ("buggy", ["perturbed-1", "perturbed-2", "perturbed-3"], "fail", False),
    ("candidate", ["perturbed-1", "perturbed-2"], "pass", False)])
def test_a_fail_on_two_perturbed_runs_warns_that_it_may_be_a_false_alarm(store, tmp_path, candidate,
                                                                         perturbed, verdict, warned):
    res = compare_stored(compose(["tracking.enabled=false"]), tmp_path / "out", str(tmp_path), str(store),
                         candidate=candidate, perturbed=perturbed)
    assert res.verdict == verdict, res.message or res.report.get("first_divergence")
    assert res.report["recipe"]["tolerance"]["perturbations"] == len(perturbed)
    said = [w for w in res.report.get("warnings", []) if WARNS in w]
    assert bool(said) == warned, res.report.get("warnings")
    if warned:
        assert "tolerance.perturbations=3" in said[0]
