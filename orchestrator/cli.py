"""`ttrace [overrides]`: one check; `ttrace -m ...`: a sweep; `ttrace compare STORE`: judge runs traced
elsewhere; `ttrace report <run-or-path>`: a summary; `ttrace bugs`: the bug catalog; `ttrace nightly`:
the regression suite; `ttrace scan [overrides] steps=N`: the first step a long run diverges.

Exit 0 pass, 1 divergence, 2 error (a sweep exits with the worst of its checks).

A sweep (`-m`) is composed by Hydra's sweeper and run by ttrace's Hydra launcher
(orchestrator/launcher.py, `hydra/launcher: ttrace`): it receives every job of the sweep at once and
runs them together on one Ray cluster.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from orchestrator import launcher
from orchestrator.recipe import RECIPES, to_dict


@hydra.main(version_base="1.3", config_path=RECIPES, config_name="config")
def _check(cfg: DictConfig) -> None:
    """One check (a run, or a job of a sweep under another Hydra launcher). The check's modules (torch,
    Ray, MLflow: 2 s) are imported once the recipe composed: a mistyped option is answered at once."""
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    from orchestrator.check import run_check
    from orchestrator.console import emit

    result = run_check(to_dict(cfg), Path(HydraConfig.get().runtime.output_dir),
                       base_dir=hydra.utils.get_original_cwd())
    emit(result)
    launcher.completed.append(result)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "report":
        from orchestrator.report.text import main as report_main

        sys.exit(report_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "bugs":
        from orchestrator.report.catalog import main as bugs_main

        sys.exit(bugs_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        from orchestrator.compare_cli import main as compare_main

        sys.exit(compare_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "scan":
        from orchestrator.scan import main as scan_main

        sys.exit(scan_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "nightly":
        from orchestrator.nightly import main as nightly_main

        sys.exit(nightly_main(sys.argv[2:]))
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    try:
        _check()
    except SystemExit as e:
        if e.code not in (0, None) and not launcher.completed:
            from orchestrator.schema import RENAMED

            args = " ".join(sys.argv[1:])
            renamed = "".join(f"; {k} is now {v}" for k, v in RENAMED.items() if k in args)
            print("ttrace: error: the recipe could not be composed (Hydra's message above says which option "
                  f"or key{renamed}); recipes live in {RECIPES}. Exit 2.", file=sys.stderr)
            sys.exit(2)
        if e.code not in (0, None):
            sys.exit(2)
    sys.exit(max((r.exit_code for r in launcher.completed), default=0))


if __name__ == "__main__":
    main()
