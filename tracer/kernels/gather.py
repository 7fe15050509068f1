"""A multi-rank run's chunk reassembled in one pass, compiled (used by tracer/rank_spans.py).

Both functions move or compare raw bits (the arrays are integer views of the stored dtype): a
reassembled tensor is its pieces' values exactly, and replicas are compared bit for bit.
"""

from __future__ import annotations

import numba
import numpy as np

from tracer.kernels.loops import JIT, U


@numba.njit(**JIT)
def gather(dst, src, plan):
    """Blocks of src into dst; plan rows (src_off, dst_off, outer, inner, dst_stride): for every
    o < outer, dst[dst_off + o dst_stride:][:inner] = src[src_off + o inner:][:inner] (a piece
    sharded along one dim lands in every `outer` row of the logical tensor)."""
    for t in range(plan.shape[0]):
        so, do, outer = U(plan[t, 0]), U(plan[t, 1]), U(plan[t, 2])
        inner, stride = U(plan[t, 3]), U(plan[t, 4])
        for o in range(outer):
            s, d = so + o * inner, do + o * stride
            for j in range(inner):
                dst[d + j] = src[s + j]


@numba.njit(**JIT)
def differ(a, b, plan, out):
    """Bitwise disagreement of replicas; plan rows (a_off, b_off, n, t): out[t] += the elements of
    a[a_off:][:n] and b[b_off:][:n] whose bits differ."""
    for q in range(plan.shape[0]):
        ao, bo, n = U(plan[q, 0]), U(plan[q, 1]), U(plan[q, 2])
        bad = 0
        for j in range(n):
            bad += 1 if a[ao + j] != b[bo + j] else 0
        out[plan[q, 3]] += bad


def warm_up() -> None:
    """Load the functions for every integer width a stored dtype is viewed as."""
    plan, rows = np.zeros((1, 5), np.int64), np.zeros((1, 4), np.int64)
    for dtype in (np.uint8, np.int16, np.int32, np.int64):
        x = np.zeros(1, dtype)
        gather(x, x, plan)
        differ(x, x, rows, np.zeros(1, np.int64))
