"""Full checks inside `ttrace scan`: its first steps (scan.full_steps) and phase 2.

The first steps: the scan's first `scan.full_steps` steps (default 2, a check's own) checked in full from
where the scan starts: every kind, every metric of a check, where the runs still share their
weights. The fingerprints of the per-step kinds cannot see a bug that shows only in activations
within their noise (`fp8_amax_unreduced`: each TP shard quantizing with its own scale), which a check
names at its first GEMM's output.

Phase 2: the first step out of the band, F, rerun in full tracing with the isolation
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


def rerun(p: PlannedCheck, first_local: int, start: int) -> tuple[str, list[dict[str, Any]]]:
    """Run phase 2 for the scan `p` whose first divergence is at local step `first_local`; writes
    p.report["scan"]["rerun"] and, when the rerun names one, the culprit and blame window. Returns
    the rerun's verdict and, on a failure, its per-tensor results."""
    save_steps, steps = rerun_plan(first_local)
    return check_steps(p, start, save_steps, steps, "rerun")


def check_first_steps(p: PlannedCheck, start: int, steps: int) -> tuple[str, list[dict[str, Any]]]:
    """The scan's first `steps` steps checked in full from its start (no saved state); writes
    p.report["scan"]["first_steps"] (and, on a failure, the culprit and blame window). Returns its
    verdict and, on a failure, its per-tensor results."""
    return check_steps(p, start, 0, steps, "first_steps")


def check_steps(p: PlannedCheck, start: int, save_steps: int, steps: int,
                key: str) -> tuple[str, list[dict[str, Any]]]:
    """A full check of `steps` steps after the reference trained `save_steps` (from the scan's start);
    its summary in p.report["scan"][key], its report in <scan>/<key>/. Returns its verdict and, on a
    failure, its per-tensor results (report.json's `tensors`)."""
    rec = copy.deepcopy(p.report["recipe"])   # the user's recipe, paths resolved
    out: dict[str, Any] = {"from_step": start + save_steps,
                           "steps": [start + save_steps + i for i in range(steps)]}
    p.report["scan"][key] = out
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
        res = run_checks([(rec, p.output_dir / key)], p.base_dir)[0]
    except TTraceError as e:
        out.update(verdict="error", error=str(e))
        return "error", []
    rep = res.report
    out.update(verdict=res.verdict, report=str(res.report_path), check_id=rep.get("check_id"))
    if res.verdict == "error":
        out["error"] = res.message
        return "error", []
    if res.verdict == "pass":
        if key == "rerun":
            out["note"] = ("the full check of these steps, started from the reference's state, passed: the "
                           "divergence the scan saw builds up over the candidate's own earlier steps (or "
                           "lies in what stats cannot show inside one step); no culprit from the rerun")
        return "pass", []
    fd = dict(rep["first_divergence"])
    fd["global_step"] = out["from_step"] + int(str(fd["name"]).split("/", 1)[0])
    out["first_divergence"] = fd
    out["failing"] = [t["name"] for t in rep["tensors"] if not t["ok"]
                      and str(t["name"]).split("/", 1)[0] == str(fd["name"]).split("/", 1)[0]]
    for k in COPIED:
        if k in rep:
            p.report[k] = rep[k]
    culprit = p.report.get("culprit")
    if isinstance(culprit, dict) and culprit.get("name"):
        # its name keeps the rerun's local step; `step` (what the summary prints) is the global one
        culprit["local_step"] = int(str(culprit["name"]).split("/", 1)[0])
        culprit["step"] = out["from_step"] + culprit["local_step"]
    return "fail", rep["tensors"]


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
