"""`ttrace [overrides]`: one check (or a Hydra multirun with -m). Exit 0 pass, 1 divergence, 2 error."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from orchestrator.check import CheckResult, run_check
from orchestrator.recipe import to_dict

RECIPES = str(Path(__file__).resolve().parents[1] / "recipes")
_results: list[CheckResult] = []


def _summary(result: CheckResult) -> str:
    rec, rep = result.report["recipe"], result.report
    what = f"parallel={rec['parallel']['name']} bug={rec['bug']['name']}"
    if result.verdict == "error":
        return f"ttrace: ERROR ({what}): {result.message}"
    fd = rep.get("first_divergence")
    if fd is None:
        n = len(rep.get("tensors", []))
        return f"ttrace: PASS ({what}): {n} tensors within tolerance"
    return (f"ttrace: FAIL ({what}): first divergence {fd['name']} in module {fd['module']} "
            f"({fd['module_type'] or fd['kind']}): {fd['reason']}")


@hydra.main(version_base="1.3", config_path=RECIPES, config_name="config")
def _check(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    result = run_check(to_dict(cfg), out, base_dir=hydra.utils.get_original_cwd())
    _results.append(result)
    print(_summary(result), file=sys.stderr if result.verdict == "error" else sys.stdout, flush=True)
    print(f"report: {result.report_path}", flush=True)


def main() -> None:
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    try:
        _check()
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
