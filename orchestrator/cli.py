"""`ttrace [overrides]`: one check; `ttrace -m ...`: a sweep; `ttrace compare STORE`: judge runs traced
elsewhere; `ttrace report <run-or-path>`: a summary; `ttrace bugs`: the bug catalog; `ttrace nightly`:
the regression suite.

Exit 0 pass, 1 divergence, 2 error (a sweep exits with the worst of its checks).

A sweep (`-m`) is composed by Hydra's sweeper and launcher as usual, but the task function only
collects each job's composed recipe and output directory; once Hydra has composed them all, the
checks run together on one Ray cluster (orchestrator.check.run_checks): distinct references are
computed once, and every job runs as soon as the cluster has room for all its ranks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from orchestrator.check import CheckResult, run_check, run_checks
from orchestrator.recipe import RECIPES, to_dict

_results: list[CheckResult] = []
_pending: list[tuple[dict, Path]] = []     # a sweep's composed recipes, run together after composition
_base_dir: list[str] = []


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
    from tracer.isolation import describe

    culprit = describe(rep) or rep.get("localization_error", "")
    return (f"ttrace: FAIL ({what}): first divergence {fd['name']} in module {fd['module']} "
            f"({fd['module_type'] or fd['kind']}): {fd['reason']}" + (f"\n  {culprit}" if culprit else ""))


@hydra.main(version_base="1.3", config_path=RECIPES, config_name="config")
def _check(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    _base_dir[:] = [hydra.utils.get_original_cwd()]
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        _pending.append((to_dict(cfg), out))
        return
    _emit(run_check(to_dict(cfg), out, base_dir=_base_dir[0]))


REPORT_LINE = "report: "   # one stdout line per check, naming its report.json (scripts read it)


def report_paths(stdout: str, cwd: Path | None = None) -> list[Path]:
    """The report.json of every check a `ttrace` run printed (relative paths resolved from cwd)."""
    paths = [Path(ln.removeprefix(REPORT_LINE).strip()) for ln in stdout.splitlines()
             if ln.startswith(REPORT_LINE)]
    return [cwd / p if cwd is not None else p for p in paths]


def _emit(result: CheckResult) -> None:
    _results.append(result)
    print(summary(result), file=sys.stderr if result.verdict == "error" else sys.stdout, flush=True)
    for warning in result.report.get("warnings", []):
        print(f"ttrace: warning: {warning}", file=sys.stderr, flush=True)
    print(f"{REPORT_LINE}{result.report_path}", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "report":
        from orchestrator.summary import main as report_main

        sys.exit(report_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "bugs":
        from orchestrator.catalog import main as bugs_main

        sys.exit(bugs_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        from orchestrator.compare_cli import main as compare_main

        sys.exit(compare_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "nightly":
        from orchestrator.nightly import main as nightly_main

        sys.exit(nightly_main(sys.argv[2:]))
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    try:
        _check()
        if _pending:
            for result in run_checks(_pending, _base_dir[0], progress=True):
                _emit(result)
    except SystemExit as e:
        if e.code not in (0, None) and not _results:
            print("ttrace: error: the recipe could not be composed (Hydra's message above says which option "
                  f"or key); recipes live in {RECIPES}. Exit 2.", file=sys.stderr)
            sys.exit(2)
        if e.code not in (0, None):
            sys.exit(2)
    sys.exit(max((r.exit_code for r in _results), default=0))


if __name__ == "__main__":
    main()
