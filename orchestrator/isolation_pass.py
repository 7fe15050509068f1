"""The isolation pass (`localize: true`): each candidate rerun with every module fed the reference's
tensors (tracer/isolation.py), all on the cluster together. On a failed check its comparison names
the culprit and the blame window, and a failure here leaves the verdict standing. Where the local
verdict judges (tolerance.local, tracer/local_verdict.py: by default bf16 and fp8 checks of the
built-in trainer) it runs on every check and is part of the verdict: a pass it could not confirm is
an error."""

from __future__ import annotations

import time
from typing import Any

from orchestrator import cluster, compare_tasks, recipe, routing
from orchestrator.outcome import PlannedCheck, keep_logs
from orchestrator.progress import JobProgress
from orchestrator.rank_logs import log_dir
from tracer.compare import compare
from tracer.errors import TTraceError
from tracer.isolation import name_culprit
from tracer.local_verdict import K_LOCAL_SCALE, k_local, local_errors, local_mode, reason, summary, why_not
from tracer.logical import load_logical
from tracer.tolerance import TolerancePolicy
from tracer.verdicts import Comparison


def judges_locally(p: PlannedCheck) -> bool:
    """Does the local verdict judge this check (tracer.local_verdict.why_not)? Where it does not, the
    report says why (`local.off`)."""
    why = why_not(p.rec, recipe.microbatches_differ(p.rec), routing.builtin(p.rec))
    if why:
        p.report["local"] = {"mode": local_mode(p.rec), "off": why}
    return why is None


def wants_isolation(p: PlannedCheck) -> bool:
    """`localize: true` (default): on a failed check; `always`: also on a pass (a self-check of the
    isolation pass, which must then flag nothing); `false`: never. Where the local verdict judges
    (judges_locally): on every check."""
    mode = p.rec.get("localize", True)
    assert p.comparison is not None
    wanted = (mode == "always" or judges_locally(p)
              or (mode is True and p.comparison.verdict == "fail"))
    if wanted and ((p.rec.get("trace") or {}).get("mode") or "full") == "stats":
        p.report["localization_error"] = ("no isolation pass: trace.mode=stats stores no tensor values to "
                                          "feed the isolated run; rerun with trace.mode=full to name the "
                                          "culprit")
        return False
    kinds = (p.rec.get("trace") or {}).get("kinds")
    if wanted and kinds is not None and not {"output", "grad_output"} <= set(kinds):
        p.report["localization_error"] = (f"no isolation pass: trace.kinds={kinds} leaves out module outputs "
                                          "or their grads, which the isolated run is fed; trace every kind "
                                          "to name the culprit")
        return False
    if wanted and recipe.microbatches_differ(p.rec):
        p.report["localization_error"] = ("no isolation pass: the reference's microbatches are not the "
                                          "candidate's, so its module tensors cannot be fed to them")
        return False
    return wanted


def isolate(plans: list[PlannedCheck], progress: bool = False) -> None:
    """Isolation pass (wants_isolation): rerun each candidate with every module fed the reference's
    tensors (tracer/isolation.py), all on the cluster together; on a failed check add `culprit` and
    `blame_window` to the report, and where the local verdict judges, judge there (judge_locally).
    A failure here leaves a verdict standing, except a pass the local verdict was to confirm: that
    becomes an error (_unjudged)."""
    jobs = []
    for p in plans:
        assert p.refs is not None and p.candidate is not None
        spec = recipe.job_spec(p.rec, role="isolated", store_url=p.store_url,
                               reference=f"{p.refs.url}/reference", base_dir=p.base_dir,
                               log=log_dir(p.output_dir, "isolated"))
        jobs.append(cluster.Job("isolated", spec, p.candidate.world_size, label=p.check_id,
                                timeout_s=float(p.rec["timeout_s"]), error_dir=p.output_dir / "errors"))
    if not jobs:
        return
    t0 = time.perf_counter()
    try:
        with JobProgress(progress) as on_change:
            cluster.run_jobs(jobs, cpus_per_rank=max(float(p.rec["cluster"]["cpus_per_rank"]) for p in plans),
                             timeout_s=max(float(p.rec["timeout_s"]) for p in plans),
                             error_dir=plans[0].output_dir / "errors", on_change=on_change)
    except TTraceError as e:
        for p in plans:
            p.report["localization_error"] = str(e)
            _unjudged(p, str(e))
        return
    wall = time.perf_counter() - t0
    for p, job in zip(plans, jobs, strict=True):
        assert p.comparison is not None and p.loaded is not None
        try:
            keep_logs(p, [job])
            if job.error:
                raise TTraceError(job.error)
            t1 = time.perf_counter()
            isolated = load_logical(p.store_url, "isolated", job.world_size, lazy=True)
            reference, perturbed = p.loaded
            policy = TolerancePolicy.from_config(p.rec["tolerance"])
            assert p.refs is not None   # a compared check has its reference set
            shared = compare_tasks.against_references(p.rec, p.refs, p.store_url, "isolated", job.world_size,
                                                      policy.k_elem)
            local = compare(reference, isolated, perturbed, policy, measurer=shared)
            if judges_locally(p):
                judge_locally(p, reference, isolated)
            if p.comparison.verdict == "fail":
                p.report.update(name_culprit(p.comparison, local))
            p.report["isolation"] = {"flagged": sum(not r.ok for r in local.results), "run": "isolated",
                                     "job_s": job.seconds, "jobs_wall": wall,
                                     "compare_s": time.perf_counter() - t1,
                                     "local": {r.name: [r.rel_err, r.elem_err] for r in local.results
                                               if not r.ok}}
            if shared is not None:
                p.report["isolation"]["compare_workers"] = compare_tasks.workers_of(p.rec)
        except TTraceError as e:
            p.report["localization_error"] = f"isolation pass failed (the verdict stands): {e}"
            _unjudged(p, str(e))
        finally:
            p.loaded = None


def judge_locally(p: PlannedCheck, reference: Any, isolated: Any) -> None:
    """The local verdict (tracer/local_verdict.py) joins the check's: a tensor past k_local or moved
    along itself past K_LOCAL_SCALE fails, and the first failing tensor in execution order is the
    first divergence."""
    assert p.comparison is not None
    k = k_local(p.rec)
    errs = local_errors(reference, isolated, p.rec["precision"]["name"])
    by_name = {r.name: r for r in p.comparison.results}
    for name, err in errs.items():
        r = by_name.get(name)
        if r is None:
            continue
        r.local_err, r.local_scale, r.local_tolerance = err.elem, err.scale, k
        if not err.ok(k) and r.ok:
            r.ok, r.reason = False, reason(err, k)
    bad = [r for r in p.comparison.results if not r.ok]
    if bad:
        p.comparison = Comparison("fail", p.comparison.results, min(bad, key=lambda r: r.index))
    p.report.update(p.comparison.to_json())
    p.report["local"] = {"mode": local_mode(p.rec), "k_local": k, "k_local_scale": K_LOCAL_SCALE,
                         **summary(errs, k)}


def _unjudged(p: PlannedCheck, why: str) -> None:
    """A check the local verdict judges whose isolation pass did not run is an error, never a pass on
    partial judgement; a check that failed already keeps its verdict."""
    if p.comparison is not None and p.comparison.verdict == "pass" and judges_locally(p):
        p.error = (f"the local verdict (tolerance.local) could not run: {why}; rerun, or set "
                   "tolerance.local=off to judge without it")
        p.comparison = None
