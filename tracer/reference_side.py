"""The reference set's side of a chunk's figures (tracer/measure.py): everything that depends on the
reference and its perturbed runs only.

Most of a comparison's arithmetic is here: with 3 perturbed runs, 72% of the demo check's
measurement. A chunk without post-step parameters (whose excusal depends on the candidate) has the
same reference side against every candidate, so it is computed once per reference set
(`prepare`): while the candidate still runs (orchestrator/prefetch.py) and for every check of a
sweep that shares the set. The figures are the same bit for bit either way (the same code on the
same chunks; tests/tracer/test_measure.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tracer.blocks import Blocks, leave_one_out, max_rows, no_nan, ratio
from tracer.rowcol import RowColSide, rowcol_side


@dataclass
class ReferenceSide:
    """One chunk's reference-side arrays and per-tensor figures (chunk order)."""

    names: tuple[str, ...]
    runs: int                 # perturbed runs it was made of
    dtype: torch.dtype
    blocks: Blocks
    r: torch.Tensor           # the chunk's reference, flat (blocks, BLOCK)
    env_full: torch.Tensor    # max_r |p_r - r| over every element (the param_grad excusal's envelope)
    rj: torch.Tensor          # r over the judged elements (0 at excused ones)
    env: torch.Tensor         # max_r |p_r - r| over the judged elements
    mag: torch.Tensor         # |r| + rms(r) per element: the rounding room's magnitude
    room: torch.Tensor        # (nu + unit) per block: the noise scale's relative part
    rn2: torch.Tensor         # per tensor: ||r||^2 over judged elements
    rn: torch.Tensor
    rn_eff: torch.Tensor      # the norm-wise errors' denominator (compare.reference_norm)
    r_absmax: torch.Tensor
    rms: torch.Tensor
    noise: torch.Tensor       # max_r rel_err(p_r, r)
    max_noise: torch.Tensor
    elem_noise: torch.Tensor
    scale_noise: torch.Tensor
    ref_nonfinite: torch.Tensor | None    # None: every value finite (no count needed)
    pert_nonfinite: torch.Tensor | None
    moved: list[int]          # per tensor: bit r set where perturbed run r differs from the reference
    rowcol: RowColSide


def reference_side(names: Sequence[str], units: Sequence[float], shapes: Sequence[tuple[int, int] | None],
                   blocks: Blocks, dtype: torch.dtype, r: torch.Tensor, ps: Sequence[torch.Tensor],
                   d_full: Sequence[torch.Tensor] | None = None, a_full: Sequence[torch.Tensor] | None = None,
                   judged: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> ReferenceSide:
    """The figures of the reference r and the perturbed runs ps (flat) over the judged elements: all of
    them, or for a chunk with excused parameter elements `judged` and the per-tensor `counts` of
    judged elements. `d_full`, `a_full`: p - r and |p - r|, when the caller has them."""
    n = len(names)
    zero = torch.zeros(n, dtype=torch.float64)
    d_full = [p - r for p in ps] if d_full is None else d_full
    a_full = [x.abs() for x in d_full] if a_full is None else a_full
    env_full = max_rows(a_full) if ps else torch.zeros_like(r)
    if judged is not None:
        keep = lambda x: torch.where(judged, x, 0.0)
        d = [keep(x) for x in d_full]
        a = [x.abs() for x in d]
        env = max_rows(a) if ps else env_full
    else:
        keep = lambda x: x
        d, a, env = list(d_full), list(a_full), env_full
    counts = torch.tensor(blocks.lens, dtype=torch.float64) if counts is None else counts
    rj = keep(r)
    units_t = torch.tensor(list(units), dtype=torch.float64)

    rn2 = blocks.sumsq(rj)
    rn = rn2.sqrt()
    rms = torch.where(counts > 0, rn / counts.clamp_min(1).sqrt(), 0.0)
    r_absmax = blocks.max(rj.abs())
    mag = rj.abs() + blocks.per_block(rms, dtype)
    pn = [blocks.sumsq(x).sqrt() for x in d]
    noise_scl = [torch.where(rn > 0, x / rn.clamp_min(1e-300), 0.0) for x in pn]   # noise_scale's nu
    # Norm-wise errors are relative to ||r|| of the whole tensor (a param's excused elements add no
    # error, but its scale stays the tensor's: relative to the few judged elements of a mostly
    # excused bias, one element's honest move read as 7-16% against a 16-ulp floor), or, for a
    # reference that is exactly zero (a bias at init), to the largest perturbed run's norm:
    # relative to nothing, every perturbed draw would be infinitely far and the tolerance infinite
    # (tracer.compare.reference_norm).
    rn_all = rn if judged is None else blocks.sumsq(r).sqrt()
    rn_eff = torch.where(rn_all > 0, rn_all, max_rows(pn)) if ps else rn_all
    noise = max_rows([ratio(x, rn_eff) for x in pn]) if ps else zero           # max_r rel_err(p_r, r)
    # max_r max_i |p_ri - r_i| = max_i env_i: one reduction for all runs (likewise below)
    max_noise = ratio(blocks.max(env), r_absmax) if ps else zero

    # Leave-one-out elementwise noise of each perturbed run against the others' scale (fmax skips
    # the 0/0 of elements no run moved).
    elem_noise = zero
    if ps:
        env_loo, nu_loo = leave_one_out(a), leave_one_out(noise_scl)
        worst = None
        for i in range(len(d)):
            q = a[i] / torch.addcmul(env_loo[i], mag, blocks.per_block(nu_loo[i] + units_t, dtype))
            worst = q if worst is None else torch.fmax(worst, q)
        elem_noise = blocks.max(no_nan(worst))
    nu = max_rows(noise_scl) if ps else zero
    rj64 = rj.double()   # once, for every projection on r
    along = lambda x: torch.where(rn2 > 0, x / rn2.clamp_min(1e-300), 0.0)
    scale_noise = max_rows([along(blocks.dot(rj64, x)).abs() for x in d]) if ps else zero

    # Non-finite values: the sums of squares are finite exactly when the values are, so only a chunk
    # with a non-finite sum (or judged on part of its elements) is counted element by element.
    ref_nf = pert_nf = None
    if judged is not None or not bool(torch.isfinite(torch.stack([rn2, *pn])).all()):
        bad = lambda x: blocks.count(~torch.isfinite(x))
        ref_nf = bad(r)
        pert_nf = sum((bad(p) for p in ps), zero)
    bits = torch.tensor([1 << i for i in range(len(d))], dtype=torch.int64)[:, None]
    moved = ((torch.stack(pn) > 0).long() * bits).sum(0).tolist() if ps else [0] * n
    return ReferenceSide(tuple(names), len(ps), dtype, blocks, r, env_full, rj, env, mag,
                         blocks.per_block(nu + units_t, dtype), rn2, rn, rn_eff, r_absmax, rms, noise,
                         max_noise, elem_noise, scale_noise, ref_nf, pert_nf, moved,
                         rowcol_side(list(shapes), list(units), blocks, r, d_full))
