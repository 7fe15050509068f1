"""The comparison's measurement in shares: each share's tensors read and measured on a worker of its
own (orchestrator/compare_tasks.py runs them as Ray tasks), their figures judged together.

What a share must hold whole: a parameter's path (its param_grad and param records of every step,
`tracer.measure`'s Adam excusal is a chain along them). Nothing else links two tensors' figures,
so the split is free otherwise; it is chosen so that a share reads few parts. Records are stored in
execution order, a part holds consecutive ones, so the shares are contiguous runs of the execution
order of about equal elements, a parameter path counted whole where it first appears (its initial
value, or its first param_grad). Activations (outputs and their gradients: no state links them)
then fall in contiguous runs, and the parameter paths too: a share reads its run of the
activations' parts, and of each step's parameter block, plus the parts it shares at the cuts.

Figures are the same as one process's up to a float64 rounding: a chunk holding a float64 tensor is
measured in float64 throughout, and a share's chunks are not the single walk's.

`Measured` is what a share sends back: plain numbers and strings (`to_json` / `from_json`), no tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tracer.compare_inputs import ShapeCheckedReads
from tracer.layouts import Assembled
from tracer.logical import LogicalTrace, StoredTensors, load_logical
from tracer.measure import TensorKey, TensorStats, measure
from tracer.reference_side import ReferenceSide

_PARAM_KINDS = ("param_grad", "param")
_NO_VALUES = torch.empty(0)   # a replica record carries the replicas' agreement, not the tensor


@dataclass
class Measured:
    """Figures of some tensors, and what reading the candidate found of them (tracer.judge's inputs)."""

    stats: dict[str, TensorStats] = field(default_factory=dict)
    replicas: dict[str, Assembled] = field(default_factory=dict)   # tensors left out (empty)
    mismatch: dict[str, str] = field(default_factory=dict)        # a candidate's wrong layouts

    def to_json(self) -> dict[str, Any]:
        return {"stats": {n: dataclasses.asdict(s) for n, s in self.stats.items()},
                "replicas": {n: {"replica_err": a.replica_err, "replica_differ": a.replica_differ,
                                 "replica_ranks": a.replica_ranks, "ranks": list(a.ranks)}
                             for n, a in self.replicas.items()},
                "mismatch": dict(self.mismatch)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Measured:
        pair = lambda p: None if p is None else (int(p[0]), int(p[1]))
        return cls({n: TensorStats(**s) for n, s in d["stats"].items()},
                   {n: Assembled(tensor=_NO_VALUES, replica_err=a["replica_err"],
                                 replica_differ=a["replica_differ"], replica_ranks=pair(a["replica_ranks"]),
                                 ranks=list(a["ranks"]))
                    for n, a in d["replicas"].items()},
                   dict(d["mismatch"]))


@dataclass(frozen=True)
class RunAt:
    """Where a run is stored: what a share's worker opens."""

    root: str
    run: str
    world_size: int


def measure_keys(reference: LogicalTrace, candidate: LogicalTrace, perturbed: Sequence[LogicalTrace],
                 keys: Sequence[TensorKey], k_elem: float,
                 prepared: Mapping[str, ReferenceSide] | None = None, workers: int | None = None,
                 only: bool = False) -> Measured:
    """Figures of `keys` (in execution order), the runs read as the measurement walks them: what the
    single comparison does for all keys and a share's worker for its own (`measure_share`). `only`:
    `keys` are some of the runs' tensors: each lazily read run reads and holds only the parts that hold
    them (StoredTensors.restrict), and none once measured."""
    got = Measured()
    arriving = ShapeCheckedReads(candidate, reference, got.replicas)
    stored = [s for t in (reference, candidate, *perturbed)
              if isinstance(s := getattr(t.tensors, "stored", t.tensors), StoredTensors)] if only else []
    for s in stored:
        s.restrict([k.name for k in keys])
    try:
        got.stats = measure(keys, ShapeCheckedReads(reference, reference), arriving,
                            [ShapeCheckedReads(p, reference) for p in perturbed], k_elem, prepared=prepared,
                            workers=workers)
    finally:
        for s in stored:   # as before the walk (a run may be shared: a reference set read lazily)
            s.restrict(None)
            s.release()
    got.mismatch = arriving.mismatch
    return got


def measure_share(reference: RunAt, candidate: RunAt, perturbed: Sequence[RunAt], keys: Sequence[TensorKey],
                  k_elem: float, workers: int | None = None) -> Measured:
    """A share's figures on a worker: its own lazily read runs, restricted to the share's tensors (a
    part is read only if it holds one of them and dropped once those are measured)."""
    ref, cand, *pert = (load_logical(r.root, r.run, r.world_size, lazy=True, read_first=False)
                        for r in (reference, candidate, *perturbed))
    return measure_keys(ref, cand, pert, keys, k_elem, workers=workers, only=True)


def merge(parts: Iterable[Measured]) -> Measured:
    out = Measured()
    for m in parts:
        out.stats.update(m.stats)
        out.replicas.update(m.replicas)
        out.mismatch.update(m.mismatch)
    return out


def partition(keys: Sequence[TensorKey], shares: int) -> list[list[TensorKey]]:
    """`keys` (execution order) cut into at most `shares` non-empty shares, each in execution order
    (module doc): the execution order cut into contiguous runs of about equal elements, a parameter
    path counted whole where it first appears."""
    if shares < 1:
        raise ValueError(f"shares must be >= 1, got {shares}")
    unit = lambda k: (True, k.path) if k.kind in _PARAM_KINDS else (False, k.name)
    units: dict[tuple[bool, str], int] = {}   # a parameter's path or an activation -> elements, in order
    for k in keys:
        units[unit(k)] = units.get(unit(k), 0) + max(k.numel, 1)
    share_of = dict(zip(units, _cut(list(units.values()), shares), strict=True))
    out: list[list[TensorKey]] = [[] for _ in range(shares)]
    for k in keys:
        out[share_of[unit(k)]].append(k)
    return [s for s in out if s]


def _cut(sizes: Sequence[int], shares: int) -> list[int]:
    """The share of each item of a sequence cut into `shares` contiguous runs of about equal total
    size: the share whose slice of the total holds the item's midpoint."""
    total, run, out = sum(sizes), 0, []
    for n in sizes:
        out.append(min(shares - 1, (2 * run + n) * shares // (2 * total)))
        run += n
    return out
