"""Checks: reference + perturbed references + candidate on Ray, then compare, report, log.

`run_checks` runs any number of checks (a Hydra sweep, a nightly matrix) on one Ray cluster: every
check's candidate and every *distinct* reference set go to the cluster together, so jobs run
concurrently as resources allow. References live in a content-keyed cache in the store
(`<store>/refcache/<key>/`, key = recipe.reference_key): a check whose key has a complete entry
reuses it, and checks of one sweep that share a key compute it once.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

from orchestrator import cluster, recipe, storage, tracking
from tracer.compare import Comparison, compare
from tracer.errors import TTraceError
from tracer.isolation import localize
from tracer.job import run_name
from tracer.logical import LogicalTrace, load_logical
from tracer.store import read_run
from tracer.tolerance import TolerancePolicy

EXIT = {"pass": 0, "fail": 1, "error": 2}
CACHE_DIR = "refcache"
COMPLETE = "COMPLETE.json"


@dataclass
class CheckResult:
    verdict: str                  # pass | fail | error
    report_path: Path
    report: dict[str, Any]
    message: str = ""

    @property
    def exit_code(self) -> int:
        return EXIT[self.verdict]


@dataclass
class _RefSet:
    """One reference + R perturbed references, either found complete in the cache or computed now."""
    key: str
    entry_url: str                # <store>/refcache/<key>
    url: str                      # root of the runs: <entry_url>/<attempt>
    runs: list[str]
    cache: str                    # hit (complete entry reused) | miss (computed) | off (cache=false)
    jobs: list[cluster.Job] = field(default_factory=list)
    computed_by: str = ""         # check_id whose plan computed it
    error: str | None = None
    why_off: str | None = None    # why a stored entry may not be reused (recipe.cacheable)


@dataclass
class _Planned:
    rec: dict[str, Any]
    output_dir: Path
    check_id: str
    report: dict[str, Any]
    t_start: float
    candidate: cluster.Job | None = None
    store_url: str = ""
    refs: _RefSet | None = None
    error: str | None = None
    comparison: Comparison | None = None
    loaded: tuple[LogicalTrace, list[LogicalTrace]] | None = None   # reference, perturbed
    base_dir: str = ""


def run_check(rec: dict[str, Any], output_dir: Path, base_dir: str) -> CheckResult:
    """Run one check end to end. Every failure becomes verdict 'error' with a message, never a pass."""
    return run_checks([(rec, output_dir)], base_dir)[0]


def run_checks(items: list[tuple[dict[str, Any], Path]], base_dir: str, *, progress: bool = False,
               parent_run_id: str | None = None) -> list[CheckResult]:
    """Run several checks together on one Ray cluster; results in the order of `items`."""
    plans = [_plan(rec, out, base_dir) for rec, out in items]
    live = [p for p in plans if p.error is None]
    refsets = _share_references(live, base_dir)
    jobs = [j for rs in refsets for j in rs.jobs] + [p.candidate for p in live if p.candidate]
    if jobs:
        try:
            ray_s = cluster.ensure_ray(live[0].rec["cluster"])
            cpus = max(float(p.rec["cluster"]["cpus_per_rank"]) for p in live)
            timeout = max(float(p.rec["timeout_s"]) for p in live)
            t0 = time.perf_counter()
            with _progress(progress) as on_change:
                cluster.run_jobs(jobs, cpus_per_rank=cpus, timeout_s=timeout,
                                 error_dir=live[0].output_dir / "errors", on_change=on_change)
            wall = time.perf_counter() - t0
            for p in live:
                p.report["timings"].update(ray_start=ray_s, jobs_wall=wall)
        except TTraceError as e:
            for p in live:
                p.error = str(e)
    for rs in refsets:
        _commit(rs)
    for p in plans:
        _judge(p)
    isolate = [p for p in plans if p.comparison is not None and _wants_isolation(p)]
    keep = {id(p) for p in isolate}
    for p in plans:   # loaded traces are kept only for the isolation pass (memory of large sweeps)
        if id(p) not in keep:
            p.loaded = None
    _isolate(isolate, progress)
    return [_finish(p, base_dir, parent_run_id) for p in plans]


def _plan(rec: dict[str, Any], output_dir: Path, base_dir: str) -> _Planned:
    check_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    p = _Planned(rec, output_dir, check_id, {"check_id": check_id, "recipe": rec, "timings": {}},
                 time.perf_counter(), base_dir=base_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    try:
        recipe.validate(rec, base_dir)
        p.report["job"] = {k: v for k, v in recipe.job_of(rec, base_dir).items() if k != "env"}
        opts = storage.options(rec["store"])
        root = recipe.resolve_url(rec["store"]["url"], base_dir).rstrip("/")
        storage.preflight(root, opts)
        p.store_url = f"{root}/{check_id}"
        p.report["store"] = p.store_url
        world = int(rec["parallel"]["world_size"])
        spec = recipe.job_spec(rec, role="candidate", store_url=p.store_url, base_dir=base_dir,
                               log=_log_dir(output_dir, "candidate"))
        p.candidate = cluster.Job("candidate", spec, world, label=check_id, timeout_s=float(rec["timeout_s"]),
                                  error_dir=output_dir / "errors")
    except TTraceError as e:
        p.error = str(e)
    return p


def _log_dir(output_dir: Path, run: str) -> dict[str, Any]:
    """Where a job's ranks write their stdout and stderr (orchestrator/jobs.py): the check directory,
    when the rank runs on this node."""
    return {"dir": str((output_dir / "logs" / run).resolve())}   # cluster.run_jobs adds this node's id


def _share_references(plans: list[_Planned], base_dir: str) -> list[_RefSet]:
    """Attach a reference set to every plan: a complete cache entry, or one computation per key."""
    computing: dict[str, _RefSet] = {}
    for p in plans:
        key = recipe.reference_key(p.rec)
        root = p.store_url.rsplit("/", 1)[0]
        entry = f"{root}/{CACHE_DIR}/{key}"
        if key in computing and computing[key].entry_url == entry:
            p.refs = computing[key]
            continue
        not_cached = recipe.cacheable(p.rec)
        found = _lookup(entry) if not_cached is None else None
        if found is not None:
            p.refs = found
            continue
        attempt = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        R = int(p.rec["tolerance"]["perturbations"])
        runs = ["reference"] + [run_name("perturbed", r) for r in range(1, R + 1)]
        rs = _RefSet(key, entry, f"{entry}/{attempt}", runs, "miss" if not_cached is None else "off",
                     computed_by=p.check_id, why_off=not_cached)
        for r, run in enumerate(runs):
            # The reference runs the candidate's code (its bug switches too) on one device, differing
            # only where the recipe's reference.* says (recipe.job_spec).
            spec = recipe.job_spec(p.rec, role="perturbed" if r else "reference", perturb=r or None,
                                   store_url=rs.url, parallel=recipe.SINGLE_DEVICE,
                                   base_dir=base_dir, log=_log_dir(p.output_dir, run))
            timeout = float(p.rec["timeout_s"])
            rs.jobs.append(cluster.Job(run, spec, 1, label=f"ref {key[:8]}", timeout_s=timeout,
                                       error_dir=p.output_dir / "errors"))
        computing[key] = rs
        p.refs = rs
    return list(computing.values())


def _lookup(entry: str) -> _RefSet | None:
    """A cache entry is reused only if its COMPLETE marker exists and every run's manifests are committed."""
    fs, path = fsspec.core.url_to_fs(entry)
    try:
        with fs.open(f"{path}/{COMPLETE}", "r") as f:
            info = json.load(f)
        url = f"{entry}/{info['attempt']}"
        for run in info["runs"]:
            read_run(url, run, 1)
    except (FileNotFoundError, KeyError, json.JSONDecodeError, TTraceError):
        return None
    return _RefSet(entry.rsplit("/", 1)[1], entry, url, list(info["runs"]), "hit",
                   computed_by=info.get("computed_by", ""))


def _commit(rs: _RefSet) -> None:
    """Mark a freshly computed entry complete (last, after every run's manifests are committed)."""
    if rs.cache == "hit":
        return
    rs.error = next((j.error for j in rs.jobs if j.error), None)
    if rs.error is None and any(j.state != "done" for j in rs.jobs):
        rs.error = "reference jobs did not run"
    if rs.error:
        return
    try:
        for run in rs.runs:
            read_run(rs.url, run, 1)
        fs, path = fsspec.core.url_to_fs(rs.entry_url)
        info = {"attempt": rs.url.rsplit("/", 1)[1], "runs": rs.runs, "computed_by": rs.computed_by,
                "code_version": recipe.code_version(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with fs.open(f"{path}/{COMPLETE}", "w") as f:
            json.dump(info, f)
    except (TTraceError, OSError) as e:
        rs.error = f"reference cache entry {rs.entry_url} could not be committed: {e}"


def _judge(p: _Planned) -> None:
    """Compare the candidate with the reference; any failure to do so becomes p.error."""
    timings, report = p.report["timings"], p.report
    try:
        if p.error:
            raise TTraceError(p.error)
        rs = p.refs
        assert rs is not None and p.candidate is not None
        report["reference"] = {"key": rs.key, "cache": rs.cache if rs.computed_by in ("", p.check_id)
                               or rs.cache == "hit" else "shared",
                               "url": rs.url, "computed_by": rs.computed_by}
        if rs.why_off:
            report["reference"]["not_stored_for_reuse"] = rs.why_off
        timings["jobs"] = {j.name: j.seconds for j in ([] if rs.cache == "hit" else rs.jobs) + [p.candidate]}
        _keep_logs(p, ([] if rs.cache == "hit" else rs.jobs) + [p.candidate])
        failed = [e for e in (rs.error, p.candidate.error) if e]
        if failed:
            raise TTraceError("; ".join(failed))
        t0 = time.perf_counter()
        # Read as the comparison walks them: a few parts per rank in memory, not the runs.
        reference = load_logical(rs.url, "reference", 1, lazy=True)
        perturbed = [load_logical(rs.url, run, 1, lazy=True) for run in rs.runs[1:]]
        candidate = load_logical(p.store_url, "candidate", p.candidate.world_size, lazy=True)
        policy = TolerancePolicy.from_config(p.rec["tolerance"])
        per_step = recipe.microbatches_differ(p.rec)
        if per_step:
            report["reference"]["compared"] = (
                f"param_grad and param only: the reference cuts the global batch into microbatches of "
                f"{p.rec['reference']['micro_batch']}, the candidate into {p.rec['data']['micro_batch']}")
        p.comparison = compare(reference, candidate, perturbed, policy, per_step_only=per_step)
        p.loaded = (reference, perturbed)
        timings["compare"] = time.perf_counter() - t0
        report.update(p.comparison.to_json())
    except TTraceError as e:
        p.error, p.comparison = str(e), None


def _keep_logs(p: _Planned, jobs: list[cluster.Job]) -> None:
    """report["logs"]: every rank's log of the check's jobs, relative to the check directory (a rank on
    another node sent its text back with its result)."""
    logs = p.report.setdefault("logs", {})
    for job in jobs:
        paths = []
        for res in job.results:
            if res.get("warning"):
                p.report.setdefault("warnings", []).append(f"job '{job.name}': {res['warning']}")
            log = res.get("log") or {}
            path = Path(log["path"]) if log.get("path") else None
            if path is None and log.get("text") is not None:
                path = Path(_log_dir(p.output_dir, job.name)["dir"]) / f"rank{res['rank']:05d}.log"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(log["text"])
            if path is not None:
                paths.append(os.path.relpath(path, p.output_dir.resolve()))
        if not paths:   # a failed job: whatever its ranks wrote before they stopped
            d = Path(_log_dir(p.output_dir, job.name)["dir"])
            paths = [os.path.relpath(f, p.output_dir.resolve()) for f in sorted(d.glob("rank*.log"))]
        if paths:
            logs[job.name] = paths


def _wants_isolation(p: _Planned) -> bool:
    """`localize: true` (default): on a failed check; `always`: also on a pass (a self-check of the
    isolation pass, which must then flag nothing); `false`: never."""
    mode = p.rec.get("localize", True)
    assert p.comparison is not None
    wanted = mode == "always" or (mode is True and p.comparison.verdict == "fail")
    if wanted and recipe.microbatches_differ(p.rec):
        p.report["localization_error"] = ("no isolation pass: the reference's microbatches are not the "
                                          "candidate's, so its module tensors cannot be fed to them")
        return False
    return wanted


def _isolate(plans: list[_Planned], progress: bool = False) -> None:
    """Isolation pass for failed checks (`localize: true`, the default): rerun each candidate with
    every module fed the reference's tensors (tracer/isolation.py), all on the cluster together, and
    add `culprit` and `blame_window` to the report. A failure here leaves the verdict standing."""
    jobs = []
    for p in plans:
        assert p.refs is not None and p.candidate is not None
        spec = recipe.job_spec(p.rec, role="isolated", store_url=p.store_url,
                               reference=f"{p.refs.url}/reference", base_dir=p.base_dir,
                               log=_log_dir(p.output_dir, "isolated"))
        jobs.append(cluster.Job("isolated", spec, p.candidate.world_size, label=p.check_id,
                                timeout_s=float(p.rec["timeout_s"]), error_dir=p.output_dir / "errors"))
    if not jobs:
        return
    t0 = time.perf_counter()
    try:
        with _progress(progress) as on_change:
            cluster.run_jobs(jobs, cpus_per_rank=max(float(p.rec["cluster"]["cpus_per_rank"]) for p in plans),
                             timeout_s=max(float(p.rec["timeout_s"]) for p in plans),
                             error_dir=plans[0].output_dir / "errors", on_change=on_change)
    except TTraceError as e:
        for p in plans:
            p.report["localization_error"] = str(e)
        return
    wall = time.perf_counter() - t0
    for p, job in zip(plans, jobs, strict=True):
        assert p.comparison is not None and p.loaded is not None
        try:
            _keep_logs(p, [job])
            if job.error:
                raise TTraceError(job.error)
            t1 = time.perf_counter()
            isolated = load_logical(p.store_url, "isolated", job.world_size, lazy=True)
            reference, perturbed = p.loaded
            policy = TolerancePolicy.from_config(p.rec["tolerance"])
            local = compare(reference, isolated, perturbed, policy)
            if p.comparison.verdict == "fail":
                p.report.update(localize(p.comparison, local))
            p.report["isolation"] = {"flagged": sum(not r.ok for r in local.results), "run": "isolated",
                                     "job_s": job.seconds, "jobs_wall": wall,
                                     "compare_s": time.perf_counter() - t1,
                                     "local": {r.name: [r.rel_err, r.elem_err] for r in local.results
                                               if not r.ok}}
        except TTraceError as e:
            p.report["localization_error"] = f"isolation pass failed (the verdict stands): {e}"
        finally:
            p.loaded = None


def compare_stored(rec: dict[str, Any], output_dir: Path, base_dir: str, root: str, *,
                   reference: str = "reference", candidate: str = "candidate",
                   perturbed: list[str] | None = None, isolated: str | None = None) -> CheckResult:
    """The comparison stage alone, for runs traced anywhere (e.g. torchrun on a Slurm cluster that never
    saw Ray) into one store: world sizes and layouts from the manifests, the perturbed runs by name
    (default: every `perturbed-*` run), the isolation pass's run when there is one (default:
    `isolated`, if present). Same report, MLflow run and verdict as a check."""
    from tracer.store import configure, runs_in, world_size_of

    check_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    output_dir.mkdir(parents=True, exist_ok=True)
    report = {"check_id": check_id, "recipe": rec, "timings": {}, "store": root, "source": "ttrace compare"}
    p = _Planned(rec, output_dir, check_id, report, time.perf_counter(), base_dir=base_dir)
    try:
        configure(storage.options(rec.get("store") or {"url": root}))
        present = runs_in(root)
        if perturbed is None:
            perturbed = sorted((r for r in present if r.startswith("perturbed-")),
                               key=lambda r: (len(r), r))
        if not perturbed:
            raise TTraceError(f"no perturbed reference run under {root} (runs present: {present or 'none'}): "
                              "the tolerance is estimated from them; launch the job R >= 2 more times on one "
                              "device with TTRACE_ROLE=perturbed TTRACE_PERTURB=1, 2, ... "
                              "(README, `ttrace compare`)")
        if len(perturbed) < 2:
            raise TTraceError(f"only one perturbed reference run ({perturbed[0]}) under {root}: the "
                              "elementwise tolerance scores each run against the others' noise, so at "
                              "least 2 are needed; launch another with TTRACE_ROLE=perturbed "
                              "TTRACE_PERTURB=2")
        if isolated is None and "isolated" in present:
            isolated = "isolated"
        t0 = time.perf_counter()
        ref = load_logical(root, reference, world_size_of(root, reference), lazy=True)
        pert = [load_logical(root, r, world_size_of(root, r), lazy=True) for r in perturbed]
        world = world_size_of(root, candidate)
        cand = load_logical(root, candidate, world, lazy=True)
        meta = cand.meta
        rec["parallel"] = {"name": meta.get("parallel") or f"world{world}", "world_size": world}
        rec["bug"] = {"name": meta.get("bug") or "none"}
        p.report["job"] = {"label": meta.get("job") or "script"}
        p.report["reference"] = {"url": root, "cache": "external", "key": "",
                                 "runs": {"reference": reference, "perturbed": perturbed,
                                          "candidate": candidate, "isolated": isolated}}
        policy = TolerancePolicy.from_config(rec["tolerance"])
        p.comparison = compare(ref, cand, pert, policy)
        p.report["timings"]["compare"] = time.perf_counter() - t0
        p.report.update(p.comparison.to_json())
        if isolated and p.comparison.verdict == "fail":
            try:
                local = compare(load_logical(root, reference, world_size_of(root, reference), lazy=True),
                                load_logical(root, isolated, world_size_of(root, isolated), lazy=True),
                                [load_logical(root, r, world_size_of(root, r), lazy=True) for r in perturbed],
                                policy)
                p.report.update(localize(p.comparison, local))
            except TTraceError as e:
                p.report["localization_error"] = (f"isolation run '{isolated}' not usable (the verdict "
                                                   f"stands): {e}")
    except TTraceError as e:
        p.error, p.comparison = str(e), None
    return _finish(p, base_dir, None)


def _finish(p: _Planned, base_dir: str, parent_run_id: str | None) -> CheckResult:
    timings, report = p.report["timings"], p.report
    if p.comparison is not None:
        verdict, message = p.comparison.verdict, ""
    else:
        verdict, message = "error", str(p.error)
        report.update(verdict="error", error=message, first_divergence=None, tensors=[])

    report_path = p.output_dir / "report.json"
    report_path.write_text(json.dumps(report, indent=1, default=str))
    html_path = p.output_dir / "report.html"
    try:
        from orchestrator.html_report import write_html

        write_html(report, html_path)
    except Exception as e:  # a rendering bug must not hide the verdict
        report["html_error"] = f"{type(e).__name__}: {e}"
        html_path = None
    t0 = time.perf_counter()
    if p.rec.get("tracking", {}).get("enabled", False):
        try:
            report["mlflow_run_id"] = tracking.log_check(p.rec["tracking"], base_dir, report, report_path,
                                                         html_path=html_path, parent_run_id=parent_run_id)
        except Exception as e:  # a tracking outage must not turn a verdict into a crash
            report["tracking_error"] = f"{type(e).__name__}: {e}"
    timings["tracking"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - p.t_start
    report_path.write_text(json.dumps(report, indent=1, default=str))
    return CheckResult(verdict, report_path, report, message)


class _progress:
    """Live display of the sweep's jobs (rich, on stderr) when enabled; a no-op callback otherwise."""

    def __init__(self, enabled: bool):
        self.enabled, self.live, self.last = enabled, None, ""

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        if console.is_terminal:
            self.live = Live(console=console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self.update

    def update(self, jobs: list[cluster.Job]) -> None:
        from rich.table import Table

        counts = {s: sum(j.state == s for j in jobs) for s in ("queued", "running", "done", "failed")}
        line = (f"ttrace jobs: {counts['queued']} queued, {counts['running']} running, "
                f"{counts['done']} done, {counts['failed']} failed")
        if self.live is None:      # not a terminal (cron, CI, a pipe): one log line per change
            if line != self.last:
                print(line, file=sys.stderr, flush=True)
            self.last = line
            return
        table = Table(title=line, title_justify="left")
        for col in ("for", "job", "ranks", "state"):
            table.add_column(col)
        for j in [j for j in jobs if j.state == "running"][:12]:
            table.add_row(j.label, j.name, str(j.world_size), "[cyan]running")
        for j in [j for j in jobs if j.state == "failed"][:5]:
            table.add_row(j.label, j.name, str(j.world_size), "[red]failed")
        self.live.update(table)

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)
        return False
