"""Layouts: how one rank's local tensor relates to the logical (unsharded) tensor.

A layout names, for a local tensor, which dims are sharded over which mesh axis and which
mesh axes hold partial sums; every other mesh axis holds a replica. The same layout both
slices a full tensor into a rank's shard (consistent initialization) and reassembles the
logical tensor from every rank's shard (comparison), so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tracer.errors import LayoutMismatch, TraceError


@dataclass(frozen=True)
class Layout:
    """Sharded dims (outermost first) and partial-sum axes; all other mesh axes are replicas."""

    shard: tuple[tuple[int, str], ...] = ()
    partial: tuple[str, ...] = ()
    # Sharded axes split load-balanced ("zigzag", context parallelism): the dim is cut into 2n chunks
    # and coordinate i holds chunks i and 2n-1-i, concatenated (causal attention work evens out).
    zigzag: tuple[str, ...] = ()
    # Partial axes whose summands have disjoint supports: each element is nonzero in at most one
    # coordinate's summand (a distributed optimizer's grad ranges, each rank's own range and zeros
    # elsewhere). The sum is the same; their statistics add up as shards' do (tracer/stats.py), so stats
    # mode and scans need not keep their values.
    disjoint: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not set(self.disjoint) <= set(self.partial):
            raise TraceError(f"layout: disjoint axes {self.disjoint} must be partial-sum axes "
                             f"(partial: {self.partial})")

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for _, a in self.shard) + self.partial

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"shard": [list(s) for s in self.shard], "partial": list(self.partial)}
        if self.zigzag:
            out["zigzag"] = list(self.zigzag)
        if self.disjoint:
            out["disjoint"] = list(self.disjoint)
        return out

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Layout:
        return Layout(tuple((int(dim), str(ax)) for dim, ax in d.get("shard", ())),
                      tuple(d.get("partial", ())), tuple(d.get("zigzag", ())), tuple(d.get("disjoint", ())))

    def local(self, full: torch.Tensor, coords: Mapping[str, int], sizes: Mapping[str, int]) -> torch.Tensor:
        """This rank's shard of a full logical tensor (a view; partial sums cannot be sliced)."""
        if self.partial:
            raise ValueError("a partial-sum layout has no slice of a full tensor")
        out = full
        for dim, axis in self.shard:
            n = sizes.get(axis, 1)
            parts = 2 * n if axis in self.zigzag else n
            if out.shape[dim] % parts:
                raise TraceError(f"dim {dim} of size {out.shape[dim]} is not divisible by {parts} "
                                 f"({axis}={n})")
            i = coords.get(axis, 0)
            if axis in self.zigzag:
                chunks = out.chunk(parts, dim=dim)
                out = torch.cat([chunks[i], chunks[parts - 1 - i]], dim=dim)
            else:
                out = out.chunk(n, dim=dim)[i]
        return out


    def summand(self, full: torch.Tensor, coords: Mapping[str, int],
                sizes: Mapping[str, int]) -> torch.Tensor:
        """A local tensor that reassembles to `full`: this rank's shard, and for partial-sum axes the
        whole shard on coordinate 0 and zeros elsewhere (any split that sums to `full` is valid)."""
        out = Layout(self.shard, (), self.zigzag).local(full, coords, sizes)
        return out if self.holds_sum(coords) else torch.zeros_like(out)

    def holds_sum(self, coords: Mapping[str, int]) -> bool:
        """Does the rank at `coords` hold the whole shard in its summand (`summand`): coordinate 0 of
        every partial-sum axis (any rank, without one)?"""
        return all(coords.get(a, 0) == 0 for a in self.partial)


def axes_known(layout: Mapping[str, Any], sizes: Mapping[str, int]) -> bool:
    """Does the run's mesh (`sizes`) hold every axis a manifest's layout (`Layout.to_json`) shards or
    sums over?"""
    return all(ax in sizes for _, ax in layout.get("shard", ())) and all(
        ax in sizes for ax in layout.get("partial", ()))


def Replicate() -> Layout:  # noqa: N802 - reads like torch's placements
    return Layout()


def Shard(dim: int, axis: str = "tp") -> Layout:  # noqa: N802
    return Layout(shard=((dim, axis),))


def Partial(axis: str = "tp") -> Layout:  # noqa: N802
    return Layout(partial=(axis,))


@dataclass
class Piece:
    """One rank's local tensor with that rank's mesh coordinates."""

    coords: Mapping[str, int]
    tensor: torch.Tensor
    rank: int = 0


@dataclass
class Assembled:
    tensor: torch.Tensor
    replica_err: float = 0.0      # max relative Frobenius distance between replicas
    replica_ranks: tuple[int, int] | None = None  # the pair that disagreed most
    replica_differ: int = 0       # most elements in which two replicas differ bitwise
    ranks: list[int] = field(default_factory=list)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    denom = b64.norm().item()
    diff = (a64 - b64).norm().item()
    if diff == 0.0:
        return 0.0
    return diff / denom if denom > 0 else float("inf")


_SAME_WIDTH_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ (a NaN equals the same NaN; -0.0 differs from 0.0): honest replicas
    are computed by the same kernels from the same inputs and agree bit for bit."""
    if a.dtype != b.dtype:
        return a.numel()
    as_int = _SAME_WIDTH_INT[a.element_size()]
    ai, bi = a.contiguous().view(as_int), b.contiguous().view(as_int)
    if torch.equal(ai, bi):   # the honest case, one pass and no temporary
        return 0
    return int((ai != bi).sum())


def _unzigzag(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    halves = [p.chunk(2, dim=dim) for p in pieces]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def assemble(name: str, layout: Layout, pieces: Sequence[Piece], sizes: Mapping[str, int]) -> Assembled:
    """Reassemble the logical tensor from every rank's piece; measure replica agreement.

    Pieces that differ only in replica axes must agree; pieces over a partial axis are summed;
    pieces over a sharded axis are concatenated (innermost shard spec first).
    """
    if not pieces:
        raise TraceError(f"{name}: no shard was traced by any rank")
    for ax in layout.axes:
        if ax not in sizes:
            raise TraceError(f"{name}: layout uses mesh axis '{ax}' which the run does not have")
    key_axes = layout.axes
    if len(pieces) == 1 and all(sizes[a] == 1 for a in key_axes):   # a single-rank run: nothing to do
        return Assembled(tensor=pieces[0].tensor, ranks=[pieces[0].rank])
    groups: dict[tuple[int, ...], list[Piece]] = {}
    for p in sorted(pieces, key=lambda p: p.rank):
        groups.setdefault(tuple(p.coords.get(a, 0) for a in key_axes), []).append(p)

    # Replicas: every piece of a group must equal the group's first piece.
    replica_err, worst, differ = 0.0, None, 0
    chosen: dict[tuple[int, ...], torch.Tensor] = {}
    for key, group in groups.items():
        first = group[0]
        for other in group[1:]:
            if other.tensor.shape != first.tensor.shape:
                raise LayoutMismatch(f"{name}: replicas on ranks {first.rank} and {other.rank} have shapes "
                                     f"{tuple(first.tensor.shape)} and {tuple(other.tensor.shape)}")
            n = _bits_differ(other.tensor, first.tensor)
            if n == 0:
                continue
            err = _rel(other.tensor, first.tensor)
            if (n, err) > (differ, replica_err):
                replica_err, worst, differ = err, (first.rank, other.rank), n
        chosen[key] = first.tensor

    # Every coordinate of every sharded/partial axis must be present.
    expected = 1
    for ax in key_axes:
        expected *= sizes[ax]
    if len(chosen) != expected:
        have = sorted(chosen)
        raise TraceError(f"{name}: expected {expected} distinct shards over {key_axes}, found {len(chosen)} "
                         f"(coordinates present: {have}); a rank's trace is missing")

    # Partial axes: sum in float64 and keep it, so the reassembly adds no rounding of its own.
    n_shard = len(layout.shard)
    summed: dict[tuple[int, ...], torch.Tensor] = {}
    for key, t in chosen.items():
        skey = key[:n_shard]
        acc = t.double() if layout.partial else t
        if skey in summed and summed[skey].shape != acc.shape:
            raise LayoutMismatch(f"{name}: partial sums over {layout.partial} have shapes "
                                 f"{tuple(summed[skey].shape)} and {tuple(acc.shape)}")
        summed[skey] = summed[skey] + acc if skey in summed else acc

    # Sharded axes: concatenate innermost spec first.
    current = summed
    for i in reversed(range(n_shard)):
        dim = layout.shard[i][0]
        merged: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
        for key, t in current.items():
            merged.setdefault(key[:i], []).append((key[i], t))
        try:
            if layout.shard[i][1] in layout.zigzag:   # coordinate j holds chunks j and 2n-1-j
                current = {k: _unzigzag([t for _, t in sorted(v, key=lambda x: x[0])], dim)
                           for k, v in merged.items()}
            else:
                current = {k: torch.cat([t for _, t in sorted(v, key=lambda x: x[0])], dim=dim)
                           for k, v in merged.items()}
        except (RuntimeError, IndexError) as e:
            shapes = sorted({tuple(t.shape) for v in merged.values() for _, t in v})
            raise LayoutMismatch(f"{name}: shards of shapes {shapes} do not concatenate along dim {dim} "
                                 f"({layout.shard[i][1]}): {str(e).splitlines()[0]}") from None
    (tensor,) = current.values()
    return Assembled(tensor=tensor, replica_err=replica_err, replica_ranks=worst, replica_differ=differ,
                     ranks=sorted(p.rank for p in pieces))
