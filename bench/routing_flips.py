"""Routing flips of an MoE check's traces (tracer/routing.py): how many tokens' top-k experts differ
from the reference's in the candidate and in each perturbed reference, and the reference's top-k
margin at the candidate's flips. A flip is a discrete event no rounding-noise tolerance describes
(docs/tolerance.md, "Held-out results ... seeds 11, 12"). Reads a `bench/tolerance.py` store
directory.

Usage: python bench/routing_flips.py <store>/moe_tiny-bf16-s12 [--candidate ep2_tp2] [--top-k 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tolerance import load_combo  # noqa: E402
from tracer.routing import routing_flips  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--candidate", default="ep2_tp2")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--perturbed", type=int, default=3)
    args = ap.parse_args()
    ref, pert, cands = load_combo(args.url, args.perturbed, (args.candidate,))
    if args.candidate not in cands:
        sys.exit(f"no complete trace of cand-{args.candidate} in {args.url}")
    flips = routing_flips(ref, cands[args.candidate], pert, args.top_k)
    if flips is None:
        sys.exit(f"{args.url}: no router output traced")
    print(json.dumps(flips.to_json()))
    print(flips.warning())


if __name__ == "__main__":
    main()
