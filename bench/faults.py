"""Fault suite: every fault must end in a clear verdict or error (exit 1 or 2, never 0) within a bounded
time, and lose no completed result (report.json on disk, MLflow run logged) -> bench/faults.json.

Checks run through the `ttrace` CLI (subprocesses) on one Ray cluster started here; they share one
store, so the reference set is computed once and later checks run only their candidate. Trace
damage (truncated, corrupt, missing, other recipe, shape/dtype mismatch) is applied to a copy of a
completed check's candidate trace and judged by the comparison stage (`load_logical` + `compare`),
which turns any TTraceError into exit 2.

Usage: python bench/faults.py [--only name,name]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.cluster import rank_worker_pids  # noqa: E402
from orchestrator.console import report_paths  # noqa: E402
from orchestrator.rank_tasks import free_port  # noqa: E402

OUT = ROOT / "bench" / "faults.json"
TTRACE = str(ROOT / ".venv" / "bin" / "ttrace")
BASE = ["parallel=tp2", "model.layers=2", "tolerance.perturbations=2"]   # small and quick on 2 cores


@dataclass
class Outcome:
    fault: str
    expect: str                   # the exit codes that count as survived, e.g. "2" or "1"
    exit: int | None = None
    seconds: float = 0.0
    bound_s: float = 0.0
    survived: bool = False
    lost: int = 0                 # completed results missing from disk or MLflow
    detail: str = ""
    reports: list[str] = field(default_factory=list)


class Suite:
    def __init__(self, work: Path, address: str):
        self.work, self.address = work, address
        self.store = work / "store"
        self.outcomes: list[Outcome] = []
        self.base_report: dict[str, Any] | None = None

    def ttrace(self, *overrides: str, timeout: float = 600, cwd: Path | None = None,
               on_start: Callable[[subprocess.Popen], None] | None = None) -> tuple[int, str, str, float]:
        args = [TTRACE, *overrides, f"cluster.address={self.address}"]
        if not any(o.startswith("store.url=") for o in overrides):
            args.append(f"store.url={self.store}")
        t0 = time.monotonic()
        proc = subprocess.Popen(args, cwd=cwd or self.work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        if on_start:
            threading.Thread(target=on_start, args=(proc,), daemon=True).start()
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            return -1, out, err + f"\n[bench] killed after {timeout:.0f} s", time.monotonic() - t0
        return proc.returncode, out, err, time.monotonic() - t0

    def add(self, o: Outcome) -> None:
        self.outcomes.append(o)
        _write(self.outcomes, partial=True)   # an interrupted suite still leaves its results

    def lost(self, stdout: str, cwd: Path) -> tuple[int, list[str]]:
        """Reports named on stdout that are missing, or completed without their MLflow run."""
        import mlflow

        paths = report_paths(stdout, cwd)
        mlflow.set_tracking_uri(f"sqlite:///{cwd}/mlflow.db")
        runs = {r.info.run_id for r in mlflow.search_runs(search_all_experiments=True, output_format="list")}
        lost = 0
        for p in paths:
            if not p.exists():
                lost += 1
                continue
            rep = json.loads(p.read_text())
            if rep["verdict"] in ("pass", "fail") and rep.get("mlflow_run_id") not in runs:
                lost += 1
        return lost, [str(p) for p in paths]

    def run(self, name: str, overrides: list[str], expect: set[int], bound_s: float, *,
            cwd: Path | None = None, on_start: Callable[[subprocess.Popen], None] | None = None,
            note: str = "", report: bool = True, must: str = "") -> Outcome:
        """`must`: text the error has to contain, so a fault that ends in exit 2 for another reason
        (e.g. the job never got scheduled) does not count as survived."""
        cwd = cwd or self.work
        code, out, err, secs = self.ttrace(*overrides, timeout=bound_s + 60, cwd=cwd, on_start=on_start)
        lost, reports = self.lost(out, cwd)
        lines = (err if code == 2 else out).strip().splitlines() or [""]
        msg = (lines[-1] if code == 2 else lines[0])[:200]
        o = Outcome(name, "|".join(map(str, sorted(expect))), code, secs, bound_s,
                    code in expect and secs <= bound_s and (bool(reports) or not report)
                    and must in (err if code == 2 else out), lost,
                    (note + " " if note else "") + msg, reports)
        self.add(o)
        print(f"  {name:<28} exit {code}  {secs:6.1f}s  {'ok' if o.survived else 'NOT SURVIVED'}"
              f"  lost {lost}  {o.detail[:120]}", flush=True)
        return o

    def record(self, name: str, survived: bool, detail: str, seconds: float = 0.0, expect: str = "2") -> None:
        o = Outcome(name, expect, 2 if survived else 0, seconds, 0.0, survived, 0, detail)
        self.add(o)
        print(f"  {name:<28} {'ok' if survived else 'NOT SURVIVED'}  {detail[:150]}", flush=True)


def _when_ranks_run(action: Callable[[], None], n: int = 2, delay: float = 2.0, limit: float = 300):
    """on_start hook: once n rank workers run (the candidate's, on a cache hit), wait, then act."""
    def hook(proc: subprocess.Popen) -> None:
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < limit:
            if len(rank_worker_pids()) >= n:
                time.sleep(delay)
                action()
                return
            time.sleep(0.2)
    return hook


# -- the faults --------------------------------------------------------------------------------------

def baseline(s: Suite) -> None:
    """A clean check: fills the reference cache and gives a complete trace to damage later."""
    code, out, err, secs = s.ttrace(*BASE)
    if code != 0:
        raise SystemExit(f"baseline check did not pass (exit {code}): {err[-2000:]}")
    s.base_report = json.loads(report_paths(out, s.work)[-1].read_text())
    print(f"  baseline (clean, pass)       {secs:6.1f}s", flush=True)


def job_faults(s: Suite) -> None:
    s.run("rank raises", [*BASE, "fault.kind=raise", "fault.rank=1", "fault.step=1"], {2}, 300,
          must="rank 1 raised")
    s.run("rank killed mid-step", [*BASE, "fault.kind=exit", "fault.rank=1", "fault.step=1"], {2}, 300,
          must="rank 1's process exited with code 17")
    s.run("rank hangs in collective", [*BASE, "fault.kind=hang", "fault.rank=0", "fault.step=1",
                                       "timeout_s=40"], {2}, 40 + 180, must="timed out")


def nan_fault(s: Suite) -> None:
    s.run("NaN gradient", [*BASE, "fault.kind=nan_grad", "fault.rank=0", "fault.step=0"], {1}, 400)


def worker_lost(s: Suite) -> None:
    # The candidate's rank 0 hangs (timeout 300 s) so the kill lands while the job runs; the check
    # must end in exit 2 long before that timeout.
    def kill() -> None:
        pids = rank_worker_pids()
        if pids:
            os.kill(pids[0], signal.SIGKILL)
    s.run("Ray worker lost (kill -9)", [*BASE, "fault.kind=hang", "fault.rank=0", "fault.step=0",
                                        "timeout_s=300"], {2}, 150, on_start=_when_ranks_run(kill))


def sweep_with_one_fault(s: Suite) -> None:
    """A sweep where one check dies: the others' reports and MLflow runs must all be there."""
    o = s.run("sweep, one check dies", ["-m", *BASE, "fault.kind=none,exit", "fault.rank=1", "fault.step=0"],
              {2}, 400)
    if len(o.reports) != 2:
        o.survived, o.detail = False, f"expected 2 report lines, got {len(o.reports)}; " + o.detail


def trace_damage(s: Suite) -> None:
    from orchestrator.recipe import compose
    from tracer.compare import compare
    from tracer.errors import TTraceError
    from tracer.logical import load_logical
    from tracer.tolerance import TolerancePolicy

    rep = s.base_report
    assert rep is not None
    ref_url = rep["reference"]["url"]
    runs = json.loads((Path(rep["reference"]["url"]).parent / "COMPLETE.json").read_text())["runs"]
    ref, *pert = (load_logical(ref_url, r, 1) for r in runs)   # undamaged: must load
    policy = TolerancePolicy.from_config(compose(BASE)["tolerance"])
    src = Path(rep["store"]) / "candidate"

    def judge(name: str, damage: Callable[[Path], None], mutate: Callable[[Any], None] | None = None,
              must: str = "") -> str:
        """Survived: an error (exit 2) whose message contains `must` (it names the fault, not some
        other failure), or a FAIL whose reason contains it."""
        root = s.work / "damaged" / name.replace(" ", "_")
        shutil.copytree(src, root / "candidate")
        damage(root / "candidate" / "rank00001")
        t0 = time.monotonic()
        try:
            cand = load_logical(str(root), "candidate", 2)
            if mutate:
                mutate(cand)
            res = compare(ref, cand, pert, policy)
        except TTraceError as e:   # the check turns this into exit 2 with this message
            if name != "undamaged copy":
                s.record(name, must in str(e), str(e), time.monotonic() - t0)
            return "error"
        if name != "undamaged copy":
            why = res.first_divergence.reason if res.first_divergence else ""
            s.record(name, res.verdict == "fail" and must in why, f"verdict {res.verdict}: {why}",
                     time.monotonic() - t0, "1")
        return res.verdict

    if (v := judge("undamaged copy", lambda d: None)) != "pass":   # the harness itself must be sound
        raise SystemExit(f"an undamaged copy of the candidate trace gave '{v}', not pass")
    part = lambda d: sorted(d.glob("part-*.safetensors"))[0]

    def truncate(d: Path) -> None:
        data = part(d).read_bytes()
        part(d).write_bytes(data[: len(data) // 2])

    def corrupt(d: Path) -> None:
        data = bytearray(part(d).read_bytes())
        data[-100] ^= 0xFF   # one flipped byte in the tensor data: same size, wrong checksum
        part(d).write_bytes(bytes(data))

    def other_recipe(d: Path) -> None:
        m = json.loads((d / "manifest.json").read_text())
        m["meta"]["fingerprint"] = "0" * len(m["meta"]["fingerprint"])
        (d / "manifest.json").write_text(json.dumps(m))

    def shape(cand: Any) -> None:
        name = next(n for n in cand.order if cand.tensors[n].tensor.dim() == 2)
        cand.tensors[name].tensor = cand.tensors[name].tensor[:, :-1]

    def dtype(cand: Any) -> None:
        name = cand.order[0]
        cand.info[name] = dict(cand.info[name], dtype="bfloat16")

    judge("trace part truncated", truncate, must="truncated or corrupt")
    judge("trace part corrupted", corrupt, must="checksum mismatch")
    judge("trace part missing", lambda d: part(d).unlink(), must="listed in the manifest is missing")
    judge("rank manifest missing", lambda d: (d / "manifest.json").unlink(),
          must="no committed manifest for rank(s) [1]")
    judge("manifest of other recipe", other_recipe, must="different recipe")
    # A candidate tensor of another shape is a wrong layout: a verdict at that tensor (reason shape).
    judge("shape mismatch", lambda d: None, shape, must="shape: candidate reassembles")
    judge("dtype mismatch", lambda d: None, dtype, must="bfloat16 but the reference as float32")


def recipe_errors(s: Suite) -> None:
    s.run("malformed recipe (steps=0)", [*BASE, "steps=0"], {2}, 120)
    # Hydra cannot compose it: no check, so no report line; the message names the bad option.
    s.run("malformed recipe (no group)", ["parallel=no_such_layout"], {2}, 120, report=False)
    s.run("malformed recipe (heads)", [*BASE, "model.heads=3"], {2}, 120)


def s3_faults(s: Suite) -> None:
    import s3fs
    from moto.server import ThreadedMotoServer

    port = free_port("127.0.0.1")
    s.run("S3 endpoint unreachable", [*BASE, "store=s3", "store.url=s3://nowhere/runs",
                                      f"store.endpoint_url=http://127.0.0.1:{port}"], {2}, 120)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    s3fs.S3FileSystem(endpoint_url=url).mkdir("ttrace-bench")
    stopped: list[float] = []

    def stop() -> None:
        server.stop()
        stopped.append(time.monotonic())
    # A fresh prefix: the references are computed too, so the server goes away while ranks write.
    s.run("S3 endpoint gone mid-write", [*BASE, "store=s3", "store.url=s3://ttrace-bench/runs",
                                         f"store.endpoint_url={url}", "store.connect_timeout=2",
                                         "store.read_timeout=5", "store.max_attempts=2"],
          {2}, 300, on_start=_when_ranks_run(stop, n=1, delay=1.0))
    if not stopped:
        server.stop()


def concurrent_sweeps(s: Suite) -> None:
    """Two sweeps, same store and MLflow db, a fresh reference key: both race to compute it."""
    store = s.work / "shared-store"
    args = ["-m", *BASE, "seed=99", "bug=none,row_parallel_bias_per_rank", f"store.url={store}"]
    results: dict[str, Outcome] = {}

    def one(tag: str) -> None:
        results[tag] = s.run(f"concurrent sweep {tag}", args, {1}, 600)
    threads = [threading.Thread(target=one, args=(t,)) for t in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = (set(results[t].reports) for t in "AB")
    for _, o in sorted(results.items()):
        if a & b:   # same cwd, same second: Hydra gives both sweeps the same multirun directory
            o.survived = False
            o.detail = f"report paths shared by both sweeps: {sorted(a & b)[:1]}; " + o.detail
        verdicts = [json.loads(Path(p).read_text())["verdict"] for p in o.reports if Path(p).exists()]
        if sorted(verdicts) != ["fail", "pass"]:
            o.survived, o.detail = False, f"verdicts {verdicts} (expected pass + fail); " + o.detail
    _write(s.outcomes, partial=True)


GROUPS: dict[str, Callable[[Suite], None]] = {
    "trace": trace_damage, "recipe": recipe_errors, "jobs": job_faults, "nan": nan_fault,
    "worker": worker_lost,
    "sweep": sweep_with_one_fault, "s3": s3_faults, "concurrent": concurrent_sweeps,
}


def _write(outs: list[Outcome], partial: bool = False, seconds: float = 0.0) -> dict[str, Any]:
    summary = {"tried": len(outs), "survived": sum(o.survived for o in outs),
               "data_lost": sum(o.lost for o in outs), "seconds": seconds, "partial": partial}
    OUT.write_text(json.dumps({**summary, "faults": [asdict(o) for o in outs]}, indent=1))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help=f"comma-separated groups of {', '.join(GROUPS)}")
    args = ap.parse_args()
    groups = [g for g in args.only.split(",") if g] or list(GROUPS)
    # Ray workers inherit the environment at start: credentials for the local moto server (any works).
    for var, val in (("AWS_ACCESS_KEY_ID", "ttrace-bench"), ("AWS_SECRET_ACCESS_KEY", "ttrace-bench"),
                     ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(var, val)
    import ray

    from orchestrator.cluster import ensure_ray

    ensure_ray({"address": None, "num_cpus": 8})   # one cluster, owned by this process
    address = ray.get_runtime_context().gcs_address
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="ttrace-faults-") as d:
            suite = Suite(Path(d), address)
            baseline(suite)
            for g in groups:
                GROUPS[g](suite)
    finally:
        ray.shutdown()
    outs = suite.outcomes
    summary = _write(outs, seconds=time.monotonic() - t0)
    print(f"\n{'fault':<30}{'expect':>7}{'exit':>6}{'s':>8}{'survived':>10}{'lost':>6}")
    for o in outs:
        ok = "yes" if o.survived else "NO"
        print(f"{o.fault:<30}{o.expect:>7}{str(o.exit):>6}{o.seconds:>8.1f}{ok:>10}{o.lost:>6}")
    print(f"\nfaults tried {summary['tried']}, survived {summary['survived']}, "
          f"data lost {summary['data_lost']}  ({summary['seconds']:.0f} s)\nwrote {OUT.relative_to(ROOT)}")
    sys.exit(0 if summary["survived"] == summary["tried"] and summary["data_lost"] == 0 else 1)


if __name__ == "__main__":
    main()
