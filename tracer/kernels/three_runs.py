"""The reference side's loops over a piece fused for three perturbed runs, the default
(tracer/kernels/reference.py takes them when R = 3). The general loops (loops.py) walk the piece
once per run and keep per-position state in arrays between the walks (the envelope, the two largest
deviations, the running ratios); here the three runs' values of a position are in registers at
once and each piece is walked once per pass. Same operations in the same order per position, so the
figures are those of the general loops, but for the sums, whose vectorized order may differ (a
rounding of float64). Replayed on the 16x comparison's chunks (35.6M elements, one thread): 15.7 ->
8.0 ns per element."""

from __future__ import annotations

import numba
import numpy as np

from tracer.kernels.loops import INLINE, TILE, U, own_up, ratio_up, top_two, up


@numba.njit(**INLINE)
def envelope_three(P, r, lo, m, env_full, env, ea, cs, c0, c1, c2, viewed):
    """Pass 1 over r[lo:lo + m] without a mask: env_full and env = max_k |p_k - r|, ea its running
    maxima per piece position, for a row-column view (`viewed`) each run's squared deviations added
    into its column sums cs[c_k:]; returns each run's sum of (p_k - r)^2 and of r (p_k - r)."""
    p0, p1, p2 = P[0], P[1], P[2]
    s0 = s1 = s2 = t0 = t1 = t2 = 0.0
    for j in range(U(m)):
        x = r[lo + j]
        rf = np.float64(x)
        d0, d1, d2 = np.float64(p0[lo + j] - x), np.float64(p1[lo + j] - x), np.float64(p2[lo + j] - x)
        s0 += d0 * d0
        s1 += d1 * d1
        s2 += d2 * d2
        t0 += rf * d0
        t1 += rf * d1
        t2 += rf * d2
        e = up(up(up(0.0, abs(d0)), abs(d1)), abs(d2))
        env_full[lo + j] = e
        env[lo + j] = e
        ea[j] = up(ea[j], e)
    if viewed:
        for j in range(U(m)):
            x = r[lo + j]
            d0, d1, d2 = np.float64(p0[lo + j] - x), np.float64(p1[lo + j] - x), np.float64(p2[lo + j] - x)
            cs[c0 + j] += d0 * d0
            cs[c1 + j] += d1 * d1
            cs[c2 + j] += d2 * d2
    return s0, s1, s2, t0, t1, t2


@numba.njit(**INLINE)
def loo_three_into(acc, a, mt, c0, c1, c2, m):
    """loops.top_two_into over the three runs' deviations a[k * TILE:], then loops.loo_ratios_into
    for each run (its share of mt c_k), in one walk."""
    num, den = acc[0], acc[1]
    for j in range(U(m)):
        v0, v1, v2 = a[j], a[U(TILE) + j], a[U(2 * TILE) + j]
        top, second = top_two(0.0, 0.0, v0)
        top, second = top_two(top, second, v1)
        top, second = top_two(top, second, v2)
        mj = mt[j]
        n, d = ratio_up(num[j], den[j], v0, (second if v0 >= top else top) + mj * c0)
        n, d = ratio_up(n, d, v1, (second if v1 >= top else top) + mj * c1)
        n, d = ratio_up(n, d, v2, (second if v2 >= top else top) + mj * c2)
        num[j], den[j] = n, d


@numba.njit(**INLINE)
def viewed_three_into(acc_rc, acc_own, a, room, la0, la1, la2, lc, cs, c0, c1, c2, rs0, rs1, rs2,
                      tot0, tot1, tot2, i_c, i_r, i_n, m):
    """Each run's row-column ratio (loops.ratios_into, w = la_k lc_k + room) and own-fit ratio
    (loops.own_into), the three runs in turn, in one walk."""
    rn, rd, on, od = acc_rc[0], acc_rc[1], acc_own[0], acc_own[1]
    for j in range(U(m)):
        v0, v1, v2 = a[j], a[U(TILE) + j], a[U(2 * TILE) + j]
        w = room[j]
        n, d = ratio_up(rn[j], rd[j], v0, la0 * lc[c0 + j] + w)
        n, d = ratio_up(n, d, v1, la1 * lc[c1 + j] + w)
        n, d = ratio_up(n, d, v2, la2 * lc[c2 + j] + w)
        rn[j], rd[j] = n, d
        n, d = own_up(on[j], od[j], v0, w, rs0, cs[c0 + j], tot0, i_c, i_r, i_n)
        n, d = own_up(n, d, v1, w, rs1, cs[c1 + j], tot1, i_c, i_r, i_n)
        n, d = own_up(n, d, v2, w, rs2, cs[c2 + j], tot2, i_c, i_r, i_n)
        on[j], od[j] = n, d
