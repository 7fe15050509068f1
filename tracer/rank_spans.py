"""A chunk of a multi-rank run reassembled in one pass (tracer.logical.StoredTensors.span).

Looked up one by one, a TP=2 candidate's tensor costs two part views, a grouping of its pieces, a
replica comparison and a concatenation: ~70 us of Python for each of a 16x trace's 6,113 tensors,
on the thread that feeds every measuring thread. Where each rank holds the chunk's tensors back to
back in one part (ranks record in the same order), the chunk is planned from the manifests instead:
every piece a block copy into the logical layout, every replica a bitwise comparison, each done for
the whole chunk by one compiled call per rank (tracer/kernels/gather.py).

The plan covers pieces that are replicas or sharded along one dim, unscaled or scaled by a power of
two (a DP run's grad_output records, applied exactly as tracer.logical.scaled does); a chunk with
anything else (partial sums, zigzag, other scales, shapes that do not fit, replicas that differ)
returns None and is looked up tensor by tensor, whose assembly says what is wrong or measures the
replicas' error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tracer.kernels.gather import differ, gather

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

Pieces = Sequence[tuple[Any, dict[str, Any]]]   # (tracer.store.RankTrace, manifest entry) per rank


class ChunkPlan:
    """Where every piece of the chunk's tensors goes (module doc)."""

    def __init__(self) -> None:
        self.keys: dict[int, list[str]] = {}      # rank -> its pieces' keys, in its part's order
        self.files: dict[int, tuple[Any, str]] = {}   # rank -> (RankTrace, part file)
        self.copies: dict[int, list[tuple[int, int, int, int, int]]] = {}   # rank -> gather rows
        self.replicas: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}   # (kept, other) -> rows
        self.used: dict[int, int] = {}             # rank -> elements of its span
        self.scaled: list[tuple[int, int, float]] = []   # (first element, end, scale) of scaled tensors
        self.size = 0                              # elements of the reassembled chunk
        self.ranks: list[int] = []


def plan_chunk(names: Sequence[str], pieces_of: Callable[[str], Pieces],
               sizes: Mapping[str, int]) -> ChunkPlan | None:
    """The chunk's plan, or None where it needs a lookup per tensor (module doc). `pieces_of(name)`
    lists a tensor's pieces in rank order (tracer.logical.StoredTensors.pieces)."""
    plan = ChunkPlan()
    used, coords = plan.used, {}
    for t, name in enumerate(names):
        pieces = pieces_of(name)
        ranks = [rt.rank for rt, _ in pieces]
        if t == 0:
            # statistics only (trace.mode=stats), or pieces out of rank order: looked up one by one
            if any(e.get("file") is None for _, e in pieces) or ranks != sorted(ranks):
                return None
            plan.ranks = ranks
            for rt, e in pieces:
                plan.keys[rt.rank], plan.files[rt.rank], plan.copies[rt.rank] = [], (rt, e.get("file")), []
                used[rt.rank], coords[rt.rank] = 0, rt.manifest["coords"]
        elif ranks != plan.ranks:
            return None
        first = pieces[0][1]
        layout, shape = first["layout"], first["shape"]
        shard = layout.get("shard", ())
        if layout.get("partial") or layout.get("zigzag") or len(shard) > 1:
            return None
        dim, axis = (int(shard[0][0]), shard[0][1]) if shard else (0, None)
        k = 1 if axis is None else sizes.get(axis)
        if k is None or (shard and not 0 <= dim < len(shape)):
            return None
        scale = float(first.get("scale", 1.0))
        if scale != 1.0 and not _power_of_two(scale):   # tracer.logical.scaled: float64
            return None
        n = math.prod(shape)
        outer, inner = math.prod(shape[:dim]), math.prod(shape[dim:])
        kept: dict[int, tuple[int, int]] = {}   # coordinate -> (rank, span offset) of its first piece
        for rt, e in pieces:
            if (e.get("file") != plan.files[rt.rank][1] or float(e.get("scale", 1.0)) != scale
                    or e["shape"] != shape or e["layout"] != layout):
                return None
            rank, at = rt.rank, used[rt.rank]
            plan.keys[rank].append(e["key"])
            used[rank] = at + n
            j = 0 if axis is None else int(coords[rank].get(axis, 0))
            if j in kept:
                plan.replicas.setdefault((kept[j][0], rank), []).append((kept[j][1], at, n, t))
            else:
                kept[j] = (rank, at)
                plan.copies[rank].append((at, plan.size + j * inner, outer, inner, k * inner))
        if sorted(kept) != list(range(k)):
            return None
        if scale != 1.0:
            last = plan.scaled[-1] if plan.scaled else None
            if last is not None and last[1] == plan.size and last[2] == scale:   # one run of them
                plan.scaled[-1] = (last[0], plan.size + n * k, scale)
            else:
                plan.scaled.append((plan.size, plan.size + n * k, scale))
        plan.size += n * k
    return plan


def assemble_chunk(plan: ChunkPlan, spans: Mapping[int, torch.Tensor | None], tensors: int
                   ) -> torch.Tensor | None:
    """The chunk reassembled from each rank's span of its pieces (flat, in `plan.keys` order; None: not
    back to back), or None if a span is missing, their dtypes differ or replicas differ bitwise."""
    if (any(s is None for s in spans.values()) or len({s.dtype for s in spans.values()}) != 1
            or any(s.numel() != plan.used[rank] for rank, s in spans.items())):
        return None
    dtype = next(iter(spans.values())).dtype
    bits = _BITS[dtype.itemsize]
    view = {rank: s.view(bits).numpy() for rank, s in spans.items()}
    counts = np.zeros(tensors, np.int64)
    for (kept, other), rows in plan.replicas.items():
        differ(view[kept], view[other], np.array(rows, np.int64).reshape(-1, 4), counts)
    if counts.any():
        return None
    out = torch.empty(plan.size, dtype=dtype)
    dst = out.view(bits).numpy()
    for rank, rows in plan.copies.items():
        if rows:
            gather(dst, view[rank], np.array(rows, np.int64).reshape(-1, 5))
    return out if _scaled(out, plan.scaled) else None


_EXACT_BY_POWERS_OF_TWO = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _power_of_two(scale: float) -> bool:
    return abs(math.frexp(scale)[0]) == 0.5


def exactly_scaled(t: torch.Tensor, scale: float) -> torch.Tensor | None:
    """`t * scale` in t's dtype where that is exact: a power of two only moves exponents, unless a
    product lost bits (subnormal) or overflowed, which dividing back detects; None otherwise
    (tracer.logical.scaled then widens to float64)."""
    if t.dtype in _EXACT_BY_POWERS_OF_TWO and _power_of_two(scale):
        out = t * scale
        if torch.equal(out * (1.0 / scale), t):
            return out
    return None


def _scaled(out: torch.Tensor, scaled: Sequence[tuple[int, int, float]]) -> bool:
    """Each scaled tensor's elements times its power-of-two scale, in place, as a lookup applies it
    one tensor at a time (exactly_scaled); False (a lookup per tensor, which widens to float64) where
    that is not exact."""
    for start, end, scale in scaled:
        piece = out[start:end]
        up = exactly_scaled(piece, scale)
        if up is None:
            return False
        piece.copy_(up)
    return True


def runs_by(names: Sequence[str], key: Callable[[str], Any]) -> list[list[str]]:
    """`names` cut where key(name) changes: e.g. their recorded dtype (a part stores each dtype's
    tensors as a run of their own, tracer/safetensors_views.py), so that one span covers each run."""
    out: list[list[str]] = []
    last = object()
    for n in names:
        k = key(n)
        if not out or k != last:
            out.append([])
            last = k
        out[-1].append(n)
    return out


def joined(pieces: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Consecutive spans (each a run of one dtype in one part per rank) as one flat tensor: the one
    span itself, else all of them in float32 (float64 if one is; both hold every float dtype exactly,
    and the comparison works in that dtype anyway); None for a non-float span."""
    if len(pieces) == 1:
        return pieces[0]
    if not all(p.dtype.is_floating_point for p in pieces):
        return None
    wide = torch.float64 if any(p.dtype == torch.float64 for p in pieces) else torch.float32
    return torch.cat([p.to(wide) for p in pieces])
