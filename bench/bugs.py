"""Bug-catalog benchmark (`make bench-bugs`): detection, localization and the loss-curve baseline.

Writes bench/bugs.json and bench/bugs.md (one row per catalog bug):
  detected        the check on the bug's trigger recipe fails (exit 1), and the clean counterpart
                  (same recipe, bug=none; the catalog's `clean` where no honest plan has that
                  setting) passes
  first divergence / culprit   where the plain comparison / the isolation pass point
  correct module? the culprit (else the first divergence) matches the catalog's `expect` pattern
  blame window    modules the isolation pass could not rule out
  loss shows at   the first training step from which the buggy loss stays away from the clean loss
                  by more than the seed-to-seed spread of clean runs for 10 steps (or "not within N")
  scan flags at   `ttrace scan`'s first step out of the band (report.json scan.first_step), scanning
                  Bug.first_step + SCAN_AFTER steps, or the first divergence of a full check of it
                  where that is earlier (its first steps', scan.full_steps, or its phase-2 rerun's,
                  which checks the step before too; marked "in full"), and the culprit the full check
                  that decided names (the isolation pass's, else its first divergence) against `expect`
  stats mode      the same check and its clean counterpart with every run traced in `trace.mode=stats`
                  (docs/stats_mode.md; `localize=false`: the verdict only): whether stats mode flags
                  the bug, and the largest statistic over its tolerance (`--no-stats` skips it). A
                  bug stats mode does not see is reported, not a failure of the bench (what the mode
                  cannot see is documented); a clean counterpart it fails is one

A late bug (Bug.first_step > 0) is checked at its `early` recipe (it acts at step 1 of the 2-step
check); its loss curves and its scan run at its `late` recipe (Bug.scan_recipe), where it first acts
at step first_step, so the two columns read "steps until the scan flags it" against "steps until the
loss curve shows it". A late bug's scan is also a clean scan of the steps before it acts: a step
flagged there is a false alarm.

All checks run in one `run_checks` call on one Ray cluster (each distinct reference computed once);
the scans run one after another on the same cluster (`run_scan` takes one recipe), and the loss
curves untraced, as plain training jobs, on it too.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator import cluster, recipe  # noqa: E402
from orchestrator.check import run_checks  # noqa: E402
from orchestrator.nightly import located  # noqa: E402
from orchestrator.scan import run_scan  # noqa: E402
from tracer.errors import TTraceError  # noqa: E402
from tracer.stats_compare import over_tolerance  # noqa: E402
from workloads.bugs import CATALOG  # noqa: E402

COMMON = ["tracking.enabled=false"]
STATS = ["trace.mode=stats", "localize=false"]   # the stats-mode column's checks
SUSTAIN = 10   # loss-curve baseline: steps the loss gap must stay above the seed spread
SCAN_AFTER = 4   # a scan runs Bug.first_step + SCAN_AFTER steps: the bug's step and a few after it


def _checks(bugs: list[str], work: Path, extra: list[str], stats: bool) -> dict[str, Any]:
    """Run every bug's check and each distinct trigger's clean counterpart, and with `stats` the same
    in stats mode (labels prefixed "stats:"); reports by label."""
    items, labels = [], []
    for prefix, mode in (("", []), ("stats:", STATS))[:2 if stats else 1]:
        tag = prefix.replace(":", "-")   # the checks' directories: <bug>, clean-<i>, stats-<bug>, ...
        for name in bugs:
            trig = list(CATALOG[name].recipe)   # the trigger, and the reference the bug needs
            rec = recipe.compose([*trig, f"bug={name}", *COMMON, *mode, *extra])
            items.append((rec, work / f"{tag}{name}"))
            labels.append(prefix + name)
            honest = list(CATALOG[name].clean_recipe)
            clean = f"{prefix}clean:" + " ".join(honest)
            if clean not in labels:
                rec = recipe.compose([*honest, "bug=none", *COMMON, *mode, *extra])
                items.append((rec, work / f"{tag}clean-{len(labels)}"))
                labels.append(clean)
    results = run_checks(items, base_dir=str(work), progress=True)
    return {label: r for label, r in zip(labels, results, strict=True)}


def _scans(bugs: list[str], work: Path, extra: list[str]) -> dict[str, dict[str, Any]]:
    """`ttrace scan` of each bug at its real step (Bug.scan_recipe), one after another: run_scan takes
    one recipe. Returns {bug: the row's scan_* fields}."""
    out: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(bugs):
        bug = CATALOG[name]
        steps = bug.first_step + SCAN_AFTER
        timeout = int(recipe.compose([*COMMON, *extra])["timeout_s"]) + steps   # as the loss curves
        print(f"bench-bugs: scan {i + 1}/{len(bugs)}: {name}, {steps} steps", flush=True)
        t0 = time.perf_counter()
        try:
            rec = recipe.compose([*bug.scan_recipe, f"bug={name}", f"steps={steps}", f"timeout_s={timeout}",
                                  *COMMON, *extra])
            res = run_scan(rec, work / f"scan-{name}", base_dir=str(work))
        except TTraceError as e:   # run_scan reports its own failures as verdict 'error'; this is a backstop
            out[name] = {"scan_recipe": " ".join(bug.scan_recipe), "scan_steps": steps,
                         "scan_verdict": "error", "scan_error": str(e), "scan_first_step": None,
                         "scan_culprit": None, "scan_correct_module": False, "scan_on_time": False,
                         "scan_delay": None}
            continue
        out[name] = _scan_fields(name, res, steps, time.perf_counter() - t0)
    return out


def _scan_fields(name: str, res: Any, steps: int, seconds: float) -> dict[str, Any]:
    bug, rep = CATALOG[name], res.report
    scan = rep.get("scan") or {}
    # the full check that named the culprit: the first steps' (a divergence there) or phase 2's rerun
    rerun = (scan.get("first_steps") if scan.get("flagged_by") == "first_steps" else scan.get("rerun")) or {}
    first = scan.get("first_step")
    c = rep.get("culprit") or {}
    # where the rerun points: its isolation pass's culprit when resolved, else its first divergence
    at = c if c.get("resolved") else rerun.get("first_divergence") or {}
    culprit = f"{at['module']}/{at['kind']}" if at else None
    fd = rep.get("first_divergence") if first is not None else None   # at first_step
    error = res.message if res.verdict == "error" else rerun.get("error")
    if first is not None and rerun.get("verdict") == "pass":
        error = error or "the rerun of the flagged step passed: no culprit"
    # Before a late bug acts the candidate runs the clean code: a step flagged there is a false alarm. A bug
    # acting from the first step may already show in the weights as attached (scan step -1).
    on_time = first is not None and (first >= bug.first_step or (not bug.is_late and first == -1))
    return {"scan_recipe": " ".join(bug.scan_recipe), "scan_steps": steps, "scan_verdict": res.verdict,
            "scan_first_step": first,            "scan_tensors": len(scan.get("tensors") or []),
            "scan_flagged_by": scan.get("flagged_by"),
            "scan_first_steps_verdict": (scan.get("first_steps") or {}).get("verdict"),
            "scan_first_divergence": f"{fd['module']}/{fd['kind']}" if fd else None,
            "scan_rerun_steps": rerun.get("steps"), "scan_rerun_verdict": rerun.get("verdict"),
            "scan_culprit": culprit, "scan_culprit_step": at.get("step", at.get("global_step")),
            "scan_correct_module": culprit is not None and fnmatch.fnmatch(culprit, bug.expect),
            "scan_on_time": on_time, "scan_delay": max(first - bug.first_step, 0) if on_time else None,
            "scan_error": error, "scan_report": str(res.report_path), "scan_s": round(seconds, 1),
            "scan_line": scan.get("line")}


def _loss_curves(bugs: list[str], work: Path, steps: int, seeds: int, extra: list[str]) -> dict[str, Any]:
    """Untraced training, `steps` steps: each bug at the recipe seed, each trigger clean at `seeds`
    seeds. Returns {bug: {"curve", "clean", "spread", "first_step"}}."""
    jobs: dict[str, cluster.Job] = {}

    def job(key: str, rec: dict[str, Any]) -> None:
        # trace.enabled=false: nothing is written, but a traced role must name a store (tracer/job_config.py)
        spec = recipe.job_spec(rec, role="candidate", run=key, store_url=str(work / "loss-curves-untraced"))
        spec["trace"]["enabled"], spec["steps"] = False, steps
        jobs[key] = cluster.Job(key, spec, int(rec["parallel"]["world_size"]), label="loss curve",
                                timeout_s=float(rec["timeout_s"]) + steps)

    base_seed = recipe.compose([*COMMON, *extra])["seed"]
    for name in bugs:
        trig = _curve_trigger(name)
        job(name, recipe.compose([*trig, f"bug={name}", *COMMON, *extra]))
        for s in range(seeds):
            key = f"clean:{' '.join(trig)}:{s}"
            if key not in jobs:
                job(key, recipe.compose([*trig, "bug=none", f"seed={base_seed + s}", *COMMON, *extra]))
    rec0 = recipe.compose([*COMMON, *extra])
    cluster.ensure_ray(rec0["cluster"])
    cluster.run_jobs(list(jobs.values()), cpus_per_rank=float(rec0["cluster"]["cpus_per_rank"]),
                     timeout_s=float(rec0["timeout_s"]) + steps, error_dir=ROOT / "bench" / "errors")

    def curve(key: str) -> list[float] | None:
        j = jobs[key]
        return None if j.error else next((r["losses"] for r in j.results if r["losses"]), None)

    out: dict[str, Any] = {}
    for name in bugs:
        trig = " ".join(_curve_trigger(name))
        buggy = curve(name)
        clean = [curve(f"clean:{trig}:{s}") for s in range(seeds)]
        if buggy is None or any(c is None for c in clean):
            out[name] = {"error": jobs[name].error or "a clean loss-curve job failed"}
            continue
        spread = [max(c[t] for c in clean) - min(c[t] for c in clean) for t in range(steps)]
        gap = [abs(buggy[t] - clean[0][t]) for t in range(steps)]
        above = [g > s for g, s in zip(gap, spread, strict=True)]
        # "Shows" = the gap exceeds the spread and stays above it for SUSTAIN steps (or to the end):
        # a single crossing is as likely seed noise as the bug.
        first = next((t for t in range(steps) if all(above[t:t + SUSTAIN])), None)
        out[name] = {"first_step": first, "first_crossing": next((t for t in range(steps) if above[t]), None),
                     "buggy": buggy, "clean": clean[0], "spread": spread,
                     "final_gap": gap[-1], "final_spread": spread[-1]}
    return out


def _curve_trigger(name: str) -> list[str]:
    """The candidate overrides of a bug's loss curves: its trigger, a late bug at its real step."""
    bug = CATALOG[name]
    return [*bug.trigger, *bug.late]


def worst_over_tolerance(report: dict[str, Any]) -> float:
    """A stats-mode report's largest statistic over its tolerance (norm, largest magnitude, sum)."""
    return max((over_tolerance(t)[0] for t in report.get("tensors", [])), default=0.0)


def _stats_fields(name: str, res: Any, clean: Any) -> dict[str, Any]:
    """The stats-mode column of a bug: its check's and its clean counterpart's verdicts, the first
    tensor it flags and whether that is at the catalogued module (stats mode has no isolation pass:
    its first divergence is all it says), and each one's largest statistic over tolerance."""
    fd = res.report.get("first_divergence") or {}
    return {"stats_verdict": res.verdict, "stats_clean_verdict": clean.verdict,
            "stats_detected": res.verdict == "fail" and clean.verdict == "pass",
            "stats_first_divergence": fd.get("name"), "stats_reason": fd.get("reason") or res.message or None,
            "stats_correct_module": bool(fd) and fnmatch.fnmatch(f"{fd['module']}/{fd['kind']}",
                                                                 CATALOG[name].expect),
            "stats_worst": worst_over_tolerance(res.report),
            "stats_clean_worst": worst_over_tolerance(clean.report)}


def _row(name: str, res: Any, clean: Any, loss: dict[str, Any] | None, steps: int,
         scan: dict[str, Any] | None) -> dict[str, Any]:
    bug = CATALOG[name]
    rep = res.report
    row: dict[str, Any] = {"bug": name, "trigger": " ".join(bug.recipe), "expect": bug.expect,
                           "verdict": res.verdict, "clean_verdict": clean.verdict,
                           "detected": res.verdict == "fail" and clean.verdict == "pass"}
    if res.verdict == "error":
        row["error"] = res.message
    fd = rep.get("first_divergence")
    if fd:
        at = located(rep)
        c = rep.get("culprit") or {}
        row.update(first_divergence=f"{fd['module']}/{fd['kind']}", first_divergence_name=fd["name"],
                   culprit=f"{c['module']}/{c['kind']}" if c.get("resolved") else None,
                   culprit_name=c.get("name") if c.get("resolved") else None,
                   origin=rep.get("origin"), blame_window=(rep.get("blame_window") or {}).get("size"),
                   # without the isolation pass: every module with a tensor beyond tolerance
                   diverged_modules=len({t["module"] for t in rep.get("tensors", []) if not t["ok"]}),
                   correct_module=fnmatch.fnmatch(f"{at['module']}/{at['kind']}", bug.expect),
                   first_divergence_correct=fnmatch.fnmatch(f"{fd['module']}/{fd['kind']}", bug.expect))
    if loss is not None:
        row["loss_first_step"] = loss.get("first_step")
        row["loss_error"] = loss.get("error")
    row["loss_steps"] = steps
    row["acts_from_step"] = bug.first_step   # in the loss curves and the scan (late bugs: their real step)
    if scan is not None:
        row.update(scan)
        row["scan_ok"] = bool(scan.get("scan_on_time") and scan.get("scan_correct_module"))
    return row


def _scan_cell(r: dict[str, Any]) -> tuple[str, str]:
    """The table's "scan flags it at step" and "scan rerun culprit" cells."""
    if "scan_steps" not in r:
        return "-", "-"
    first, acts, delay = r.get("scan_first_step"), r.get("acts_from_step"), r.get("scan_delay")
    if first is None:
        at = ("**error**" if r.get("scan_verdict") in (None, "error")
              else f"**missed** (not within {r['scan_steps']})")
    elif not r.get("scan_on_time"):
        at = f"**{first}: before it acts**"
    else:
        at = f"{first}" + (f" (**{delay} steps late**)" if delay else "")
    if r.get("scan_flagged_by") in ("first_steps", "rerun"):
        at = f"{at} in full"   # a full check of the scan saw it before the fingerprints
    if acts:
        at = f"{at} (acts from {acts})"
    culprit, error = r.get("scan_culprit"), " ".join(str(r.get("scan_error") or "").split()).replace("|", "/")
    error = error if len(error) <= 160 else error[:157] + "..."
    cell = (f"{culprit}: {'yes' if r.get('scan_correct_module') else '**no**'}" if culprit
            else f"**none** ({error})" if error else "**none**")
    return at, cell


def _stats_cell(r: dict[str, Any]) -> str:
    if "stats_verdict" not in r:
        return "-"
    if r["stats_clean_verdict"] != "pass":
        return f"**clean {r['stats_clean_verdict'].upper()}** ({r['stats_clean_worst']:.2f}x)"
    if r["stats_detected"]:
        fd = r["stats_first_divergence"]
        said = "yes, there" if r["stats_correct_module"] else f"yes, first at `{fd}`"
    else:
        said = "**error**" if r["stats_verdict"] == "error" else "not seen"
    return f"{said} ({r['stats_worst']:.3g}x; clean {r['stats_clean_worst']:.2f}x)"


def markdown(rows: list[dict[str, Any]], totals: dict[str, Any]) -> str:
    title = "# ttrace bug catalog benchmark" + (f" in {p}" if (p := totals.get("precision")) else "")
    lines = [title, "",
             f"{totals['detected']}/{totals['bugs']} detected, {totals['correct']}/{totals['bugs']} "
             f"culprit at the catalogued module, mean blame window {totals['mean_blame_window']} "
             f"(modules diverged without isolation: {totals['mean_diverged_modules']}), clean "
             f"counterparts passing {totals['clean_pass']}/{totals['clean']}; "
             f"{totals['wall_s']:.0f} s wall", ""]
    if totals.get("stats_clean"):
        lines += [f"Stats mode (`trace.mode=stats localize=false`, every run of the check): "
                  f"{totals['stats_detected']}/{totals['bugs']} flagged, {totals['stats_correct']}/"
                  f"{totals['bugs']} first at the catalogued module, clean counterparts passing "
                  f"{totals['stats_clean_pass']}/{totals['stats_clean']}. A bug it does not see is what "
                  "the mode cannot see (docs/stats_mode.md), not a failure of this bench; a clean FAIL "
                  "is.", ""]
    if totals.get("scanned"):
        lines += [f"Scans (`ttrace scan` of {totals['scanned']} bugs at their real step, "
                  f"Bug.first_step + {SCAN_AFTER} steps): {totals['scan_on_time']}/{totals['scanned']} "
                  f"flagged from the step the bug acts at ({totals['scan_at_step']} at that very step), "
                  f"{totals['scan_correct']}/{totals['scanned']} rerun culprit at the catalogued module; "
                  f"{totals['scans_wall_s']:.0f} s. A late bug's check runs the trigger recipe shown (its "
                  "`early` step 1); its loss curves and scan run Bug.scan_recipe (its real step).", ""]
    lines += ["| bug | trigger recipe | detected | first divergence | culprit | correct module? "
              "| blame window | modules diverged | loss curve shows it at step | scan flags it at step "
              "| scan rerun culprit: correct? | stats mode flags it at the catalogued module? (largest "
              "statistic x tolerance; clean's) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        loss = r.get("loss_first_step", "-")
        if "loss_first_step" in r and loss is None:
            loss = f"not within {r['loss_steps']}" if not r.get("loss_error") else "error"
        if r.get("acts_from_step"):
            loss = f"{loss} (acts from {r['acts_from_step']})"
        lines.append(f"| {r['bug']} | `{r['trigger']}` | {'yes' if r['detected'] else '**NO**'} | "
                     f"{r.get('first_divergence', r.get('error', '-'))} | "
                     f"{r.get('culprit') or 'unresolved'} | "
                     f"{'yes' if r.get('correct_module') else '**no**'} | "
                     f"{r.get('blame_window', '-')} | {r.get('diverged_modules', '-')} | {loss} | "
                     f"{' | '.join(_scan_cell(r))} | {_stats_cell(r)} |")
    return "\n".join(lines) + "\n"


def runs_in(precision: str) -> tuple[list[str], dict[str, str]]:
    """The catalog bugs a check runs in `precision` on this machine: their trigger sets no precision of
    its own (fp8_amax_unreduced's is fp8) and their recipe validates with it. Returns (those bugs, the
    others' reasons)."""
    keep, left = [], {}
    for name, bug in CATALOG.items():
        set_it = [o for o in bug.recipe if o.startswith("precision")]
        try:
            if set_it:
                raise TTraceError(f"its trigger sets {set_it[0]}")
            for overrides in ([*bug.recipe, f"bug={name}"], [*bug.clean_recipe, "bug=none"]):
                recipe.validate(recipe.compose([*overrides, f"precision={precision}", *COMMON]))
        except TTraceError as e:
            left[name] = str(e)
            continue
        keep.append(name)
    return keep, left


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bugs", default="", help="comma-separated subset of the catalog (default: every "
                    "built-in-trainer bug; with --precision, every bug that runs in it)")
    ap.add_argument("--precision", default="", help="every check in this precision (e.g. bf16), and by "
                    "default every catalog bug a check runs in it (`make bench-bugs-bf16`)")
    ap.add_argument("--loss-steps", type=int, default=200, help="loss-curve baseline length (0: skip)")
    ap.add_argument("--seeds", type=int, default=3, help="clean seeds for the loss spread")
    ap.add_argument("--scan", action=argparse.BooleanOptionalAction, default=True,
                    help="`ttrace scan` each bug at its real step (--no-scan: skip)")
    ap.add_argument("--stats", action=argparse.BooleanOptionalAction, default=True,
                    help="each check and clean counterpart again in trace.mode=stats (--no-stats: skip)")
    ap.add_argument("--scan-bugs", default="", help="comma-separated subset of --bugs to scan (default: all)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "bugs.json"))
    ap.add_argument("overrides", nargs="*", help="recipe overrides applied to every check")
    args = ap.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)   # before the checks: a run lost its results
    # Default: the BUGS.md catalog in the built-in trainer (framework bugs have their own tests).
    builtin = [name for name, bug in CATALOG.items() if bug.job == "builtin"]
    if args.precision:
        args.overrides = [*args.overrides, f"precision={args.precision}"]
        if not args.bugs:
            builtin, left = runs_in(args.precision)
            for name, why in left.items():
                print(f"bench-bugs: {name} left out in {args.precision}: {why}", file=sys.stderr)
    bugs = [b for b in args.bugs.split(",") if b] or builtin
    unknown = [b for b in bugs if b not in CATALOG]
    if unknown:
        print(f"bench-bugs: unknown bugs {unknown}; `ttrace bugs` lists the catalog", file=sys.stderr)
        return 2
    scan_bugs = ([b for b in args.scan_bugs.split(",") if b] or bugs) if args.scan else []
    if set(scan_bugs) - set(bugs):
        print(f"bench-bugs: --scan-bugs {sorted(set(scan_bugs) - set(bugs))} are not among the bugs benched "
              "(--bugs)", file=sys.stderr)
        return 2
    work = ROOT / "bench" / "bugs_runs" / time.strftime("%Y%m%d-%H%M%S")
    t0 = time.perf_counter()
    try:
        checks = _checks(bugs, work, args.overrides, args.stats)
        checks_s = time.perf_counter() - t0
        scans = _scans(scan_bugs, work, args.overrides)
        scans_s = time.perf_counter() - t0 - checks_s
        losses = (_loss_curves(bugs, work, args.loss_steps, args.seeds, args.overrides)
                  if args.loss_steps else {})
    except TTraceError as e:
        print(f"bench-bugs: error: {e}", file=sys.stderr)
        return 2
    rows = [_row(b, checks[b], checks["clean:" + " ".join(CATALOG[b].clean_recipe)], losses.get(b),
                 args.loss_steps, scans.get(b)) for b in bugs]
    if args.stats:
        for r in rows:
            r.update(_stats_fields(r["bug"], checks["stats:" + r["bug"]],
                                   checks["stats:clean:" + " ".join(CATALOG[r["bug"]].clean_recipe)]))
    scanned = [r for r in rows if "scan_steps" in r]
    cleans = [r for k, r in checks.items() if k.startswith("clean:")]
    stats_cleans = [r for k, r in checks.items() if k.startswith("stats:clean:")]
    windows = [r["blame_window"] for r in rows if r.get("blame_window")]
    totals = {"bugs": len(rows), "detected": sum(r["detected"] for r in rows),
              "correct": sum(bool(r.get("correct_module")) for r in rows),
              "first_divergence_correct": sum(bool(r.get("first_divergence_correct")) for r in rows),
              "mean_blame_window": round(statistics.mean(windows), 2) if windows else None,
              "mean_diverged_modules": round(statistics.mean(r.get("diverged_modules", 0) for r in rows), 1),
              "clean": len(cleans), "clean_pass": sum(r.verdict == "pass" for r in cleans),
              "scanned": len(scanned), "scan_on_time": sum(bool(r.get("scan_on_time")) for r in scanned),
              "scan_at_step": sum(r.get("scan_delay") == 0 for r in scanned),
              "scan_correct": sum(bool(r.get("scan_correct_module")) for r in scanned),
              "scan_ok": sum(r["scan_ok"] for r in scanned),
              "loss_errors": sum(bool(v.get("error")) for v in losses.values()),
              "stats_detected": sum(bool(r.get("stats_detected")) for r in rows),
              "stats_correct": sum(bool(r.get("stats_detected") and r.get("stats_correct_module"))
                                   for r in rows),
              "stats_clean": len(stats_cleans),
              "stats_clean_pass": sum(r.verdict == "pass" for r in stats_cleans),
              "checks_wall_s": checks_s, "scans_wall_s": scans_s, "wall_s": time.perf_counter() - t0,
              "precision": args.precision or None}
    out = Path(args.out)
    out.write_text(json.dumps({"totals": totals, "rows": rows,
                               "loss_curves": {k: v for k, v in losses.items()}}, indent=1))
    md = markdown(rows, totals)
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    # Exit 1 on any miss, any culprit away from its catalogued module, any clean counterpart not passing;
    # any scan that errs, misses, flags a step before its bug acts, or whose rerun names another module;
    # any loss curve that could not run (its column would be no baseline); any clean counterpart stats
    # mode fails, or any stats-mode check that ends in an error.
    ok = (totals["detected"] == totals["bugs"] and totals["correct"] == totals["bugs"]
          and totals["clean_pass"] == totals["clean"] and totals["scan_ok"] == totals["scanned"]
          and not totals["loss_errors"] and totals["stats_clean_pass"] == totals["stats_clean"]
          and not any(r.get("stats_verdict") == "error" for r in rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
