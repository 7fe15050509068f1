"""A rank's log (orchestrator/rank_logs.py): in the check directory when the rank runs on the driver's
node, else a temporary file whose text travels back in the rank's result and which is then removed."""

import signal
import subprocess
import sys
from pathlib import Path

from orchestrator.rank_logs import rank_log, sweep_orphaned_logs


def test_a_log_kept_off_the_check_directory_travels_back_and_leaves_no_file():
    with rank_log({"log": {}}, 3) as log:
        log.write("hello\n", stderr=True)
        where, directory = log.where(), log.path.parent
        assert directory.is_dir() and log.path.name == "rank00003.log"
    assert where == {"text": "hello\n"}
    assert not directory.exists()   # until 2026-11-29 every such rank left one in /tmp


def test_a_log_in_the_check_directory_stays(tmp_path):
    with rank_log({"log": {"dir": str(tmp_path)}}, 0) as log:
        log.write("kept\n", stderr=False)
        assert log.where() == {"path": str(tmp_path / "rank00000.log")}
    assert (tmp_path / "rank00000.log").read_text() == "kept\n"


HOLDS_A_LOG = """
import sys, time
from orchestrator.rank_logs import rank_log
with rank_log({"log": {}}, 1) as log:
    print(log.path.parent, flush=True)
    time.sleep(120)
"""


def test_the_log_of_a_rank_killed_before_it_removed_it_goes_with_the_next_rank_and_a_live_ones_stays():
    """A rank killed by a signal runs no cleanup: its temporary log stayed in /tmp for good (four per
    `make test`, until 2026-12-06). The next rank that makes one removes it; a live rank's is kept."""
    procs = [subprocess.Popen([sys.executable, "-c", HOLDS_A_LOG], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        killed, alive = (Path(p.stdout.readline().strip()) for p in procs)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        assert killed.is_dir() and alive.is_dir()
        with rank_log({"log": {}}, 0) as log:
            assert not killed.exists() and alive.is_dir() and log.path.parent.is_dir()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert alive in sweep_orphaned_logs() and not alive.exists()   # others may go too: tests run side by side
