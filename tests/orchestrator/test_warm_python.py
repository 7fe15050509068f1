"""A `python SCRIPT` rank forked from a warm interpreter behaves as `python SCRIPT` would: what the
script sees, what it writes, and how it ends (exit code, exception, signal, threads, atexit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import warm_python

SCRIPT = """
import atexit, os, sys, threading, time
print("argv", sys.argv, "cwd", os.getcwd(), "path0", sys.path[0], "main", __name__,
      "env", os.environ.get("X"))
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
how = sys.argv[1] if len(sys.argv) > 1 else ""
if how == "raise":
    raise ValueError("boom")
if how == "abort":
    os.abort()
if how == "message":
    sys.exit("a message")
sys.exit(int(how) if how else None)
"""


def _both(tmp_path: Path, argv: list[str], **extra: str) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """(code, stdout, stderr) of `argv` forked warm, and of the same run by a fresh interpreter."""
    env = {"X": "1", "PATH": str(Path(sys.executable).parent), "PYTHONUNBUFFERED": "1", **extra}   # as ttrace
    proc = warm_python.start(argv, str(tmp_path), env)
    warm = proc.stdout.read(), proc.stderr.read()
    fresh = subprocess.run([sys.executable if a == "python" else a for a in argv], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
    return (proc.wait(), *warm), (fresh.returncode, fresh.stdout, fresh.stderr)


@pytest.mark.parametrize("how", ["", "3", "raise", "abort", "message"])
def test_a_forked_script_ends_as_the_same_script_run_by_python(tmp_path, how):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "train.py").write_text(SCRIPT)
    warm, fresh = _both(tmp_path, ["python", "job/train.py", *([how] if how else [])])
    assert warm[0] == fresh[0] == {"": 0, "3": 3, "raise": 1, "abort": -6, "message": 1}[how]
    assert warm[1] == fresh[1], (warm[1], fresh[1])   # argv, cwd, sys.path[0], __main__, env, thread, atexit
    assert f"path0 {tmp_path / 'job'}" in warm[1] and "main __main__ env 1" in warm[1]
    if how == "raise":
        assert warm[2].splitlines()[-1] == fresh[2].splitlines()[-1] == "ValueError: boom"
    else:
        assert warm[2] == fresh[2], (warm[2], fresh[2])


def test_python_dash_m_runs_the_module_from_the_working_directory(tmp_path):
    (tmp_path / "trainpkg").mkdir()
    (tmp_path / "trainpkg" / "__init__.py").write_text("")
    (tmp_path / "trainpkg" / "run.py").write_text(SCRIPT)
    warm, fresh = _both(tmp_path, ["python", "-m", "trainpkg.run", "7"])
    assert warm[0] == fresh[0] == 7
    assert warm[1] == fresh[1] and f"path0 {tmp_path}" in warm[1], (warm[1], fresh[1])


def test_pythonpath_from_the_rank_environment_is_on_the_path(tmp_path):
    """`+job.env.PYTHONPATH=src`: the script imports the team's package from it, warm as fresh."""
    (tmp_path / "src" / "teamlib").mkdir(parents=True)
    (tmp_path / "src" / "teamlib" / "__init__.py").write_text("WHO = 'teamlib'\n")
    (tmp_path / "train.py").write_text("import sys, teamlib\nprint(teamlib.WHO, sys.path[1])\n")
    warm, fresh = _both(tmp_path, ["python", "train.py"], PYTHONPATH="src")
    assert warm[0] == fresh[0] == 0, (warm, fresh)
    assert warm[1] == fresh[1] == f"teamlib {tmp_path / 'src'}\n", (warm, fresh)


def test_a_forked_rank_shows_its_own_command_in_ps(tmp_path):
    """Not its worker's title: `ps`, `pgrep -f train.py` and `py-spy dump` find the rank by its command."""
    (tmp_path / "train.py").write_text("print(open('/proc/self/cmdline').read().replace(chr(0), ' ')"
                                       ".strip())\n")
    proc = warm_python.start(["python", "train.py", "--bug", "a b"], str(tmp_path), {})
    assert proc.wait() == 0
    assert proc.stdout.read().strip() == "python train.py --bug 'a b'"


def test_a_missing_script_exits_2_as_python_does(tmp_path):
    warm, fresh = _both(tmp_path, ["python", "nope.py"])
    assert warm[0] == fresh[0] == 2
    assert "can't open file" in warm[2] and "nope.py" in warm[2]


def test_only_a_plain_python_command_starts_warm():
    target = warm_python.python_target(["python", "train.py", "--lr", "1"])
    assert target == ("path", "train.py", ["--lr", "1"])
    assert warm_python.python_target([sys.executable, "-m", "pkg.train"]) == ("module", "pkg.train", [])
    for argv in (["python", "-u", "train.py"], ["python"], ["bash", "run.sh"], ["torchrun", "train.py"],
                 ["/usr/bin/python2", "train.py"]):
        assert warm_python.python_target(argv) is None, argv
    assert not warm_python.warm_start({"warm_start": False}, ["python", "train.py"])
    assert warm_python.warm_start({}, ["python", "train.py"])
