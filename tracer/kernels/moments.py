"""Tensors' statistics for stats mode and scans (tracer/stats.py), compiled: per tensor, one pass
for the sum and the sum of squares (float64 accumulators, vectorized), one for the largest
magnitude, taken on the values' bits with the sign cleared (an unsigned maximum vectorizes where a
float one with NaN semantics does not, and a NaN's bits exceed infinity's, so a NaN is the
maximum), then xxh3_64 of the tensor's bytes while they are still in cache: xxhash's own
XXH3_64bits, linked from python-xxhash's extension (pinned in pyproject.toml), so the digest is the
one `xxhash.xxh3_64` gives. Hashed from Python after the moments of every tensor, each tensor was
read from memory a second time, and the writer thread held the GIL for a call per tensor."""

from __future__ import annotations

import ctypes

import llvmlite.binding as llvm
import numba
import numpy as np
import xxhash._xxhash
from numba import types

from tracer.kernels.loops import JIT, U

_XXH = xxhash._xxhash.__file__
if not hasattr(ctypes.CDLL(_XXH), "XXH3_64bits"):   # a python-xxhash other than the pinned one
    raise ImportError(f"{_XXH} does not export XXH3_64bits, which stats mode links to: install the "
                      "xxhash version pyproject.toml pins")
llvm.load_library_permanently(_XXH)   # before a kernel calling it is compiled or loaded from the cache
_xxh3_64 = types.ExternalFunction("XXH3_64bits", types.uint64(types.uint64, types.uint64))  # (address, bytes)


@numba.njit(**JIT)
def moments(x, bits, sign_off, starts, lens, top, base, offs, nbytes, hashes):
    """Per tensor i of the flat float array x (x[starts[i]:starts[i] + lens[i]]): its sum of squares
    and sum (returned, float64 arrays), into top[i] the bits of its largest |x|, and into hashes[i]
    the xxh3_64 of its bytes as recorded, nbytes[i] of them at address base + offs[i] (x may be a
    widened copy). `bits` is x's memory as unsigned integers (top's dtype), `sign_off` the mask that
    clears their sign bit."""
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
        hashes[t] = _xxh3_64(base + U(offs[t]), U(nbytes[t]))
    return s2, s
