"""The candidate's side of a chunk's figures, compiled (used by tracer/measure.py)."""

from __future__ import annotations

import math

import numba
import numpy as np

from tracer.kernels.loops import (
    JIT,
    TILE,
    U,
    count_nonfinite,
    deviations,
    fresh_ratios,
    largest,
    largest_ratio,
    max_into,
    own_into,
    ratios_into,
    view,
)


@numba.njit(**JIT)
def candidate(c, r, env, judged, starts, lens, units, rms, nu, rows, cols, a_off, c_off, a_all, cf_all,
              rc_rms):
    """The candidate's figures of a chunk against its reference side (the arrays `reference_side`
    wrote and returned). Returns per-tensor float64 arrays (dc2 = ||c - r||^2, dc_max = max |c - r|,
    r_dc = <r, c - r>, all over judged elements; elem_err; nonfinite over all elements; rowcol_err;
    own_err). One pass per tensor, a second over a row-column tensor for own_err."""
    T = starts.shape[0]
    masked = judged.shape[0] > 0
    out = np.zeros((7, T))
    dc2, dc_max, r_dc, elem, nonfinite, rc_err, own = out
    a, w, mt = np.zeros(TILE), np.zeros(TILE), np.zeros(TILE)
    acc, acc_rc = np.zeros((2, TILE)), np.zeros((2, TILE))   # running ratios (loops.fresh_ratios)
    da = np.zeros(TILE)   # running maxima of |c - r| per piece position (vectorizes; see reference.py)
    for t in range(T):
        s0, n, u = U(starts[t]), lens[t], units[t]
        nr, nc, viewed = view(n, rows[t], cols[t])
        room_rel = nu[t] + u
        rms_t = rms[t]
        rs = np.zeros(nr if viewed else 0)
        cs = np.zeros(nc if viewed else 0)
        a0, c0 = a_off[t], U(c_off[t])
        w_rms = rc_rms[t]
        s2, dot = 0.0, 0.0
        da[:] = 0.0
        fresh_ratios(acc)
        fresh_ratios(acc_rc)
        for i in range(nr):
            for j0 in range(0, nc, TILE):
                m = min(TILE, nc - j0)
                lo = s0 + U(i * nc + j0)
                d2, dr = deviations(c, r, lo, m, judged, masked, a, U(0))
                s2 += d2
                dot += dr
                max_into(da, a, U(0), m)
                for j in range(U(m)):
                    w[j] = np.float64(env[lo + j]) + (abs(np.float64(r[lo + j])) + rms_t) * room_rel
                ratios_into(acc, a, U(0), w, m)
                if viewed:
                    rs[i] += d2
                    af = a_all[a0 + i]
                    co = U(j0)
                    for j in range(U(m)):
                        cs[co + j] += a[j] * a[j]
                        mt[j] = u * (abs(np.float64(r[lo + j])) + w_rms)
                        w[j] = af * cf_all[c0 + co + j] + mt[j]
                    ratios_into(acc_rc, a, U(0), w, m)
        # max_into skips NaN, the sum of squares does not: a NaN deviation makes the largest NaN.
        dc2[t], dc_max[t], r_dc[t] = s2, largest(da, TILE) if s2 == s2 else s2, dot
        elem[t] = largest_ratio(acc, TILE)
        rc_err[t] = largest_ratio(acc_rc, TILE)
        if masked or not math.isfinite(s2):
            nonfinite[t] = count_nonfinite(c, s0, n)
        if viewed:   # own_err: the candidate's deviations in the units fitted to them
            total = rs.sum()
            i_c, i_r, i_n = 1.0 / (nc - 1), 1.0 / (nr - 1), 1.0 / (nr * nc - 1)
            fresh_ratios(acc)
            for i in range(nr):
                for j0 in range(0, nc, TILE):
                    m = min(TILE, nc - j0)
                    lo = s0 + U(i * nc + j0)
                    deviations(c, r, lo, m, judged, False, a, U(0))
                    for j in range(U(m)):
                        mt[j] = u * (abs(np.float64(r[lo + j])) + w_rms)
                    own_into(acc, a, U(0), mt, rs[i], cs, U(j0), total, i_c, i_r, i_n, m)
            own[t] = largest_ratio(acc, TILE)
    return dc2, dc_max, r_dc, elem, nonfinite, rc_err, own
