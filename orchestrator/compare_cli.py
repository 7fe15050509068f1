"""`ttrace compare STORE`: judge runs traced anywhere (torchrun on a cluster that never saw Ray).

Every run is a directory of STORE written by a job's session (tracer/job.py), e.g.

    export TTRACE_STORE=/shared/traces/exp42
    TTRACE_ROLE=reference              torchrun --nproc-per-node 1 train.py
    TTRACE_ROLE=perturbed TTRACE_PERTURB=1 torchrun --nproc-per-node 1 train.py
    TTRACE_ROLE=perturbed TTRACE_PERTURB=2 torchrun --nproc-per-node 1 train.py
    TTRACE_ROLE=candidate              torchrun --nproc-per-node 4 train.py --tp 2
    ttrace compare /shared/traces/exp42

World sizes and layouts come from the manifests. Writes report.json and report.html, logs the
comparison to MLflow like a check, and exits 0 (pass), 1 (divergence) or 2 (error).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from tracer.errors import TTraceError

USAGE = "ttrace compare STORE [options] [recipe overrides, e.g. tolerance.k=6 tracking.enabled=false]"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ttrace compare", usage=USAGE, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", help="the store the runs were traced into (any fsspec URL; TTRACE_STORE)")
    p.add_argument("overrides", nargs="*", help="recipe overrides for the comparison (tolerance.*, "
                                                "tracking.*, store.* for an S3 endpoint)")
    p.add_argument("--reference", default="reference", help="the reference run (default: reference)")
    p.add_argument("--candidate", default="candidate", help="the candidate run (default: candidate)")
    p.add_argument("--perturbed", default=None,
                   help="comma-separated perturbed reference runs (default: every perturbed-* run)")
    p.add_argument("--isolated", default=None,
                   help="the isolation pass's run (TTRACE_ROLE=isolated), if any (default: isolated, if "
                        "present)")
    p.add_argument("--out", default=None, help="directory for report.json and report.html "
                                               "(default: ttrace-compare/<date>/<time>)")
    return p


def main(argv: list[str]) -> int:
    from orchestrator.check import compare_stored
    from orchestrator.cli import REPORT_LINE, summary
    from orchestrator.recipe import compose, resolve_url

    args = parser().parse_intermixed_args(argv)
    base = os.getcwd()
    try:
        rec = compose(args.overrides)
    except TTraceError as e:
        print(f"ttrace compare: error: {e}", file=sys.stderr)
        return 2
    root = resolve_url(args.store, base).rstrip("/")
    rec["store"] = dict(rec["store"], url=root)
    out = Path(args.out or Path(base, "ttrace-compare", time.strftime("%Y-%m-%d"),
                                time.strftime("%H-%M-%S-") + f"{time.time_ns() % 10**6:06d}"))
    perturbed = args.perturbed.split(",") if args.perturbed else None
    res = compare_stored(rec, out, base, root, reference=args.reference, candidate=args.candidate,
                         perturbed=perturbed, isolated=args.isolated)
    print(summary(res), file=sys.stderr if res.verdict == "error" else sys.stdout, flush=True)
    print(f"{REPORT_LINE}{res.report_path}", flush=True)
    return res.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
