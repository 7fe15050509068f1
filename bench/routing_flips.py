"""Routing flips of an MoE check's traces: per traced router output, how many tokens' top-k experts
differ from the reference's in the candidate and in each perturbed reference, and the top-k margin
(k-th minus (k+1)-th routing probability, in the reference) of the tokens the candidate flipped.

A flip is a discrete event no rounding-noise tolerance describes (docs/tolerance.md, "Held-out
results ... seeds 11, 12"). Reads a `bench/tolerance.py` store directory.

Usage: python bench/routing_flips.py <store>/moe_tiny-bf16-s12 [--candidate ep2_tp2] [--top-k 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.tolerance import load_combo  # noqa: E402


def experts(logits: torch.Tensor, k: int) -> torch.Tensor:
    return logits.double().topk(k, -1).indices.sort(-1).values


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
    cand, k = cands[args.candidate], args.top_k
    value = lambda run, n: run.tensors[n].tensor
    flipped_total = 0
    for name in (n for n in ref.order if n.endswith("router/output")):
        r = value(ref, name)
        want = experts(r, k)
        flips = (experts(value(cand, name), k) != want).any(-1)
        pert_flips = [int((experts(value(p, name), k) != want).any(-1).sum()) for p in pert]
        probs = r.double().softmax(-1).sort(-1, descending=True).values
        margin = probs[..., k - 1] - probs[..., k]
        flipped_total += int(flips.sum())
        print(f"{name}: {flips.numel()} tokens, candidate flips {int(flips.sum())} "
              f"(margins {[f'{float(m):.2g}' for m in margin[flips]]}), perturbed flips {pert_flips}, "
              f"median margin {float(margin.median()):.3g}")
    print(f"candidate flips in total: {flipped_total}")


if __name__ == "__main__":
    main()
