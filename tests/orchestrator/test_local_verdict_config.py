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
def test_asked_for_where_it_cannot_judge_the_recipe_is_refused_and_auto_says_why_it_is_off(overrides, needle,
                                                                                         tmp_path):
    with pytest.raises(ConfigError, match="tolerance.local=on") as e:
        validate(compose(["parallel=tp2", "tolerance.local=on", *overrides]))
    assert needle in str(e.value)
    rec = compose(["parallel=tp2", *overrides])   # auto, the default: the recipe runs, unjudged locally
    validate(rec)
    p = PlannedCheck(rec, Path(tmp_path), "c", {}, 0.0)
    p.comparison = Comparison("pass")
    assert not wants_isolation(p) and needle in p.report["local"]["off"]


def test_bad_local_settings_are_refused():
    for bad, needle in (("tolerance.local=maybe", "use auto"), ("tolerance.k_local=0", "> 0"),
                        ("tolerance.k_local=-1", "> 0")):
        with pytest.raises(ConfigError, match=needle):
            validate(compose(["parallel=tp2", "precision=bf16", bad]))


def test_by_default_bf16_and_fp8_builtin_checks_are_judged_locally_and_an_unconfirmed_pass_is_an_error(
        tmp_path):
    def plan(*overrides: str) -> PlannedCheck:
        rec = compose(["parallel=tp2", *overrides])
        p = PlannedCheck(rec, Path(tmp_path), "c", {}, 0.0)
        p.comparison = Comparison("pass")
        return p

    assert not wants_isolation(plan())                       # fp32: a pass runs no isolation pass
    assert not wants_isolation(plan("precision=bf16", "tolerance.local=off"))
    for precision in ("bf16", "fp8"):                        # the default judges them: on every check
        assert wants_isolation(plan(f"precision={precision}"))
    user = plan("precision=bf16", "job.command=python train.py")
    assert not wants_isolation(user) and "built-in trainer" in user.report["local"]["off"]
    assert wants_isolation(plan("precision=bf16", "job.command=python train.py", "tolerance.local=on"))
    judged = plan("precision=bf16")
    _unjudged(judged, "the isolated job failed: rank 1 raised")
    assert judged.comparison is None and "could not run: the isolated job failed" in str(judged.error)
    failed = plan("precision=bf16")
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
