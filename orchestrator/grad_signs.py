"""Grad-sign replay, the orchestrator's side: which checks take the reference's sign for every gradient
element whose sign their own run disagrees on (the rank's side: tracer/grad_signs.py).

Adam's first update is lr * sign(g) for every element, whatever |g|: an element whose reference grad
is at noise level (3e-5 where the perturbed runs move it 3e-4) moves by +-lr, its sign a coin toss
between layouts. One such flip on a bias shifts a whole column of the next step's outputs, for all
the tokens of that expert, and which elements flip differs from run to run: R perturbed runs cannot
cover the candidate's flips element by element (the step-1 MoE false alarms of docs/tolerance.md,
"Grad-sign replay"). Under replay the perturbed references and the candidate take the reference's grad
where their own has the other sign (or is zero where the reference's is not), after the grads are
traced and before the optimizer reads them. The traced grads are the run's own and judged as
before; the update no longer amplifies noise into a discrete move.

`auto` replays where routing replays (orchestrator/routing.py): the built-in trainer's MoE models in
bf16 and fp8, whose perturbed references and candidate already start after the reference. A dense
check passes without it (0 false positives over the families on seeds 8-11) and would pay that
ordering: `replay` turns it on for any check whose reference traces its param grads in full.
"""

from __future__ import annotations

from typing import Any

from orchestrator import routing
from tracer.errors import ConfigError

MODES = ("auto", "replay", "own")


def replay(recipe: dict[str, Any]) -> bool:
    """Does the check replay the reference's grad signs (tolerance.grad_signs)?"""
    mode = recipe["tolerance"].get("grad_signs", "auto")
    if mode != "auto":
        return mode == "replay"
    return routing.replay(recipe) and routing.traces(recipe.get("trace") or {}, "param_grad")


def validate(recipe: dict[str, Any]) -> None:
    mode = recipe["tolerance"].get("grad_signs", "auto")
    if mode not in MODES:
        raise ConfigError(f"tolerance.grad_signs={mode!r}: use auto, replay (the perturbed references and "
                          "the candidate take the reference's grad where their own disagrees in sign) or own")
    if mode == "replay" and not routing.traces(recipe.get("trace") or {}, "param_grad"):
        raise ConfigError("tolerance.grad_signs=replay reads the param grads of the reference's trace, "
                          "which trace.mode=stats or a trace.kinds without 'param_grad' does not keep; trace "
                          "them in full or set tolerance.grad_signs=own")
