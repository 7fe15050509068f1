"""`ttrace report <run-or-path>`: print a check's summary in the terminal.

<run-or-path> is a report.json, a report.html next to one, a check's output directory, or an MLflow
run id (looked up in the tracking store: --tracking-uri, default sqlite:///mlflow.db here).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from orchestrator.report.tracking import module_metrics


def load(target: str, tracking_uri: str) -> dict[str, Any]:
    path = Path(target)
    if path.is_dir():
        path = path / "report.json"
    elif path.suffix == ".html":
        path = path.with_name("report.json")
    if path.is_file():
        return json.loads(path.read_text())
    if "/" in target or target.endswith(".json"):
        raise FileNotFoundError(f"no report at {path}")
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    with tempfile.TemporaryDirectory() as tmp:
        local = mlflow.artifacts.download_artifacts(run_id=target, artifact_path="report.json", dst_path=tmp)
        return json.loads(Path(local).read_text())


def render(report: dict[str, Any], console: Console) -> None:
    rec, fd = report.get("recipe", {}), report.get("first_divergence")
    verdict = report.get("verdict", "error")
    style = {"pass": "green", "fail": "red"}.get(verdict, "yellow")
    job = (report.get("job") or {}).get("label", "builtin")
    what = ((f"job={job} " if job != "builtin" else "")
            + f"parallel={rec.get('parallel', {}).get('name')} bug={rec.get('bug', {}).get('name')} "
            f"precision={rec.get('precision', {}).get('name')} steps={rec.get('steps')}")
    console.print(f"[bold]ttrace check {report.get('check_id', '')}[/]: {escape(what)}")
    console.print(f"verdict: [{style}]{verdict.upper()}[/]")
    ref = report.get("reference")
    if ref:
        console.print(f"reference: cache {ref.get('cache')} (key {ref.get('key')})"
                      + (f"; compared: {ref['compared']}" if ref.get("compared") else ""), markup=False)
        if ref.get("trusted"):
            console.print(f"reference layout: {ref['trusted']}", markup=False)
    for warning in report.get("warnings", []):
        console.print(f"warning: {warning}", markup=False)
    if report.get("logs"):
        runs = ", ".join(f"{run} ({len(paths)})" for run, paths in report["logs"].items())
        console.print(f"rank logs: {runs} under logs/ beside report.json", markup=False)
    if verdict == "error":
        console.print(f"error: {report.get('error', '')}", markup=False)
        return
    tensors = report.get("tensors", [])
    if fd:
        console.print(f"first divergence: {fd['name']} in module {fd['module']} "
                      f"({fd['module_type'] or fd['kind']}): {fd['reason']}", markup=False)
        if describe(report):
            console.print(describe(report), markup=False)
    else:
        console.print(f"{len(tensors)} tensors within tolerance")
    table = Table(title="per module type and kind: max rel_err / tolerance")
    for col in ("module type/kind", "max rel_err", "max err/tol"):
        table.add_column(col)
    mm = module_metrics(tensors)
    for key in sorted(k for k in mm if k.startswith("rel_err/")):
        group = key.removeprefix("rel_err/")
        ratio = mm[f"err_over_tol/{group}"]
        shown = lambda x: "inf" if x >= 1e300 else f"{x:.3g}"   # module_metrics caps inf for MLflow
        table.add_row(group, shown(mm[key]), f"[{'red' if ratio > 1 else 'green'}]{shown(ratio)}[/]")
    console.print(table)
    worst = sorted(tensors, key=lambda t: -(t["rel_err"] / t["tolerance"] if t["tolerance"] else 0))[:10]
    top = Table(title="largest rel_err / tolerance")
    for col in ("index", "tensor", "rel_err", "tolerance", "ok"):
        top.add_column(col)
    for t in worst:
        top.add_row(str(t["index"]), t["name"], f"{t['rel_err']:.3g}", f"{t['tolerance']:.3g}",
                    "yes" if t["ok"] else "[red]NO[/]")
    console.print(top)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ttrace report", description=__doc__.splitlines()[0])
    ap.add_argument("target", help="report.json, report.html, check output directory, or MLflow run id")
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    args = ap.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 140)
    try:
        report = load(args.target, args.tracking_uri)
    except Exception as e:
        print(f"ttrace report: cannot load {args.target!r}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    render(report, console)
    return 0


def describe(report: Mapping[str, Any]) -> str:
    """One line on the culprit of a report (empty if the isolation pass did not run)."""
    c, w = report.get("culprit"), report.get("blame_window")
    if not c or not w:
        return ""
    if not c.get("resolved"):
        return f"culprit unresolved (no module beyond tolerance on its own); blame window {w['size']} modules"
    why = c.get("reason") or f"rel_err {c['rel_err']:.3g} > tolerance {c['tolerance']:.3g}"
    return (f"culprit {c['module']} ({c['module_type'] or c['kind']}, {c['kind']} at step {c['step']}): "
            f"on its own, {why}; the first divergence's error is "
            f"{report.get('origin', '?')}; blame window {w['size']} module{'s' if w['size'] != 1 else ''}")
