"""The row-column metric on a flat chunk of tensors (tracer/measure.py): the per-tensor definitions
are `tracer.tolerance.rowcol_err` and `rowcol_noise`, held equal by tests/tracer/test_measure.py.

Each judged tensor is viewed as (rows, columns). A perturbed run's squared deviations are only ever
needed as row and column sums; the leave-one-out sums are the total minus a run's own. The
candidate and the R leave-one-out draws are then scored in one batch: a draw's scale is an outer
product of two vectors plus the rounding room, so a tensor costs a dozen batched operations."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tracer.blocks import Blocks


def _figures(rv: torch.Tensor, cv: torch.Tensor, devs: Sequence[torch.Tensor], u: float) -> list[float]:
    """[rowcol_err, loo_1, ..., loo_R] of one (rows, columns) tensor: max |x| / w for x the
    candidate's deviation (w from all R runs) and each run's own (w from the others), with
    w_ij = sqrt(a_i b_j / m) + u (|r_ij| + rms(r)). For sums over k runs, a_i b_j / m =
    rows_i cols_j / (k total). Where w is 0 (a zero tensor nothing moved) any move is ~1e38 scales
    off, and no move is 0."""
    R = len(devs)
    x = torch.stack([cv - rv, *devs])                                   # (1 + R, rows, cols)
    # Squares in the data's dtype, the deviations first scaled by a power of two to at most 1 (FP32
    # deviations of ~1e-20 would underflow); every figure below is a ratio, so the scale cancels.
    big = float(x[1:].abs().amax())
    unit = 2.0 ** -math.frexp(big)[1] if big > 0 else 1.0
    sq = x[1:].mul(unit).square_()
    rows, cols = sq.sum(2), sq.sum(1)                                   # (R, rows), (R, cols)
    all_runs = lambda s: torch.cat([(t := s.sum(0, keepdim=True)), t - s])   # all runs, then each LOO
    rows, cols = all_runs(rows), all_runs(cols)
    k = torch.tensor([R] + [R - 1] * R, dtype=rows.dtype)[:, None]
    total = rows.sum(1, keepdim=True)
    a = torch.where(total > 0, rows / (k * total).clamp_min(torch.finfo(rows.dtype).tiny), 0.0).sqrt_()
    rms = torch.linalg.vector_norm(rv, dtype=torch.float64).item() / rv.numel() ** 0.5
    room = rv.abs().add_(rms).mul_(u * unit)
    scale = (a[:, :, None] * cols.clamp_min_(0).sqrt_()[:, None, :]).add_(room)
    q = x.abs_().mul_(unit).div_(scale.clamp_min_(torch.finfo(rv.dtype).tiny))
    return q.flatten(1).amax(1).tolist()


def rowcol_figures(shapes: Sequence[tuple[int, int] | None], units: Sequence[float], blocks: Blocks,
                   r: torch.Tensor, c: torch.Tensor,
                   d: Sequence[torch.Tensor]) -> tuple[list[float], list[float]]:
    """(rowcol_err, rowcol_noise) per tensor of the chunk: r, c the chunk's reference and candidate,
    d the perturbed runs' deviations p - r (all (blocks, BLOCK)); 0 where a tensor is not judged
    (and the noise 0 with fewer than 2 runs: no leave-one-out draw)."""
    n = len(shapes)
    err, noise = [0.0] * n, [0.0] * n
    if not d:
        return err, noise
    view = lambda x, i, rc: x.view(-1)[blocks.slice(i)].view(rc)
    for i, rc in enumerate(shapes):
        if rc is None:
            continue
        got = _figures(view(r, i, rc), view(c, i, rc), [view(x, i, rc) for x in d], units[i])
        err[i] = got[0]
        noise[i] = max(got[1:]) if len(d) > 1 else 0.0
    return err, noise
