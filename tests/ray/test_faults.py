"""A fault not covered elsewhere: processes creating one MLflow database at once. (raise/exit/hang/
nan_grad, damaged traces, unreachable S3 and bad recipes: test_checks.py, test_store_compare.py,
test_sweeps_cache_s3_nightly.py. The S3 endpoint going away mid-write and two sweeps racing for one
reference on one store run in `make bench-faults`, which exits 1 if either ends in a pass or loses a
report: they are too slow for `make test` on 2 cores.)"""

from __future__ import annotations

import subprocess
import sys
import time

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
