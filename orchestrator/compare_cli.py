"""`ttrace compare STORE`: judge runs traced anywhere (torchrun on a cluster that never saw Ray).

Every run is a directory of STORE written by a job's session (tracer/job.py), e.g.

    export TTRACE_STORE=/shared/traces/exp42
    TTRACE_ROLE=reference              torchrun --nproc-per-node 1 train.py
    TTRACE_ROLE=perturbed TTRACE_PERTURB=1 torchrun --nproc-per-node 1 train.py
    TTRACE_ROLE=perturbed TTRACE_PERTURB=2 torchrun --nproc-per-node 1 train.py
    TTRACE_ROLE=candidate              torchrun --nproc-per-node 4 train.py --tp 2
    ttrace compare /shared/traces/exp42

World sizes and layouts come from the manifests. Writes report.json and report.html, logs the
comparison to MLflow like a check, and exits 0 (pass), 1 (divergence) or 2 (error).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from orchestrator import compare_tasks, storage
from orchestrator.outcome import CheckResult, PlannedCheck, finish
from tracer.compare import compare
from tracer.compare_shares import RunAt
from tracer.errors import TTraceError
from tracer.isolation import name_culprit
from tracer.logical import load_logical
from tracer.tolerance import TolerancePolicy

USAGE = "ttrace compare STORE [options] [recipe overrides, e.g. tolerance.k=6 tracking.enabled=false]"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ttrace compare", usage=USAGE, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", help="the store the runs were traced into (any fsspec URL; TTRACE_STORE)")
    p.add_argument("overrides", nargs="*", help="recipe overrides for the comparison (tolerance.*, "
                                                "tracking.*, store.* for an S3 endpoint)")
    p.add_argument("--reference", default="reference", help="the reference run (default: reference)")
    p.add_argument("--candidate", default="candidate", help="the candidate run (default: candidate)")
    p.add_argument("--perturbed", default=None,
                   help="comma-separated perturbed reference runs (default: every perturbed-* run)")
    p.add_argument("--isolated", default=None,
                   help="the isolation pass's run (TTRACE_ROLE=isolated), if any (default: isolated, if "
                        "present)")
    p.add_argument("--out", default=None, help="directory for report.json and report.html "
                                               "(default: ttrace-compare/<date>/<time>)")
    return p


def main(argv: list[str]) -> int:
    from orchestrator.console import REPORT_LINE, summary
    from orchestrator.recipe import compose, resolve_url

    args = parser().parse_intermixed_args(argv)
    base = os.getcwd()
    try:
        rec = compose(args.overrides)
    except TTraceError as e:
        print(f"ttrace compare: error: {e}", file=sys.stderr)
        return 2
    root = resolve_url(args.store, base).rstrip("/")
    rec["store"] = dict(rec["store"], url=root)
    out = Path(args.out or Path(base, "ttrace-compare", time.strftime("%Y-%m-%d"),
                                time.strftime("%H-%M-%S-") + f"{time.time_ns() % 10**6:06d}"))
    perturbed = args.perturbed.split(",") if args.perturbed else None
    res = compare_stored(rec, out, base, root, reference=args.reference, candidate=args.candidate,
                         perturbed=perturbed, isolated=args.isolated)
    print(summary(res), file=sys.stderr if res.verdict == "error" else sys.stdout, flush=True)
    print(f"{REPORT_LINE}{res.report_path}", flush=True)
    return res.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


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
    p = PlannedCheck(rec, output_dir, check_id, report, time.perf_counter(), base_dir=base_dir)
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
        rec["tolerance"]["perturbations"] = len(perturbed)   # the R this judgement uses
        policy = TolerancePolicy.from_config(rec["tolerance"])
        at = lambda run, trace: RunAt(root, run, trace.world_size)
        pert_at = [at(r, t) for r, t in zip(perturbed, pert, strict=True)]
        # cluster.compare_workers > 1: a run's measurement against the reference set in Ray tasks
        tasks = lambda run, trace: compare_tasks.from_recipe(rec, at(reference, ref), at(run, trace), pert_at,
                                                             policy.k_elem)
        shared = tasks(candidate, cand)
        if shared is not None:
            p.report["compare_workers"] = compare_tasks.workers_of(rec)
        p.comparison = compare(ref, cand, pert, policy, measurer=shared)
        p.report["timings"]["compare"] = time.perf_counter() - t0
        p.report.update(p.comparison.to_json())
        _local_verdict(p, root, reference, isolated)
        if isolated and p.comparison.verdict == "fail":
            try:   # measured where the candidate was (cluster.compare_workers), against the same runs
                iso = load_logical(root, isolated, world_size_of(root, isolated), lazy=True)
                shared = tasks(isolated, iso)
                t1 = time.perf_counter()
                local = compare(ref, iso, pert, policy, measurer=shared)
                p.report.update(name_culprit(p.comparison, local))
                p.report["isolation"] = {"run": isolated, "flagged": sum(not r.ok for r in local.results),
                                         "compare_s": time.perf_counter() - t1}
                if shared is not None:
                    p.report["isolation"]["compare_workers"] = compare_tasks.workers_of(rec)
            except TTraceError as e:
                p.report["localization_error"] = (f"isolation run '{isolated}' not usable (the verdict "
                                                   f"stands): {e}")
    except TTraceError as e:
        p.error, p.comparison = str(e), None
    return finish(p, base_dir, None)


def _local_verdict(p: PlannedCheck, root: str, reference: str, isolated: str | None) -> None:
    """The local verdict (tracer/local_verdict.py) on stored runs: only when asked (tolerance.local=on:
    their job and kernels are not known to be the built-in trainer's it is calibrated on), and then
    on the isolated run, whose absence is an error."""
    from orchestrator.isolation_pass import judge_locally
    from tracer.local_verdict import check_local, local_mode
    from tracer.store import world_size_of

    mode = local_mode(p.rec)
    if mode != "on":
        p.report["local"] = {"mode": mode, "off": "ttrace compare judges stored runs locally only when asked "
                                                  "(tolerance.local=on, with an isolated run)"}
        return
    check_local(p.rec, False, True)
    if not isolated:
        raise TTraceError(f"tolerance.local=on: the local verdict judges the isolation pass's run, and there "
                          f"is none under {root}; launch the candidate once more with TTRACE_ROLE=isolated "
                          "TTRACE_REFERENCE=<the reference run's URL>, or name it with --isolated RUN")
    judge_locally(p, load_logical(root, reference, world_size_of(root, reference), lazy=True),
                  load_logical(root, isolated, world_size_of(root, isolated), lazy=True))
