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

What the server imports before forking is fixed (`preloads`): torch for every job, and the
entrypoint module itself only when it is ttrace's own adapter. A user's module is always imported in
the child, so a long-lived server never runs a stale copy of code the user has edited since.

The child dies with the server (PR_SET_PDEATHSIG) and with the rank task that asked for it
(`requester`: a thread of the child waits on that process), so stopping a job by removing its
placement group (cluster.py), which kills the rank tasks, stops its forked ranks too. It reports its
result or its exception as a JSON line; a child killed by a signal is a JobError naming the rank,
the signal and, for a crash, the Python stacks faulthandler left in its log.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import faulthandler
import importlib
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

from orchestrator.rank_logs import crash_lines, local_path
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


def pool_preloads(pool: str) -> tuple[str, ...]:
    """The preload set whose last module names `pool` (`host_key`)."""
    return (*BASE_PRELOADS, pool) if pool.startswith(OWN_ADAPTERS) else BASE_PRELOADS


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


def outcome(payload: str | None, status: int, spec: dict[str, Any], rank: Any,
            node: str | None) -> dict[str, Any]:
    """A forked rank's result from its "R" line (`payload`, None if it wrote none) and its
    os.waitpid `status`; what it raised, raised here again; its death, a JobError."""
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        log = local_path(spec, rank, node)
        stacks = crash_lines(log) if name != "SIGKILL" else ""
        where = f"; the stacks at the crash end its log {log}" if stacks else ""
        raise JobError(f"rank {rank}'s process died (killed by {name}{where})") \
            from (ChildTraceback(stacks) if stacks else None)
    try:
        message = json.loads(payload or "")
    except ValueError:
        raise JobError(f"rank {rank}'s process exited with code {os.WEXITSTATUS(status)} before "
                       "reporting a result (see its log)") from None
    if "error" in message:
        raise _rebuilt(message["error"]) from ChildTraceback(message["error"]["traceback"])
    return message["result"]


class ChildTraceback(Exception):
    """Where the forked rank raised (the scheduler saves the whole chain in the rank's error file)."""


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


_KNOWN = {c.__name__: c for c in (ConfigError, JobError, TraceError)}
OWN_PACKAGES = ("torch", "tracer", "workloads", "orchestrator")   # importable to rebuild an error


def _rebuilt(error: dict[str, str]) -> BaseException:
    """The child's exception, as the same class where it can be rebuilt from its message (so the
    scheduler reports it exactly as an in-process rank's): ttrace's errors, builtins, and classes of
    modules already imported here or of torch's and ttrace's packages (the built-in trainer's injected
    fault), imported here if need be. A user's module is never imported here: a class of it is a
    RuntimeError naming the class, as is one that does not give its message back."""
    name, module, message = error["type"], error["module"], error["message"]
    cls = _KNOWN.get(name) if module.startswith("tracer.") else None
    if cls is None and module == "builtins":
        cls = getattr(builtins, name, None)
    if cls is None and "." not in name and (module in sys.modules
                                            or module.partition(".")[0] in OWN_PACKAGES):
        with contextlib.suppress(Exception):
            cls = getattr(importlib.import_module(module), name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        with contextlib.suppress(Exception):
            rebuilt = cls(message)
            if str(rebuilt) == message:
                return rebuilt
    return RuntimeError(f"{module}.{name}: {message}")
