"""The row-column metric on a flat chunk of tensors (tracer/measure.py): the per-tensor definitions
are `tracer.tolerance.rowcol_err` and `rowcol_noise`, held equal by tests/tracer/test_measure.py.

Each judged tensor is viewed as (rows, columns). A perturbed run's squared deviations are only ever
needed as row and column sums; the leave-one-out sums are the total minus a run's own. The
candidate and the R leave-one-out draws are then scored in one batch: a draw's scale is an outer
product of two vectors plus the rounding room. The tensors of a chunk that share a view and a unit
roundoff (a layer's tensors repeat in every layer) are scored together, a leading batch dimension
over the same operations: a tensor costs a few batched operations, not a dozen of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tracer.blocks import Blocks


def _figures(rv: torch.Tensor, x: torch.Tensor, u: float) -> torch.Tensor:
    """(G, 1 + R) [rowcol_err, loo_1, ..., loo_R] of G (rows, columns) tensors: rv (G, rows, columns)
    their references, x (G, 1 + R, rows, columns) the candidate's deviation c - r and the R perturbed
    runs' p - r. max |x| / w for the candidate's deviation (w from all R runs) and each run's own (w
    from the others), with w_ij = sqrt(a_i b_j / m) + u (|r_ij| + rms(r)). For sums over k runs,
    a_i b_j / m = rows_i cols_j / (k total). Where w is 0 (a zero tensor nothing moved) any move is
    ~1e38 scales off, and no move is 0."""
    R = x.shape[1] - 1
    # Squares in the data's dtype, each tensor's deviations first scaled by a power of two to at most
    # 1 (FP32 deviations of ~1e-20 would underflow); every figure below is a ratio, so the scale cancels.
    big = x[:, 1:].abs().amax((1, 2, 3))
    unit = torch.where(big > 0, torch.ldexp(torch.ones_like(big), -torch.frexp(big).exponent), 1.0)
    unit4 = unit[:, None, None, None]
    sq = x[:, 1:].mul(unit4).square_()
    rows, cols = sq.sum(3), sq.sum(2)                                   # (G, R, rows), (G, R, cols)
    all_runs = lambda s: torch.cat([(t := s.sum(1, keepdim=True)), t - s], dim=1)   # all runs, then LOO
    rows, cols = all_runs(rows), all_runs(cols)
    k = torch.tensor([R] + [R - 1] * R, dtype=rows.dtype)[:, None]
    total = rows.sum(2, keepdim=True)
    a = torch.where(total > 0, rows / (k * total).clamp_min(torch.finfo(rows.dtype).tiny), 0.0).sqrt_()
    # rms(r) in float64, then rounded to the data's dtype (as a Python scalar added to it would be)
    rms = (torch.linalg.vector_norm(rv, dim=(1, 2), dtype=torch.float64) / rv[0].numel() ** 0.5).to(rv.dtype)
    room = rv.abs().add_(rms[:, None, None]).mul_((unit.double() * u).to(rv.dtype)[:, None, None])
    scale = (a[:, :, :, None] * cols.clamp_min_(0).sqrt_()[:, :, None, :]).add_(room[:, None])
    q = x.abs_().mul_(unit4).div_(scale.clamp_min_(torch.finfo(rv.dtype).tiny))
    return q.flatten(2).amax(2)


def rowcol_figures(shapes: Sequence[tuple[int, int] | None], units: Sequence[float], blocks: Blocks,
                   r: torch.Tensor, dc: torch.Tensor,
                   d: Sequence[torch.Tensor]) -> tuple[list[float], list[float]]:
    """(rowcol_err, rowcol_noise) per tensor of the chunk: r the chunk's reference, dc the candidate's
    deviation c - r, d the perturbed runs' p - r (all (blocks, BLOCK)); 0 where a tensor is not judged
    (and the noise 0 with fewer than 2 runs: no leave-one-out draw)."""
    n = len(shapes)
    err, noise = [0.0] * n, [0.0] * n
    if not d:
        return err, noise
    groups: dict[tuple[tuple[int, int], float], list[int]] = {}
    for i, rc in enumerate(shapes):
        if rc is not None:
            groups.setdefault((rc, units[i]), []).append(i)
    if not groups:
        return err, noise
    devs = [dc.view(-1), *(x.view(-1) for x in d)]
    flat = r.view(-1)
    for (rc, u), idx in groups.items():
        # one copy each of the group's references and deviations, laid out (G, 1 + R, rows, columns)
        rv = torch.stack([flat[blocks.slice(i)] for i in idx]).view(len(idx), *rc)
        x = torch.stack([dev[blocks.slice(i)] for i in idx for dev in devs]).view(len(idx), len(devs), *rc)
        got = _figures(rv, x, u).tolist()
        for i, g in zip(idx, got, strict=True):
            err[i] = g[0]
            noise[i] = max(g[1:]) if len(d) > 1 else 0.0
    return err, noise
