"""The reference set's side of a chunk's figures (tracer/measure.py): everything that depends on the
reference and its perturbed runs only.

Most of a comparison's arithmetic is here: with 3 perturbed runs, three quarters of it. A chunk
without post-step parameters (whose excusal depends on the candidate) has the same reference side
against every candidate, so it is computed once per reference set (`prepare`): while the candidate
still runs (orchestrator/prefetch.py) and for every check of a sweep that shares the set. The
figures are the same bit for bit either way (the same code on the same chunks;
tests/tracer/test_measure.py). The arithmetic is tracer/kernels.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tracer import kernels
from tracer.chunk import ChunkLayout

_ALL = np.zeros(0)   # `judged` meaning every element


@dataclass
class RowCol:
    """The chunk's row-column views (tracer.tolerance.rowcol_shape) and the scale the candidate is
    judged against there: w_ij = a_i cf_j + u (|r_ij| + rms(r)), per tensor t its row factors at
    a_all[a_off[t]:] and column factors at cf_all[c_off[t]:] (rows[t] 0: no view, or no perturbed
    run to build one from)."""

    rows: np.ndarray
    cols: np.ndarray
    a_off: np.ndarray
    c_off: np.ndarray
    a_all: np.ndarray
    cf_all: np.ndarray
    rms: np.ndarray           # rms(r) of each viewed tensor (float64)
    noise: np.ndarray         # max_r leave-one-out rowcol_err(p_r)
    own_noise: np.ndarray     # max_r own_err(p_r)


@dataclass
class ReferenceSide:
    """One chunk's reference-side arrays (flat: tracer/chunk.py) and per-tensor figures
    (float64, chunk order)."""

    names: tuple[str, ...]
    runs: int                 # perturbed runs it was made of
    dtype: torch.dtype
    layout: ChunkLayout
    r: torch.Tensor           # the chunk's reference, flat
    env_full: torch.Tensor    # max_r |p_r - r| over every element, flat (the param_grad excusal's envelope)
    env: torch.Tensor         # the same over the judged elements (0 at excused ones), flat
    judged: np.ndarray        # 1.0 per judged element, 0.0 per excused one, or empty: every element judged
    rn2: np.ndarray           # ||r||^2 over judged elements
    rn_eff: np.ndarray        # the norm-wise errors' denominator (tracer.tolerance.reference_norm)
    r_absmax: np.ndarray
    rms: np.ndarray           # rms(r) over judged elements
    nu: np.ndarray            # max_r rel_err(p_r, r) relative to the judged ||r||: the noise scale's part
    noise: np.ndarray         # max_r rel_err(p_r, r)
    max_noise: np.ndarray
    elem_noise: np.ndarray
    scale_noise: np.ndarray   # max_r |<p_r - r, r>| / ||r||^2
    scale_mean: np.ndarray    # mean_r <p_r - r, r> / ||r||^2
    scale_spread: np.ndarray  # their largest minus their smallest
    ref_nonfinite: np.ndarray
    pert_nonfinite: np.ndarray
    moved: list[int]          # per tensor: bit r set where perturbed run r differs from the reference
    units: np.ndarray
    rowcol: RowCol


def reference_side(names: Sequence[str], units: Sequence[float], shapes: Sequence[tuple[int, int] | None],
                   layout: ChunkLayout, dtype: torch.dtype, r: torch.Tensor, ps: Sequence[torch.Tensor],
                   judged: np.ndarray | None = None) -> ReferenceSide:
    """The figures of the reference r and the perturbed runs ps (each flat, ChunkLayout.flat) over the
    judged elements: all of them, or for a chunk with excused parameter elements those where `judged`
    (flat, float64) is 1.0."""
    runs = len(ps)
    rows = np.array([s[0] if s is not None and runs else 0 for s in shapes], dtype=np.int64)
    cols = np.array([s[1] if s is not None and runs else 0 for s in shapes], dtype=np.int64)
    a_off = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    c_off = np.concatenate([[0], np.cumsum(cols)]).astype(np.int64)
    a_all, cf_all = np.zeros(int(a_off[-1])), np.zeros(int(c_off[-1]))
    env_full = torch.empty_like(r)
    env = env_full if judged is None else torch.empty_like(r)
    mask = _ALL if judged is None else judged
    units_a = np.asarray(units, dtype=np.float64)
    (rn2, rn_eff, r_absmax, rms, nu, noise, max_noise, elem_noise, scale_noise, scale_mean, scale_spread,
     ref_nf, pert_nf, moved, rc_rms, rc_noise, own_noise) = kernels.reference_side(
        r.numpy(), kernels.runs([p.numpy() for p in ps], r.numpy()), runs, mask,
        layout.starts, layout.lengths, units_a, rows, cols, a_off, c_off,
        env.numpy(), env_full.numpy(), a_all, cf_all)
    return ReferenceSide(tuple(names), runs, dtype, layout, r, env_full, env, mask, rn2, rn_eff, r_absmax,
                         rms, nu, noise, max_noise, elem_noise, scale_noise, scale_mean, scale_spread,
                         ref_nf, pert_nf, moved.tolist(), units_a,
                         RowCol(rows, cols, a_off, c_off, a_all, cf_all, rc_rms, rc_noise, own_noise))
