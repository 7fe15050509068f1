"""`trace.mode=stats`: per traced tensor, four statistics instead of its values (docs/stats_mode.md).

Recorded per LOCAL tensor (a rank's shard), on the writer thread from the snapshot:
  sumsq   sum of squares (float64): the norm is its root
  absmax  largest |x|
  sum     sum of the elements (float64): numel x the mean
  hash    xxh3_64 of the tensor's bytes (bitwise identity)
They combine into the LOGICAL tensor's statistics (`combine`) the way the tensor itself reassembles
(tracer.layouts.assemble): shards add their sums of squares and sums and take the max of maxima;
replicas must agree bitwise, so their hashes must be equal (the replica check). Partial sums
(unreduced shards that add up to the tensor) do not combine (the norm of a sum is not a function of
the summands' norms): in stats mode they are recorded in full and their statistics computed from
the reassembled tensor at comparison time (`PARTIAL_IN_FULL`).

The same functions serve a per-step scan (issue 18): `local_stats` of a list of tensors, `combine`
of the ranks' records, `Stat` to compare.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from tracer.blocks import BLOCK
from tracer.errors import TraceError
from tracer.layouts import Layout

MODES = ("full", "stats")
PARTIAL_IN_FULL = True   # stats mode records partial-sum layouts in full (module doc)


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


def tensor_hash(t: torch.Tensor) -> str:
    """xxh3_64 of a tensor's bytes in row-major order."""
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return xxhash.xxh3_64(raw.numpy()).hexdigest()


def local_stats(tensors: Sequence[torch.Tensor], raw: Sequence[Any] | None = None) -> list[dict[str, Any]]:
    """Statistics of each tensor, as recorded in a stats-mode manifest entry. Tensors of one dtype
    are reduced together (`block_stats`: a few dense reductions, not four per tensor). `raw`: each
    tensor's bytes (buffer objects) to hash, when the caller has them."""
    out: list[dict[str, Any]] = [{} for _ in tensors]
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    for dtype, idx in groups.items():
        lens = [tensors[i].numel() for i in idx]
        pad = torch.zeros(BLOCK, dtype=dtype)
        pieces: list[torch.Tensor] = []
        for i, n in zip(idx, lens, strict=True):
            pieces.append(tensors[i].reshape(-1))
            if n % BLOCK:
                pieces.append(pad[:BLOCK - n % BLOCK])
        rows = torch.cat(pieces).view(-1, BLOCK)
        hashes = [tensor_hash(tensors[i]) if raw is None else xxhash.xxh3_64(raw[i]).hexdigest() for i in idx]
        for i, st in zip(idx, block_stats(rows, lens, hashes), strict=True):
            out[i] = st
    return out


def block_stats(rows: torch.Tensor, lens: Sequence[int], hashes: Sequence[str]) -> list[dict[str, Any]]:
    """The statistics of tensors laid out back to back in `rows` (blocks, BLOCK) of one dtype, each
    zero-padded to whole blocks (zeros are neutral for all three reductions); `lens`: their element
    counts. Each block is reduced in the tensor's precision, float32 at least (dense reductions along
    a row are 5-15x faster than float64 ones), and the blocks are accumulated in float64: a block of
    BLOCK elements carries an error of a few unit roundoffs, far below stats_compare's floor of
    tolerance.floor_ulps (16) of them. A block whose float32 reduction overflows is redone in
    float64, so a statistic is non-finite only if the tensor is."""
    wide = torch.float32 if rows.dtype.is_floating_point and rows.dtype.itemsize <= 4 else torch.float64
    rows = rows.to(wide)
    nblocks = torch.tensor([-(-n // BLOCK) for n in lens], dtype=torch.int64)
    norm, total = torch.linalg.vector_norm(rows, dim=1), rows.sum(1)
    if wide != torch.float64 and not (norm.isfinite().all() and total.isfinite().all()):
        rows = rows.double()   # an overflow (or an inf/nan in the data: then it stays)
        norm, total = torch.linalg.vector_norm(rows, dim=1), rows.sum(1)
    absmax = torch.maximum(rows.amax(1), rows.amin(1).neg())   # amax and amin: each 25x faster than aminmax
    sumsq = torch.segment_reduce(norm.double().square(), "sum", lengths=nblocks).tolist()
    sums = torch.segment_reduce(total.double(), "sum", lengths=nblocks).tolist()
    maxes = torch.segment_reduce(absmax.double(), "max", lengths=nblocks, initial=0).tolist()
    return [{"sumsq": a, "absmax": m, "sum": b, "numel": n, "hash": h}
            for a, m, b, n, h in zip(sumsq, maxes, sums, lens, hashes, strict=True)]


def of_tensor(t: torch.Tensor) -> Stat:
    """A whole tensor's statistics (a full-mode trace, or a partial sum reassembled)."""
    s = local_stats([t])[0]
    return Stat(s["sumsq"], s["absmax"], s["sum"], s["numel"], s["hash"])


Piece = tuple[Mapping[str, int], Mapping[str, Any], int, float]   # (coords, recorded stats, rank, scale)


def combine(name: str, layout: Layout, pieces: Sequence[Piece], sizes: Mapping[str, int]) -> Stat:
    """The logical tensor's statistics from every rank's (coords, recorded stats, rank, scale)."""
    if layout.partial:
        raise TraceError(f"{name}: partial sums over {layout.partial} cannot be combined from statistics; "
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
        out = Stat(sum(c.sumsq for c in chosen), max(c.absmax for c in chosen), sum(c.sum for c in chosen),
                   sum(c.numel for c in chosen),
                   xxhash.xxh3_64("|".join(c.hash for c in chosen).encode()).hexdigest())
    out.replica_differ, out.replica_err, out.replica_ranks = differ, err, worst
    return out
