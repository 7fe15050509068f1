"""Nightly regression run: the clean matrix must pass, every catalog bug must be caught and localized.

`python -m orchestrator.nightly [nightly=full|quick] [clean=a,b] [bugs=x,y] [recipe overrides...]`
(also `ttrace nightly ...` and `make nightly`). All checks run together on one Ray cluster (shared
references computed once), are logged to MLflow as children of one parent run, and summarized in
<output>/<date>/summary.md and summary.json. Exit 0: no regression; 1: a clean recipe failed or a
catalog bug was missed or mislocalized; 2: a check could not run (error) or the matrix is invalid.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from orchestrator.check import run_checks
from orchestrator.recipe import compose
from orchestrator.report import tracking
from tracer.errors import TTraceError

MATRIX_FILE = Path(__file__).resolve().parents[1] / "recipes" / "sweep" / "nightly.yaml"


def trigger_of(bug: Any) -> list[str]:
    """The recipe overrides that trigger a catalog bug within a 2-step check: Bug.recipe (a late bug
    at its `early` step), else the `(trigger: k=v ...)` and `model=` / `precision=` requirements
    written in Bug.needs."""
    if bug.trigger:
        return list(bug.recipe)
    m = re.search(r"trigger:\s*([^)]*)", bug.needs)
    found = m.group(1).split() if m else []
    found += [f"{k}={v}" for k, v in re.findall(r"\b(model|precision)=([\w.]+)", bug.needs)]
    return list(dict.fromkeys(o.rstrip(",;") for o in found if "=" in o))


def plan(argv: list[str]) -> tuple[str, list[dict[str, Any]], list[str], str]:
    """(matrix name, entries, shared overrides, output dir) from the command line and nightly.yaml."""
    from workloads.bugs import CATALOG

    cfg = OmegaConf.to_container(OmegaConf.load(MATRIX_FILE), resolve=True)
    assert isinstance(cfg, dict)
    opts = dict(a.split("=", 1) for a in argv if a.split("=", 1)[0] in ("nightly", "clean", "bugs", "output"))
    extra = [a for a in argv if a.split("=", 1)[0] not in ("nightly", "clean", "bugs", "output")]
    name = opts.get("nightly", "full")
    if name not in cfg or name == "output":
        have = sorted(set(cfg) - {"output"})
        raise TTraceError(f"nightly={name}: no such matrix in {MATRIX_FILE} (have {have})")
    matrix = cfg[name]
    clean = opts["clean"].split(",") if "clean" in opts else list(matrix["clean"])
    bugs = opts.get("bugs", matrix["bugs"])
    bugs = list(CATALOG) if bugs == "catalog" else (bugs.split(",") if isinstance(bugs, str) else list(bugs))
    shared = [*matrix.get("overrides", []), *extra]
    entries: list[dict[str, Any]] = [
        {"label": "clean-" + "-".join(o.split("=", 1)[-1] for o in ovr), "expect": "pass",
         "overrides": [*ovr, "bug=none", *shared]}
        for item in clean if item for ovr in _clean_overrides(item)]
    for b in bugs:
        if not b:
            continue
        bug = CATALOG.get(b)
        if bug is None:
            raise TTraceError(f"bugs={b}: not in workloads/bugs.py CATALOG ({sorted(CATALOG)})")
        trigger = trigger_of(bug)
        entries.append({"label": f"bug-{b}", "expect": "fail", "pattern": bug.expect,
                        "overrides": [*trigger, f"bug={b}", *shared], "no_trigger": not trigger,
                        "late_step": bug.first_step})
    return name, entries, shared, opts.get("output", cfg.get("output", "nightly"))


def _clean_overrides(item: str) -> list[list[str]]:
    """A clean-matrix item: a parallel recipe name (`tp2`), or overrides whose comma-separated values
    expand to their product, as in a Hydra sweep (`model=llama_tiny precision=fp32,bf16 parallel=tp2,pp2`)."""
    if "=" not in item:
        return [[f"parallel={item}"]]
    axes = [[f"{k}={v}" for v in vals.split(",")] for k, vals in (o.split("=", 1) for o in item.split())]
    return [list(combo) for combo in itertools.product(*axes)]


def judge(entry: dict[str, Any], report: dict[str, Any] | None) -> tuple[str, str]:
    """(status, detail): ok | regression | error."""
    if entry.get("no_trigger"):
        return "regression", "catalog bug has no trigger recipe (Bug.trigger in workloads/bugs.py)"
    if report is None or report.get("verdict") == "error":
        return "error", (report or {}).get("error", entry.get("error", "not run"))
    fd = report.get("first_divergence")
    if entry["expect"] == "pass":
        if report["verdict"] == "pass":
            return "ok", f"{len(report['tensors'])} tensors within tolerance"
        return "regression", f"clean recipe diverged at {fd['name']} ({fd['reason']})"
    if report["verdict"] == "pass":
        return "regression", "bug MISSED: every tensor within tolerance"
    at = located(report)
    where = f"{at['module']}/{at['kind']}"
    how = f"culprit {at['name']}" if at is not fd else f"first divergence {at['name']}"
    window = (report.get("blame_window") or {}).get("size")
    how += f" (blame window {window})" if window else ""
    if entry.get("pattern") and not fnmatch.fnmatch(where, entry["pattern"]):
        return "regression", f"bug MISLOCALIZED: {how}, expected {entry['pattern']}"
    if entry.get("late_step"):   # its `early` recipe: at its real step only a scan meets it
        how += f" (late bug, moved to step 1; it acts at step {entry['late_step']} in a real run)"
    if not entry.get("pattern"):
        return "ok", f"caught: {how} (localization not checked: Bug.expect is empty)"
    return "ok", f"caught: {how}"


def located(report: dict[str, Any]) -> dict[str, Any]:
    """Where a failed check points: the isolation pass's culprit when resolved, else the first divergence."""
    c = report.get("culprit")
    return c if c and c.get("resolved") else report["first_divergence"]


def main(argv: list[str]) -> int:
    base = os.getcwd()
    try:
        name, entries, shared, output = plan(argv)
    except TTraceError as e:
        print(f"ttrace nightly: error: {e}", file=sys.stderr)
        return 2
    date = time.strftime("%Y-%m-%d")
    root = Path(base, output, date)
    items, runnable = [], []
    for i, entry in enumerate(entries):
        if entry.get("no_trigger"):
            continue
        try:
            rec = compose(entry["overrides"])
        except TTraceError as e:
            entry["error"] = str(e)
            continue
        items.append((rec, root / "checks" / f"{i:02d}-{entry['label']}"))
        runnable.append(entry)
    track = items[0][0]["tracking"] if items else {"enabled": False}
    parent = None
    if track.get("enabled"):
        try:
            parent = tracking.start_parent(track, base, f"nightly/{date}/{name}",
                                           {"nightly": name, "date": date, "overrides": " ".join(shared)})
        except Exception as e:  # tracking outage: the nightly still runs and writes its summary
            print(f"ttrace nightly: MLflow unavailable ({type(e).__name__}: {e})", file=sys.stderr)
    t0 = time.perf_counter()
    results = run_checks(items, base, progress=True, parent_run_id=parent)
    wall = time.perf_counter() - t0
    by_entry = {id(e): r for e, r in zip(runnable, results, strict=True)}
    rows = []
    for entry in entries:
        res = by_entry.get(id(entry))
        status, detail = judge(entry, res.report if res else None)
        rows.append({"check": entry["label"], "expect": entry["expect"], "status": status, "detail": detail,
                     "verdict": res.verdict if res else "error", "overrides": entry["overrides"],
                     "reference_cache": ((res.report.get("reference") or {}).get("cache") if res else None),
                     "report": str(res.report_path) if res else None,
                     "mlflow_run_id": res.report.get("mlflow_run_id") if res else None})
    n_reg = sum(r["status"] == "regression" for r in rows)
    n_err = sum(r["status"] == "error" for r in rows)
    code = 2 if n_err else (1 if n_reg else 0)
    summary = {"date": date, "matrix": name, "overrides": shared, "wall_s": wall, "exit_code": code,
               "regressions": n_reg, "errors": n_err, "checks": rows, "mlflow_parent_run_id": parent}
    root.mkdir(parents=True, exist_ok=True)
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    (root / "summary.md").write_text(markdown(summary))
    if parent:
        try:
            tracking.end_parent(track, base, parent, {"checks": len(rows), "regressions": n_reg,
                                                      "errors": n_err, "wall_s": wall},
                                [root / "summary.md", root / "summary.json"], ok=code == 0)
        except Exception as e:
            print(f"ttrace nightly: MLflow logging failed ({type(e).__name__}: {e})", file=sys.stderr)
    print(markdown(summary))
    print(f"summary: {root / 'summary.md'}")
    return code


def markdown(s: dict[str, Any]) -> str:
    parent = f"; MLflow parent run `{s['mlflow_parent_run_id']}`" if s.get("mlflow_parent_run_id") else ""
    verdict = "OK" if s["exit_code"] == 0 else ("REGRESSION" if s["exit_code"] == 1 else "ERROR")
    lines = [f"# ttrace nightly {s['date']} ({s['matrix']}): {verdict}", "",
             f"{len(s['checks'])} checks, {s['regressions']} regressions, {s['errors']} errors, "
             f"{s['wall_s']:.0f} s wall; overrides: `{' '.join(s['overrides']) or '-'}`"
             + parent,
             "", "| check | expect | status | verdict | ref cache | detail | report |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in s["checks"]:
        mark = {"ok": "ok", "regression": "**REGRESSION**", "error": "**ERROR**"}[r["status"]]
        detail = str(r["detail"]).replace("|", "\\|").replace("\n", " ")[:300]
        lines.append(f"| {r['check']} | {r['expect']} | {mark} | {r['verdict']} | "
                     f"{r['reference_cache'] or '-'} | {detail} | {r['report'] or '-'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
