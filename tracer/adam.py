"""Adam's first update: the model grad-sign replay and the comparison's first-update excusal share.

From a fresh state, Adam's (and AdamW's) bias-corrected moments after one step are m = g, v = g^2,
so an element's first update is lr * g / (|g| + eps), eps in the units of the grads the optimizer
steps (`first_update`: its size over lr). Above ~100 eps it is lr * sign(g) whatever |g| is; near eps
its size follows |g|, which rounding decides there. Two places use it:
- grad-sign replay (tracer/grad_signs.py): a perturbed run or the candidate keeps its own grad only
  where its first update is within UPDATE_AGREE (1%) of lr of the reference's;
- the comparison (tracer/excusal.py): a post-step parameter of that first update is excused where its
  deviation is what the candidate's own grad, kept under that rule, makes of it through this formula.

The grads are traced before clipping (the job contract), so the eps that acts on them is the
optimizer's eps over the clip factor s (Adam steps s*g: s*g / (s|g| + eps) = g / (|g| + eps/s)), or a
job's own eps. `fitted_eps` measures it from the reference's own first update (`eps_estimates`: an
element moved a fraction f of lr by grad g says eps = |g| (1/f - 1)): a clean Hugging Face bf16 check
clipping at 0.1 gave 1.08e-7 to 1.11e-7 on 645-734 elements each (10 times ADAM_EPS), where replaying
at ADAM_EPS kept a 6%-of-lr deviation for a 0.6% one and the next step's layer norm failed (an Intel
Xeon, seed 522). Where the elements do not agree on one eps (SGD, whose move is linear in g; params too
coarse to resolve a move), nothing is fitted and ADAM_EPS stays.
"""

from __future__ import annotations

import torch

ADAM_EPS = 1e-8   # torch.optim.Adam's and AdamW's default eps

# An element moved FIT_MOVED of its parameter's lr: |g| within ~20x of eps either way, the move resolved.
FIT_MOVED = (0.05, 0.9)
FIT_MIN = 16       # fewer such elements over the model: nothing fitted
FIT_ENOUGH = 4096  # enough: the reading of parameters may stop
# Their estimates' 90th over 10th percentile: within it, one eps (Adam: 1.007 in the checks above);
# beyond it, the elements do not move as Adam's first update would (SGD: 3.0 on the grads of
# tests/tracer/test_grad_signs.py's first step, AdamW 1.015 there).
FIT_SPREAD = 1.25


def first_update(g: torch.Tensor, eps: float = ADAM_EPS) -> torch.Tensor:
    """Adam's first update of grads `g`, over lr (bias-corrected: g / (|g| + eps))."""
    return g / (g.abs() + eps)


def eps_estimates(initial: torch.Tensor, grad: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """One parameter's first update (its values before and after, its grad as traced): the eps each
    element moved FIT_MOVED of lr says Adam used, lr the parameter's largest move (float64). Empty
    for a parameter held below float32 (a bf16 step is ~1% of its value: no move resolved)."""
    if after.dtype not in (torch.float32, torch.float64) or initial.dtype != after.dtype:
        return torch.empty(0, dtype=torch.float64)
    move = (after.double() - initial.double()).abs().flatten()
    lr = move.max() if move.numel() else move.new_zeros(())
    g = grad.double().abs().flatten()
    if not lr > 0 or g.numel() != move.numel():
        return torch.empty(0, dtype=torch.float64)
    f = move / lr
    at = (f > FIT_MOVED[0]) & (f < FIT_MOVED[1]) & (g > 0)
    return g[at] * (1 / f[at] - 1)


def fitted_eps(estimates: torch.Tensor) -> float | None:
    """The eps a model's first update used (`eps_estimates` of its parameters, joined): their median
    where there are FIT_MIN or more and they agree within FIT_SPREAD; else None (not Adam's first
    update, or too few elements near eps to tell)."""
    n = estimates.numel()
    if n < FIT_MIN:
        return None
    s = estimates.sort().values
    lo, mid, hi = (float(s[min(n - 1, int(q * n))]) for q in (0.1, 0.5, 0.9))
    return mid if 0 < lo and hi <= FIT_SPREAD * lo else None
