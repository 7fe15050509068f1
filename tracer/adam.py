"""Adam's first update: the model grad-sign replay and the comparison's first-update excusal share.

From a fresh state, Adam's (and AdamW's) bias-corrected moments after one step are m = g, v = g^2,
so an element's first update is lr * g / (|g| + eps), eps in the units of the grads the optimizer
steps (`first_update`: its size over lr). Above ~100 eps it is lr * sign(g) whatever |g| is; near eps
its size follows |g|, which rounding decides there. Two places use it:
- grad-sign replay (tracer/grad_signs.py): a perturbed run or the candidate keeps its own grad only
  where its first update is within UPDATE_AGREE (1%) of lr of the reference's;
- the comparison (tracer/excusal.py): a post-step parameter of that first update is excused where its
  deviation is what the candidate's own grad, kept under that rule, makes of it through this formula.
Both assume Adam's default eps (every built-in job's) on the grads as traced: a job that clips them
(moving every |g| by the clip factor) or sets a larger eps moves its updates by more than this says.
"""

from __future__ import annotations

import torch

ADAM_EPS = 1e-8   # torch.optim.Adam's and AdamW's default eps


def first_update(g: torch.Tensor) -> torch.Tensor:
    """Adam's first update of grads `g`, over lr (bias-corrected: g / (|g| + eps))."""
    return g / (g.abs() + ADAM_EPS)
