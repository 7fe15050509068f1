"""What the comparison stage reads (tracer/compare.py): the tensors to judge, in execution order, and
each run's tensors checked against the reference's shapes; and the reference set's side of the
measurement, which needs no candidate (tracer/reference_side.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

import torch

from tracer.adam import ADAM_EPS
from tracer.errors import LayoutMismatch, TraceError
from tracer.layouts import Assembled
from tracer.logical import LogicalTrace, StoredTensors
from tracer.measure import TensorKey, prepare
from tracer.reference_side import ReferenceSide
from tracer.tolerance import rowcol_shape, unit_roundoff

_NONE = torch.empty(0)


class ShapeCheckedReads(Mapping[str, torch.Tensor]):
    """A run's tensors as the measurement reads them, each once, chunk by chunk (a stored run is
    read as it goes, see tracer.logical). In the candidate (`replicas` given), a tensor whose pieces
    do not reassemble to the reference's shape is a wrong layout: it is noted in `mismatch` (judged
    as a verdict at its module) and measured as zeros; in a reference run it is an error."""

    def __init__(self, trace: LogicalTrace, reference: LogicalTrace,
                 replicas: dict[str, Assembled] | None = None):
        self.trace, self.reference, self.replicas = trace, reference, replicas
        self.mismatch: dict[str, str] = {}
        # The reference's single-rank manifest shapes are its logical shapes: nothing to check.
        self._own_shapes = trace is reference and all(int(v) == 1 for v in trace.sizes.values())

    def __getitem__(self, name: str) -> torch.Tensor:
        want = self.reference.shape(name)
        try:
            got = self.trace.tensors[name]
        except LayoutMismatch as e:
            if self.replicas is None:
                raise
            return self._mismatched(name, want, str(e))
        if tuple(got.tensor.shape) != want:
            if self.replicas is not None:
                return self._mismatched(name, want, f"candidate reassembles to shape "
                                                    f"{tuple(got.tensor.shape)} but the reference has {want}")
            raise TraceError(f"{name}: run '{self.trace.run}' has shape {tuple(got.tensor.shape)}, the "
                             f"reference {want}; the reference set is inconsistent, recompute it")
        if self.replicas is not None:   # its replicas' agreement, not its values: freed once measured
            self.replicas[name] = replace(got, tensor=_NONE)
        return got.tensor

    def span(self, names: Sequence[str]) -> torch.Tensor | None:
        """The tensors `names` as one flat tensor where the stored run holds them back to back
        (tracer.logical.StoredTensors.span) and each has the reference's shape; None otherwise (look
        them up one by one, which says what is wrong). In the candidate, their replicas agreed bit
        for bit."""
        stored = self.trace.tensors
        if not isinstance(stored, StoredTensors):
            return None
        want = self.reference.shape
        if self.trace.world_size == 1:   # the manifest's shape is the logical one
            if not self._own_shapes:
                info, ref = self.trace.info, self.reference.info
                for n in names:
                    if info[n]["shape"] != ref[n]["shape"] and tuple(info[n]["shape"]) != want(n):
                        return None
        else:
            shape = self.trace.shape
            for n in names:
                if shape(n) != want(n):
                    return None
        whole = stored.span(names)
        if whole is not None and self.replicas is not None:
            # A span's tensors all have pieces on the same ranks (tracer.rank_spans.plan_chunk): one
            # record, shared, for all of them.
            agreed = Assembled(tensor=_NONE, ranks=sorted(rt.rank for rt, _ in stored.pieces(names[0])))
            for n in names:
                self.replicas[n] = agreed
        return whole

    def _mismatched(self, name: str, want: tuple[int, ...], why: str) -> torch.Tensor:
        assert self.replicas is not None
        self.mismatch[name] = why
        self.replicas[name] = Assembled(tensor=_NONE)
        dtype = getattr(torch, str(self.reference.info[name].get("dtype", "float32")), torch.float32)
        return torch.zeros(want, dtype=dtype if dtype.is_floating_point else torch.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self.trace.tensors)

    def __len__(self) -> int:
        return len(self.trace.tensors)


def tensor_keys(reference: LogicalTrace, eps: float = ADAM_EPS) -> list[TensorKey]:
    """What the measurement needs of every reference tensor, in execution order. The row-column
    metric judges the tensors of the first traced step only (tracer.tolerance.rowcol_shape). Step 0's
    param grads and params make Adam's first update from a fresh state (TensorKey.first_update: `eps`,
    `first_update_eps`) where the trace starts at step 0 and its run says it did not start from a
    checkpoint (tracer.job_config.JobConfig.meta; a trace that does not say, written before the
    first-update rule of 2026-12-07, is not taken for one)."""
    path = lambda n: n.split("/", 2)[2].rsplit("/", 1)[0]
    first = reference.first_step()
    fresh = first == 0 and reference.meta.get("from_checkpoint") is False
    key = lambda n, e, shape: TensorKey(n, e["kind"], path(n), unit_roundoff(e["dtype"]), math.prod(shape),
                                        rowcol_shape(shape, e["kind"], after_update=int(e["step"]) > first),
                                        eps if fresh and e["kind"] in ("param_grad", "param")
                                        and int(e["step"]) == 0 else 0.0)
    return [key(n, reference.info[n], reference.shape(n)) for n in reference.order]


def first_update_eps(runs: Sequence[LogicalTrace]) -> float:
    """The eps of the reference's first update that the runs' grad-sign replay fitted and used
    (tracer.grad_signs.reference_eps, their manifests' `first_update_eps`), which the comparison's
    first-update rule uses too; ADAM_EPS where no run replayed (or was traced before 2026-12-08)."""
    said = {p.run: float(p.meta["first_update_eps"]) for p in runs if "first_update_eps" in p.meta}
    if len(set(said.values())) > 1:
        raise TraceError(f"the runs' grad-sign replays read different first updates from the reference "
                         f"(Adam's eps {said}): they replayed different reference runs; recompute the "
                         "reference set and the candidate")
    return next(iter(said.values()), ADAM_EPS)


def prepare_reference_side(reference: LogicalTrace,
                           perturbed: Sequence[LogicalTrace]) -> dict[str, ReferenceSide]:
    """The reference set's side of the comparison (tracer/reference_side.py), before any candidate:
    what `compare(..., prepared=)` then need not compute. Raises what reading the runs raises."""
    return prepare(tensor_keys(reference), ShapeCheckedReads(reference, reference),
                   [ShapeCheckedReads(p, reference) for p in perturbed])
