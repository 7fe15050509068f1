"""The command line's input errors: exit 2 with a message saying what is wrong, no report of a pass,
and no job started (so no Ray: these run with the single-process tests)."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("overrides, needle", [
    (["parallel=tp3"], "parallel/tp3"),
    (["model.hidden=66", "parallel=tp2"], "hidden"),
    (["parallel.world_size=3", "parallel=tp2"], "world"),
    (["parallel.recompute=sometimes"], "parallel.recompute=sometimes must be one of none, full, selective"),
])
def test_bad_recipe_exits_2_with_a_message_and_no_report_of_pass(workdir, overrides, needle):
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", *overrides, "tracking.enabled=false"],
                          capture_output=True, text=True, cwd=workdir, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr
    assert "PASS" not in proc.stdout


def test_unreachable_s3_endpoint_exits_2_with_a_clear_message(workdir, closed_port):
    port = closed_port
    env = dict(os.environ, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y", AWS_DEFAULT_REGION="us-east-1")
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "store=s3",
                           "store.url=s3://nowhere/runs", f"store.endpoint_url=http://127.0.0.1:{port}",
                           "tracking.enabled=false"],
                          capture_output=True, text=True, cwd=workdir, timeout=240, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # Said by the one TCP connection tried first, not after botocore's retries (orchestrator/storage.py).
    assert "unreachable" in proc.stderr and f"no connection to 127.0.0.1:{port}" in proc.stderr
    assert "PASS" not in proc.stdout and proc.stdout.strip().splitlines()[-1].startswith("report: ")


def test_a_mistyped_option_is_answered_before_the_checks_modules_load():
    """A recipe Hydra cannot compose is reported without importing torch, Ray or MLflow (2 s of the
    3 s such a typo took)."""
    probe = ("import atexit, sys\n"
             "atexit.register(lambda: print('loaded:', sorted({'torch', 'ray', 'mlflow'} & set(sys.modules)),"
             " file=sys.stderr))\n"
             "from orchestrator.cli import main\n"
             "sys.argv = ['ttrace', 'parallel=tp3', 'tracking.enabled=false']\n"
             "main()\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Could not find 'parallel/tp3'" in proc.stderr, proc.stderr
    assert "loaded: []" in proc.stderr, proc.stderr
