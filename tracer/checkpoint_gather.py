"""`checkpoint.save` from a reference on several ranks (`reference.parallel`): every rank's parameters
and Adam state brought whole to rank 0, which writes them (tracer/job_inputs.py save_checkpoint).

Two ways in, by how the model was attached:
- without a plan (layouts from DTensor placements): every rank gathers each DTensor whole
  (`full_tensor`, in the same order everywhere); its plain tensors must be replicas, as the check
  judges them (`plain_not_replicated` holds them to it);
- with a plan (the built-in trainer, megatron-core, a plan of yours): plain tensors are shards or
  replicas as the plan's layouts say; rank 0 gathers every rank's local tensors with its mesh
  coordinates and reassembles them as the comparison does (tracer.layouts.assemble), replicas held
  to agreeing bit for bit.

Refused, with the reason (`refusal`): pipeline stages (each holds other parameters), an optimizer that
steps ranges of the parameters (a distributed optimizer, parallel.zero1: its state is no parameter's
shape), and a plan that lays a parameter out as a partial sum."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tracer.errors import TraceError
from tracer.layouts import Layout, Piece, assemble


def refusal(named: Sequence[tuple[str, torch.Tensor]], owners: Sequence[torch.Tensor | None], pp: int,
            layouts: Mapping[str, Layout] | None) -> str | None:
    """Why this reference cannot save from several ranks (None: it can). `layouts`: the plan's, by
    local parameter name (None: attached without a plan). Collective without a plan: every rank calls it."""
    if pp > 1:
        return f"runs {pp} pipeline stages"
    ranged = [n for (n, p), o in zip(named, owners, strict=True) if o is None or o.numel() != p.numel()]
    if ranged:
        return (f"its optimizer steps ranges of parameters {ranged[:3]} (a distributed optimizer, "
                "parallel.zero1)")
    if layouts is None:
        apart = plain_not_replicated(named)
        return f"its plain parameters {apart[:3]} differ between ranks (shards, not replicas)" if apart \
            else None
    partial = [n for n, _ in named if layouts[n].partial]
    return f"its plan lays parameters {partial[:3]} out as partial sums" if partial else None


def assembled_on_rank0(tensors: dict[str, torch.Tensor], adam: dict[str, dict[str, torch.Tensor]],
                       layouts: Mapping[str, Layout], coords: Mapping[str, int],
                       sizes: Mapping[str, int]) -> tuple[dict[str, torch.Tensor], dict[str, dict]] | None:
    """The logical tensors and Adam state on rank 0 (None on the others), from every rank's local ones
    (`tensors`, `adam` by logical name; `layouts` by logical name). Collective: every rank calls it."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = (dict(coords), {n: t.detach().cpu() for n, t in tensors.items()},
            {n: {k: t.detach().cpu() for k, t in st.items()} for n, st in adam.items()})
    every: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, every, dst=0)
    if every is None:
        return None

    def whole(name: str, layout: Layout, of: list[torch.Tensor]) -> torch.Tensor:
        pieces = [Piece(c, t, rank=r) for r, ((c, _, _), t) in enumerate(zip(every, of, strict=True))]
        out = assemble(name, layout, pieces, sizes)
        if out.replica_differ:
            a, b = out.replica_ranks or (0, 0)
            raise TraceError(f"checkpoint.save: {name}'s replicas on ranks {a} and {b} differ in "
                             f"{out.replica_differ} elements: the reference's ranks do not hold one model")
        return out.tensor

    full = {n: whole(n, layouts[n], [t[n] for _, t, _ in every]) for n in tensors}
    state = {n: {k: whole(f"{n}.{k}", layouts[n], [a[n][k] for _, _, a in every]) for k in st}
             for n, st in adam.items()}
    return full, state


def plain_not_replicated(named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """The plain (non-DTensor) parameters whose shape or values differ between the ranks: every rank
    calls it (collectives: shapes gathered, then each parameter's elementwise max and min)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    plain = [(n, p.detach()) for n, p in named if not isinstance(p, DTensor)]
    shapes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, [(n, tuple(p.shape)) for n, p in plain])
    if any(s != shapes[0] for s in shapes):
        every = set.intersection(*(set(s) for s in shapes))
        return sorted({n for s in shapes for n, shape in s if (n, shape) not in every})
    apart = []
    for n, p in plain:
        hi, lo = p.clone(), p.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        if not torch.equal(hi, lo):
            apart.append(n)
    return apart
