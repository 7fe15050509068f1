"""The fork server that rank hosts fork their ranks from (orchestrator/fork_server.py): a real server
process, real forked ranks running orchestrator.jobs.run_rank on entrypoints written here. What a rank
starts with, how it ends (result, exception, crash, its requester's end), and that the server and its
ranks end with their host."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from orchestrator.fork_server import TRACER_IMPORTS, ForkServer, pool_preloads
from orchestrator.rank_tasks import worker_env
from tracer.errors import JobError, TraceError

PROBES = """
import gc, os, sys, threading, time, ctypes
from pathlib import Path

def frozen():
    return {"frozen": gc.get_freeze_count(), "threads": threading.active_count(), "pid": os.getpid(),
            "torch": "torch" in sys.modules, "ray": "ray" in sys.modules}

def imported():
    shims = sys.modules.get("workloads.adapters.megatron_shims")
    names = ("transformers", "megatron", "numba", "tracer")
    return {"modules": sorted(m for m in sys.modules if m.startswith(names)),
            "shims": getattr(shims, "_installed", False)}

def up(text):
    # Written whole, then renamed: a test that acts on the file's existence never reads it half-written.
    ready = Path(os.environ["READY"])
    ready.with_name(ready.name + ".tmp").write_text(text)
    ready.with_name(ready.name + ".tmp").replace(ready)

def sleeps():
    up(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
    time.sleep(float(os.environ.get("SLEEP", "60")))
    return {"slept": True}

def meets():
    # Up, then waits for its peer to be up too: only ranks running at once both meet.
    up("up")
    peer, deadline = Path(os.environ["PEER"]), time.monotonic() + 30
    while not peer.exists():
        if time.monotonic() > deadline:
            return {"met": False}
        time.sleep(0.01)
    return {"met": True}

def idle():
    time.sleep(60)

def crashes():
    threading.Thread(target=idle, name="bystander", daemon=True).start()
    ctypes.string_at(0)

def raises():
    kind = os.environ["RAISE"]
    if kind == "trace":
        from tracer.errors import TraceError
        raise TraceError("bad part")
    if kind == "value":
        raise ValueError("bad value")
    if kind == "injected":
        from workloads.faults import InjectedFault
        raise InjectedFault("injected on rank 1")
    raise UserError("from the user")

class UserError(Exception):
    pass
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("forks")
    (work / "probes.py").write_text(PROBES)
    fs = ForkServer(("torch",), env=worker_env())
    yield fs, work
    fs.close()


def rank(server, entry, rank=0, env=None, requester=None, trace=False):
    fs, work = server
    spec = {"job": {"entrypoint": f"probes:{entry}", "workdir": str(work), "env": env or {}},
            "log": {"dir": str(work / "logs" / entry)}, "trace": {"enabled": trace}}
    return fs.run("orchestrator.jobs:run_rank", spec, rank, 1, "127.0.0.1", 1, node=None,
                  requester=requester, env=env)


def test_ranks_fork_from_a_server_without_threads_with_its_heap_frozen_and_run_side_by_side(server):
    """The server has imported torch and holds no other thread when it forks; a rank's GC passes skip
    the heap it shares with the server; two ranks run at once (each waits for the other to be up: one
    after the other, the first gives up after 30 s). Neither imports Ray (0.3 s a rank, for nothing:
    a forked rank is no Ray worker)."""
    fs, work = server
    out = rank(server, "frozen")
    assert out["torch"] and out["frozen"] > 10000 and out["threads"] <= 2   # + the requester watch
    assert not out["ray"]
    assert len(os.listdir(f"/proc/{fs.proc.pid}/task")) == 1
    results = []
    both = [threading.Thread(target=lambda i=i: results.append(rank(
        server, "meets", i, env={"READY": str(work / f"up{i}"), "PEER": str(work / f"up{1 - i}")})))
        for i in (0, 1)]
    for t in both:
        t.start()
    for t in both:
        t.join()
    assert [r["met"] for r in results] == [True, True], results   # side by side, not one after the other


@pytest.mark.parametrize("adapter, framework", [("hf", "transformers.models.llama.modeling_llama"),
                                                ("megatron_core", "megatron.core.models.gpt"),
                                                ("torch_native", "tracer.integrations.dtensor"),
                                                ("train", "tracer.collector"),
                                                (None, "tracer.integrations.dtensor")])
def test_a_pools_ranks_start_with_their_framework_and_the_tracer_imported(tmp_path, adapter, framework):
    """The server of an adapter's pool imports what every rank of it imports (its `rank_imports()`:
    2-3 s of CPU a rank where each imported it) and the tracer's recording modules; a user's job's
    pool (None) the DTensor integration (with numba, 0.25 s a rank); and it still forks from its only
    thread."""
    (tmp_path / "probes.py").write_text(PROBES)
    pool = {None: "mypkg.train", "train": "workloads.train"}.get(adapter, f"workloads.adapters.{adapter}")
    fs = ForkServer(pool_preloads(pool), env=worker_env())
    try:
        out = rank((fs, tmp_path), "imported")
        assert len(os.listdir(f"/proc/{fs.proc.pid}/task")) == 1
    finally:
        fs.close()
    assert {framework, *TRACER_IMPORTS} <= set(out["modules"]), out["modules"]
    assert out["shims"] == (adapter == "megatron_core")   # megatron-core's CPU shims, as its main does


def test_a_server_started_beside_a_package_named_like_ours_still_runs_ours(tmp_path, monkeypatch):
    """A host's working directory may be a user's project: its own `orchestrator` package must not
    stand in for ttrace's when the server starts."""
    (tmp_path / "orchestrator").mkdir()
    (tmp_path / "orchestrator" / "__init__.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "probes.py").write_text(PROBES)
    monkeypatch.chdir(tmp_path)
    fs = ForkServer(("torch",), env=worker_env())
    try:
        assert rank((fs, tmp_path), "frozen")["torch"]
    finally:
        fs.close()


def test_only_processes_of_the_servers_own_user_may_ask_it_for_a_rank(server, tmp_path):
    """An abstract Unix socket has no file permissions: the server checks its peer's uid, so another
    user on the node cannot have code run as ours. (Switching user needs root, as CI runs.)"""
    from orchestrator.fork_server import address

    fs, work = server
    ask = f"""
import os, socket, json
os.setuid(65534)
s = socket.socket(socket.AF_UNIX)
s.connect({address(fs.path)!r})
request = {{"run": "orchestrator.jobs:run_rank", "spec": {{}}, "args": [0], "kwargs": {{}}}}
try:
    s.sendall((json.dumps(request) + "\\n").encode())
    print("answered" if s.recv(100) else "closed")
except (BrokenPipeError, ConnectionResetError):   # closed before, or with, our request unread
    print("closed")
"""
    if os.getuid() != 0:
        pytest.skip("switching to another user needs root")
    assert rank(server, "frozen")["torch"]   # listening
    out = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "closed", out.stdout + out.stderr
    assert rank(server, "frozen")["torch"]   # and the server still serves its own user


def test_a_rank_dies_with_the_rank_task_that_asked_for_it(server, tmp_path):
    """A host outlives the jobs it forks for: a rank must end when its rank task's process does
    (stopping a job kills those), not with the host. The rank has the task's `env`."""
    ready = tmp_path / "ready"
    task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    def kill_when_ready():
        while not ready.exists():
            time.sleep(0.05)
        task.kill()

    threading.Thread(target=kill_when_ready, daemon=True).start()
    t0 = time.monotonic()
    env = {"READY": str(ready), "CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(JobError, match="killed by SIGKILL"):
        rank(server, "sleeps", env=env, requester=task.pid)
    assert time.monotonic() - t0 < 30 and ready.read_text() == "3"
    task.wait()
    ready.unlink()   # a task already gone: the rank ends at once
    with pytest.raises(JobError, match="killed by SIGKILL"):
        rank(server, "sleeps", env=env, requester=task.pid)


def test_a_rank_that_crashes_is_named_with_the_stacks_its_log_holds(server):
    """A rank killed by a signal sends no result: its error names the signal and quotes the Python
    stacks faulthandler wrote to the rank's log at the crash (every thread's)."""
    crash = r"killed by SIGSEGV; the stacks at the crash end its log .*rank00000"
    with pytest.raises(JobError, match=crash) as e:
        rank(server, "crashes")
    stacks = str(e.value.__cause__)
    line = {ln.strip(): i + 1 for i, ln in enumerate(PROBES.split("\n"))}
    assert "Fatal Python error: Segmentation fault" in stacks
    assert f'probes.py", line {line["ctypes.string_at(0)"]} in crashes' in stacks
    assert f'probes.py", line {line["time.sleep(60)"]} in idle' in stacks   # the other thread's stack too


@pytest.mark.parametrize("kind,cls,text", [
    ("trace", TraceError, "bad part"), ("value", ValueError, "bad value"),
    ("injected", None, "injected on rank 1"), ("user", RuntimeError, "probes.UserError: from the user")])
def test_a_ranks_exception_is_raised_again_as_its_class_where_the_host_may_import_it(server, kind, cls, text):
    """ttrace's errors, builtins and classes of torch's and ttrace's packages come back as themselves;
    a user's module is never imported by the host: its class is a RuntimeError naming it."""
    from workloads.faults import InjectedFault

    cls = cls or InjectedFault
    with pytest.raises(Exception) as got:
        rank(server, "raises", env={"RAISE": kind})
    assert type(got.value) is cls and str(got.value) == text


def test_a_class_that_does_not_give_its_message_back_is_a_runtime_error_naming_it(monkeypatch):
    import types

    from orchestrator.fork_server import _rebuilt

    loaded = types.ModuleType("probe_errors")

    class Prefixed(Exception):
        def __init__(self, message):
            super().__init__(f"probe: {message}")

    Prefixed.__module__ = "probe_errors"
    loaded.Prefixed = Prefixed
    monkeypatch.setitem(sys.modules, "probe_errors", loaded)
    got = _rebuilt({"module": "probe_errors", "type": "Prefixed", "message": "probe: x"})
    assert type(got) is RuntimeError and str(got) == "probe_errors.Prefixed: probe: x"


def test_the_server_and_its_ranks_end_with_their_host(tmp_path):
    """A host (here a plain process) that dies while its rank runs takes the server and the rank with
    it: nothing keeps running for a job nobody waits for, and nothing is left on disk (Ray kills a dead
    actor's children with SIGKILL: a socket file would have stayed)."""
    (tmp_path / "probes.py").write_text(PROBES)
    ready = tmp_path / "ready"
    host = textwrap.dedent(f"""
        import sys
        from orchestrator.fork_server import TRACER_IMPORTS, ForkServer, pool_preloads
        fs = ForkServer(("torch",))
        print(fs.proc.pid, fs.path, flush=True)
        spec = {{"job": {{"entrypoint": "probes:sleeps", "workdir": {str(tmp_path)!r}}},
                 "trace": {{"enabled": False}}}}
        fs.run("orchestrator.jobs:run_rank", spec, 0, 1, "127.0.0.1", 1, node=None,
               env={{"READY": {str(ready)!r}}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", host], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **worker_env()})
    server_pid, socket_path = proc.stdout.readline().split()
    server_pid = int(server_pid)
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    ranks = [int(p) for p in open(f"/proc/{server_pid}/task/{server_pid}/children").read().split()]
    assert len(ranks) == 1
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while any(map(running, (server_pid, *ranks))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, (server_pid, *ranks)))
    # Its socket is abstract (Linux): nothing on disk to leave behind, and gone from the kernel's table.
    assert socket_path.startswith("@ttrace-forks-") and not any(
        ln.endswith(socket_path) for ln in open("/proc/net/unix").read().splitlines())


def running(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_host_reports_a_failed_rank_without_importing_torch():
    """A rank host never needs torch, and must not import it to report a rank that died: that import
    (2-3 s on a loaded node) outlasted the scheduler's grace period, and the rank that caused the
    failure was reported as 'still running' beside its peer's collective error."""
    script = """
import sys
from orchestrator.fork_server import outcome
from tracer.errors import JobError
try:
    outcome(None, 17 << 8, {}, 1, None)
except JobError as e:
    print(e)
import tracer
light = "torch" not in sys.modules
print(light, all(getattr(tracer, n) is not None for n in tracer.__all__))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **worker_env()})
    assert out.stdout.splitlines() == [
        "rank 1's process exited with code 17 before reporting a result (see its log)", "True True"], \
        out.stdout + out.stderr


def test_a_dead_fork_server_is_started_anew_once_however_many_rank_tasks_find_it_dead():
    """Rank tasks run on the rank host's threads at once: those that find its fork server dead
    together start one new server between them (each had started its own, and the spares idled until
    the host ended)."""
    from orchestrator.rank_tasks import RankHost

    others = set(_children())   # the module's own server among them
    host = RankHost()
    first = host.server
    first.proc.kill()
    first.proc.wait()
    together = threading.Barrier(4)
    got = []

    def ask():
        together.wait()
        got.append(host.live_server())

    threads = [threading.Thread(target=ask) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Every process this one started meanwhile, whatever it calls itself (a server retitles itself
        # as it starts: a read of its command line then may match neither title): the new server alone.
        started = set(_children()) - others
        assert len({id(s) for s in got}) == 1 and got[0] is not first and got[0].alive()
        assert started == {got[0].proc.pid}, [(pid, _cmdline(pid)) for pid in started]
    finally:
        for pid in set(_children()) - others:
            if _is_server(pid):
                os.kill(pid, 9)
        host.server.close()


def _children():
    """This process's children, by every process's parent field (/proc/<pid>/stat): the per-thread
    /proc/self/task/*/children lists are documented as unreliable while children come and go."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read() if entry.isdigit() else ""
        except OSError:   # ended meanwhile
            continue
        if stat and int(stat.rpartition(")")[2].split()[1]) == me:
            out.append(int(entry))
    return out


def _cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except FileNotFoundError:
        return b""


def _is_server(pid):
    """A fork server, before or after it titles itself."""
    cmdline = _cmdline(pid)
    return b"fork_server import serve" in cmdline or cmdline.startswith(b"ttrace fork server:")
