"""Phase 2 of `ttrace scan`: the first step out of the band, F, rerun in full tracing with the isolation
pass, from the reference's state before it. The reference alone trains F-1 steps and saves its state
(checkpoint.save, a single-device job: O(F) compute, one checkpoint on disk whatever N), then a full
check starts every run from it (init.checkpoint) for 2 steps, F-1 and F: a bug that needs the last
step's state (a stale grad bucket) acts again at F. A bug keyed on the training step sees the global
step (workloads/harness.py RankJob.global_step). F <= 1 needs no checkpoint: the check runs steps
0..F from the recipe's start. The rerun's verdict, culprit and blame window join the scan's report;
its own report sits in <scan>/rerun/. A failure here leaves the scan's verdict standing."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from orchestrator import cluster, layouts, recipe
from orchestrator.check import run_checks
from orchestrator.outcome import PlannedCheck, keep_logs
from orchestrator.rank_logs import log_dir
from tracer.errors import TTraceError
from tracer.fingerprint_log import SCAN_MODE

COPIED = ("culprit", "blame_window", "origin", "flagged", "flagged_modules", "isolation",
          "localization_error")


def rerun_plan(first_local: int) -> tuple[int, int]:
    """(steps the reference trains before saving its state, steps the full check runs): the saved state
    is the one before step F-1 (none when F <= 1: the check starts where the scan did)."""
    if first_local <= 1:
        return 0, max(1, first_local + 1)
    return first_local - 1, 2


def rerun(p: PlannedCheck, first_local: int, start: int) -> None:
    """Run phase 2 for the scan `p` whose first divergence is at local step `first_local`; writes
    p.report["scan"]["rerun"] and, when the rerun names one, the culprit and blame window."""
    rec = copy.deepcopy(p.report["recipe"])   # the user's recipe, paths resolved
    save_steps, steps = rerun_plan(first_local)
    out = {"from_step": start + save_steps, "steps": [start + save_steps + i for i in range(steps)]}
    p.report["scan"]["rerun"] = out
    try:
        if save_steps:
            state = p.output_dir / f"state-step{start + save_steps}"
            _save_state(p, rec, save_steps, state)
            rec["init"] = {**(rec.get("init") or {}), "checkpoint": str(state)}
            out["checkpoint"] = str(state)
        rec["steps"] = steps
        rec["trace"] = {**(rec.get("trace") or {}), "mode": "full", "kinds": None}
        rec["tracking"] = {**rec["tracking"], "enabled": False}   # the scan's MLflow run holds it
        rec["localize"] = rec.get("localize", True)
        res = run_checks([(rec, p.output_dir / "rerun")], p.base_dir)[0]
    except TTraceError as e:
        out.update(verdict="error", error=str(e))
        return
    rep = res.report
    out.update(verdict=res.verdict, report=str(res.report_path), check_id=rep.get("check_id"))
    if res.verdict == "error":
        out["error"] = res.message
        return
    if res.verdict == "pass":
        out["note"] = ("the full check of these steps, started from the reference's state, passed: the "
                       "divergence the scan saw builds up over the candidate's own earlier steps (or "
                       "lies in what stats cannot show inside one step); no culprit from the rerun")
        return
    fd = dict(rep["first_divergence"])
    fd["global_step"] = out["from_step"] + int(str(fd["name"]).split("/", 1)[0])
    out["first_divergence"] = fd
    for key in COPIED:
        if key in rep:
            p.report[key] = rep[key]
    culprit = p.report.get("culprit")
    if isinstance(culprit, dict) and culprit.get("name"):
        # its name keeps the rerun's local step; `step` (what the summary prints) is the global one
        culprit["local_step"] = int(str(culprit["name"]).split("/", 1)[0])
        culprit["step"] = out["from_step"] + culprit["local_step"]


def _save_state(p: PlannedCheck, rec: dict[str, Any], steps: int, state: Path) -> None:
    """The reference alone trains `steps` steps and writes its state to `state` (checkpoint.save)."""
    layout = layouts.reference_layout(rec)
    if int(layout["world_size"]) != 1:
        raise TTraceError(f"the rerun starts from the reference's state, which a reference on several ranks "
                          f"(reference.parallel={layout['name']}) cannot save yet; scan with "
                          "reference.parallel=null to get the rerun")
    job_rec = {**rec, "steps": steps, "checkpoint": {"save": str(state)},
               "trace": {**(rec.get("trace") or {}), "mode": SCAN_MODE, "kinds": ["loss"]}}
    spec = recipe.job_spec(job_rec, role="reference", store_url=f"{p.store_url}/rerun-state", parallel=layout,
                           base_dir=p.base_dir, log=log_dir(p.output_dir, "state"))
    job = cluster.Job("state", spec, 1, label=p.check_id, timeout_s=float(rec["timeout_s"]),
                      error_dir=p.output_dir / "errors")
    cluster.run_jobs([job], cpus_per_rank=float(rec["cluster"]["cpus_per_rank"]),
                     timeout_s=float(rec["timeout_s"]), error_dir=p.output_dir / "errors")
    keep_logs(p, [job])
    if job.error:
        raise TTraceError(f"the reference could not save its state at step {steps}: {job.error}")
