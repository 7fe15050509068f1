"""A command job's `python SCRIPT ...` rank started as a fork of a warm interpreter.

A command rank is a child process of the process that runs its rank (its *parent*: a Ray worker, or
a fork of the pool's fork server). Started as `python train.py`, it pays the
interpreter, torch and `torch._dynamo` (imported by the first optimizer) before the script's first
line: 3.5-4.5 s of CPU here, for every rank of every run of a check (1 + R + 1 runs). A fork of the
torch-only pool's fork server (fork_server.py: it imports those once and never runs a job itself) forks
the rank's process instead, and the child runs the script the way `python` would:

- `sys.argv`, `sys.path` (the script's directory, or the working directory for `-m`, then
  `PYTHONPATH`), `__main__`;
- the rank's environment and working directory, stdin from /dev/null, stdout and stderr to the
  pipes its parent reads into the rank's log;
- at the end: an uncaught exception through `sys.excepthook` and exit code 1, `SystemExit`'s code,
  non-daemon threads joined, then the script's own atexit handlers (its parent's are dropped);
- it dies with its parent (PR_SET_PDEATHSIG), and its exit code or signal reads as a `Popen`'s.

Only `python SCRIPT ARGS` and `python -m MODULE ARGS` (`python` being ttrace's interpreter) start
warm; an interpreter flag, any other program, or `job.warm_start=false` starts a fresh process. What
a warm start cannot give: torch is imported before `job.env` applies (a variable torch reads when it
is imported, such as `OMP_NUM_THREADS` for its thread pool, needs `job.warm_start=false`), and the
script shares the host's imported modules (a script that starts Ray itself needs it too).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import importlib
import io
import os
import runpy
import shlex
import signal
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Any

from orchestrator.fork_server import BASE_PRELOADS
from orchestrator.forked_rank import retitle
from tracer.heap import gc_frozen

PYTHONS = ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}")


def python_target(argv: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """("path", script, args) for `python SCRIPT ARGS`, ("module", name, args) for `python -m NAME
    ARGS`, None for any other command (an interpreter flag included: it needs a fresh interpreter)."""
    if len(argv) < 2 or not (argv[0] in PYTHONS or argv[0] == sys.executable):
        return None
    if argv[1] == "-m" and len(argv) > 2:
        return "module", argv[2], list(argv[3:])
    if argv[1].startswith("-"):
        return None
    return "path", argv[1], list(argv[2:])


def warm_start(job: Mapping[str, Any], argv: Sequence[str]) -> bool:
    """Whether this command job's ranks start as forks of a warm interpreter."""
    return job.get("warm_start", True) is not False and python_target(argv) is not None


class ForkedPython:
    """The forked rank, read like a `subprocess.Popen(..., text=True)`: `stdout`, `stderr`, `wait()`
    (the exit code, or minus the signal that killed it)."""

    def __init__(self, pid: int, stdout: IO[str], stderr: IO[str]):
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return self.returncode


def start(argv: Sequence[str], cwd: str | None, env: Mapping[str, str]) -> ForkedPython:
    """Fork this warm process (a fork of a rank host) into the rank's process, running `argv` (a
    `python_target`)."""
    target = python_target(argv)
    if target is None:
        raise ValueError(f"not a python command: {list(argv)}")
    for module in BASE_PRELOADS:   # imported by the rank host already (here, a fork of it)
        importlib.import_module(module)
    if cwd is not None and not os.path.isdir(cwd):
        raise FileNotFoundError(f"no such directory: {cwd!r}")
    sys.stdout.flush()
    sys.stderr.flush()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    parent = os.getpid()
    # The child starts with the heap frozen, as a forked entrypoint rank does (forked_rank.py).
    with gc_frozen():
        pid = os.fork()
        if pid == 0:   # never returns
            os.close(out_r)
            os.close(err_r)
            _child(target, shlex.join(argv), cwd, env, out_w, err_w, parent)
    os.close(out_w)
    os.close(err_w)
    text = lambda fd: open(fd, encoding="utf-8", errors="replace")
    return ForkedPython(pid, text(out_r), text(err_r))


def _child(target: tuple[str, str, list[str]], title: str, cwd: str | None, env: Mapping[str, str],
           out_w: int, err_w: int, parent: int) -> None:
    code = 1
    try:
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        if os.getppid() != parent:   # the parent died before the line above
            os._exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)   # the Ray worker's handlers act on Ray's state
        signal.signal(signal.SIGINT, signal.default_int_handler)
        retitle(title)   # `python train.py ...` in ps, as a fresh rank's
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, to in ((devnull, 0), (out_w, 1), (err_w, 2)):
            os.dup2(fd, to)
            os.close(fd)
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = sys.__stdout__ = _text_out(1)
        sys.stderr = sys.__stderr__ = _text_out(2)
        faulthandler.disable()   # the worker's, writing to the worker's stderr
        if env.get("PYTHONFAULTHANDLER"):
            faulthandler.enable()
        if cwd is not None:
            os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        atexit._clear()   # the Ray worker's handlers: never the rank's
        code = _run(target)
    except BaseException:   # setting the rank up failed (its working directory, ...): into its log
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _text_out(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                            line_buffering=True, write_through=True)


def _run(target: tuple[str, str, list[str]]) -> int:
    """The script as `python` runs it, then the interpreter's exit: its code."""
    kind, name, args = target
    if kind == "path" and not os.path.exists(name):
        print(f"{sys.executable}: can't open file {os.path.abspath(name)!r}: [Errno 2] No such file or "
              "directory", file=sys.stderr)
        return 2
    sys.argv = [name, *args]   # for -m, runpy sets argv[0] to the module's file
    # The path python would start with: the script's directory (cwd for -m), then PYTHONPATH's entries
    # (job.env may add some the worker never had), then the worker's own.
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [os.getcwd() if kind == "module" else os.path.dirname(os.path.abspath(name)),
                    *(p for p in extra if p not in sys.path)]
    sys.excepthook = sys.__excepthook__
    try:
        if kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(name, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    with contextlib.suppress(Exception):   # the interpreter waits for non-daemon threads first
        threading._shutdown()   # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    return code


def _exit_code(code: Any) -> int:
    """`sys.exit(code)` as the interpreter reads it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
