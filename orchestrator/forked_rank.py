"""Fresh rank processes without the start-up cost: fork each from a warm process, the rank host.

In-process jobs need a fresh process per rank (rank_tasks.RankHost says why: DTensor, megatron-core
and transformers keep process-global state; the built-in trainer keeps none, but a fork is cheaper
than a warm Ray worker per concurrent rank), and so does a command's `python SCRIPT`
(warm_python.py). A fresh process pays 5-10 s of CPU before the job's first line runs: Python and
Ray, torch, `torch._dynamo` (imported by the first optimizer) and megatron-core or transformers.
Here a warm host (a Ray actor, one per pool and node: rank_tasks.py) imports those once and forks
one child per rank. The child starts with the modules loaded and no job state, as a fresh process
that had imported them would; the host itself never runs a job, so it stays clean for the next fork.

What the host imports before forking is fixed (`preloads`): torch for every job, and the entrypoint
module itself only when it is ttrace's own adapter. A user's module is always imported in the child,
so a long-lived host never runs a stale copy of code the user has edited since.

The child dies with the host (PR_SET_PDEATHSIG) and with the rank task that asked for it (`requester`:
a thread of the child waits on that process), so stopping a job by removing its placement group
(cluster.py), which kills the rank tasks, stops its forked ranks too. It reports its result or its
exception through a pipe, as JSON; a child killed by a signal is a JobError naming the rank and the
signal.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import importlib
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from tracer.errors import ConfigError, JobError, TraceError
from tracer.heap import gc_frozen

OWN_ADAPTERS = "workloads."           # entrypoints ttrace ships; only these are imported before the fork
BASE_PRELOADS = ("torch", "torch.distributed", "torch._dynamo")
HOST_ENV = "TTRACE_RANK_HOST"         # the rank hosts' runtime_env marker: one pool per preload set


def preloads(spec: dict[str, Any]) -> tuple[str, ...]:
    """Modules a rank host imports before forking this job's ranks."""
    entrypoint = str((spec.get("job") or {}).get("entrypoint") or "")
    module = entrypoint.partition(":")[0]
    return (*BASE_PRELOADS, module) if module.startswith(OWN_ADAPTERS) else BASE_PRELOADS


def host_key(spec: dict[str, Any]) -> str:
    """Names the pool whose rank host forks a job's ranks: the last module of its preload set.
    Ray keeps workers apart by runtime_env, so an adapter's imports (and the shims some apply at
    import, as megatron-core's does) never reach another job's ranks."""
    return preloads(spec)[-1]


def retitle(title: str) -> None:
    """Name a forked rank's process after what it runs: a fork keeps its worker's title
    (`ray::RankHost.run`), so `ps`, `pgrep -f` and `py-spy dump` would not find the rank under
    its own command. Ray's own setproctitle: it owns a worker's argv area (the setproctitle package
    cannot rewrite it there)."""
    with contextlib.suppress(Exception):   # cosmetic: never fails a rank
        from ray._raylet import setproctitle

        setproctitle(title)


def rank_title(spec: dict[str, Any], rank: Any) -> str:
    """`ttrace <role> rank <r>: <entrypoint or command>`, e.g. `ttrace candidate rank 1: train:main`."""
    role = (spec.get("trace") or {}).get("role") or "job"
    job = spec.get("job") or {}
    return f"ttrace {role} rank {rank}: {job.get('command') or job.get('entrypoint') or 'workloads.train'}"


_FORK_LOCK = threading.Lock()   # a host forks for several ranks at once, from its threads: one at a time


def run_forked(run: Callable[..., dict[str, Any]], spec: dict[str, Any], *args: Any,
               requester: int | None = None, env: dict[str, str] | None = None,
               **kwargs: Any) -> dict[str, Any]:
    """`run(spec, *args, **kwargs)` in a child forked from this (warm) process, with `env` added to its
    environment and killed when process `requester` ends; its result, or its exception raised here
    again."""
    for module in preloads(spec):
        importlib.import_module(module)
    # The child starts with the host's heap frozen: its GC passes neither scan it (CPU) nor write
    # its objects' GC headers (copy-on-write of the whole heap), and its run_rank finds it frozen.
    # The host thaws after the fork (freezing and thawing move list heads, not objects). The pipe's
    # write end is closed before the lock is released: another thread's child, forked later, must not
    # hold it, or this rank's result would wait for that child's end.
    with _FORK_LOCK, gc_frozen():
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:   # the child: never returns (os._exit), so it never thaws
            os.close(read_fd)
            _child(run, spec, args, kwargs, write_fd, requester, env or {})
        os.close(write_fd)
    with os.fdopen(read_fd, encoding="utf-8") as pipe:
        payload = pipe.read()
    _, status = os.waitpid(pid, 0)
    rank = args[0] if args else "?"
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        raise JobError(f"rank {rank}'s process died (killed by {name})")
    try:
        message = json.loads(payload)
    except ValueError:
        raise JobError(f"rank {rank}'s process exited with code {os.WEXITSTATUS(status)} before "
                       "reporting a result (see its log)") from None
    if "error" in message:
        raise _rebuilt(message["error"]) from ChildTraceback(message["error"]["traceback"])
    return message["result"]


class ChildTraceback(Exception):
    """Where the forked rank raised (the scheduler saves the whole chain in the rank's error file)."""


def _child(run: Callable[..., dict[str, Any]], spec: dict[str, Any], args: tuple, kwargs: dict,
           write_fd: int, requester: int | None, env: dict[str, str]) -> None:
    code = 0
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    for sig in (signal.SIGTERM, signal.SIGINT):   # the Ray worker's handlers would act on Ray's state
        signal.signal(sig, signal.SIG_DFL)
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
        payload = json.dumps(message, default=str)
        with os.fdopen(write_fd, "w", encoding="utf-8") as pipe:
            pipe.write(payload)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)   # no atexit handlers: they belong to the Ray worker


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


_KNOWN = {c.__name__: c for c in (ConfigError, JobError, TraceError)}


def _rebuilt(error: dict[str, str]) -> BaseException:
    """The child's exception, as the same class where it can be rebuilt from its message (so the
    scheduler reports it exactly as an in-process rank's): ttrace's errors, builtins, and classes of
    modules this host had imported before the fork (torch's, ttrace's trainer's: never a user's
    module, which is imported in the child only). Else a RuntimeError naming the class."""
    name, module, message = error["type"], error["module"], error["message"]
    cls = _KNOWN.get(name) if module.startswith("tracer.") else None
    if cls is None and module == "builtins":
        cls = getattr(builtins, name, None)
    if cls is None and module in sys.modules and "." not in name:
        cls = getattr(sys.modules[module], name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        with contextlib.suppress(Exception):
            rebuilt = cls(message)
            if str(rebuilt) == message:
                return rebuilt
    return RuntimeError(f"{module}.{name}: {message}")
