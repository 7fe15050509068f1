"""A check's MLflow run: opened (RUNNING, recipe as params) while its jobs run, finished by its report,
and ended KILLED if the checks stop before their verdicts."""

import contextlib
import json
import subprocess
import sys

from orchestrator.recipe import compose
from orchestrator.report import tracking


def test_a_checks_run_is_open_while_its_jobs_run_and_its_report_finishes_that_run(tmp_path):
    import mlflow

    cfg = {"enabled": True, "uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "ttrace"}
    reports = [{"check_id": c, "recipe": compose([f"parallel={par}", "tracking.enabled=true"]),
                "job": {"label": "builtin"}, "timings": {"jobs_wall": 1.0}}
               for c, par in (("c1", "tp2"), ("c2", "dp2"))]
    opened = tracking.OpenedRuns([(cfg, r) for r in reports], str(tmp_path)).start()
    ids = opened.join()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(ids["c1"])
    assert run.info.status == "RUNNING" and run.info.run_name == "tp2/none"
    assert run.data.params["parallel.name"] == "tp2" and run.data.tags["check_id"] == "c1"
    assert "verdict" not in run.data.tags   # not judged yet

    report = reports[0]
    report["local"] = {"mode": "auto", "judged": 3, "failed": 0, "worst": {"name": "a", "local_err": 2.5},
                       "worst_scale": {"name": "b", "local_scale": -0.1}}
    report.update(verdict="pass", first_divergence=None, tensors=[
        {"index": i, "kind": "output", "module_type": "Linear", "rel_err": 1e-7, "tolerance": 1e-6,
         "ok": True} for i in range(3)])
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert tracking.log_check(cfg, str(tmp_path), report, path, run_id=ids["c1"]) == ids["c1"]
    run = client.get_run(ids["c1"])
    assert run.info.status == "FINISHED" and run.data.tags["verdict"] == "pass"
    assert len(client.get_metric_history(ids["c1"], "rel_err")) == 3
    assert run.data.tags["local"] == "judged"   # the local verdict, in the UI: judged or why not
    assert run.data.metrics["local.worst"] == 2.5 and run.data.metrics["local.worst_scale"] == 0.1
    runs = mlflow.search_runs(experiment_names=["ttrace"], output_format="list")
    assert sorted(r.info.run_id for r in runs) == sorted(ids.values())   # one run per check, no more

    with contextlib.suppress(KeyboardInterrupt), opened:   # the checks stopped (Ctrl-C) before c2's verdict
        raise KeyboardInterrupt
    assert client.get_run(ids["c2"]).info.status == "KILLED"
    assert client.get_run(ids["c1"]).info.status == "FINISHED"


def test_a_run_left_running_by_a_driver_that_is_gone_is_ended_by_the_next_check(tmp_path):
    """A driver killed with SIGKILL cannot end its runs; the next check on the host ends them KILLED
    (runs of live drivers and of other hosts stay RUNNING)."""
    import os
    import socket
    import subprocess
    import sys

    import mlflow

    cfg = {"enabled": True, "uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "ttrace"}
    rec = compose(["parallel=tp2", "tracking.enabled=true"])
    report = lambda c: {"check_id": c, "recipe": rec, "job": {"label": "builtin"}, "timings": {}}
    checks = [(cfg, report(c)) for c in ("dead", "live", "elsewhere")]
    ids = tracking.OpenedRuns(checks, str(tmp_path)).start().join()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    me = f"{socket.gethostname()}:{os.getpid()}"
    assert client.get_run(ids["live"]).data.tags[tracking.DRIVER_TAG] == me
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True)
    client.set_tag(ids["dead"], tracking.DRIVER_TAG, f"{socket.gethostname()}:{int(gone.stdout)}")
    client.set_tag(ids["elsewhere"], tracking.DRIVER_TAG, f"another-host:{int(gone.stdout)}")   # not ours

    new = tracking.OpenedRuns([(cfg, report("next"))], str(tmp_path)).start().join()["next"]
    dead = client.get_run(ids["dead"])
    assert dead.info.status == "KILLED" and "was gone" in dead.data.tags["ttrace.ended"]
    assert [client.get_run(ids[c]).info.status for c in ("live", "elsewhere")] == ["RUNNING", "RUNNING"]
    assert client.get_run(new).info.status == "RUNNING"


# Each process imports MLflow, says it is ready, waits for the others, then creates the database: the
# three first calls start within a millisecond (a barrier, not a start time guessed to follow the
# slowest import on a loaded machine).
_FIRST_LOG = """
import os, sys, time
from orchestrator.report import tracking
import mlflow  # noqa: F401 - imported before the barrier, so all processes connect together
base = sys.argv[1]
open(os.path.join(base, f"ready-{os.getpid()}"), "w").close()
deadline = time.monotonic() + 120
ready = lambda: sum(f.startswith("ready-") for f in os.listdir(base))
while ready() < int(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.001)
client, exp = tracking._client({"uri": "sqlite:///mlflow.db", "experiment": "ttrace"}, base)
print(exp)
"""


def test_processes_creating_one_mlflow_database_at_once_all_log(tmp_path):
    """Three checks' first MLflow calls on a fresh sqlite database at the same moment: without the
    lock in orchestrator.report.tracking, their schema migrations collide ("table experiments already
    exists", "duplicate column name: step") and the losers' runs are lost (seen in the two-sweeps
    test). All must succeed, in one experiment."""
    procs = [subprocess.Popen([sys.executable, "-c", _FIRST_LOG, str(tmp_path), "3"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1
