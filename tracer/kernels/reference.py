"""The reference set's side of a chunk's figures, compiled (used by tracer/reference_side.py)."""

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
    loo_ratios_into,
    max_into,
    own_into,
    ratio,
    ratios_into,
    top_two_into,
    view,
)
from tracer.kernels.three_runs import envelope_three, loo_three_into, viewed_three_into


@numba.njit(**JIT)
def reference_side(r, P, R, judged, starts, lens, units, rows, cols, a_off, c_off,
                   env, env_full, a_all, cf_all):
    """Everything of a chunk's figures that needs no candidate (tracer/reference_side.py).

    r (N,) the reference, P[:R] the perturbed runs (tracer.kernels.runs: flat (N,) arrays), judged
    (N,) 1.0/0.0 or (0,) for all: elements of post-step params left out by the Adam excusal. Per
    tensor t: units[t] its unit roundoff, rows[t] x cols[t] its row-column view (rows 0: not judged
    that way; never with `judged`). Written: env (N,) max_r |p_r - r| over judged elements (0
    elsewhere), env_full (N,) over all (may be env itself), and for row-column tensors the all-runs
    row factors a_i = sqrt(A_i / (R T)) at a_all[a_off[t]:] and column factors sqrt(B_j) at
    cf_all[c_off[t]:].
    Returns per-tensor float64 arrays (rn2, rn_eff, r_absmax, rms, nu, noise, max_noise, elem_noise,
    scale_noise, scale_mean, scale_spread, ref_nonfinite, pert_nonfinite, moved, rc_rms, rc_noise,
    own_noise): scale_* of the runs' projections <p_r - r, r> / ||r||^2 (largest magnitude, mean,
    largest minus smallest)."""
    T = starts.shape[0]
    masked = judged.shape[0] > 0
    out = np.zeros((16, T))
    (rn2, rn_eff, r_absmax, rms, nu, noise, max_noise, elem_noise, scale_noise, scale_mean, scale_spread,
     ref_nf, pert_nf, rc_rms, rc_noise, own_noise) = out
    moved = np.zeros(T, dtype=np.int64)
    pn2, dots, scl, nu_u = np.zeros(R), np.zeros(R), np.zeros(R), np.zeros(R)
    a = np.zeros(max(R, 1) * TILE)   # |p_k - r| of the piece, run k at k * TILE
    e, w, mt = np.zeros(TILE), np.zeros(TILE), np.zeros(TILE)
    acc, acc_rc, acc_own = np.zeros((2, TILE)), np.zeros((2, TILE)), np.zeros((2, TILE))   # running ratios
    top, second = np.zeros(TILE), np.zeros(TILE)
    ra, ea = np.zeros(TILE), np.zeros(TILE)   # running maxima of |r| and of e, per piece position
    for t in range(T):
        s0, n, u = U(starts[t]), lens[t], units[t]
        nr, nc, viewed = view(n, rows[t], cols[t])
        viewed = viewed and R > 0
        rs = np.zeros((R, nr if viewed else 0))
        cs = np.zeros(R * nc if viewed else 0)   # run k's column sums at k * nc
        # Pass 1: sums, envelopes, maxima.
        pn2[:] = 0.0
        dots[:] = 0.0
        s_rn2, s_all, count = 0.0, 0.0, 0.0 if masked else float(n)
        ra[:] = 0.0
        ea[:] = 0.0
        for i in range(nr):
            for j0 in range(0, nc, TILE):
                m = min(TILE, nc - j0)
                lo = s0 + U(i * nc + j0)
                if masked:
                    for j in range(U(m)):
                        rf = np.float64(r[lo + j])
                        s_all += rf * rf
                        rk = rf if judged[lo + j] > 0.0 else 0.0
                        s_rn2 += rk * rk
                        count += judged[lo + j]
                        ak = abs(rk)
                        ra[j] = ak if ak > ra[j] else ra[j]
                else:   # a sum that vectorizes, then the maximum
                    for j in range(U(m)):
                        rf = np.float64(r[lo + j])
                        s_all += rf * rf
                    for j in range(U(m)):
                        ak = abs(np.float64(r[lo + j]))
                        ra[j] = ak if ak > ra[j] else ra[j]
                if R == 3 and not masked:   # the default, fused (three_runs.py)
                    q0, q1, q2, g0, g1, g2 = envelope_three(P, r, lo, m, env_full, env, ea, cs, U(j0),
                                                            U(nc + j0), U(2 * nc + j0), viewed)
                    if viewed:
                        rs[0, i] += q0
                        rs[1, i] += q1
                        rs[2, i] += q2
                    pn2[0] += q0
                    pn2[1] += q1
                    pn2[2] += q2
                    dots[0] += g0
                    dots[1] += g1
                    dots[2] += g2
                    continue
                e[:m] = 0.0
                for k in range(R):
                    ao = U(k * TILE)
                    s2, dot = deviations(P[k], r, lo, m, judged, False, a, ao)
                    max_into(e, a, ao, m)
                    if viewed:
                        rs[k, i] += s2
                        co = U(k * nc + j0)
                        for j in range(U(m)):
                            cs[co + j] += a[ao + j] * a[ao + j]
                    if masked:   # the norms over judged elements only
                        s2, dot = deviations(P[k], r, lo, m, judged, True, a, ao)
                    pn2[k] += s2
                    dots[k] += dot
                for j in range(U(m)):
                    env_full[lo + j] = e[j]
                if masked:
                    for j in range(U(m)):
                        e[j] = e[j] if judged[lo + j] > 0.0 else 0.0
                for j in range(U(m)):
                    env[lo + j] = e[j]
                max_into(ea, e, U(0), m)
        if not masked:
            s_rn2 = s_all
        # The maxima kept per piece position vectorize (a running scalar maximum does not: 2 ns per
        # element, measured). They skip NaN; the sum of squares does not: NaN in r makes amax NaN.
        amax = largest(ra, TILE) if s_rn2 == s_rn2 else s_rn2
        emax = largest(ea, TILE)   # e skips NaN (max_into)
        if masked or not math.isfinite(s_all) or not math.isfinite(pn2.sum()):
            ref_nf[t] = count_nonfinite(r, s0, n)
            for k in range(R):
                pert_nf[t] += count_nonfinite(P[k], s0, n)
        rn = math.sqrt(s_rn2)
        rn2[t] = s_rn2
        rms[t] = rn / math.sqrt(count) if count > 0 else 0.0
        r_absmax[t] = amax
        rn_all = rn if not masked else math.sqrt(s_all)
        big = 0.0
        for k in range(R):
            big = max(big, math.sqrt(pn2[k]))
        rn_eff[t] = rn_all if (rn_all > 0.0 or R == 0) else big
        low, high = math.inf, -math.inf
        for k in range(R):
            pn = math.sqrt(pn2[k])
            scl[k] = pn / rn if rn > 0.0 else 0.0
            noise[t] = max(noise[t], ratio(pn, rn_eff[t]))
            if pn > 0.0:
                moved[t] |= 1 << k
            along = dots[k] / s_rn2 if s_rn2 > 0.0 else 0.0
            scale_noise[t] = max(scale_noise[t], abs(along))
            scale_mean[t] += along / R
            low, high = min(low, along), max(high, along)
            nu[t] = max(nu[t], scl[k])
        scale_spread[t] = high - low if R > 0 else 0.0
        max_noise[t] = ratio(emax, amax) if R > 0 else 0.0
        if R == 0:
            continue
        for k in range(R):
            other = 0.0
            for j in range(R):
                if j != k:
                    other = max(other, scl[j])
            nu_u[k] = other + u
        rms_t = rms[t]
        # Row-column factors: of all runs (the candidate's scale), and of all runs but each one.
        tot = np.zeros(R)
        la = np.zeros((R, nr if viewed else 0))
        lc = np.zeros(R * nc if viewed else 0)
        i_c, i_r, i_n, w_rms = 0.0, 0.0, 0.0, 0.0
        if viewed:
            rc_rms[t] = w_rms = math.sqrt(s_all / n)
            for k in range(R):
                tot[k] = rs[k].sum()
            total = tot.sum()
            a0, c0 = a_off[t], c_off[t]
            for i in range(nr):
                a_all[a0 + i] = math.sqrt(rs[:, i].sum() / (R * total)) if total > 0.0 else 0.0
            for j in range(nc):
                col = 0.0
                for k in range(R):
                    col += cs[k * nc + j]
                cf_all[c0 + j] = math.sqrt(col)
                for k in range(R):
                    lc[k * nc + j] = math.sqrt(max(col - cs[k * nc + j], 0.0))
            for k in range(R):
                lt = total - tot[k]
                for i in range(nr):
                    si = rs[:, i].sum() - rs[k, i] if R > 1 else 0.0
                    la[k, i] = math.sqrt(max(si, 0.0) / ((R - 1) * lt)) if lt > 0.0 else 0.0
            i_c, i_r, i_n = 1.0 / (nc - 1), 1.0 / (nr - 1), 1.0 / (nr * nc - 1)
        # Pass 2: each perturbed run against the scale of the others (leave-one-out), and in its own
        # fitted row-column units.
        fresh_ratios(acc)
        fresh_ratios(acc_rc)
        fresh_ratios(acc_own)
        for i in range(nr):
            for j0 in range(0, nc, TILE):
                m = min(TILE, nc - j0)
                lo = s0 + U(i * nc + j0)
                for k in range(R):
                    deviations(P[k], r, lo, m, judged, masked, a, U(k * TILE))
                for j in range(U(m)):
                    mt[j] = abs(np.float64(r[lo + j])) + rms_t     # the element's magnitude
                # The largest |p_q - r| over the runs but k: the second largest where run k holds the
                # largest (2R passes over the piece, not R(R-1) maxima).
                if R == 3:
                    loo_three_into(acc, a, mt, nu_u[0], nu_u[1], nu_u[2], m)
                else:
                    top[:] = 0.0
                    second[:] = 0.0
                    for q in range(R):
                        top_two_into(top, second, a, U(q * TILE), m)
                    for k in range(R):
                        loo_ratios_into(acc, a, U(k * TILE), top, second, mt, nu_u[k], m)
                if viewed:
                    for j in range(U(m)):
                        mt[j] = u * (abs(np.float64(r[lo + j])) + w_rms)   # the rounding room
                    if R == 3:
                        viewed_three_into(acc_rc, acc_own, a, mt, la[0, i], la[1, i], la[2, i], lc, cs,
                                          U(j0), U(nc + j0), U(2 * nc + j0), rs[0, i], rs[1, i], rs[2, i],
                                          tot[0], tot[1], tot[2], i_c, i_r, i_n, m)
                    for k in range(R if R != 3 else 0):
                        ao = U(k * TILE)
                        co = U(k * nc + j0)
                        if R > 1:
                            la_k = la[k, i]
                            for j in range(U(m)):
                                w[j] = la_k * lc[co + j] + mt[j]
                            ratios_into(acc_rc, a, ao, w, m)
                        own_into(acc_own, a, ao, mt, rs[k, i], cs, co, tot[k], i_c, i_r, i_n, m)
        elem_noise[t] = largest_ratio(acc, TILE)
        rc_noise[t] = largest_ratio(acc_rc, TILE)
        own_noise[t] = largest_ratio(acc_own, TILE)
    return (rn2, rn_eff, r_absmax, rms, nu, noise, max_noise, elem_noise, scale_noise, scale_mean,
            scale_spread, ref_nf, pert_nf, moved, rc_rms, rc_noise, own_noise)
