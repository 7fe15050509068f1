"""Faults not covered elsewhere: the S3 endpoint going away while ranks write, and two sweeps writing
to one store at once. Each must end in a clear verdict or error, never a pass, with its reports kept.
(raise/exit/hang/nan_grad, damaged traces, unreachable S3 and bad recipes: test_checks.py,
test_store_compare.py, test_sweeps_cache_s3_nightly.py; the whole suite: `make bench-faults`.)"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from orchestrator.cluster import rank_worker_pids
from orchestrator.console import report_paths

SMALL = ["parallel=tp2", "model.layers=2", "tolerance.perturbations=2"]


def _ttrace(cwd: Path, *overrides: str) -> subprocess.Popen:
    flags = [o for o in overrides if o.startswith("-")]   # Hydra wants --multirun before the overrides
    rest = [o for o in overrides if not o.startswith("-")]
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *flags, *SMALL, *rest], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)




def test_s3_endpoint_going_away_mid_write_is_an_error_not_a_pass(ray_cluster, workdir):
    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    s3fs.S3FileSystem(endpoint_url=url).mkdir("ttrace-gone")
    proc = _ttrace(workdir, "store=s3", "store.url=s3://ttrace-gone/runs", f"store.endpoint_url={url}",
                   "store.connect_timeout=2", "store.read_timeout=5", "store.max_attempts=2",
                   f"cluster.address={ray_cluster}")
    deadline = time.monotonic() + 120
    while proc.poll() is None and not rank_worker_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    server.stop()   # the endpoint disappears while the jobs run and write their traces
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 2, out[-2000:] + err[-3000:]
    (report,) = report_paths(out, workdir)
    rep = json.loads(report.read_text())
    assert rep["verdict"] == "error" and rep["error"], rep.get("error")


def test_two_sweeps_on_one_store_both_get_correct_verdicts(ray_cluster, workdir):
    """Same store, same MLflow db, same (uncached) reference key, started together: both sweeps
    compute or reuse the references safely and report pass for the clean run, fail for the bug.
    (Sweep b is the clean check alone: it races sweep a for the clean reference's key.)"""
    store = workdir / "store"
    args = [f"store.url={store}", "localize=false", f"cluster.address={ray_cluster}",
            f"tracking.uri=sqlite:///{workdir}/mlflow.db"]
    sweeps = {"a": "bug=none,row_parallel_bias_per_rank", "b": "bug=none"}
    dirs = [workdir / "a", workdir / "b"]   # two working dirs (Hydra output dirs), one store, one MLflow db
    for d in dirs:
        d.mkdir()
    procs = [_ttrace(d, "-m", sweeps[d.name], *args) for d in dirs]
    outs: dict[int, tuple[str, str]] = {}
    threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, procs[i].communicate(timeout=600)))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    logged = {r.info.run_id for r in mlflow.search_runs(search_all_experiments=True, output_format="list")}
    for i, d in enumerate(dirs):
        out, err = outs[i]
        assert procs[i].returncode == (1 if d.name == "a" else 0), out[-2000:] + err[-3000:]
        reps = [json.loads(p.read_text()) for p in report_paths(out, d)]
        want = [("none", "pass"), ("row_parallel_bias_per_rank", "fail")][: 2 if d.name == "a" else 1]
        assert sorted((r["recipe"]["bug"]["name"], r["verdict"]) for r in reps) == want
        assert all(r["mlflow_run_id"] in logged for r in reps)


_FIRST_LOG = """
import sys, time
from orchestrator.report import tracking
import mlflow  # noqa: F401 - imported before the start line, so all processes connect together
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
client, exp = tracking._client({"uri": "sqlite:///mlflow.db", "experiment": "ttrace"}, sys.argv[2])
print(exp)
"""


def test_processes_creating_one_mlflow_database_at_once_all_log(tmp_path):
    """Three checks' first MLflow calls on a fresh sqlite database at the same moment: without the
    lock in orchestrator.report.tracking, their schema migrations collide ("table experiments already
    exists", "duplicate column name: step") and the losers' runs are lost (seen in the two-sweeps
    test). All must succeed, in one experiment."""
    start = time.time() + 6.0
    procs = [subprocess.Popen([sys.executable, "-c", _FIRST_LOG, str(start), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1
