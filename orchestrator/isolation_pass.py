"""The isolation pass of failed checks (`localize: true`): each candidate rerun with every module fed
the reference's tensors (tracer/isolation.py), all on the cluster together; its comparison names the
culprit and the blame window. A failure here leaves the verdict standing."""

from __future__ import annotations

import time

from orchestrator import cluster, recipe
from orchestrator.outcome import PlannedCheck, keep_logs
from orchestrator.progress import JobProgress
from orchestrator.rank_logs import log_dir
from tracer.compare import compare
from tracer.errors import TTraceError
from tracer.isolation import name_culprit
from tracer.logical import load_logical
from tracer.tolerance import TolerancePolicy


def wants_isolation(p: PlannedCheck) -> bool:
    """`localize: true` (default): on a failed check; `always`: also on a pass (a self-check of the
    isolation pass, which must then flag nothing); `false`: never."""
    mode = p.rec.get("localize", True)
    assert p.comparison is not None
    wanted = mode == "always" or (mode is True and p.comparison.verdict == "fail")
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
    """Isolation pass for failed checks (`localize: true`, the default): rerun each candidate with
    every module fed the reference's tensors (tracer/isolation.py), all on the cluster together, and
    add `culprit` and `blame_window` to the report. A failure here leaves the verdict standing."""
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
            local = compare(reference, isolated, perturbed, policy)
            if p.comparison.verdict == "fail":
                p.report.update(name_culprit(p.comparison, local))
            p.report["isolation"] = {"flagged": sum(not r.ok for r in local.results), "run": "isolated",
                                     "job_s": job.seconds, "jobs_wall": wall,
                                     "compare_s": time.perf_counter() - t1,
                                     "local": {r.name: [r.rel_err, r.elem_err] for r in local.results
                                               if not r.ok}}
        except TTraceError as e:
            p.report["localization_error"] = f"isolation pass failed (the verdict stands): {e}"
        finally:
            p.loaded = None
