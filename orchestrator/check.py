"""One check: reference + perturbed references + candidate on Ray, then compare, report, log."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator import cluster, recipe, tracking
from tracer.compare import compare, load_logical
from tracer.errors import TTraceError
from tracer.tolerance import TolerancePolicy

EXIT = {"pass": 0, "fail": 1, "error": 2}


@dataclass
class CheckResult:
    verdict: str                  # pass | fail | error
    report_path: Path
    report: dict[str, Any]
    message: str = ""

    @property
    def exit_code(self) -> int:
        return EXIT[self.verdict]


def run_check(rec: dict[str, Any], output_dir: Path, base_dir: str) -> CheckResult:
    """Run one check end to end. Every failure becomes verdict 'error' with a message, never a pass."""
    t_start = time.perf_counter()
    timings: dict[str, Any] = {}
    check_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    report: dict[str, Any] = {"check_id": check_id, "recipe": rec, "timings": timings}
    output_dir.mkdir(parents=True, exist_ok=True)
    try:
        recipe.validate(rec)
        store_root = recipe.resolve_url(rec["store"]["url"], base_dir)
        store_url = f"{store_root.rstrip('/')}/{check_id}"
        report["store"] = store_url
        timings["ray_start"] = cluster.ensure_ray(rec["cluster"])

        jobs = _plan_jobs(rec, store_url)
        t0 = time.perf_counter()
        cluster.run_jobs(jobs, cpus_per_rank=float(rec["cluster"]["cpus_per_rank"]),
                         timeout_s=float(rec["timeout_s"]), error_dir=output_dir / "errors")
        timings["jobs_wall"] = time.perf_counter() - t0
        timings["jobs"] = {j.name: j.seconds for j in jobs}
        failed = [j.error for j in jobs if j.error]
        if failed:
            raise TTraceError("; ".join(failed))

        t0 = time.perf_counter()
        by_name = {j.name: load_logical(store_url, j.name, j.world_size) for j in jobs}
        perturbed = [by_name[j.name] for j in jobs if j.name.startswith("perturbed")]
        tol = rec["tolerance"]
        comparison = compare(by_name["reference"], by_name["candidate"], perturbed,
                             TolerancePolicy(k=float(tol["k"]), floor_ulps=float(tol["floor_ulps"])))
        timings["compare"] = time.perf_counter() - t0
        report.update(comparison.to_json())
        verdict, message = comparison.verdict, ""
    except TTraceError as e:
        verdict, message = "error", str(e)
        report.update(verdict="error", error=message, first_divergence=None, tensors=[])

    report_path = output_dir / "report.json"
    report_path.write_text(json.dumps(report, indent=1, default=str))
    t0 = time.perf_counter()
    if rec.get("tracking", {}).get("enabled", False):
        try:
            report["mlflow_run_id"] = tracking.log_check(rec["tracking"], base_dir, report, report_path)
        except Exception as e:  # a tracking outage must not turn a verdict into a crash
            report["tracking_error"] = f"{type(e).__name__}: {e}"
    timings["tracking"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_start
    report_path.write_text(json.dumps(report, indent=1, default=str))
    return CheckResult(verdict, report_path, report, message)


def _plan_jobs(rec: dict[str, Any], store_url: str) -> list[cluster.Job]:
    ref = dict(parallel=recipe.SINGLE_DEVICE, bug="none")
    jobs = [cluster.Job("reference", recipe.job_spec(rec, run="reference", store_url=store_url, **ref), 1)]
    for i in range(int(rec["tolerance"]["perturbations"])):
        name = f"perturbed-{i}"
        jobs.append(cluster.Job(name, recipe.job_spec(rec, run=name, store_url=store_url,
                                                      perturb_seed=i + 1, **ref), 1))
    world = int(rec["parallel"]["world_size"])
    jobs.append(cluster.Job("candidate", recipe.job_spec(rec, run="candidate", store_url=store_url), world))
    return jobs
