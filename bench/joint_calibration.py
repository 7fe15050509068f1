"""How the joint single-element rule's constants were chosen (docs/tolerance.md, "Two views of one
element"): on stored clean family matrices (`bench/tolerance.py --store DIR`), for every honest
candidate tensor the row-column metric judges (the first step's outputs, output grads and weight
grads), its two figures over the perturbed runs' (own_err / own_noise, counted only past the floor
floor_elem; rowcol_err / rowcol_noise), and for each candidate rule (k_own, k_joint) its head-room:
1 / the largest min(own ratio / k_own, row-column ratio / k_joint) over the honest tensors (a rule
flags a tensor only past both). Reads traces only; no job runs.

Usage: python bench/joint_calibration.py /work/bt-s26/*-bf16-* /work/bt-s27/*-fp8-* [--perturbations 2]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracer.logical import load_logical  # noqa: E402
from tracer.tolerance import (  # noqa: E402
    TolerancePolicy,
    own_err,
    rowcol_err,
    rowcol_noise,
    rowcol_shape,
    unit_roundoff,
)

RULES = ((2.0, 1.0), (1.5, 1.5), (1.5, 2.0), (2.0, 1.5), (1.25, 2.0))


def ratios(store: str, runs: int) -> list[tuple[str, str, float, float]]:
    """(candidate, tensor, own ratio, row-column ratio) of every judged tensor of the store's checks."""
    floor = TolerancePolicy().floor_elem
    ref = load_logical(store, "reference", 1)
    pert = [load_logical(store, f"perturbed-{i}", 1) for i in range(runs)]
    names = [n for n in ref.order if ref.info[n]["step"] == 0
             and rowcol_shape(ref.shape(n), ref.info[n]["kind"]) is not None]
    side = {}
    for n in names:
        r, u = ref.tensors[n].tensor, unit_roundoff(ref.info[n]["dtype"])
        ps = [p.tensors[n].tensor for p in pert]
        side[n] = (r, u, ps, max(own_err(p.double() - r.double(), r, u) for p in ps),
                   max(rowcol_noise(ps, r, u)))
    out = []
    for cand_dir in sorted(glob.glob(f"{store}/cand-*")):
        run = os.path.basename(cand_dir)
        if run == "cand-single":   # the reference's twin: not a layout
            continue
        cand = load_logical(store, run, len(glob.glob(f"{cand_dir}/rank*")))
        for n in names:
            r, u, ps, own_noise, rc_noise = side[n]
            c = cand.tensors[n].tensor
            own = own_err(c.double() - r.double(), r, u)
            own_ratio = own / own_noise if own > floor and own_noise > 0 else 0.0
            rc_ratio = rowcol_err(c, r, ps, u) / rc_noise if rc_noise > 0 else 0.0
            out.append((run, n, own_ratio, rc_ratio))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stores", nargs="+", help="family-matrix store directories (one precision each)")
    ap.add_argument("--perturbations", type=int, default=3, help="perturbed runs used (R)")
    args = ap.parse_args()
    by_prec: dict[str, list[tuple[str, str, str, float, float]]] = {}
    for store in args.stores:
        prec = os.path.basename(store.rstrip("/")).split("-")[1]
        by_prec.setdefault(prec, []).extend((store, *row) for row in ratios(store, args.perturbations))
    for prec, rows in by_prec.items():
        print(f"{prec}: {len(rows)} honest tensor checks")
        for k_own, k_joint in RULES:
            worst = max(rows, key=lambda x: min(x[3] / k_own, x[4] / k_joint))
            m = min(worst[3] / k_own, worst[4] / k_joint)
            room = f"{1 / m:.2f}" if m > 0 else "inf"
            print(f"  k_own {k_own} k_joint {k_joint}: head-room {room} (closest: "
                  f"{os.path.basename(worst[0])} {worst[1]} {worst[2]}, own {worst[3]:.2f} "
                  f"row-column {worst[4]:.2f})")


if __name__ == "__main__":
    main()
