"""The job contract, launcher side: start one rank of a job the way torchrun would (runs inside the
rank's Ray task; scheduling is orchestrator.cluster's).

A job is `job.entrypoint` (`pkg.module:function`, called with no arguments in this worker process)
or `job.command` (any program, started as a child process). Either way the rank gets torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the TTRACE_*
variables of its role (tracer/job.py), `job.env`, and `job.workdir` as its working directory. Its
stdout and stderr go to `<check dir>/logs/<run>/rankNNNNN.log`. A rank fails (JobError naming it,
with the last lines of its stderr) when it raises or exits non-zero, or when it finishes without
committing a trace: it never called `tracer.session()`, never attached a model, or traced nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from orchestrator import warm_python
from orchestrator.fork_server import HOST_ENV
from orchestrator.rank_logs import RankLog, output_to, pump, rank_log
from tracer.errors import ConfigError, JobError
from tracer.heap import gc_frozen

BUILTIN_ENTRYPOINT = "workloads.train:main"   # the built-in trainer's entrypoint (recipe.job_of)
OWN_JOBS = "workloads."   # entrypoints shipped with ttrace: their code is hashed into the cache key

# The child runs this first: it asks the kernel to kill it when the Ray worker that started it dies
# (its job stopped by removing the placement group, tracer/cluster.py), then execs the program. A
# preexec_fn would do the same but may deadlock in a process with threads, as Ray workers are.
_PDEATHSIG = ("import ctypes, os, signal, sys\n"
              "try: ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
              "except (AttributeError, OSError): pass   # not Linux: no parent-death signal\n"
              "if os.getppid() != int(sys.argv[1]): os._exit(1)\n"
              "os.execvp(sys.argv[2], sys.argv[2:])\n")


def rank_env(spec: Mapping[str, Any], rank: int, world_size: int, master_addr: str, master_port: int,
             local_rank: int, local_world_size: int) -> dict[str, str]:
    """The variables a rank is started with, beyond the worker's own environment."""
    from tracer.job_config import JobConfig

    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
           "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": "0", "MASTER_ADDR": master_addr,
           "MASTER_PORT": str(master_port)}
    env.update(JobConfig.from_spec(spec, env=env).env())
    env.update({str(k): str(v) for k, v in (spec["job"].get("env") or {}).items()})
    return env


def run_rank(spec: dict[str, Any], rank: int, world_size: int, master_addr: str, master_port: int,
             local_rank: int | None = None, local_world_size: int | None = None,
             node: str | None = None) -> dict[str, Any]:
    """Run one rank to completion; {"rank", "seconds", "log", ...what an entrypoint returned}.
    `node`: this process's Ray node, when Ray cannot be asked (a forked rank, forked_rank.py)."""
    t0 = time.perf_counter()
    job = spec["job"]
    env = rank_env(spec, rank, world_size, master_addr, master_port,
                   rank if local_rank is None else local_rank,
                   world_size if local_world_size is None else local_world_size)
    with rank_log(spec, rank, node) as log:
        if job.get("command"):
            out = _run_command(job, env, log, rank)
            warning = _check_exit(spec, rank, out["exit_code"], log)
            if warning:
                out["warning"] = warning
        else:   # the worker's own objects (Ray, torch: ~3 x 10^5) stay out of the job's GC passes
            with gc_frozen():
                out = _run_entrypoint(job, env, log, rank)
        _verify_trace(spec, rank, log)
        return {**out, "rank": rank, "seconds": time.perf_counter() - t0, "log": log.where()}


# -- command jobs -----------------------------------------------------------------------------------
def command_argv(command: str, env: Mapping[str, str]) -> list[str]:
    """`job.command` split as a shell would split it (quotes respected, $VAR and ${VAR} expanded from
    the rank's environment); it is not run by a shell."""
    expand = lambda tok: re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: env.get(m.group(1) or m.group(2), ""), tok)
    try:
        argv = [expand(t) for t in shlex.split(command)]
    except ValueError as e:
        raise ConfigError(f"job.command={command!r} cannot be split into arguments ({e})") from None
    if not argv:
        raise ConfigError("job.command is empty")
    return argv


def _child_env(job: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    out = dict(os.environ)
    out.update(env)
    # `python` in a command is this worker's interpreter (the one ttrace is installed in).
    out["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), out.get("PATH", "")])
    out.setdefault("PYTHONUNBUFFERED", "1")
    return out


def _run_command(job: Mapping[str, Any], env: Mapping[str, str], log: RankLog, rank: int) -> dict[str, Any]:
    argv = command_argv(str(job["command"]), {**os.environ, **env})
    cwd = job.get("workdir") or None
    try:
        # In a fork of a rank host (rank_tasks.rank_task sent it there): the rank is a fork of that.
        if os.environ.get(HOST_ENV) and warm_python.warm_start(job, argv):
            proc: Any = warm_python.start(argv, cwd, _child_env(job, env))
        else:
            proc = subprocess.Popen([sys.executable, "-c", _PDEATHSIG, str(os.getpid()), *argv], cwd=cwd,
                                    env=_child_env(job, env), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    errors="replace")
    except OSError as e:
        raise JobError(f"rank {rank}: job.command could not be started in {cwd or os.getcwd()} ({e})") \
            from None
    readers = [threading.Thread(target=pump, args=(stream, log, err), daemon=True)
               for stream, err in ((proc.stdout, False), (proc.stderr, True))]
    for t in readers:
        t.start()
    code = proc.wait()
    for t in readers:
        t.join()
    return {"exit_code": code}


def _check_exit(spec: Mapping[str, Any], rank: int, code: int, log: RankLog) -> str | None:
    """A command that exited non-zero failed its rank. One exception, reported as a warning: a SIGABRT
    after the rank committed a complete trace. torch's gloo backend can abort the interpreter's
    finalization ("terminate called without an active exception": its worker threads still hold
    tensors when the interpreter tears down; pytorch PR #179291), also after destroy_process_group,
    in about 1 of 10 two-rank runs here; the training, and the trace, had finished."""
    if code == 0:
        return None
    how = (f"was killed by signal {-code} ({signal.Signals(-code).name})" if code < 0
           else f"exited with code {code}")
    if code == -signal.SIGABRT:
        try:
            _verify_trace(spec, rank, log)
            return (f"rank {rank} {how} after committing a complete trace (torch's gloo teardown at "
                    "interpreter exit, pytorch PR #179291); the trace is used")
        except JobError:
            pass
    raise JobError(f"rank {rank} {how}; the last lines of its stderr:\n{log.tail_text()}")


# -- entrypoint jobs ------------------------------------------------------------------------------
def resolve_entrypoint(entrypoint: str, workdir: str | None = None) -> Callable[..., Any]:
    """`pkg.module:function` imported (with `workdir` first on sys.path)."""
    module, sep, name = entrypoint.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"job.entrypoint={entrypoint!r} must be 'pkg.module:function'")
    with _sys_path(workdir):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            where = f" (workdir {workdir})" if workdir else ""
            raise ConfigError(f"job.entrypoint={entrypoint}: module '{module}' cannot be imported{where}: "
                              f"{e}") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ConfigError(f"job.entrypoint={entrypoint}: '{module}' has no function '{name}'")
    return fn


def _run_entrypoint(job: Mapping[str, Any], env: Mapping[str, str], log: RankLog,
                    rank: int) -> dict[str, Any]:
    import tracer.job

    workdir = job.get("workdir") or None
    tracer.job.reset()   # a reused worker: the previous job's session is not this one's
    try:
        with _environ(env), _cwd(workdir), _sys_path(workdir), output_to(log):
            try:
                fn = resolve_entrypoint(str(job["entrypoint"]), workdir)
                result = fn()
                session = tracer.job.current()
                if session is not None:
                    session.close()
            except BaseException as e:
                traceback.print_exc()
                session = tracer.job.current()
                if session is not None:
                    with contextlib.suppress(Exception):   # the job's own error is the one to report
                        session.close(failed=f"{type(e).__name__}: {e}"[:500])
                raise
    finally:
        _teardown()
        tracer.job.reset()
    return dict(result) if isinstance(result, Mapping) else {}


def _teardown() -> None:
    """A process group the job left behind would break the next job in this worker."""
    if "torch" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _cwd(path: str | None) -> Iterator[None]:
    if not path:
        yield
        return
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@contextlib.contextmanager
def _sys_path(path: str | None) -> Iterator[None]:
    if not path or path in sys.path:
        yield
        return
    sys.path.insert(0, path)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(path)


# -- the trace a rank must leave ------------------------------------------------------------------
def _verify_trace(spec: Mapping[str, Any], rank: int, log: RankLog) -> None:
    """A rank that ran to completion must have committed a trace with at least one tensor."""
    trace = spec.get("trace") or {}
    if not trace.get("enabled", True):
        return
    import fsspec

    from tracer.store import MANIFEST, rank_dir

    url = f"{str(trace['store_url']).rstrip('/')}/{trace['run']}/{rank_dir(rank)}/{MANIFEST}"
    fs, path = fsspec.core.url_to_fs(url)
    try:
        with fs.open(path, "r") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise JobError(f"rank {rank} finished but committed no trace ({url} is missing): its job never "
                       "called tracer.session(), or exited before the session closed; the last lines of "
                       f"its output:\n{log.tail_text()}") from None
    except (OSError, ValueError) as e:
        raise JobError(f"rank {rank}: its trace manifest {url} cannot be read ({e})") from None
    if manifest.get("incomplete"):
        raise JobError(f"rank {rank} stopped early ({manifest['incomplete']}) and committed a partial trace; "
                       f"the last lines of its output:\n{log.tail_text()}")
    if not manifest.get("entries") and not manifest.get("names"):   # names: a scan's log (fingerprint_log)
        if manifest.get("meta", {}).get("attached") is False:
            why = "it called tracer.session() but never tr.attach(model)"
        else:
            why = ("it attached a model but recorded nothing: no forward ran inside `with tr.step(i):`, and "
                   "no tr.record_param_grads / tr.record_params")
        raise JobError(f"rank {rank} traced nothing: {why}; the last lines of its output:\n{log.tail_text()}")
