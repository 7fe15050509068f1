"""A check's state through the pipeline and its outcome: the report.json and report.html it
writes, its MLflow run, and the logs of its jobs."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator import cluster
from orchestrator.rank_logs import log_dir
from orchestrator.refcache import ReferenceSet
from orchestrator.report import tracking
from tracer.logical import LogicalTrace
from tracer.verdicts import Comparison
from workloads import bugs

EXIT = {"pass": 0, "fail": 1, "error": 2}
# The R the tolerance constants were calibrated with; a FAIL judged on fewer perturbed runs may be a
# false alarm (docs/tolerance.md, "Known gaps": a clean fp8 check fails at R = 2 and passes at 3).
CALIBRATED_PERTURBATIONS = 3


def verdict_warnings(rec: dict[str, Any], verdict: str) -> list[str]:
    """What may make a verdict of this recipe wrong: a FAIL on fewer perturbed runs than calibrated (a
    false alarm?), a catalog bug checked without the reference it needs (a PASS that cannot see it)."""
    out = []
    if verdict == "fail" and (r := int(rec["tolerance"]["perturbations"])) < CALIBRATED_PERTURBATIONS:
        out.append(f"judged on {r} perturbed reference runs, fewer than the {CALIBRATED_PERTURBATIONS} the "
                   f"tolerance is calibrated on: a clean run has failed that way (docs/tolerance.md, Known "
                   f"gaps); to rule a false alarm out, run the check again with "
                   f"tolerance.perturbations={CALIBRATED_PERTURBATIONS}")
    if (left_out := bugs.reference_left_out(rec)) is not None:
        out.append(left_out)
    return out


@dataclass
class CheckResult:
    verdict: str                  # pass | fail | error
    report_path: Path
    report: dict[str, Any]
    message: str = ""

    @property
    def exit_code(self) -> int:
        return EXIT[self.verdict]


@dataclass
class PlannedCheck:
    """One check on its way through the pipeline (orchestrator/check.py)."""
    rec: dict[str, Any]
    output_dir: Path
    check_id: str
    report: dict[str, Any]
    t_start: float
    candidate: cluster.Job | None = None
    store_url: str = ""
    refs: ReferenceSet | None = None
    error: str | None = None
    comparison: Comparison | None = None
    loaded: tuple[LogicalTrace, list[LogicalTrace]] | None = None   # reference, perturbed
    base_dir: str = ""


def keep_logs(p: PlannedCheck, jobs: list[cluster.Job]) -> None:
    """report["logs"]: every rank's log of the check's jobs, relative to the check directory (a rank on
    another node sent its text back with its result)."""
    logs = p.report.setdefault("logs", {})
    for job in jobs:
        paths = []
        for res in job.results:
            if res.get("warning"):
                p.report.setdefault("warnings", []).append(f"job '{job.name}': {res['warning']}")
            log = res.get("log") or {}
            path = Path(log["path"]) if log.get("path") else None
            if path is None and log.get("text") is not None:
                path = Path(log_dir(p.output_dir, job.name)["dir"]) / f"rank{res['rank']:05d}.log"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(log["text"])
            if path is not None:
                paths.append(os.path.relpath(path, p.output_dir.resolve()))
        if not paths:   # a failed job: whatever its ranks wrote before they stopped
            d = Path(log_dir(p.output_dir, job.name)["dir"])
            paths = [os.path.relpath(f, p.output_dir.resolve()) for f in sorted(d.glob("rank*.log"))]
        if paths:
            logs[job.name] = paths


def report_text(report: dict[str, Any]) -> str:
    """report.json's text: indented, each tensor's row on a line of its own. (Indenting every row's
    fields runs json's pure-Python encoder: 24 ms per write of the demo's 849 rows, against 11 ms
    with the rows encoded compactly, by its C encoder.)"""
    rows = report.get("tensors")
    if not rows:
        return json.dumps(report, indent=1, default=str)
    head = json.dumps({**report, "tensors": []}, indent=1, default=str)
    body = ",\n".join("  " + json.dumps(row, default=str) for row in rows)
    return head.replace('\n "tensors": []', '\n "tensors": [\n' + body + "\n ]", 1)


def finish(p: PlannedCheck, base_dir: str, parent_run_id: str | None,
           run_id: str | None = None) -> CheckResult:
    """Write the check's report (json, html) and log it to its MLflow run (`run_id`: opened while its
    jobs ran, tracking.OpenedRuns)."""
    timings, report = p.report["timings"], p.report
    if p.comparison is not None:
        verdict, message = p.comparison.verdict, ""
        if warnings := verdict_warnings(p.rec, verdict):
            report.setdefault("warnings", []).extend(warnings)
    else:
        verdict, message = "error", str(p.error)
        report.update(verdict="error", error=message, first_divergence=None, tensors=[])

    report_path = p.output_dir / "report.json"
    report_path.write_text(report_text(report))
    html_path = p.output_dir / "report.html"
    try:
        from orchestrator.report.html import write_html

        write_html(report, html_path)
    except Exception as e:  # a rendering bug must not hide the verdict
        report["html_error"] = f"{type(e).__name__}: {e}"
        html_path = None
    t0 = time.perf_counter()
    if p.rec.get("tracking", {}).get("enabled", False):
        try:
            report["mlflow_run_id"] = tracking.log_check(p.rec["tracking"], base_dir, report, report_path,
                                                         html_path=html_path, parent_run_id=parent_run_id,
                                                         run_id=run_id)
        except Exception as e:  # a tracking outage must not turn a verdict into a crash
            report["tracking_error"] = f"{type(e).__name__}: {e}"
    timings["tracking"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - p.t_start
    report_path.write_text(report_text(report))
    return CheckResult(verdict, report_path, report, message)
