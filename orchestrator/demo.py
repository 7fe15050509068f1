"""`make demo`: a clean tensor+sequence-parallel check and the same recipe with a silent bug.

Runs `ttrace -m parallel=tp2_sp bug=none,sp_layernorm_grad_unreduced` (one Ray cluster for both
checks), then prints what each found. Exits non-zero unless the clean check passes and the buggy
one fails at a LayerNorm.
"""

from __future__ import annotations

import json
import subprocess
import sys

from rich.console import Console
from rich.table import Table

from orchestrator.console import REPORT_LINE, report_paths

BUG = "sp_layernorm_grad_unreduced"


def main() -> int:
    console = Console(width=None if sys.stdout.isatty() else 140)
    cmd = [sys.executable, "-m", "orchestrator.cli", "-m", "parallel=tp2_sp", f"bug=none,{BUG}"]
    console.print(f"[bold]ttrace demo[/]: {' '.join(['ttrace', *cmd[3:]])}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    reports = report_paths(proc.stdout)
    if len(reports) != 2:
        console.print(proc.stdout[-4000:], proc.stderr[-4000:], markup=False)
        console.print(f"[red]demo failed: expected two reports, got {len(reports)} (exit {proc.returncode})")
        return 2

    table = Table(title="ttrace: candidate tp2_sp vs single-device reference (fp32, gpt_tiny)")
    for col in ("bug", "verdict", "tensors", "first divergence", "module type", "rel_err / tol", "wall s"):
        table.add_column(col, overflow="fold")
    verdicts = {}
    for path in reports:
        rep = json.loads(path.read_text())
        bug, fd = rep["recipe"]["bug"]["name"], rep.get("first_divergence")
        verdicts[bug] = (rep["verdict"], fd)
        style = {"pass": "green", "fail": "red"}.get(rep["verdict"], "yellow")
        table.add_row(bug, f"[{style}]{rep['verdict'].upper()}[/]", str(len(rep.get("tensors", []))),
                      fd["name"] if fd else "-",
                      fd["module_type"] if fd else "-",
                      f"{fd['rel_err']:.2e} / {fd['tolerance']:.1e}" if fd else "-",
                      f"{rep['timings'].get('total', 0):.1f}")
    console.print(table)
    for path in reports:
        print(f"{REPORT_LINE}{path}")
    console.print("Browse both checks in MLflow: [bold]make ui[/] then open http://127.0.0.1:5000")

    clean, buggy = verdicts.get("none"), verdicts.get(BUG)
    ok = (clean and clean[0] == "pass" and buggy and buggy[0] == "fail"
          and buggy[1]["module_type"] == "LayerNorm")
    if not ok:
        console.print("[red]demo: unexpected outcome (see the reports above)")
        console.print(proc.stderr[-3000:], markup=False)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
