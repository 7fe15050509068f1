"""`trace.mode=stats`: per traced tensor, four statistics instead of its values (docs/stats_mode.md).

Recorded per LOCAL tensor (a rank's shard), on the writer thread from the snapshot (`slab_stats`):
  sumsq   sum of squares (float64): the norm is its root
  absmax  largest |x|
  sum     sum of the elements (float64): numel x the mean
  hash    xxh3_64 of the tensor's bytes (bitwise identity)
They combine into the LOGICAL tensor's statistics (`combine`) the way the tensor itself reassembles
(tracer.layouts.assemble): shards add their sums of squares and sums and take the max of maxima;
replicas must agree bitwise, so their hashes must be equal (the replica check). Partial sums
(unreduced shards that add up to the tensor) do not combine (the norm of a sum is not a function of
the summands' norms): in stats mode they are recorded in full and their statistics computed from
the reassembled tensor at comparison time (`PARTIAL_IN_FULL`). Except partial sums with disjoint
supports (`Layout.disjoint`: a distributed optimizer's grad ranges, zeros elsewhere), whose sums of
squares, sums and maxima add up as shards' do.

The same functions serve a per-step scan (issue 18): `local_stats` of a list of tensors, `combine`
of the ranks' records, `Stat` to compare.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from tracer.errors import TraceError
from tracer.layouts import Layout

MODES = ("full", "stats")
PARTIAL_IN_FULL = True   # stats mode records partial-sum layouts in full (module doc)


def kept_in_full(layout: Mapping[str, Any]) -> bool:
    """Whether stats mode and a scan's log keep this tensor's values (its layout as a manifest records
    it): a partial sum's, unless its summands are disjoint (module doc)."""
    return PARTIAL_IN_FULL and bool(set(layout.get("partial", ())) - set(layout.get("disjoint", ())))


@dataclass
class Stat:
    """A logical tensor's statistics, and how its replicas agreed."""

    sumsq: float
    absmax: float
    sum: float
    numel: int
    hash: str
    replica_differ: int = 0        # replicas whose hash differs from their group's first
    replica_err: float = 0.0       # largest |norm(a) - norm(b)| / norm(b) between replicas
    replica_ranks: tuple[int, int] | None = None

    @property
    def norm(self) -> float:
        return math.sqrt(self.sumsq) if self.sumsq >= 0 else math.nan

    @property
    def finite(self) -> bool:
        return all(math.isfinite(x) for x in (self.sumsq, self.absmax, self.sum))

    def scaled(self, scale: float) -> Stat:
        """The statistics of scale * x (an fp8 payload's per-tensor scale, a grad scale)."""
        if scale == 1.0:
            return self
        return Stat(self.sumsq * scale * scale, self.absmax * abs(scale), self.sum * scale, self.numel,
                    self.hash, self.replica_differ, self.replica_err, self.replica_ranks)


def local_stats(tensors: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    """Statistics of each tensor, as recorded in a stats-mode manifest entry: the tensors of one dtype
    laid back to back and summarized in one call (`slab_stats`)."""
    out: list[dict[str, Any]] = [{} for _ in tensors]
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    for dtype, idx in groups.items():
        flats = [tensors[i].detach().reshape(-1).cpu() for i in idx]
        slab = torch.cat(flats).view(torch.uint8)
        slots, at = [], 0
        for f in flats:
            slots.append((at, f.numel() * dtype.itemsize))
            at += slots[-1][1]
        for i, st in zip(idx, slab_stats(slab, slots, dtype), strict=True):
            out[i] = st
    return out


def slab_stats(slab: torch.Tensor, slots: Sequence[tuple[int, int]],
               dtype: torch.dtype) -> list[dict[str, Any]]:
    """The statistics of tensors of `dtype` lying in a byte buffer (a snapshot's slab, tracer/writer.py)
    at (byte offset, bytes) each, aligned to the element size, as manifest entries record them
    (`slab_figures`, `entry`)."""
    at = np.array([off for off, _ in slots], dtype=np.int64)
    nbytes = np.array([n for _, n in slots], dtype=np.int64)
    figures = slab_figures(slab, at, nbytes, dtype)
    return [entry(*f, n // dtype.itemsize) for *f, n in zip(*(a.tolist() for a in figures), nbytes.tolist(),
                                                           strict=True)]


def slab_figures(slab: torch.Tensor, at: np.ndarray, nbytes: np.ndarray,
                 dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(sum of squares, sum, largest |x|, xxh3_64) of the tensors of `dtype` at byte offsets `at`, of
    `nbytes` each, in `slab`: the sums accumulated in float64, the hash of the bytes as they lie (a
    uint64 each). One compiled pass per tensor, all tensors in one call (tracer/kernels/moments.py);
    float32 and float64 are read where they lie, other float dtypes widened to float32 (bf16, fp16
    and fp8 values are exact there). Non-finite values make the statistics non-finite."""
    from tracer.kernels.moments import moments  # numba: imported by stats mode and scans only

    size = dtype.itemsize
    lo = int(at.min()) if len(at) else 0
    hi = int((at + nbytes).max()) if len(at) else 0
    typed = slab[lo:hi].view(dtype) if hi > lo else torch.zeros(0, dtype=dtype)
    x = typed.numpy() if dtype in _NUMPY_FLOATS else typed.to(torch.float32).numpy()
    uint, sign_off = _BITS[x.dtype]
    top = np.zeros(len(at), dtype=uint)
    hashes = np.zeros(len(at), dtype=np.uint64)
    sumsq, sums = moments(x, x.view(uint), sign_off, (at - lo) // size, nbytes // size, top,
                          np.uint64(slab.data_ptr()), at, nbytes, hashes)
    return sumsq, sums, top.view(x.dtype).astype(np.float64), hashes


def entry(sumsq: float, total: float, absmax: float, digest: int, numel: int) -> dict[str, Any]:
    """A tensor's statistics as a stats-mode manifest entry records them (the hash as xxh3_64's hex
    digest)."""
    return {"sumsq": sumsq, "absmax": absmax, "sum": total, "numel": numel, "hash": f"{digest:016x}"}


_NUMPY_FLOATS = (torch.float32, torch.float64)
_BITS = {np.dtype(np.float32): (np.uint32, np.uint32(0x7FFFFFFF)),
         np.dtype(np.float64): (np.uint64, np.uint64(0x7FFFFFFFFFFFFFFF))}


def load_kernel() -> None:
    """Import and load (numba's cache) the statistics kernel now, for both working dtypes: a writer in
    stats or scan mode calls it before the first step. Loaded lazily by the first part instead, it
    took ~1 s on the writer thread, holding the GIL in bursts that stalled the training thread's
    snapshots of steps 1-3 (single adds of 100-140 ms, measured)."""
    empty = torch.zeros(8, dtype=torch.uint8)
    for dtype in _NUMPY_FLOATS:
        slab_stats(empty, [(0, dtype.itemsize)], dtype)


def of_tensor(t: torch.Tensor) -> Stat:
    """A whole tensor's statistics (a full-mode trace, or a partial sum reassembled)."""
    s = local_stats([t])[0]
    return Stat(s["sumsq"], s["absmax"], s["sum"], s["numel"], s["hash"])


Piece = tuple[Mapping[str, int], Mapping[str, Any], int, float]   # (coords, recorded stats, rank, scale)


def combine(name: str, layout: Layout, pieces: Sequence[Piece], sizes: Mapping[str, int]) -> Stat:
    """The logical tensor's statistics from every rank's (coords, recorded stats, rank, scale)."""
    overlapping = tuple(a for a in layout.partial if a not in layout.disjoint)
    if overlapping:
        raise TraceError(f"{name}: partial sums over {overlapping} cannot be combined from statistics; "
                         "stats mode records them in full (a trace written otherwise is corrupt)")
    if not pieces:
        raise TraceError(f"{name}: no shard was traced by any rank")
    axes = layout.axes
    for ax in axes:
        if ax not in sizes:
            raise TraceError(f"{name}: layout uses mesh axis '{ax}' which the run does not have")
    groups: dict[tuple[int, ...], list[tuple[Mapping[str, Any], int, float]]] = {}
    for coords, st, rank, scale in sorted(pieces, key=lambda p: p[2]):
        groups.setdefault(tuple(int(coords.get(a, 0)) for a in axes), []).append((st, rank, scale))
    differ, err, worst = 0, 0.0, None
    chosen: list[Stat] = []
    for key in sorted(groups):
        (first, r0, s0), *others = groups[key]
        for st, r, _ in others:
            if st["hash"] != first["hash"]:
                differ += 1
                a, b = math.sqrt(st["sumsq"]), math.sqrt(first["sumsq"])
                e = abs(a - b) / b if b > 0 else math.inf
                if worst is None or e > err:
                    err, worst = e, (r0, r)
        chosen.append(Stat(first["sumsq"], first["absmax"], first["sum"], int(first["numel"]),
                           first["hash"]).scaled(float(s0)))
    expected = math.prod(int(sizes[a]) for a in axes)
    if len(chosen) != expected:
        raise TraceError(f"{name}: expected {expected} distinct shards over {axes}, found {len(chosen)} "
                         f"(coordinates present: {sorted(groups)}); a rank's trace is missing")
    if len(chosen) == 1:
        out = chosen[0]
    else:   # a hash of the shards' hashes: identifies the content under this layout only
        summands = math.prod(int(sizes[a]) for a in layout.partial)   # disjoint: each the whole shape
        out = Stat(sum(c.sumsq for c in chosen), max(c.absmax for c in chosen), sum(c.sum for c in chosen),
                   sum(c.numel for c in chosen) // summands,
                   xxhash.xxh3_64("|".join(c.hash for c in chosen).encode()).hexdigest())
    out.replica_differ, out.replica_err, out.replica_ranks = differ, err, worst
    return out
