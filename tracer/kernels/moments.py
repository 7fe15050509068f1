"""Tensors' statistics for stats mode and scans (tracer/stats.py), compiled: per tensor, one pass
for the sum and the sum of squares (float64 accumulators, vectorized), one for the largest
magnitude, taken on the values' bits with the sign cleared (an unsigned maximum vectorizes where a
float one with NaN semantics does not, and a NaN's bits exceed infinity's, so a NaN is the
maximum)."""

from __future__ import annotations

import numba
import numpy as np

from tracer.kernels.loops import JIT, U


@numba.njit(**JIT)
def moments(x, bits, sign_off, starts, lens, top):
    """Per tensor i of the flat float array x (x[starts[i]:starts[i] + lens[i]]): its sum of squares
    and sum (returned, float64 arrays) and into top[i] the bits of its largest |x|. `bits` is x's
    memory as unsigned integers (top's dtype), `sign_off` the mask that clears their sign bit."""
    n = starts.shape[0]
    s2, s = np.zeros(n), np.zeros(n)
    for t in range(n):
        lo, m = U(starts[t]), U(lens[t])
        a, b = 0.0, 0.0
        for i in range(m):
            v = np.float64(x[lo + i])
            a += v * v
            b += v
        s2[t], s[t] = a, b
        most = bits.dtype.type(0)
        for i in range(m):
            w = bits[lo + i] & sign_off
            most = w if w > most else most
        top[t] = most
    return s2, s
