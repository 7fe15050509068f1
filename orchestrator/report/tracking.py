"""MLflow logging of one check: recipe as params, per-tensor divergence as metrics, report as artifact."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from orchestrator.forked_rank import pid_alive

BATCH = 900  # MLflow accepts at most 1000 metrics per log_batch call
DRIVER_TAG = "ttrace.driver"   # host:pid of the process that opened a run (orphans: _end_orphans)


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


class OpenedRuns:
    """Each tracked check's MLflow run, opened (RUNNING, with its recipe as params) on a background
    thread while the jobs run: the MLflow UI shows a check, or a sweep's checks, from their start,
    and the thread takes MLflow's import and store opening (2-15 s on a fresh process) off the
    check's wall time. It first ends the runs that dead drivers left RUNNING (_end_orphans).
    `log_check` finishes a run opened here; a failure here only leaves `log_check` to open the run
    itself (and report what fails). As a context manager: runs still RUNNING when the block raises
    (Ctrl-C, a crash) end KILLED."""

    def __init__(self, checks: list[tuple[dict[str, Any], dict[str, Any]]], base_dir: str,
                 parent_run_id: str | None = None):
        self._checks, self._base_dir, self._parent = checks, base_dir, parent_run_id
        self._cfg = {report["check_id"]: cfg for cfg, report in checks}
        self._ids: dict[str, str] = {}   # check_id -> run id
        self._thread: threading.Thread | None = None

    def start(self) -> OpenedRuns:
        """Open the runs on the background thread (nothing to do without tracked checks)."""
        if self._checks and self._thread is None:
            self._thread = threading.Thread(target=self._open, name="ttrace-mlflow-open", daemon=True)
            self._thread.start()
        return self

    def join(self) -> dict[str, str]:
        """check_id -> run id of every run opened."""
        if self._thread is not None:
            self._thread.join()
        return self._ids

    def end_running(self, status: str) -> None:
        """End every opened run still RUNNING with `status` (its check stopped before its verdict)."""
        for check_id, run_id in self.join().items():
            with contextlib.suppress(Exception):
                client, _ = _client(self._cfg[check_id], self._base_dir)
                if client.get_run(run_id).info.status == "RUNNING":
                    client.set_terminated(run_id, status=status)

    def __enter__(self) -> OpenedRuns:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.end_running("KILLED")

    def _open(self) -> None:
        with contextlib.suppress(Exception):
            stores: dict[tuple[str, str], tuple[Any, str]] = {}   # (uri, experiment) -> client, exp id
            for cfg, report in self._checks:
                key = (cfg["uri"], cfg["experiment"])
                if key not in stores:
                    stores[key] = _client(cfg, self._base_dir)
                    _end_orphans(*stores[key])
                self._ids[report["check_id"]] = _open_run(*stores[key], report, self._parent)


def _driver() -> str:
    """This process as DRIVER_TAG names it: host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _end_orphans(client: Any, exp_id: str) -> int:
    """End KILLED the RUNNING runs opened on this host by a driver that is gone (killed with SIGKILL,
    or its machine rebooted): MLflow would show them running forever. Runs of live drivers, and of
    other hosts, are left alone. Returns how many were ended."""
    host = socket.gethostname()
    ended = 0
    for run in client.search_runs([exp_id], filter_string="attributes.status = 'RUNNING'", max_results=1000):
        driver = run.data.tags.get(DRIVER_TAG, "")
        who, _, pid = driver.rpartition(":")
        if who != host or not pid.isdigit() or pid_alive(int(pid)):
            continue
        client.set_tag(run.info.run_id, "ttrace.ended", f"its driver ({driver}) was gone when a later check "
                                                       "started")
        client.set_terminated(run.info.run_id, status="KILLED")
        ended += 1
    return ended


def _client(cfg: dict[str, Any], base_dir: str) -> tuple[Any, str]:
    import mlflow

    uri = _tracking_uri(cfg["uri"], base_dir)
    mlflow.set_tracking_uri(uri)
    with _sqlite_lock(uri):
        client = mlflow.MlflowClient()   # connecting creates or migrates the schema
        exp = client.get_experiment_by_name(cfg["experiment"])
        if exp is None:
            root = Path(base_dir, cfg.get("artifact_root") or "mlartifacts").resolve()
            return client, client.create_experiment(cfg["experiment"], artifact_location=root.as_uri())
        return client, exp.experiment_id


@contextlib.contextmanager
def _sqlite_lock(uri: str) -> Iterator[None]:
    """Serialize, across processes, the first use of a local sqlite MLflow database: two sweeps
    that create a fresh database at once race on its schema ("table experiments already exists",
    "duplicate column name: step") and on the experiment, and one of them loses its MLflow runs
    (tests/orchestrator/test_tracking.py). The lock is a file next to the database."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        yield
        return
    with open(uri[len(prefix):] + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def start_parent(cfg: dict[str, Any], base_dir: str, name: str, tags: dict[str, str]) -> str:
    """A parent run (nightly, sweep) that checks are logged under as children; returns its id."""
    client, exp_id = _client(cfg, base_dir)
    return client.create_run(exp_id, run_name=name, tags={**tags, DRIVER_TAG: _driver()}).info.run_id


def end_parent(cfg: dict[str, Any], base_dir: str, run_id: str, metrics: dict[str, float],
               artifacts: list[Path], ok: bool) -> None:
    from mlflow.entities import Metric

    client, _ = _client(cfg, base_dir)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])
    for path in artifacts:
        client.log_artifact(run_id, str(path))
    client.set_terminated(run_id, status="FINISHED" if ok else "FAILED")


def module_metrics(tensors: list[dict[str, Any]]) -> dict[str, float]:
    """Per (module type, kind) maxima: comparable side by side across a sweep in MLflow's run
    comparison, and a bounded count (module types x kinds) whatever the model's depth."""
    out: dict[str, float] = {}
    for t in tensors:
        group = f"{t.get('module_type') or 'model'}/{t['kind']}"
        ratio = t["rel_err"] / t["tolerance"] if t["tolerance"] > 0 else 0.0
        for name, val in ((f"rel_err/{group}", t["rel_err"]), (f"err_over_tol/{group}", ratio)):
            out[name] = max(out.get(name, 0.0), min(float(val), 1e300))
    return out


def _open_run(client: Any, exp_id: str, report: dict[str, Any], parent_run_id: str | None) -> str:
    """A check's run, RUNNING, named after its job and layout, with the recipe as params."""
    from mlflow.entities import Param

    rec = report["recipe"]
    job = (report.get("job") or {}).get("label", "builtin")
    tags = {"check_id": report["check_id"], "job": str(job)[:5000], "parallel": rec["parallel"]["name"],
            "bug": rec["bug"]["name"], DRIVER_TAG: _driver()}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    name = f"{rec['parallel']['name']}/{rec['bug']['name']}"
    run = client.create_run(exp_id, run_name=name if job == "builtin" else f"{job[:60]}/{name}", tags=tags)
    params = {k: v[:6000] for k, v in _flatten({k: v for k, v in rec.items() if k != "tracking"}).items()}
    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in params.items()])
    return run.info.run_id


def log_check(cfg: dict[str, Any], base_dir: str, report: dict[str, Any], report_path: Path,
              html_path: Path | None = None, parent_run_id: str | None = None,
              run_id: str | None = None) -> str:
    """Log the check into its MLflow run (`run_id`: opened by OpenedRuns; else opened here) and end
    it (report_path is already written); returns the run id."""
    from mlflow.entities import Metric, RunTag

    client, exp_id = _client(cfg, base_dir)
    if run_id is None:
        run_id = _open_run(client, exp_id, report, parent_run_id)
    fd = report.get("first_divergence") or {}
    tags = {"verdict": report["verdict"], "first_divergence.name": fd.get("name", ""),
            "first_divergence.module": fd.get("module", ""), "first_divergence.kind": fd.get("kind", "")}
    culprit, window = report.get("culprit") or {}, report.get("blame_window") or {}
    if culprit:
        tags.update({"culprit.module": culprit["module"], "culprit.kind": culprit["kind"],
                     "culprit.resolved": str(culprit.get("resolved")), "origin": report.get("origin", ""),
                     "blame_window": str(window.get("size", ""))})
    if report.get("error"):
        tags["error"] = report["error"][:5000]
    local = report.get("local") or {}
    if local:   # the local verdict (tracer/local_verdict.py): judged, or why not
        tags["local"] = f"off: {local['off']}"[:5000] if "off" in local else "judged"
    if report.get("reference"):
        tags["reference.cache"] = report["reference"].get("cache", "")
        tags["reference.key"] = report["reference"].get("key", "")
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
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
    metrics += [Metric(k, v, now, 0) for k, v in module_metrics(tensors).items()]
    if "judged" in local:
        worst = (local.get("worst") or {}).get("local_err", 0.0)
        along = abs((local.get("worst_scale") or {}).get("local_scale", 0.0))
        metrics += [Metric(k, min(float(v), 1e300), now, 0) for k, v in (
            ("local.judged", local["judged"]), ("local.failed", local["failed"]), ("local.worst", worst),
            ("local.worst_scale", along))]
    for key, val in report.get("timings", {}).items():
        if isinstance(val, (int, float)):
            metrics.append(Metric(f"seconds.{key}", float(val), now, 0))
    from orchestrator.report.scan_report import metrics as scan_metrics

    metrics += [Metric(k, min(v, 1e300), now, step) for k, v, step in scan_metrics(report)]   # ttrace scan
    for i in range(0, len(metrics), BATCH):
        client.log_batch(run_id, metrics=metrics[i:i + BATCH])
    client.log_artifact(run_id, str(report_path))
    if html_path is not None and html_path.exists():
        client.log_artifact(run_id, str(html_path))
    client.set_terminated(run_id, status="FINISHED" if report["verdict"] != "error" else "FAILED")
    return run_id
