"""The comparison's elementwise arithmetic, compiled (numba): a chunk's figures in two passes over its
flat arrays, where the same formulas as torch operations read and wrote the whole chunk about a
hundred times (tracer/measure.py).

The definitions are tracer/tolerance.py's; tests/tracer/test_measure.py holds these equal to them.
Differences `p - r`, `c - r` are taken in the arrays' own dtype (float32, or float64 for a widened
chunk: nearby values subtract exactly), everything after that in float64. Conventions of the
definitions: a ratio 0/0 is 0 (an element nothing moved), x/0 is inf; the candidate's largest
|c - r| propagates NaN; non-finite values are counted.

How it is fast. A tensor is walked row by row (the rows of its row-column view; a tensor without one
is a single row), in pieces of at most TILE elements. Within a piece every formula is a loop without
a branch over flat arrays indexed by unsigned integers, which LLVM vectorizes (a signed index gets
Python's negative-index check, which stops it). Each element's ratio is kept in a piece-sized
running maximum reduced once per tensor: a running maximum kept inline (`if q > worst`)
mispredicts on random data and does not vectorize (20-30 ns per element instead of 2). A ratio's
running maximum keeps its numerator and denominator and compares by cross-multiplying (loops.
fresh_ratios), a division per position at the end instead of one per element and run: 10% off both
kernels (8.6-8.9 against 9.5-10.3 ns per element with 3 perturbed runs; the figures bit for bit the
same on that test). Sums may be reordered (`reassoc`, vectorized): their value moves by a rounding
of float64.

With three perturbed runs (the default) the reference side walks each piece once per pass with the
three runs' values of a position in registers (three_runs.py), not once per run with the state
between runs kept in arrays: 15.7 -> 8.0 ns per element on the 16x comparison's chunks.

A chunk holds its tensors back to back (tracer/chunk.py: tensor t at `starts[t]`, `lens[t]`
elements); each run's chunk is read where it lies, most often a view of its part (`runs`). The
functions release the GIL: chunks are measured on several threads (tracer/chunk_pool.py). What is
left around them is Python on those threads and on the one that feeds them, and that, not the
arithmetic, bounds a 16x comparison's walk on 2 cores: 0.09 s of pure Python run beside it made
it 0.1 s longer (docs/scale.md section 4). Compiled once per machine and cached under
__pycache__/ttrace-kernels-<digest of these files> (numba's cache, `_cache_dir`); `warm_up` loads
them in a fresh process (~0.5 s) before a comparison needs them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numba
import numpy as np


def _cache_dir() -> str:
    """numba's cache directory for these kernels, named by the content of every file here. numba
    keys a cached function on its own file only: a kernel whose inlined loop (loops.py) changed was
    loaded stale from the cache, silently (measured: two mutations of loops.py passed test_measure)."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + source.read_bytes())
    base = numba.config.CACHE_DIR or str(Path(__file__).parent / "__pycache__")
    return str(Path(base) / f"ttrace-kernels-{digest.hexdigest()[:16]}")


# A kernel's cache is located when it is defined (numba.njit(cache=True)): every kernel module is
# imported here, with the directory set around the imports only.
_user_dir, numba.config.CACHE_DIR = numba.config.CACHE_DIR, _cache_dir()
try:
    from tracer.kernels import excusal, gather, moments
    from tracer.kernels.candidate import candidate
    from tracer.kernels.reference import reference_side
finally:
    numba.config.CACHE_DIR = _user_dir

__all__ = ["candidate", "excusal", "reference_side", "runs", "warm_up"]

FUSED_RUNS = 3   # the perturbed runs the reference side's fused loops take (three_runs.py)


def runs(perturbed: Sequence[np.ndarray], like: np.ndarray) -> tuple[np.ndarray, ...]:
    """The perturbed runs' flat arrays as the kernels take them (P, with their count R beside it): a
    tuple of arrays of one type, read where they lie (stacking them into one (R, N) array copied
    0.07 s of a 16x comparison), padded with `like` (never read) to the FUSED_RUNS the fused loops
    index, so that one compiled kernel serves 0 to 3 runs (tolerance.perturbations above 3 compiles
    its own on first use: 26 s here for both dtypes, then cached). An array numba would type otherwise
    (unaligned, read-only) is copied."""
    want = lambda a: np.require(a, like.dtype, ("C", "A", "W"))
    return tuple(map(want, perturbed)) + (want(like),) * (FUSED_RUNS - len(perturbed))


def prune_stale_caches() -> list[Path]:
    """Remove the compiled kernels of earlier sources (other `ttrace-kernels-*` directories, and the
    per-file cache numba kept beside them before those existed): each edit of a kernel left ~3 MB
    behind. Returns what it removed."""
    import shutil

    current = Path(_cache_dir())
    stale = [d for d in current.parent.glob("ttrace-kernels-*") if d != current]
    stale += [f for pattern in ("*.nbi", "*.nbc") for f in current.parent.glob(pattern)]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def warm_up(dtypes: tuple[str, ...] = ("float32", "float64"), gathers: bool = True) -> None:
    """Load (or compile) every kernel now, for float32 and float64 data (`dtypes`), and the gathers: a
    fresh process pays it once, here rather than inside its first comparison (orchestrator/prefetch.py
    calls it while a check's jobs run; `make setup` once, to compile them into the cache, in two
    processes: one per dtype). The stale caches go first."""
    prune_stale_caches()
    if gathers:
        gather.warm_up()
    one, zero, none, at = np.ones(1, np.int64), np.zeros(1, np.int64), np.zeros(0), np.uint64(0)
    offsets = np.zeros(2, np.int64)
    for dtype, uint in ((np.float32, np.uint32), (np.float64, np.uint64)):
        if np.dtype(dtype).name not in dtypes:
            continue
        x, f8, flags = np.zeros(1, dtype), np.zeros(1), np.zeros(1, np.bool_)
        side = reference_side(x, runs([x], x), 1, none, zero, one, f8, zero, zero, offsets, offsets,
                              x.copy(), x.copy(), f8.copy(), f8.copy())
        candidate(x, x, x, none, zero, one, f8, side[3], side[4], zero, zero, offsets, offsets, f8, f8,
                  side[14])
        excusal.gradient(x, x, x, at, 1, 1.0, 0.0, 1e-8, flags, f8.copy(), f8.copy(), f8.copy())
        excusal.param(x, runs([x], x), 1, x, at, 1, flags, none, none, none, False, False, 1.0, 1.0, x[:0],
                      x.copy(), f8.copy())
        moments.moments(x, x.view(uint), uint(0), zero, one, np.zeros(1, uint), np.uint64(x.ctypes.data),
                        zero, one * x.itemsize, np.zeros(1, np.uint64))
