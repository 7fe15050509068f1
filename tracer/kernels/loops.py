"""The loops the kernels are made of (tracer/kernels/__init__.py says why they look like this), each
inlined into its caller and indexed by unsigned offsets into flat arrays."""

from __future__ import annotations

import math

import numba
import numpy as np

JIT = {"nogil": True, "cache": True, "error_model": "numpy", "boundscheck": False,
        "fastmath": {"reassoc"}}
INLINE = dict(JIT, inline="always")
TILE = 512   # elements of a piece: its scratch arrays stay in L1
U = np.uint64


@numba.njit(**INLINE)
def ratio(num, den):
    """num / den per the definitions: 0/x = 0, x/0 = inf (tracer.tolerance.rel_err)."""
    if num == 0.0:
        return 0.0
    if den > 0.0:
        return num / den
    return math.inf


@numba.njit(**INLINE)
def nanmax(m, v):
    """max(m, v) where a NaN, once seen, stays."""
    if m != m:
        return m
    return v if not v <= m else m


@numba.njit(**INLINE)
def deviations(x, r, lo, m, keep, masked, a, ao):
    """a[ao:ao + m] = |x - r| over x[lo:lo + m] (float64; 0 at elements keep marks 0 when `masked`);
    returns (sum of (x - r)^2, sum of r (x - r)) over the kept elements."""
    s2, dot = 0.0, 0.0
    for j in range(U(m)):
        d = np.float64(x[lo + j] - r[lo + j])
        if masked:
            d = d if keep[lo + j] > 0.0 else 0.0
        a[ao + j] = abs(d)
        s2 += d * d
        dot += np.float64(r[lo + j]) * d
    return s2, dot


# One position's update of each running state below: the array loops here walk them over a piece,
# tracer/kernels/three_runs.py over three runs' values at once.
@numba.njit(**INLINE)
def up(best, v):
    """max(best, v), v ignored if NaN."""
    return v if v > best else best


@numba.njit(**INLINE)
def ratio_up(num, den, v, w):
    """A running ratio num / den (`fresh_ratios`) taking v / w if larger: 0/0 ignored, v/0 inf."""
    larger = v * den > num * w
    return (v if larger else num), (w if larger else den)


@numba.njit(**INLINE)
def top_two(top, second, v):
    """The largest two of (top, second) and v (a tie fills both; a NaN v is ignored), branch-free."""
    larger = v > top
    low = top if larger else v
    return (v if larger else top), up(second, low)


@numba.njit(**INLINE)
def own_up(num, den, v, room, row_sum, col_sum, total, i_c, i_r, i_n):
    """A running ratio taking |v| / w, w = sqrt(a b / m) + room fitted without v's own square
    (tracer.tolerance.own_err): a = (row_sum - v^2) / (cols - 1), b = (col_sum - v^2) / (rows - 1),
    m = (total - v^2) / (n - 1) (i_c, i_r, i_n the reciprocals)."""
    sq = v * v
    a = max(row_sum - sq, 0.0) * i_c
    b = max(col_sum - sq, 0.0) * i_r
    mm = max(total - sq, 0.0) * i_n
    fit = a * b / mm
    return ratio_up(num, den, v, math.sqrt(fit if mm > 0.0 else 0.0) + room)


@numba.njit(**INLINE)
def max_into(acc, x, xo, m):
    """acc[:m] = max(acc[:m], x[xo:xo + m]); a NaN in x is ignored."""
    for j in range(U(m)):
        acc[j] = up(acc[j], x[xo + j])


@numba.njit(**INLINE)
def ratios_into(acc, x, xo, w, m):
    """acc (running ratios, `fresh_ratios`) takes the larger of itself and x[xo:xo + m] / w[:m]."""
    num, den = acc[0], acc[1]
    for j in range(U(m)):   # ratio_up written out (fresh_ratios says why)
        v, d = x[xo + j], w[j]
        larger = v * den[j] > num[j] * d
        num[j] = v if larger else num[j]
        den[j] = d if larger else den[j]


@numba.njit(**INLINE)
def top_two_into(top, second, x, xo, m):
    """top[:m], second[:m] = the largest and second largest of themselves and x[xo:xo + m] (`top_two`)."""
    for j in range(U(m)):
        top[j], second[j] = top_two(top[j], second[j], x[xo + j])


@numba.njit(**INLINE)
def loo_ratios_into(acc, x, xo, top, second, mt, c, m):
    """acc (running ratios) takes x_j / w_j, w_j = (the largest of the other runs' x) + mt_j c, where
    top and second hold the largest two over every run, x's included (top_two_into)."""
    num, den = acc[0], acc[1]
    for j in range(U(m)):
        v = x[xo + j]
        num[j], den[j] = ratio_up(num[j], den[j], v, (second[j] if v >= top[j] else top[j]) + mt[j] * c)


@numba.njit(**INLINE)
def own_into(acc, x, xo, room, row_sum, cs, co, total, i_c, i_r, i_n, m):
    """acc (running ratios) takes each x[xo + j]'s own-fit ratio (`own_up`), its column sum cs[co + j]."""
    num, den = acc[0], acc[1]
    for j in range(U(m)):   # own_up written out (fresh_ratios says why)
        v = x[xo + j]
        sq = v * v
        a = max(row_sum - sq, 0.0) * i_c
        b = max(cs[co + j] - sq, 0.0) * i_r
        mm = max(total - sq, 0.0) * i_n
        fit = a * b / mm
        w = math.sqrt(fit if mm > 0.0 else 0.0) + room[j]
        larger = v * den[j] > num[j] * w
        num[j] = v if larger else num[j]
        den[j] = w if larger else den[j]


@numba.njit(**INLINE)
def fresh_ratios(acc):
    """Running ratios emptied: every position holds 0/1. A position keeps the pair (num, den) of its
    largest ratio so far, compared as v den > num w: two multiplications instead of a division per
    element and run, 10% of both kernels' time (tracer/kernels/__init__.py). The update is `ratio_up`;
    `ratios_into` and `own_into` write it out, as the candidate's kernel walks them: through the
    helper it took 7.5 against 6.1 ns per element there (replayed, 2026-11-29). Exact but for products beyond
    float64's range, i.e. values above ~1e154 (traced float32, bf16 and fp8 values stay below 1e39)."""
    acc[0, :] = 0.0
    acc[1, :] = 1.0


@numba.njit(**INLINE)
def largest_ratio(acc, m):
    """The largest ratio the running ratios hold (0 for none): one division per position."""
    best = 0.0
    for j in range(m):
        best = max(best, ratio(acc[0, j], acc[1, j]))
    return best


@numba.njit(**INLINE)
def largest(x, m):
    """max(x[:m]) of non-negative values (0 for none); NaN propagates. Eight running maxima, NaN
    counted aside: one running maximum is a chain of dependent compares that does not vectorize
    (2 ns per element, measured; these 0.15 ns)."""
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = 0.0
    k = U(m) // U(8) * U(8)
    for j in range(U(0), k, U(8)):
        b0, b1, b2, b3 = up(b0, x[j]), up(b1, x[j + U(1)]), up(b2, x[j + U(2)]), up(b3, x[j + U(3)])
        b4, b5 = up(b4, x[j + U(4)]), up(b5, x[j + U(5)])
        b6, b7 = up(b6, x[j + U(6)]), up(b7, x[j + U(7)])
    for j in range(k, U(m)):
        b0 = up(b0, x[j])
    nan = 0
    for j in range(U(m)):
        nan += x[j] != x[j]
    return math.nan if nan else max(max(max(b0, b1), max(b2, b3)), max(max(b4, b5), max(b6, b7)))


@numba.njit(**INLINE)
def count_nonfinite(x, lo, n):
    bad = 0
    for j in range(U(n)):
        bad += 0 if math.isfinite(np.float64(x[lo + j])) else 1
    return bad


@numba.njit(**INLINE)
def view(n, rows, cols):
    """The walk's (rows, cols) over a tensor: its row-column view, or one row of n elements."""
    if rows > 0:
        return rows, cols, True
    return 1, n, False
