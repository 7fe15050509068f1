"""MLflow logging of one check: recipe as params, per-tensor divergence as metrics, report as artifact."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

BATCH = 900  # MLflow accepts at most 1000 metrics per log_batch call


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = str(v)
    return out


def _tracking_uri(uri: str, base_dir: str) -> str:
    """sqlite:///relative.db is taken from the directory ttrace was started in."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + os.path.join(base_dir, uri[len(prefix):])
    return uri


def log_check(cfg: dict[str, Any], base_dir: str, report: dict[str, Any], report_path: Path) -> str:
    """Log the check as one MLflow run (report_path is already written); returns its run id."""
    import mlflow
    from mlflow.entities import Metric

    mlflow.set_tracking_uri(_tracking_uri(cfg["uri"], base_dir))
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(cfg["experiment"])
    if exp is None:
        root = Path(base_dir, cfg.get("artifact_root") or "mlartifacts").resolve()
        exp_id = client.create_experiment(cfg["experiment"], artifact_location=root.as_uri())
    else:
        exp_id = exp.experiment_id
    rec = report["recipe"]
    fd = report.get("first_divergence") or {}
    tags = {"verdict": report["verdict"], "check_id": report["check_id"],
            "parallel": rec["parallel"]["name"], "bug": rec["bug"]["name"],
            "first_divergence.name": fd.get("name", ""), "first_divergence.module": fd.get("module", ""),
            "first_divergence.kind": fd.get("kind", "")}
    if report.get("error"):
        tags["error"] = report["error"][:5000]
    run = client.create_run(exp_id, run_name=f"{rec['parallel']['name']}/{rec['bug']['name']}", tags=tags)
    run_id = run.info.run_id
    params = {k: v[:6000] for k, v in _flatten({k: v for k, v in rec.items() if k != "tracking"}).items()}
    from mlflow.entities import Param

    client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
    now = int(time.time() * 1000)
    metrics = []
    for t in report.get("tensors", []):
        # step = execution index: the UI's chart of rel_err against tolerance is the divergence profile.
        metrics.append(Metric("rel_err", min(t["rel_err"], 1e300), now, t["index"]))
        metrics.append(Metric("tolerance", t["tolerance"], now, t["index"]))
    tensors = report.get("tensors", [])
    if tensors:
        metrics.append(Metric("divergent_tensors", sum(not t["ok"] for t in tensors), now, 0))
        metrics.append(Metric("max_err_over_tolerance",
                              max(t["rel_err"] / t["tolerance"] for t in tensors), now, 0))
    for key, val in report.get("timings", {}).items():
        if isinstance(val, (int, float)):
            metrics.append(Metric(f"seconds.{key}", float(val), now, 0))
    for i in range(0, len(metrics), BATCH):
        client.log_batch(run_id, metrics=metrics[i:i + BATCH])
    client.log_artifact(run_id, str(report_path))
    client.set_terminated(run_id, status="FINISHED" if report["verdict"] != "error" else "FAILED")
    return run_id
