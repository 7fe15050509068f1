"""Fresh rank processes without the start-up cost: fork each from a warm process.

In-process jobs need a fresh process per rank (rank_tasks.RankHost says why: DTensor, megatron-core
and transformers keep process-global state; the built-in trainer keeps none, but a fork is cheaper
than a warm Ray worker per concurrent rank), and so does a command's `python SCRIPT`
(warm_python.py). A fresh process pays 5-10 s of CPU before the job's first line runs: Python and
Ray, torch, `torch._dynamo` (imported by the first optimizer) and megatron-core or transformers.
Here a warm process imports those once and forks one child per rank: the fork server of a rank host
(fork_server.py; one host per pool and node, rank_tasks.py). The child starts with the modules
loaded and no job state, as a fresh process that had imported them would; the server never runs a
job, so it stays clean for the next fork.

What the server imports before forking is fixed (fork_server.preloads, rank_imports): torch and the
tracer's recording modules for every job, and the entrypoint module itself, with what it names in its
`rank_imports()` (its framework), only when it is ttrace's own adapter. A user's module is always
imported in the child, so a long-lived server never runs a stale copy of code the user has edited since.

The child dies with the server (PR_SET_PDEATHSIG) and with the rank task that asked for it
(`requester`: a thread of the child waits on that process), so stopping a job by removing its
placement group (cluster.py), which kills the rank tasks, stops its forked ranks too. It reports its
result or its exception as a JSON line; a child killed by a signal is a JobError naming the rank,
the signal and, for a crash, the Python stacks faulthandler left in its log.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tracer.heap import gc_frozen


def retitle(title: str) -> None:
    """Name a process after what it runs: a fork keeps its parent's title (`ttrace fork server: ...`),
    so `ps`, `pgrep -f` and `py-spy dump` would not find the rank under its own command. The
    setproctitle package (a small C extension) rewrites the process's argv area; Ray's copy of it,
    used until 2026-11-28, cost the fork server 0.3 s of imports (`ray._raylet`) before its first rank."""
    with contextlib.suppress(Exception):   # cosmetic: never fails a rank
        import setproctitle

        setproctitle.setproctitle(title)


def rank_title(spec: dict[str, Any], rank: Any) -> str:
    """`ttrace <role> rank <r>: <entrypoint or command>`, e.g. `ttrace candidate rank 1: train:main`."""
    role = (spec.get("trace") or {}).get("role") or "job"
    job = spec.get("job") or {}
    return f"ttrace {role} rank {rank}: {job.get('command') or job.get('entrypoint') or 'workloads.train'}"


def spawn(run: Callable[..., dict[str, Any]], spec: dict[str, Any], args: tuple, kwargs: dict, out: int,
          requester: int | None, env: Mapping[str, str], close: Sequence[int] = ()) -> int:
    """Fork this process into a rank running `run(spec, *args, **kwargs)`, with `env` added to its
    environment, killed when process `requester` ends, and fds `close` closed; the rank writes one
    line to fd `out`, "R" and its result or exception as JSON (read back by `outcome`). Its pid.
    Only from a process without other threads (fork_server.py says why)."""
    # The rank starts with this process's heap frozen: its GC passes neither scan it (CPU) nor write
    # its objects' GC headers (copy-on-write of the whole heap), and its run_rank finds it frozen.
    # This process thaws after the fork (freezing and thawing move list heads, not objects).
    with gc_frozen():
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:   # the child: never returns (os._exit), so it never thaws
            signal.set_wakeup_fd(-1)   # the server's, before its fds go
            for fd in close:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _child(run, spec, args, kwargs, out, requester, env)
    return pid


def _child(run: Callable[..., dict[str, Any]], spec: dict[str, Any], args: tuple, kwargs: dict,
           out: int, requester: int | None, env: Mapping[str, str]) -> None:
    code = 0
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):   # the server's (or a Ray worker's)
        signal.signal(sig, signal.SIG_DFL)
    # A crash (SIGSEGV, SIGABRT, ...) dumps every thread's Python stack to fd 2, which is the rank's
    # log while its job runs (rank_logs.output_to); `outcome` quotes it.
    faulthandler.enable(2, all_threads=True)
    if requester is not None:
        die_with(requester)
    os.environ.update(env)
    retitle(rank_title(spec, args[0] if args else "?"))
    try:
        message: dict[str, Any] = {"result": run(spec, *args, **kwargs)}
    except BaseException as e:   # SystemExit included: the rank's own exit is its failure
        code = 1
        message = {"error": {"module": type(e).__module__, "type": type(e).__qualname__, "message": str(e),
                             "traceback": traceback.format_exc()}}
    try:
        line = memoryview(f"R{json.dumps(message, default=str)}\n".encode())
        while line:
            line = line[os.write(out, line):]
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)   # no atexit handlers: they belong to the server (or a Ray worker)


def die_with(pid: int) -> None:
    """Kill this process (SIGKILL, as a parent-death signal would) once process `pid` has ended: a
    daemon thread waits on it (a pidfd; polled where the kernel has none)."""
    def kill() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:   # already gone
        return kill()
    except (AttributeError, OSError):   # no pidfd (kernel < 5.3): poll
        def watch() -> None:
            while pid_alive(pid):
                time.sleep(0.5)
            kill()
    else:
        def watch() -> None:
            select.select([fd], [], [])
            kill()
    threading.Thread(target=watch, name=f"ttrace-dies-with-{pid}", daemon=True).start()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process: it exists
        pass
    return True
