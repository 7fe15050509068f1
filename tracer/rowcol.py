"""The row-column metric on a flat chunk of tensors (tracer/measure.py): the per-tensor definitions
are `tracer.tolerance.rowcol_err` and `rowcol_noise`, held equal by tests/tracer/test_measure.py.

Each judged tensor is viewed as (rows, columns) and its perturbed runs' squared deviations reduced
to row and column means, so the cost is a few passes over the tensor, in float64 (squared
deviations of FP32 tensors reach 1e-40)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tracer.blocks import Blocks
from tracer.tolerance import rowcol_scale


def _worst(diff: torch.Tensor, scale: torch.Tensor) -> float:
    q = diff / scale
    return float(torch.where(torch.isnan(q), 0.0, q).max())   # 0/0: nothing moved where nothing may


def rowcol_figures(shapes: Sequence[tuple[int, int] | None], units: Sequence[float], blocks: Blocks,
                   r: torch.Tensor, c: torch.Tensor,
                   d: Sequence[torch.Tensor]) -> tuple[list[float], list[float]]:
    """(rowcol_err, rowcol_noise) per tensor of the chunk: r, c the chunk's reference and candidate,
    d the perturbed runs' deviations p - r (all (blocks, BLOCK)); 0 where a tensor is not judged."""
    n = len(shapes)
    err, noise = [0.0] * n, [0.0] * n
    if not d:
        return err, noise
    flat = lambda x, i, rc: x.view(-1)[blocks.slice(i)].double().view(rc)
    for i, rc in enumerate(shapes):
        if rc is None:
            continue
        rv, u = flat(r, i, rc), units[i]
        sq = [flat(x, i, rc).square() for x in d]
        total = torch.stack(sq).sum(0)
        err[i] = _worst((flat(c, i, rc) - rv).abs(), rowcol_scale(total / len(sq), rv, u))
        if len(sq) > 1:
            noise[i] = max(_worst(s.sqrt(), rowcol_scale((total - s) / (len(sq) - 1), rv, u)) for s in sq)
    return err, noise
