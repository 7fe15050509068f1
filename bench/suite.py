"""What the test suite costs: wall time, CPU, Ray worker starts, memory -> bench/suite.json.

Issue 16 wants `make test` under 10 minutes on a fresh 2-core clone. Wall time alone does not say
why a run was slow or whether a change helped on a shared machine; this runs the tests once as
`make test` does (scripts/run_tests.sh) and records beside it what the machine did meanwhile:

- busy CPU-seconds of the whole machine (/proc/stat) and their share of what the cores could give:
  the idle share is what packing the work differently can still win, beyond it only less work helps;
- Ray workers started (log files of the test session's Ray cluster): each boots Python and Ray
  (~0.8 s of CPU on an idle machine) and some then import torch;
- the peak memory in use (MemTotal - MemAvailable, sampled every second).

It exits 1 when a test fails or the suite's wall time misses the goal. The goal is judged on pytest
alone, which is what a change to the tests moves; with --fresh-clone, on `make test` in a fresh clone
of HEAD, as CI runs it (the setup included: venv, bytecode, compiled kernels; `setup_s`).

Usage: python bench/suite.py [--goal-s 600] [--fresh-clone] [pytest args, default: tests]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "suite.json"
GOAL_S = 600.0   # issue 16: `make test` under 10 minutes


def _busy_jiffies() -> int:
    """Jiffies this machine's CPUs ran anything since boot (not idle, iowait, or stolen by the host)."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text()
                                                           .split("\n", 1)[0].split()[1:8])
    return user + nice + system + irq + softirq


def _meminfo_mb(key: str) -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def _used_mb() -> float:
    return _meminfo_mb("MemTotal") - _meminfo_mb("MemAvailable")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _ray_sessions() -> set[Path]:
    root = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"
    return set(root.glob("session_2*")) if root.is_dir() else set()


def measure(cmd: list[str], cwd: Path, cpus: int, env: dict[str, str] | None = None,
            stamp: Path | None = None) -> dict[str, Any]:
    """Run `cmd` once (the test suite); its outcome and what the machine (`cpus` cores) spent meanwhile.
    `stamp`: a file the command creates once its setup is done (when it appears: `setup_s`)."""
    sessions_before, peak, done, setup = _ray_sessions(), [_used_mb()], threading.Event(), [None]
    hz = os.sysconf("SC_CLK_TCK")
    busy0, t0 = _busy_jiffies(), time.perf_counter()

    def sample() -> None:
        while not done.wait(1.0):
            peak[0] = max(peak[0], _used_mb())
            if stamp is not None and setup[0] is None and stamp.exists():
                setup[0] = round(time.perf_counter() - t0, 1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    wall, busy = time.perf_counter() - t0, (_busy_jiffies() - busy0) / hz
    done.set()
    sampler.join()
    sys.stdout.write(proc.stdout[-6000:])
    sys.stderr.write(proc.stderr[-3000:])
    counts: dict[str, int] = {}   # summed over the two phases' summary lines
    for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", proc.stdout):
        counts[k] = counts.get(k, 0) + int(n)
    new = _ray_sessions() - sessions_before
    workers = sum(len(list((s / "logs").glob("worker-*.out"))) for s in new)
    out = {"exit_code": proc.returncode, "tests": counts,
           "wall_s": round(wall, 1), "busy_cpu_s": round(busy, 1),
           "cpu_busy_share": round(busy / (wall * cpus), 3), "ray_sessions": len(new),
           "ray_workers_started": workers, "peak_mem_used_mb": round(peak[0]),
           # the two parts' own figures (pytest's summary lines: multi-rank, then single-process)
           "pytest_phases_s": [float(x) for x in re.findall(r" in ([0-9.]+)s", proc.stdout)]}
    if stamp is not None:
        out["setup_s"] = setup[0]
    return out


def fresh_clone(cpus: int) -> dict[str, Any]:
    """`make test` in a fresh clone of this checkout's HEAD, as CI runs it: the venv, its bytecode and
    the compiled kernels set up from nothing, then the tests."""
    with tempfile.TemporaryDirectory(prefix="ttrace-fresh-") as tmp:
        clone = Path(tmp) / "ttrace"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        return measure(["make", "test"], clone, cpus, stamp=clone / ".venv" / ".installed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--goal-s", type=float, default=GOAL_S, help="the suite's wall-time goal, seconds")
    ap.add_argument("--fresh-clone", action="store_true",
                    help="`make test` in a fresh clone of HEAD, setup included (the goal judges all of it)")
    args, pytest_args = ap.parse_known_args()
    cpus = len(os.sched_getaffinity(0))
    if args.fresh_clone:
        measured = {"fresh_clone": True, **fresh_clone(cpus)}
    else:   # as `make test` runs them: the multi-rank tests, the single-process ones beside them
        pytest_args = pytest_args or ["tests"]
        measured = {"pytest_args": pytest_args,
                    **measure(["sh", str(ROOT / "scripts" / "run_tests.sh"), *pytest_args], ROOT, cpus,
                              env={**os.environ, "PY": sys.executable})}
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": _cpu_model(), "cpus": cpus,
              "mem_total_mb": round(_meminfo_mb("MemTotal")),
              "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True).stdout.strip(),
              "goal_s": args.goal_s, **measured}
    over = result["wall_s"] > args.goal_s
    result["missed"] = [f"wall {result['wall_s']} s > {args.goal_s:g} s"] if over else []
    OUT.write_text(json.dumps(result, indent=1))
    setup = f" (setup {result['setup_s']} s)" if args.fresh_clone else ""
    print(f"\nsuite: {result['tests']} in {result['wall_s']} s wall{setup}, pytest phases "
          f"{result['pytest_phases_s']} s, {result['busy_cpu_s']} busy CPU-s ({result['cpu_busy_share']:.0%} "
          f"of {result['cpus']} cores), {result['ray_workers_started']} Ray workers started, peak "
          f"{result['peak_mem_used_mb']} MB in use; wrote {OUT.relative_to(ROOT)}")
    if result["exit_code"] != 0:
        sys.exit(f"tests failed (exit code {result['exit_code']})")
    if result["missed"]:
        sys.exit(f"goal missed: {result['missed'][0]}")


if __name__ == "__main__":
    main()
