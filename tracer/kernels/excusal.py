"""The Adam excusal's per-element work, compiled (used by tracer/measure.py, which says what the
excusal is): a gradient's elements within noise of zero, and a post-step parameter's elements
whose deviation its gradient's deviation explains, with the bounds every excused element is still
held to."""

from __future__ import annotations

import numba
import numpy as np

from tracer.kernels.loops import JIT, U, nanmax


@numba.njit(**JIT)
def gradient(r, c, env_full, lo, n, k, room, eps, near, dev, env, upd):
    """A param_grad of n elements at lo: near[j] = |r| <= k (env + room) (within noise of zero: its
    update may go either way), except where the reference, every perturbed run and the candidate are
    exactly zero (a deterministic zero update); dev[j] = |c - r|, env[j] = the perturbed runs'
    envelope and, where this grad makes Adam's first update (eps > 0: its eps, tracer/adam.py), upd[j] =
    |u(c) - u(r)|, u(g) = g / (|g| + eps) that update over lr, kept for the param's excusal (not written
    otherwise). `room` = (noise + unit) x rms(r)."""
    for j in range(U(n)):
        at = lo + j
        rv = np.float64(r[at])
        e = np.float64(env_full[at])
        d = abs(np.float64(c[at] - r[at]))
        near[j] = abs(rv) <= k * (e + room) and not (rv == 0.0 and e == 0.0 and d == 0.0)
        dev[j] = d
        env[j] = e
        if eps > 0.0:
            cv = np.float64(c[at])
            upd[j] = abs(cv / (abs(cv) + eps) - rv / (abs(rv) + eps))


@numba.njit(**JIT)
def param(r, P, R, c, lo, n, mask, c_dg, p_dg, c_upd, first, explain, k, unit, before, keep, judged):
    """A post-step param of n elements at lo (P[:R] the perturbed runs, tracer.kernels.runs). With `explain`,
    mask (bool, n) gains the elements whose deviation the candidate's gradient deviation c_dg explains:
    0 < |c - r| <= k x gain x c_dg, gain the perturbed runs' parameter envelope over their gradient envelope
    p_dg; or, where this is Adam's first update (`first`, with `before`), 0 < |c - r| <= k x lr x c_upd,
    lr the reference's largest move from `before` (float64, computed only then), c_upd the candidate's
    first-update deviation |u(c_g) - u(r_g)| (tracer/adam.py; read only then). Written: keep (n,) the
    reference's values (the next step's `before`), judged[lo:][:n] 0.0 at the masked elements and 1.0
    elsewhere. Returns (added, env_max, absmax, excused, excused_dev, beyond, beyond_noise, step_max): the
    perturbed runs' largest move and the reference's largest element; over the excused (masked) elements
    their count, their largest |c - r| (NaN propagates), how many lie beyond k x their envelope (one ulp
    of room where no run moved them), and the most any perturbed run has beyond the others' envelope; the
    reference's largest move from `before` (its previous step's values; 0 without them), in r's dtype as
    torch's (r - before).abs().max() (NaN propagates)."""
    added, env_max, absmax, step_max, lr = 0, 0.0, 0.0, 0.0, 0.0
    if before.shape[0] == n:   # the reference's largest move, before the elements it explains
        for j in range(U(n)):
            step_max = nanmax(step_max, abs(r[lo + j] - before[j]))
            if first:
                lr = nanmax(lr, abs(np.float64(r[lo + j]) - np.float64(before[j])))
    for j in range(U(n)):
        at = lo + j
        rv = r[at]
        keep[j] = rv
        e = 0.0
        for q in range(R):
            e = max(e, abs(np.float64(P[q][at] - rv)))
        env_max = max(env_max, e)
        absmax = max(absmax, abs(np.float64(rv)))
        if explain and not mask[j]:
            d = abs(np.float64(c[at] - rv))
            gain = e / p_dg[j] if p_dg[j] > 0.0 else 0.0
            adam = lr > 0.0 and d <= k * lr * c_upd[j]   # lr > 0 only where `first`: c_upd read then
            if d > 0.0 and ((c_dg[j] > 0.0 and d <= k * gain * c_dg[j]) or adam):
                mask[j] = True
                added += 1
        judged[at] = 0.0 if mask[j] else 1.0
    excused, excused_dev, beyond = 0, 0.0, 0
    noise = np.zeros(R, dtype=np.int64)
    for j in range(U(n)):
        if not mask[j]:
            continue
        at = lo + j
        rv = r[at]
        d = abs(np.float64(c[at] - rv))
        excused += 1
        excused_dev = nanmax(excused_dev, d)
        room = abs(np.float64(rv)) * unit
        e = 0.0
        for q in range(R):
            e = max(e, abs(np.float64(P[q][at] - rv)))
        if d > k * max(e, room):
            beyond += 1
        if R > 1:
            for q in range(R):
                others = 0.0
                for q2 in range(R):
                    if q2 != q:
                        others = max(others, abs(np.float64(P[q2][at] - rv)))
                if abs(np.float64(P[q][at] - rv)) > k * max(others, room):
                    noise[q] += 1
    return added, env_max, absmax, excused, excused_dev, beyond, noise.max() if R > 1 else 0, step_max
