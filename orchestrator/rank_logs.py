"""Where a job's ranks write their stdout and stderr: `<check dir>/logs/<run>/rankNNNNN.log` when the
rank runs on the driver's node, else a temporary file whose text goes back with the rank's result
(orchestrator/outcome.py keeps it next to the others)."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

TAIL_LINES = 25
LOG_CAP = 4 << 20     # bytes of a rank's log returned to a driver on another node


def log_dir(output_dir: Path, run: str) -> dict[str, Any]:
    """The job spec's `log` entry: the check directory's logs/<run> (cluster.run_jobs adds the
    driver's node id: a rank elsewhere sends its text back instead)."""
    return {"dir": str((output_dir / "logs" / run).resolve())}


class RankLog:
    """A rank's stdout and stderr, written to the check directory when this worker shares the
    driver's node (else a temporary file whose text goes back with the result), with the last
    stderr lines kept for error messages."""

    def __init__(self, path: Path, local: bool):
        self.path, self.local = path, local
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "w", buffering=1)
        self.lock = threading.Lock()
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def write(self, line: str, stderr: bool) -> None:
        with self.lock:
            self.file.write(line)
            if stderr:
                self.tail.append(line.rstrip("\n"))

    def tail_text(self) -> str:
        if not self.tail:   # in-process entrypoints write straight to the file: read its end
            self.file.flush()
            lines = self.path.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        else:
            lines = list(self.tail)
        return "\n".join("    " + ln for ln in lines) if lines else "    (no output)"

    def where(self) -> dict[str, str]:
        self.file.flush()
        if self.local:
            return {"path": str(self.path)}
        data = self.path.read_bytes()
        return {"text": data[-LOG_CAP:].decode(errors="replace")}


@contextlib.contextmanager
def rank_log(spec: Mapping[str, Any], rank: int, here: str | None = None) -> Iterator[RankLog]:
    """The rank's log file; `here` is this process's Ray node (asked of Ray when not given). A log
    that cannot go to the check directory (no directory set, or another node) is a temporary file,
    removed on exit: its text has travelled back in the rank's result by then (`RankLog.where`). Those
    of ranks killed before they could remove theirs are removed by the next rank that makes one."""
    path = local_path(spec, rank, here or node_id())
    if path is not None:
        rl = RankLog(path, local=True)
    else:
        sweep_orphaned_logs()
        rl = RankLog(Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{_owner()}-")) / f"rank{rank:05d}.log",
                     local=False)
    try:
        yield rl
    finally:
        rl.file.close()
        if not rl.local:   # until 2026-11-29 never removed: 391 of them in one machine's /tmp
            shutil.rmtree(rl.path.parent, ignore_errors=True)


TEMP_PREFIX = "ttrace-log-"


def _pid_namespace() -> int:
    """This process's pid namespace (only a dead process of this namespace may have its temporary log
    removed by another); 0 where /proc cannot tell."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _owner() -> str:
    """`<pid namespace>.<pid>`: the owner a temporary log is named after."""
    return f"{_pid_namespace()}.{os.getpid()}"


def sweep_orphaned_logs() -> list[Path]:
    """Remove the temporary logs of ranks that died before removing their own (a rank killed by a
    signal runs no cleanup: its job stopped, a fault test, the OOM killer); returns what was removed.
    Their text never travelled back and nobody reads them. Only this user's, of this pid namespace,
    whose process is gone; logs named before 2026-12-06 (no owner in the name) are left alone."""
    ns = str(_pid_namespace())
    removed: list[Path] = []
    if ns == "0":
        return removed
    for d in Path(tempfile.gettempdir()).glob(f"{TEMP_PREFIX}{ns}.*-*"):
        pid = d.name[len(TEMP_PREFIX) + len(ns) + 1:].partition("-")[0]
        try:
            mine = d.stat().st_uid == os.getuid()
        except OSError:   # removed meanwhile
            continue
        if pid.isdigit() and mine and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def local_path(spec: Mapping[str, Any], rank: int, here: str | None) -> Path | None:
    """The rank's log in the check directory when the rank runs on the driver's node (`here`: its
    node); None when it goes to a temporary file instead."""
    log = spec.get("log") or {}
    if log.get("dir") and (not log.get("node") or log.get("node") == here):
        return Path(log["dir"]) / f"rank{rank:05d}.log"
    return None


def crash_lines(path: Path | None, limit: int = 60) -> str:
    """The end of a log from the last 'Fatal Python error' on (faulthandler's stacks of a rank killed
    by a signal), else its last TAIL_LINES lines; '' when there is no such log."""
    try:
        lines = path.read_text(errors="replace").splitlines() if path is not None else []
    except OSError:
        return ""
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error")]
    return "\n".join(lines[starts[-1]:][:limit] if starts else lines[-TAIL_LINES:])


def node_id() -> str | None:
    """This process's Ray node, None outside Ray. A process that never imported Ray (a forked rank)
    is not connected to it: asked there, importing Ray would cost the rank 0.3 s for nothing."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None


def pump(stream: Any, log: RankLog, stderr: bool) -> None:
    for line in stream:
        log.write(line, stderr)


@contextlib.contextmanager
def output_to(log: RankLog) -> Iterator[None]:
    """This process's fds 1 and 2 (Python and C output alike) into the rank's log, then back."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(log.file.fileno(), 1)
    os.dup2(log.file.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
