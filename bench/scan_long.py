"""Long `ttrace scan` runs recorded once, judged offline (issue 18: the band's soundness over 1000 steps).

  python bench/scan_long.py record DIR/NAME <recipe overrides>   # phase 1 only: the runs' fingerprint logs
  python bench/scan_long.py judge DIR/NAME [DIR/NAME ...] [--window N] [--ahead N] [--out F.json]

`record` runs what `ttrace scan` runs in phase 1 (orchestrator/scan.py: the reference set, cached as a
scan's, and the candidate, logging fingerprints every step) and writes DIR/NAME/run.json naming the
logs; it neither judges nor reruns. `judge` walks the logs with tracer/scan_judge.py as `ttrace scan`
does and prints per scan its first step out of the band, the steps out of it, and its worst error
over tolerance (overall and per kind), so a band is calibrated on some seeds' logs and reported on
others' without training again. The former band: this script run in a checkout of the commit
before it (684b6a5) with `--window 8`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator import recipe
from orchestrator.scan import _phase1, _plan
from tracer.fingerprint_read import FingerprintRun
from tracer.scan_judge import WINDOW, judge_steps
from tracer.tolerance import TolerancePolicy


def record(out: Path, overrides: list[str]) -> dict[str, Any]:
    import ray

    rec = recipe.compose(overrides)
    t0 = time.time()
    p = _plan(rec, out, os.getcwd())
    if p.error is None:
        _phase1(p, os.getcwd())
    if ray.is_initialized():
        ray.shutdown()
    if p.error is not None or p.refs is None or p.candidate is None:
        raise SystemExit(f"scan_long record: {p.error}")
    run = {"overrides": overrides, "seconds": round(time.time() - t0, 1), "reference_url": p.refs.url,
           "reference_runs": p.refs.runs, "reference_world": p.refs.world_size, "candidate_url": p.store_url,
           "candidate_world": p.candidate.world_size, "tolerance": p.rec["tolerance"]}
    (out / "run.json").write_text(json.dumps(run, indent=1))
    return run


def judge(path: Path, window: int | None, ahead: int | None = None) -> dict[str, Any]:
    run = json.loads((path / "run.json").read_text())
    t0 = time.time()
    ref, *perts = (FingerprintRun(run["reference_url"], r, run["reference_world"])
                   for r in run["reference_runs"])
    cand = FingerprintRun(run["candidate_url"], "candidate", run["candidate_world"])
    more = {} if ahead is None else {"ahead": ahead}
    j = judge_steps(ref.steps(), cand.steps(), [p.steps() for p in perts],
                    TolerancePolicy.from_config(run["tolerance"]), window=window, **more)
    out_steps = [s for s in j.steps if not s.ok]
    worst = max(j.steps, key=lambda s: s.worst)
    names = sorted({k for s in j.steps for k in s.kinds})
    kinds = {k: max(s.kinds.get(k, 0.0) for s in j.steps) for k in names}
    first = out_steps[0] if out_steps else None
    return {"name": path.name, "overrides": run["overrides"], "window": window, "ahead": ahead,
            "steps": len(j.steps),
            "first_step": j.first_step, "steps_out": len(out_steps),
            "first_tensors": first.failing[:5] if first else [],
            "first_worst": round(first.worst, 4) if first else None, "worst": round(worst.worst, 4),
            "worst_step": worst.step, "worst_tensor": worst.tensor,
            "worst_per_kind": {k: round(v, 4) for k, v in kinds.items()},
            "judge_s": round(time.time() - t0, 1)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["record", "judge"])
    ap.add_argument("paths", nargs="+", help="record: DIR/NAME then recipe overrides; judge: DIR/NAME ...")
    ap.add_argument("--window", type=int, default=WINDOW,
                    help="judge: steps pooled into a band (default: every step so far)")
    ap.add_argument("--ahead", type=int, help="judge: steps of look-ahead (default: tracer/scan_judge.py's)")
    ap.add_argument("--out", help="judge: write the rows to this JSON file")
    a = ap.parse_args(argv)
    if a.command == "record":
        out = Path(a.paths[0])
        out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(record(out, a.paths[1:])))
        return 0
    rows = []
    for p in a.paths:
        rows.append(judge(Path(p), a.window, a.ahead))
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
    wrong = [r["name"] for r in rows if _has_bug(r["overrides"]) == (r["first_step"] is None)]
    if wrong:   # the figure this bench exists for: clean scans inside the band, bug scans out of it
        print(f"scan_long: wrong verdicts (a clean scan out of its band, or a bug never flagged): {wrong}",
              file=sys.stderr)
    return 1 if wrong else 0


def _has_bug(overrides: list[str]) -> bool:
    return any(o.startswith("bug=") and o != "bug=none" for o in overrides)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
