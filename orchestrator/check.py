"""The check pipeline: reference + perturbed references + candidate on Ray, then compare, isolate,
report.

`run_checks` runs any number of checks (a Hydra sweep, a nightly matrix) on one Ray cluster: every
check's candidate and every *distinct* reference set (orchestrator/refcache.py) go to the cluster
together, so jobs run concurrently as resources allow. Failed checks then get their isolation pass
(orchestrator/isolation_pass.py), and every check its report and MLflow run
(orchestrator/outcome.py).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from orchestrator import cluster, compare_tasks, inputs, layouts, recipe, routing, storage
from orchestrator.isolation_pass import isolate, wants_isolation
from orchestrator.outcome import CheckResult, PlannedCheck, finish, keep_logs
from orchestrator.prefetch import ReferencePrefetch
from orchestrator.progress import JobProgress
from orchestrator.rank_logs import log_dir
from orchestrator.refcache import ReferenceSet, commit, share_references
from orchestrator.report import tracking
from tracer.compare import compare
from tracer.errors import TTraceError
from tracer.heap import gc_frozen
from tracer.logical import load_logical
from tracer.routing import routing_flips
from tracer.tolerance import TolerancePolicy


def run_check(rec: dict[str, Any], output_dir: Path, base_dir: str) -> CheckResult:
    """Run one check end to end. Every failure becomes verdict 'error' with a message, never a pass."""
    return run_checks([(rec, output_dir)], base_dir)[0]


def run_checks(items: list[tuple[dict[str, Any], Path]], base_dir: str, *, progress: bool = False,
               parent_run_id: str | None = None) -> list[CheckResult]:
    """Run several checks together on one Ray cluster; results in the order of `items`."""
    plans = [_plan(rec, out, base_dir) for rec, out in items]
    live = [p for p in plans if p.error is None]
    refsets = share_references(live, base_dir)
    # Every set read while the candidates run: cache hits (not in refsets, nothing to compute) now.
    # A set read ahead serves checks measured here; shares in Ray tasks read it themselves.
    ahead = [p.refs for p in live if p.refs is not None and compare_tasks.workers_of(p.rec) <= 1]
    prefetch = ReferencePrefetch(list({id(rs): rs for rs in ahead}.values()))
    prefetch.poll()
    routing.order_jobs(live)
    jobs = [j for rs in refsets for j in rs.jobs] + [p.candidate for p in live if p.candidate]
    tracked = [(p.rec["tracking"], p.report) for p in live if p.rec.get("tracking", {}).get("enabled", False)]
    with tracking.OpenedRuns(tracked, base_dir, parent_run_id) as opened:
        if jobs:
            try:
                ray_s = cluster.ensure_ray(live[0].rec["cluster"])
                opened.start()   # each check's MLflow run opens while the jobs run (after Ray's own imports)
                cpus = max(float(p.rec["cluster"]["cpus_per_rank"]) for p in live)
                timeout = max(float(p.rec["timeout_s"]) for p in live)
                t0 = time.perf_counter()
                with JobProgress(progress) as shown:
                    def on_change(jobs: list[cluster.Job]) -> None:
                        if shown is not None:
                            shown(jobs)
                        prefetch.poll()
                    cluster.run_jobs(jobs, cpus_per_rank=cpus, timeout_s=timeout,
                                     error_dir=live[0].output_dir / "errors", on_change=on_change)
                wall = time.perf_counter() - t0
                for p in live:
                    p.report["timings"].update(ray_start=ray_s, jobs_wall=wall)
            except TTraceError as e:
                for p in live:
                    p.error = str(e)
        with gc_frozen():   # the driver's heap (Ray, torch, MLflow) is not rescanned by every GC pass
            for rs in refsets:
                commit(rs)
            for p in plans:
                _judge(p, prefetch)
            to_isolate = [p for p in plans if p.comparison is not None and wants_isolation(p)]
            keep = {id(p) for p in to_isolate}
            for p in plans:   # loaded traces are kept only for the isolation pass (memory of large sweeps)
                if id(p) not in keep:
                    p.loaded = None
            isolate(to_isolate, progress)
            run_ids = opened.join()
            return [finish(p, base_dir, parent_run_id, run_ids.get(p.check_id)) for p in plans]


def _plan(rec: dict[str, Any], output_dir: Path, base_dir: str) -> PlannedCheck:
    check_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    p = PlannedCheck(rec, output_dir, check_id, {"check_id": check_id, "recipe": rec, "timings": {}},
                     time.perf_counter(), base_dir=base_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    try:
        # Input and output paths absolute, once: the cache key and every job read the same files.
        p.rec = rec = inputs.resolved(rec, base_dir)
        p.report["recipe"] = rec
        recipe.validate(rec, base_dir)
        p.report["job"] = {k: v for k, v in recipe.job_of(rec, base_dir).items() if k != "env"}
        opts = storage.options(rec["store"])
        root = recipe.resolve_url(rec["store"]["url"], base_dir).rstrip("/")
        storage.preflight(root, opts)
        p.store_url = f"{root}/{check_id}"
        p.report["store"] = p.store_url
        world = int(rec["parallel"]["world_size"])
        spec = recipe.job_spec(rec, role="candidate", store_url=p.store_url, base_dir=base_dir,
                               log=log_dir(output_dir, "candidate"))
        p.candidate = cluster.Job("candidate", spec, world, label=check_id, timeout_s=float(rec["timeout_s"]),
                                  error_dir=output_dir / "errors")
    except TTraceError as e:
        p.error = str(e)
    return p


def _measurer(p: PlannedCheck, rs: ReferenceSet, policy: TolerancePolicy) -> Any:
    """The measurement in Ray tasks when `cluster.compare_workers` > 1 (orchestrator/compare_tasks.py),
    else None: in this process, with the reference side read ahead (orchestrator/prefetch.py)."""
    assert p.candidate is not None
    shared = compare_tasks.against_references(p.rec, rs, p.store_url, "candidate", p.candidate.world_size,
                                              policy.k_elem)
    if shared is not None:
        p.report["compare_workers"] = compare_tasks.workers_of(p.rec)
    return shared


def _judge(p: PlannedCheck, prefetch: ReferencePrefetch) -> None:
    """Compare the candidate with the reference; any failure to do so becomes p.error."""
    timings, report = p.report["timings"], p.report
    try:
        if p.error:
            raise TTraceError(p.error)
        rs = p.refs
        assert rs is not None and p.candidate is not None
        report["reference"] = {"key": rs.key, "cache": rs.cache if rs.computed_by in ("", p.check_id)
                               or rs.cache == "hit" else "shared",
                               "url": rs.url, "computed_by": rs.computed_by,
                               **layouts.report(p.rec["parallel"], layouts.reference_layout(p.rec))}
        if rs.why_off:
            report["reference"]["not_stored_for_reuse"] = rs.why_off
        replay = bool(p.candidate.spec["trace"].get("routing_replay"))
        if replay:   # orchestrator/routing.py
            report["reference"]["routing"] = "replay"
        if p.candidate.spec["trace"].get("grad_sign_replay"):   # orchestrator/grad_signs.py
            report["reference"]["grad_signs"] = "replay"
        timings["jobs"] = {j.name: j.seconds for j in ([] if rs.cache == "hit" else rs.jobs) + [p.candidate]}
        keep_logs(p, ([] if rs.cache == "hit" else rs.jobs) + [p.candidate])
        failed = [e for e in (rs.error, p.candidate.error) if e]
        if failed:
            raise TTraceError("; ".join(failed))
        t0 = time.perf_counter()
        # The reference set as read while the candidate ran (orchestrator/prefetch.py); the candidate
        # read as the comparison walks it, a few parts per rank in memory. Each run is reassembled by
        # its own layout (the reference's: reference.parallel).
        reference, perturbed = prefetch.traces(rs)
        if (ahead := prefetch.seconds_of(rs)) is not None:
            timings["reference_read_ahead"] = ahead
        candidate = load_logical(p.store_url, "candidate", p.candidate.world_size, lazy=True)
        policy = TolerancePolicy.from_config(p.rec["tolerance"])
        per_step = recipe.microbatches_differ(p.rec)
        if per_step:
            report["reference"]["compared"] = (
                f"param_grad and param only: the reference cuts the global batch into microbatches of "
                f"{p.rec['reference']['micro_batch']}, the candidate into {p.rec['data']['micro_batch']}")
        shared = _measurer(p, rs, policy)
        p.comparison = compare(reference, candidate, perturbed, policy, per_step_only=per_step,
                               prepared=None if shared else prefetch.prepared(rs), measurer=shared)
        p.loaded = (reference, perturbed)
        if p.comparison.verdict == "fail" and not per_step:   # an MoE FAIL: tokens that changed experts
            flips = routing_flips(reference, candidate, perturbed, int(p.rec["model"].get("top_k", 2)))
            if flips is not None:
                report["routing"] = dict(flips.to_json(), replayed=replay)
                if flips.candidate and not replay:   # replayed: the flips did not change the experts
                    report.setdefault("warnings", []).append(flips.warning())
        timings["compare"] = time.perf_counter() - t0
        report.update(p.comparison.to_json())
    except TTraceError as e:
        p.error, p.comparison = str(e), None


