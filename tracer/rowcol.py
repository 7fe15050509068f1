"""The row-column metric on a flat chunk of tensors (tracer/measure.py): the per-tensor definitions
are `tracer.tolerance.rowcol_err` and `rowcol_noise`, held equal by tests/tracer/test_measure.py.

Each judged tensor is viewed as (rows, columns). A perturbed run's squared deviations are only ever
needed as row and column sums; the leave-one-out sums are the total minus a run's own. The R
leave-one-out draws are scored in one batch (`rowcol_side`, from the reference set alone), the
candidate later against the scale of all runs (`rowcol_err`): a scale is an outer product of two
vectors plus the rounding room. The tensors of a chunk that share a view and a unit roundoff (a
layer's tensors repeat in every layer) are scored together, a leading batch dimension over the same
operations: a tensor costs a few batched operations, not a dozen of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tracer.blocks import Blocks


@dataclass
class _Group:
    """Tensors of a chunk sharing a (rows, columns) view and a unit roundoff: what the candidate's
    figure needs of the perturbed runs (the scale from all of them)."""

    idx: list[int]
    shape: tuple[int, int]
    unit: torch.Tensor      # (G, 1, 1) power-of-two scale of each tensor's deviations
    a: torch.Tensor         # (G, rows) all runs' row factors
    cols: torch.Tensor      # (G, columns) all runs' column factors (square roots)
    room: torch.Tensor      # (G, rows, columns) rounding room


@dataclass
class RowColSide:
    """A chunk's row-column figures of the perturbed runs (their leave-one-out noise, and their largest
    error in units of their own fitted noise: `own_noise`) and the scale the candidate is judged
    against: computed once per reference set (tracer/reference_side.py)."""

    groups: list[_Group]
    noise: list[float]
    own_noise: list[float]


def _scales(rv: torch.Tensor, xp: torch.Tensor, u: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unit, a, cols, room) of G (rows, columns) tensors: rv (G, rows, columns) their references, xp
    (G, R, rows, columns) the R perturbed runs' p - r. Scales w_ij = sqrt(a_i b_j / m) + u (|r_ij| +
    rms(r)), for all runs (index 0) and each run left out (1..R); for sums over k runs, a_i b_j / m =
    rows_i cols_j / (k total)."""
    R = xp.shape[1]
    # Squares in the data's dtype, each tensor's deviations first scaled by a power of two to at most
    # 1 (FP32 deviations of ~1e-20 would underflow); every figure is a ratio, so the scale cancels.
    big = xp.abs().amax((1, 2, 3))
    unit = torch.where(big > 0, torch.ldexp(torch.ones_like(big), -torch.frexp(big).exponent), 1.0)
    sq = xp.mul(unit[:, None, None, None]).square_()
    rows, cols = sq.sum(3), sq.sum(2)                                   # (G, R, rows), (G, R, cols)
    all_runs = lambda s: torch.cat([(t := s.sum(1, keepdim=True)), t - s], dim=1)   # all runs, then LOO
    rows, cols = all_runs(rows), all_runs(cols)
    k = torch.tensor([R] + [R - 1] * R, dtype=rows.dtype)[:, None]
    total = rows.sum(2, keepdim=True)
    a = torch.where(total > 0, rows / (k * total).clamp_min(torch.finfo(rows.dtype).tiny), 0.0).sqrt_()
    # rms(r) in float64, then rounded to the data's dtype (as a Python scalar added to it would be)
    rms = (torch.linalg.vector_norm(rv, dim=(1, 2), dtype=torch.float64) / rv[0].numel() ** 0.5).to(rv.dtype)
    room = rv.abs().add_(rms[:, None, None]).mul_((unit.double() * u).to(rv.dtype)[:, None, None])
    return unit, a, cols.clamp_min_(0).sqrt_(), room


def _ratio(x: torch.Tensor, unit: torch.Tensor, a: torch.Tensor, cols: torch.Tensor,
           room: torch.Tensor) -> torch.Tensor:
    """max |x| / w per tensor (leading dims kept): where w is 0 (a zero tensor nothing moved) any move
    is ~1e38 scales off, and no move is 0."""
    scale = (a[..., :, None] * cols[..., None, :]).add_(room)
    return x.abs().mul_(unit).div_(scale.clamp_min_(torch.finfo(room.dtype).tiny)).flatten(-2).amax(-1)


def _own(x: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """tracer.tolerance.own_err of (..., rows, columns) deviations scaled to at most ~1 (leading dims
    kept): each element in units of the row-column noise fitted to the others (its own square left
    out). The perturbed runs' in their dtype; the candidate's in float64 (a bug's deviations may be
    any multiple of the perturbed runs' scale, whose squares would overflow float32)."""
    tiny = torch.finfo(x.dtype).tiny
    sq = x.square()
    rows, cols = x.shape[-2:]
    a = (sq.sum(-1, keepdim=True) - sq).clamp_min_(0).div_(cols - 1)
    b = (sq.sum(-2, keepdim=True) - sq).clamp_min_(0).div_(rows - 1)
    m = (sq.sum((-2, -1), keepdim=True) - sq).clamp_min_(0).div_(rows * cols - 1)
    w = a.mul_(b).div_(m.clamp_min_(tiny)).sqrt_().add_(room)
    return x.abs().div_(w.clamp_min_(tiny)).flatten(-2).amax(-1)


def rowcol_side(shapes: Sequence[tuple[int, int] | None], units: Sequence[float], blocks: Blocks,
                r: torch.Tensor, d: Sequence[torch.Tensor]) -> RowColSide:
    """The perturbed runs' side of the row-column figures of a chunk: r the chunk's reference, d the
    perturbed runs' p - r (all (blocks, BLOCK)); noise 0 where a tensor is not judged or with fewer
    than 2 runs (no leave-one-out draw)."""
    noise, own = [0.0] * len(shapes), [0.0] * len(shapes)
    groups: dict[tuple[tuple[int, int], float], list[int]] = {}
    for i, rc in enumerate(shapes):
        if rc is not None and d:
            groups.setdefault((rc, units[i]), []).append(i)
    out = []
    flat, devs = r.view(-1), [x.view(-1) for x in d]
    for (rc, u), idx in groups.items():
        # one copy each of the group's references and deviations, laid out (G, R, rows, columns)
        rv = torch.stack([flat[blocks.slice(i)] for i in idx]).view(len(idx), *rc)
        xp = torch.stack([dev[blocks.slice(i)] for i in idx for dev in devs]).view(len(idx), len(devs), *rc)
        unit, a, cols, room = _scales(rv, xp, u)
        unit3 = unit[:, None, None]
        if len(d) > 1:
            loo = _ratio(xp, unit3[:, None], a[:, 1:], cols[:, 1:], room[:, None]).tolist()
            for i, g in zip(idx, loo, strict=True):
                noise[i] = max(g)
        xo = _own(xp * unit3[:, None], room[:, None]).amax(1).tolist()
        for i, o in zip(idx, xo, strict=True):
            own[i] = o
        out.append(_Group(idx, rc, unit3, a[:, 0], cols[:, 0], room))
    return RowColSide(out, noise, own)


def rowcol_err(side: RowColSide, blocks: Blocks, dc: torch.Tensor) -> tuple[list[float], list[float]]:
    """The candidate's row-column figure per tensor of the chunk against the scale of all perturbed
    runs, and its own_err (0 where not judged): dc its deviation c - r ((blocks, BLOCK))."""
    err, own = [0.0] * len(blocks.lens), [0.0] * len(blocks.lens)
    flat = dc.view(-1)
    for g in side.groups:
        x = torch.stack([flat[blocks.slice(i)] for i in g.idx]).view(len(g.idx), *g.shape)
        xo = _own(x.double() * g.unit.double(), g.room.double()).tolist()   # not in place: x is used below
        for i, e, o in zip(g.idx, _ratio(x, g.unit, g.a, g.cols, g.room).tolist(), xo, strict=True):
            err[i], own[i] = e, o
    return err, own
