"""What a check prints on the terminal: one summary line (two on a FAIL), warnings, and the line
naming its report.json that scripts read back (`report_paths`)."""

from __future__ import annotations

import sys
from pathlib import Path

from orchestrator.outcome import CheckResult

REPORT_LINE = "report: "   # one stdout line per check, naming its report.json (scripts read it)


def report_paths(stdout: str, cwd: Path | None = None) -> list[Path]:
    """The report.json of every check a `ttrace` run printed (relative paths resolved from cwd)."""
    paths = [Path(ln.removeprefix(REPORT_LINE).strip()) for ln in stdout.splitlines()
             if ln.startswith(REPORT_LINE)]
    return [cwd / p if cwd is not None else p for p in paths]


def summary(result: CheckResult) -> str:
    """The one-line account of a check on the terminal (a FAIL adds its culprit on a second line)."""
    rep = result.report
    rec = rep.get("recipe") or {}
    job = (rep.get("job") or {}).get("label", "builtin")
    what = " ".join(x for x in (f"job={job}" if job != "builtin" else "",
                                f"parallel={(rec.get('parallel') or {}).get('name')}",
                                f"bug={(rec.get('bug') or {}).get('name')}") if x)
    if result.verdict == "error":
        return f"ttrace: ERROR ({what}): {result.message}"
    fd = rep.get("first_divergence")
    if fd is None:
        n = len(rep.get("tensors", []))
        return f"ttrace: PASS ({what}): {n} tensors within tolerance"
    from orchestrator.report.text import describe

    culprit = describe(rep) or rep.get("localization_error", "")
    return (f"ttrace: FAIL ({what}): first divergence {fd['name']} in module {fd['module']} "
            f"({fd['module_type'] or fd['kind']}): {fd['reason']}" + (f"\n  {culprit}" if culprit else ""))


def emit(result: CheckResult) -> None:
    """Print a check's summary (stderr for an error), its warnings, and its report line."""
    print(summary(result), file=sys.stderr if result.verdict == "error" else sys.stdout, flush=True)
    for warning in result.report.get("warnings", []):
        print(f"ttrace: warning: {warning}", file=sys.stderr, flush=True)
    print(f"{REPORT_LINE}{result.report_path}", flush=True)
