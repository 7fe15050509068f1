"""The fork server: the single-threaded process a rank host forks its ranks from.

A rank host is a Ray actor (rank_tasks.RankHost), and a Ray worker runs ~150 threads: Ray's gRPC
and event loops, pyarrow's jemalloc background threads, the actor's request threads. A fork copies
only the forking thread, and the child inherits whatever locks and half-updated state the others
held at that instant: POSIX allows such a child only async-signal-safe calls until it execs, and
Python 3.12 warns at such forks. Forked straight from the actor, one built-in trainer rank died of
SIGSEGV in one CI run of `make test` (2026-11-28; 14 reruns of that test here, 42 checks, did not
reproduce it). So the host forks
nothing itself: it starts this server, a plain Python process without threads that imports torch
(and the pool's adapter) once and forks each rank from its main loop (forked_rank.spawn), as
multiprocessing's forkserver does.

Protocol, one Unix-socket connection per rank: the host sends one JSON line, {"run":
"module:function", "spec", "args", "kwargs", "requester", "env"}; the rank writes one line, "R" and its
result or exception as JSON (forked_rank.py); the server, once it has reaped the rank, writes
"S<os.waitpid status>" and closes. A rank dies with the server (PR_SET_PDEATHSIG), and the server
exits when its host does (a pidfd, polled where the kernel has none), killing the ranks it forked.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import json
import os
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.rank_logs import crash_lines, local_path

START_S = 120.0       # the server's imports (torch, an adapter) on a loaded node, before a first rank
REQUEST_S = 30.0      # a host's request line, once connected
# The server's command: the working directory leaves sys.path first (`python -m` and `-c` put it
# there), so a directory of the user's that holds a package named like ours cannot stand in for it.
_MAIN = ("import sys; del sys.path[0]; from orchestrator.fork_server import serve; "
         "serve(sys.argv[1], int(sys.argv[2]), tuple(sys.argv[3:]))")
OWN_ADAPTERS = "workloads."           # entrypoints ttrace ships; only these are imported before the fork
BASE_PRELOADS = ("torch", "torch.distributed", "torch._dynamo")
HOST_ENV = "TTRACE_RANK_HOST"         # the rank hosts' runtime_env marker: one pool per preload set
# What a traced rank imports as it attaches (lazily in tracer/job.py: a user's `import tracer` stays
# light); a model attached without a plan (most users' jobs) the DTensor integration too (numba)
TRACER_IMPORTS, WITHOUT_PLAN = ("tracer.collector",), ("tracer.integrations.dtensor",)


def preloads(spec: dict[str, Any]) -> tuple[str, ...]:
    """Modules the fork server of this job's pool imports before forking its ranks."""
    entrypoint = str((spec.get("job") or {}).get("entrypoint") or "")
    return pool_preloads(entrypoint.partition(":")[0])


def pool_preloads(pool: str) -> tuple[str, ...]:
    """The preload set whose last module names `pool` (`host_key`): ttrace's own adapter module
    after torch's, any other name torch's alone."""
    return (*BASE_PRELOADS, pool) if pool.startswith(OWN_ADAPTERS) else BASE_PRELOADS


def host_key(spec: dict[str, Any]) -> str:
    """Names the pool whose rank host forks a job's ranks: the last module of its preload set.
    Ray keeps workers apart by runtime_env, so an adapter's imports (and the shims some apply at
    import, as megatron-core's does) never reach another job's ranks."""
    return preloads(spec)[-1]


def rank_imports(preload: Sequence[str]) -> None:
    """What every rank of the pool imports beyond `preload`, once, before any fork: the tracer's
    recording modules, and what ttrace's adapter names in `rank_imports()` (its framework, kept out of
    its module, which the driver imports to validate a recipe: transformers' Llama model or
    megatron-core, 2-3 s of CPU a rank where each rank imported it), else WITHOUT_PLAN (0.25 s a rank)."""
    adapter = sys.modules.get(preload[-1]) if preload and preload[-1].startswith(OWN_ADAPTERS) else None
    for module in TRACER_IMPORTS + (() if adapter else WITHOUT_PLAN):
        importlib.import_module(module)
    getattr(adapter, "rank_imports", lambda: None)()


def serve(path: str, host: int, preload: Sequence[str]) -> None:
    """Listen at `path` (`address`) for ranks to fork, with `preload` imported, until process `host`
    ends."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address(path))
    listener.listen(128)   # hosts connect while the imports below run; their requests wait
    for module in preload:
        importlib.import_module(module)
    rank_imports(preload)
    from orchestrator.forked_rank import pid_alive, retitle

    retitle(f"ttrace fork server: {preload[-1] if preload else 'python'}")
    woken_r, woken_w = os.pipe()
    os.set_blocking(woken_w, False)
    signal.set_wakeup_fd(woken_w)                       # SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    try:
        watch: Any = os.pidfd_open(host)
    except (AttributeError, OSError):
        watch = None
    ranks: dict[int, socket.socket] = {}
    try:
        while watch is not None or pid_alive(host):
            ready, _, _ = select.select([listener, woken_r, *([watch] if watch is not None else [])],
                                        [], [], None if watch is not None else 1.0)
            if watch in ready:
                break
            if woken_r in ready:
                os.read(woken_r, 4096)
            _reap(ranks)
            if listener in ready:
                _fork_one(listener, ranks, (listener.fileno(), woken_r, woken_w))
    finally:
        for pid in ranks:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if not path.startswith("@"):
            with contextlib.suppress(OSError):   # its ForkServer's directory, if nothing else is in it
                os.unlink(path)
                os.rmdir(os.path.dirname(path))


def _fork_one(listener: socket.socket, ranks: dict[int, socket.socket], own: tuple[int, ...]) -> None:
    from orchestrator.forked_rank import spawn

    conn, _ = listener.accept()
    if not _same_user(conn):   # an abstract socket has no file permissions: only our user's processes
        conn.close()
        return
    conn.settimeout(REQUEST_S)
    try:
        with conn.makefile("rb") as f:
            request = json.loads(f.readline())
        conn.settimeout(None)   # the rank writes to it: blocking, as an inherited fd should be
        module, _, name = str(request["run"]).partition(":")
        run = getattr(importlib.import_module(module), name)
        close = (*own, *(c.fileno() for c in ranks.values()))
        pid = spawn(run, request["spec"], tuple(request["args"]), request["kwargs"], conn.fileno(),
                    request.get("requester"), request.get("env") or {}, close)
    except Exception as e:   # a malformed request fails that rank, never the server
        with contextlib.suppress(OSError):
            error = {"module": type(e).__module__, "type": type(e).__qualname__, "traceback": "",
                     "message": f"the fork server could not start this rank: {e}"}
            conn.sendall(f"R{json.dumps({'error': error})}\nS0\n".encode())
        conn.close()
        return
    ranks[pid] = conn


def address(path: str) -> str:
    """A Unix socket's address: "@name" is Linux's abstract namespace (no file)."""
    return "\0" + path[1:] if path.startswith("@") else path


def _same_user(conn: socket.socket) -> bool:
    if not hasattr(socket, "SO_PEERCRED"):   # not Linux: the socket's directory is private (0700)
        return True
    cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", cred)[1] == os.getuid()


def _reap(ranks: dict[int, socket.socket]) -> None:
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = ranks.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"S{status}\n".encode())
            conn.close()


class ForkServer:
    """A rank host's side: starts the server (its imports begin at once) and asks it for ranks, from
    any number of threads (a connection per rank)."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str] | None = None):
        # Linux: an abstract socket, gone with the server however it ends (Ray kills a dead actor's
        # children with SIGKILL; a socket file in a directory of its own was left behind by each host
        # of each driver: 104 of them after a day's tests here). Elsewhere a file in a private directory.
        self._dir = None if sys.platform.startswith("linux") else tempfile.mkdtemp(prefix="ttrace-forks-")
        self.path = (os.path.join(self._dir, "socket") if self._dir else
                     f"@ttrace-forks-{os.getpid()}-{secrets.token_hex(8)}")
        self.proc = subprocess.Popen([sys.executable, "-c", _MAIN, self.path, str(os.getpid()), *preload],
                                     stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, target: str, spec: dict[str, Any], *args: Any, requester: int | None = None,
            env: dict[str, str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """`target(spec, *args, **kwargs)` ("module:function") in a rank forked by the server, with
        `env` added to its environment and killed when process `requester` ends: its result, or its
        exception raised here again (`outcome`)."""
        rank = args[0] if args else "?"
        request = {"run": target, "spec": spec, "args": list(args), "kwargs": kwargs,
                   "requester": requester, "env": env or {}}
        with self._connect(rank) as conn:
            conn.sendall((json.dumps(request) + "\n").encode())
            payload, status = None, None
            with conn.makefile("r", encoding="utf-8") as replies:
                for line in replies:
                    if line.startswith("R"):
                        payload = line[1:]
                    elif line.startswith("S"):
                        status = int(line[1:])
                        break
        if status is None:
            raise _job_error(f"rank {rank}'s process was lost with its fork server (exit code "
                             f"{self.proc.poll()}; its output is in the rank host's Ray worker log)")
        return outcome(payload, status, spec, rank, kwargs.get("node"))

    def _connect(self, rank: Any) -> socket.socket:
        deadline = time.monotonic() + START_S
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(address(self.path))
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
            if not self.alive() or time.monotonic() > deadline:
                raise _job_error(f"rank {rank} could not be forked: the fork server "
                               + (f"exited with code {self.proc.poll()}" if not self.alive() else
                                  f"did not listen within {START_S:.0f} s")
                               + " (its output is in the rank host's Ray worker log)")
            time.sleep(0.02)

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


def outcome(payload: str | None, status: int, spec: dict[str, Any], rank: Any,
            node: str | None) -> dict[str, Any]:
    """A forked rank's result from its "R" line (`payload`, None if it wrote none) and its
    os.waitpid `status`; what it raised, raised here again; its death, a JobError."""
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        log = local_path(spec, rank, node)
        stacks = crash_lines(log) if name != "SIGKILL" else ""
        where = f"; the stacks at the crash end its log {log}" if stacks else ""
        raise _job_error(f"rank {rank}'s process died (killed by {name}{where})") \
            from (ChildTraceback(stacks) if stacks else None)
    try:
        message = json.loads(payload or "")
    except ValueError:
        raise _job_error(f"rank {rank}'s process exited with code {os.WEXITSTATUS(status)} before "
                         "reporting a result (see its log)") from None
    if "error" in message:
        raise _rebuilt(message["error"]) from ChildTraceback(message["error"]["traceback"])
    return message["result"]


class ChildTraceback(Exception):
    """Where the forked rank raised (the scheduler saves the whole chain in the rank's error file)."""


def _job_error(message: str) -> Exception:
    """tracer.errors.JobError, imported only when a rank failed: the tracer package imports torch,
    which a host (and the rank task waiting on it) otherwise never needs."""
    from tracer.errors import JobError

    return JobError(message)


OWN_PACKAGES = ("torch", "tracer", "workloads", "orchestrator")   # importable to rebuild an error


def _rebuilt(error: dict[str, str]) -> BaseException:
    """The child's exception, as the same class where it can be rebuilt from its message (so the
    scheduler reports it exactly as an in-process rank's): builtins, and classes of modules already
    imported here or of torch's and ttrace's packages (ttrace's errors, the built-in trainer's injected
    fault), imported here if need be. A user's module is never imported here: a class of it is a
    RuntimeError naming the class, as is one that does not give its message back."""
    name, module, message = error["type"], error["module"], error["message"]
    cls = getattr(builtins, name, None) if module == "builtins" else None
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
