"""The local elementwise verdict's recipe rules (tolerance.k_local; tracer/local_verdict.py): where it
cannot be reached the recipe is refused before anything runs, and a pass it could not confirm is an
error, never a pass."""

from pathlib import Path

import pytest

from orchestrator.isolation_pass import _unjudged, wants_isolation
from orchestrator.outcome import PlannedCheck
from orchestrator.recipe import compose, validate
from tracer.errors import ConfigError
from tracer.verdicts import Comparison


@pytest.mark.parametrize("overrides, needle", [
    (["precision=fp32"], "not fp32"),
    (["precision=bf16", "localize=false"], "localize=false"),
    (["precision=bf16", "trace.mode=stats"], "trace.mode=stats"),
    (["precision=bf16", "trace.kinds=[param_grad]"], "trace.kinds"),
    (["precision=bf16", "reference.micro_batch=8"], "other microbatches"),
])
def test_a_recipe_the_local_verdict_cannot_judge_is_refused(overrides, needle):
    with pytest.raises(ConfigError, match="tolerance.k_local=6") as e:
        validate(compose(["parallel=tp2", "tolerance.k_local=6", *overrides]))
    assert needle in str(e.value)
    validate(compose(["parallel=tp2", *overrides]))   # the same recipe without it runs
    with pytest.raises(ConfigError, match=">= 0"):
        validate(compose(["parallel=tp2", "precision=bf16", "tolerance.k_local=-1"]))


def test_the_local_verdict_runs_the_isolation_pass_on_a_pass_and_an_unconfirmed_pass_is_an_error(tmp_path):
    def plan(*overrides: str) -> PlannedCheck:
        rec = compose(["parallel=tp2", "precision=bf16", *overrides])
        p = PlannedCheck(rec, Path(tmp_path), "c", {}, 0.0)
        p.comparison = Comparison("pass")
        return p

    assert not wants_isolation(plan())                       # a pass: no isolation pass by default
    asked = plan("tolerance.k_local=6")
    assert wants_isolation(asked)
    _unjudged(asked, "the isolated job failed: rank 1 raised")
    assert asked.comparison is None and "could not run: the isolated job failed" in str(asked.error)
    failed = plan("tolerance.k_local=6")
    failed.comparison = Comparison("fail")
    _unjudged(failed, "x")
    assert failed.comparison.verdict == "fail" and failed.error is None   # a FAIL stands


def test_a_silent_fault_reaches_the_candidate_and_its_isolation_pass_never_the_references():
    """fault.kind=scale_grad_element (workloads/faults.py) stands for a bug in the candidate's code,
    which its isolation pass runs too; a crash fault stays the candidate's; a reference never gets one."""
    from orchestrator.recipe import job_spec
    from workloads.config import validate as validate_spec

    silent = compose(["parallel=tp2", "precision=bf16", "fault.kind=scale_grad_element", "fault.scale=0.1"])
    got = {role: job_spec(silent, role=role, store_url="/tmp/s")["fault"]
           for role in ("reference", "perturbed", "candidate", "isolated")}
    assert got["reference"] is None and got["perturbed"] is None
    assert got["candidate"] == got["isolated"] and got["isolated"]["scale"] == 0.1
    crash = compose(["parallel=tp2", "fault.kind=raise"])
    assert job_spec(crash, role="isolated", store_url="/tmp/s")["fault"] is None
    assert job_spec(crash, role="candidate", store_url="/tmp/s")["fault"]["kind"] == "raise"
    with pytest.raises(ConfigError, match="fault.scale=-1.5"):
        validate_spec(job_spec(compose(["parallel=tp2", "fault.kind=scale_grad_element", "fault.scale=-1.5"]),
                               role="candidate", store_url="/tmp/s"))
