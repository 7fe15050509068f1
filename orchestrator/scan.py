"""`ttrace scan <recipe overrides> steps=N`: the first step where the candidate leaves the reference,
then that step checked in full (README "Long runs: ttrace scan").

Phase 1: the reference, the R perturbed references and the candidate train N steps, each logging
per-step fingerprints of the per-step kinds (trace.mode=scan, trace.kinds=param_grad,param,loss:
tracer/fingerprint_log.py); every step is judged against that step's band from the perturbed runs
(tracer/scan_judge.py, the statistics and tolerances of trace.mode=stats). The first step out of the
band is `first_step`.
The first steps in full: unless phase 1 flagged one of them, the first `scan.full_steps` steps
(default 2) are checked in full, as a check does: what fingerprints of grads and params cannot see
(a bug only in activations, within the grads' noise) is caught there, and a divergence there is
`first_step`.
Phase 2: that step rerun in full with the isolation pass, from the reference's state before it
(orchestrator/scan_rerun.py). One report.json / report.html / MLflow run for the scan.

Exit 0: every step within its band and the first steps' full check passed; 1: a step left its band
or the full check failed; 2: the scan (its full check of the first steps included) could not run.
"""

from __future__ import annotations

import copy
import os
import sys
import time
import uuid
from dataclasses import fields
from pathlib import Path
from typing import Any

from orchestrator import cluster, inputs, layouts, recipe, storage
from orchestrator.console import emit
from orchestrator.outcome import CheckResult, PlannedCheck, finish, keep_logs
from orchestrator.progress import JobProgress
from orchestrator.rank_logs import log_dir
from orchestrator.refcache import commit, share_references
from orchestrator.report import tracking
from orchestrator.scan_rerun import check_first_steps, rerun
from tracer.errors import ConfigError, TTraceError
from tracer.fingerprint_log import SCAN_MODE
from tracer.fingerprint_read import FingerprintRun
from tracer.scan_judge import ScanJudgement, judge_steps
from tracer.tolerance import TolerancePolicy
from tracer.verdicts import Comparison, TensorResult

SCAN_KINDS = ["param_grad", "param", "loss"]   # one record per tensor per step (loss: per microbatch)


def main(argv: list[str]) -> int:
    """`ttrace scan [overrides]`: compose the recipe, scan, print the summary; the exit code."""
    try:
        rec = recipe.compose(argv)
    except ConfigError as e:
        print(f"ttrace scan: error: {e}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S-") + f"{time.time() % 1:.6f}"[2:]
    out = Path("outputs") / f"{stamp}-scan-{rec['parallel']['name']}-{rec['bug']['name']}"
    result = run_scan(rec, out.resolve(), base_dir=os.getcwd())
    scan = result.report.get("scan") or {}
    if scan.get("line"):
        print(f"ttrace scan: {scan['line']}", flush=True)
    emit(result)
    return result.exit_code


def run_scan(rec: dict[str, Any], output_dir: Path, base_dir: str) -> CheckResult:
    """Phase 1, then phase 2 on a divergence; every failure is verdict 'error', never a pass."""
    p = _plan(rec, output_dir, base_dir)
    tracked = p.error is None and p.rec.get("tracking", {}).get("enabled", False)
    with tracking.OpenedRuns([(p.rec["tracking"], p.report)] if tracked else [], base_dir) as opened:
        opened.start()   # RUNNING while it scans
        if p.error is None:
            _phase1(p, base_dir)
        if p.error is None:
            _judge(p)
        return finish(p, base_dir, None, opened.join().get(p.check_id))


def scan_recipe(rec: dict[str, Any]) -> dict[str, Any]:
    """The recipe phase 1's jobs run: the fingerprint log of the per-step kinds, no isolation pass. The
    loss is left out when the reference cuts other microbatches (their losses have no counterpart)."""
    out = copy.deepcopy(rec)
    kinds = [k for k in SCAN_KINDS if not (k == "loss" and recipe.microbatches_differ(rec))]
    out["trace"] = {**(rec.get("trace") or {}), "mode": SCAN_MODE, "kinds": kinds}
    # The perturbed runs move their weights after every step too (tracer.parameters.EveryStep): an
    # honest layout adds rounding noise at every step, and a band from one initial move is too narrow
    # past a few hundred steps. (bf16/fp8 draw the rounding of every GEMM at every step already.)
    out["tolerance"] = {**rec["tolerance"], "perturbation_steps": "every"}
    out["localize"] = False
    return out


def _plan(rec: dict[str, Any], output_dir: Path, base_dir: str) -> PlannedCheck:
    check_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    p = PlannedCheck(rec, output_dir, check_id, {"check_id": check_id, "kind": "scan", "recipe": rec,
                                                 "timings": {}}, time.perf_counter(), base_dir=base_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    try:
        rec = inputs.resolved(rec, base_dir)
        p.report["recipe"] = rec
        trace = rec.get("trace") or {}
        if (trace.get("mode") or "full") != "full" or trace.get("kinds") is not None:
            raise ConfigError(f"ttrace scan sets trace.mode and trace.kinds itself (phase 1 logs "
                              f"{SCAN_KINDS} per step, phase 2 traces every kind in full); leave them at "
                              "their defaults")
        if rec["tolerance"].get("grad_signs") == "replay":
            raise ConfigError("tolerance.grad_signs=replay: ttrace scan does not replay grad signs (its "
                              "phase 1 logs no grads to take them from); set tolerance.grad_signs=own or "
                              "auto")
        if rec["tolerance"].get("routing") == "replay":
            raise ConfigError("tolerance.routing=replay: ttrace scan does not replay routing (its phase 1 "
                              "logs no router outputs to take the experts from); set tolerance.routing=own "
                              "or auto")
        if (rec.get("checkpoint") or {}).get("save"):
            raise ConfigError("checkpoint.save: ttrace scan saves the reference's state itself (phase 2); "
                              "run a check with checkpoint.save to keep a final state")
        recipe.validate(rec, base_dir)   # the recipe as a check takes it: exit 2 before anything runs
        full_steps(rec)
        p.rec = scan_recipe(rec)
        p.report["job"] = {k: v for k, v in recipe.job_of(rec, base_dir).items() if k != "env"}
        root = recipe.resolve_url(rec["store"]["url"], base_dir).rstrip("/")
        storage.preflight(root, storage.options(rec["store"]))
        p.store_url = f"{root}/{check_id}"
        spec = recipe.job_spec(p.rec, role="candidate", store_url=p.store_url, base_dir=base_dir,
                               log=log_dir(output_dir, "candidate"))
        p.candidate = cluster.Job("candidate", spec, int(rec["parallel"]["world_size"]), label=check_id,
                                  timeout_s=float(rec["timeout_s"]), error_dir=output_dir / "errors")
    except TTraceError as e:
        p.error = str(e)
    return p


def _phase1(p: PlannedCheck, base_dir: str) -> None:
    """The reference set (cached like a check's, keyed with trace.mode=scan) and the candidate, together."""
    refsets = share_references([p], base_dir)
    assert p.candidate is not None and p.refs is not None
    jobs = [j for rs in refsets for j in rs.jobs] + [p.candidate]
    try:
        p.report["timings"]["ray_start"] = cluster.ensure_ray(p.rec["cluster"])
        t0 = time.perf_counter()
        with JobProgress(False) as on_change:
            cluster.run_jobs(jobs, cpus_per_rank=float(p.rec["cluster"]["cpus_per_rank"]),
                             timeout_s=float(p.rec["timeout_s"]), error_dir=p.output_dir / "errors",
                             on_change=on_change)
        p.report["timings"]["jobs_wall"] = time.perf_counter() - t0
    except TTraceError as e:
        p.error = str(e)
        return
    for rs in refsets:
        commit(rs)
    rs = p.refs
    p.report["reference"] = {"key": rs.key, "cache": rs.cache, "url": rs.url,
                             **layouts.report(p.rec["parallel"], layouts.reference_layout(p.rec))}
    ran = ([] if rs.cache == "hit" else rs.jobs) + [p.candidate]
    p.report["timings"]["jobs"] = {j.name: j.seconds for j in ran}
    keep_logs(p, ran)
    failed = [e for e in (rs.error, p.candidate.error) if e]
    if failed:
        p.error = "; ".join(failed)


def start_step(rec: dict[str, Any]) -> int:
    """The global step of the scan's local step 0: init.checkpoint's step count (0 without one)."""
    path = (rec.get("init") or {}).get("checkpoint")
    if not path:
        return 0
    from tracer.checkpoint import open_checkpoint

    return open_checkpoint(str(path)).step


def _judge(p: PlannedCheck) -> None:
    """Every step against its band; on a divergence, phase 2. Any failure to judge becomes p.error."""
    rs, cand_job, t0 = p.refs, p.candidate, time.perf_counter()
    assert rs is not None and cand_job is not None
    try:
        ref = FingerprintRun(rs.url, "reference", rs.world_size)
        perts = [FingerprintRun(rs.url, run, rs.world_size) for run in rs.runs[1:]]
        cand = FingerprintRun(p.store_url, "candidate", cand_job.world_size)
        start = start_step(p.report["recipe"])
        j = judge_steps(ref.steps(), cand.steps(), [x.steps() for x in perts],
                        TolerancePolicy.from_config(p.rec["tolerance"]), start)
        p.report["timings"]["compare"] = time.perf_counter() - t0
        if not j.steps:
            raise TTraceError("the scan's runs logged no step: did the job call tr.step(i) and record?")
        stored = {"fingerprint_bytes": ref.bytes + cand.bytes + sum(x.bytes for x in perts),
                  "store_bytes": _du(rs.url) + _du(p.store_url)}
        p.comparison = j.first if j.first is not None else j.worst
        assert p.comparison is not None
        p.report.update(p.comparison.to_json())
        p.report["scan"] = scan_section(j, start, stored)
    except TTraceError as e:
        p.error, p.comparison = str(e), None
        return
    first = j.first_step
    full = full_steps(p.rec)
    if full and (first is None or first - start >= full):
        t1 = time.perf_counter()
        verdict, tensors = check_first_steps(p, start, full)
        p.report["timings"]["first_steps"] = time.perf_counter() - t1
        if verdict == "fail":
            _failed_in_full(p, j, tensors, "first_steps")
            first = None   # the full check named the first divergence: no phase 2
        elif verdict == "error" and first is None:
            p.error, p.comparison = ("the full check of the scan's first steps could not run: "
                                     f"{p.report['scan']['first_steps'].get('error')}"), None
            return
    if first is not None:
        t1 = time.perf_counter()
        verdict, tensors = rerun(p, first - start, start)
        p.report["timings"]["rerun"] = time.perf_counter() - t1
        fd = p.report["scan"]["rerun"].get("first_divergence")
        if verdict == "fail" and fd and fd["global_step"] < first:
            # the full check saw it a step before the fingerprints did (it reruns step F-1 too)
            _failed_in_full(p, j, tensors, "rerun")
    p.report["scan"]["line"] = _line(p.report["scan"], p.report)


def full_steps(rec: dict[str, Any]) -> int:
    """How many of the scan's first steps are checked in full (scan.full_steps, at most steps)."""
    n = (rec.get("scan") or {}).get("full_steps", 2)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigError(f"scan.full_steps={n!r}: the number of first steps checked in full, an integer "
                          ">= 0 (0: fingerprints only)")
    return min(n, int(rec["steps"]))


def _failed_in_full(p: PlannedCheck, j: ScanJudgement, tensors: list[dict[str, Any]], key: str) -> None:
    """A full check of the scan (its first steps', or phase 2's rerun) failed before any step the
    fingerprints flagged: the scan fails at its first divergence, with its comparison."""
    scan, fs = p.report["scan"], p.report["scan"][key]
    names = {f.name for f in fields(TensorResult)}
    results = [TensorResult(**{k: v for k, v in t.items() if k in names}) for t in tensors]
    fd = next(r for r in results if r.name == fs["first_divergence"]["name"])
    p.comparison = Comparison("fail", results, fd)
    p.report.update(p.comparison.to_json())
    step = int(fs["first_divergence"]["global_step"])
    scan.update(fingerprint_first_step=scan["first_step"], first_step=step, tensors=fs["failing"],
                flagged_by=key, loss_gap_at_first_step=_loss_gap(j, step))


def scan_section(j: ScanJudgement, start: int, stored: dict[str, int]) -> dict[str, Any]:
    """report.json's `scan`: first_step (global), the tensors that left the band there, the loss gap
    at that step next to the perturbed runs' spread, and a summary of every step."""
    first = next((s for s in j.steps if s.step == j.first_step), None)
    return {"first_step": j.first_step, "flagged_by": None if first is None else "fingerprints",
            "start_step": start, "steps_scanned": len(j.steps), "band_k": j.k,
            "tensors": [] if first is None else first.failing,
            "loss_gap_at_first_step": _loss_gap(j, j.first_step),
            "worst_step": j.worst_step, **stored, "steps": [s.to_json() for s in j.steps]}


def _loss_gap(j: ScanJudgement, step: int | None) -> dict[str, Any] | None:
    """The loss at `step` next to the perturbed runs' spread (None where the scan logged none)."""
    at = next((s for s in j.steps if s.step == step), None)
    if at is None or at.loss is None:
        return None
    return {**at.loss, "gap": at.loss["candidate"] - at.loss["reference"],
            "note": "spread: the largest |loss - reference loss| of the R perturbed runs (one ulp of "
                    "every weight, or GEMM rounding draws), not a seed-to-seed spread"}


def _line(scan: dict[str, Any], report: dict[str, Any]) -> str:
    n = scan["steps_scanned"]
    mb = f"{scan['store_bytes'] / 1e6:.2f} MB (fingerprint blocks {scan['fingerprint_bytes'] / 1e6:.2f} MB)"
    fs = scan.get("first_steps") or {}
    full = f"; steps {fs['steps']} checked in full: {fs['verdict']}" if fs else ""
    if scan["first_step"] is None:
        worst = max((s["worst"] for s in scan["steps"]), default=0.0)
        return (f"{n} steps within their bands (worst {worst:.3g} of tolerance, step {scan['worst_step']})"
                f"{full}; scan store {mb}")
    by = scan.get("flagged_by")
    if by in ("first_steps", "rerun"):
        full_check = scan[by]
        fd = full_check["first_divergence"]
        later = scan.get("fingerprint_first_step")
        prints = ("every step's fingerprints within their bands" if later is None else
                  f"the fingerprints first out of their band at step {later}")
        return (f"first divergence at step {scan['first_step']}, in the full check of steps "
                f"{full_check['steps']}: {fd['name']} ({fd['reason']}); {prints}; scan store {mb}")
    gap = scan.get("loss_gap_at_first_step")
    loss = (f"; loss {gap['candidate']:.6g} vs reference {gap['reference']:.6g} (gap {gap['gap']:.3g}, "
            f"perturbed spread {gap['spread']:.3g})" if gap else "")
    rr = scan.get("rerun") or {}
    return (f"first step out of the band: {scan['first_step']} ({len(scan['tensors'])} tensors, e.g. "
            f"{', '.join(scan['tensors'][:3])}){loss}; rerun of steps {rr.get('steps')}: "
            f"{rr.get('verdict', 'not run')}; scan store {mb}")


def _du(url: str) -> int:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    try:
        return int(fs.du(path))
    except FileNotFoundError:
        return 0
