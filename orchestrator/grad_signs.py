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

`auto` replays for the built-in trainer in bf16 (every model family) and where routing replays (its
MoE models in fp8), traced in full: the perturbed references and candidate start after the reference
(orchestrator/routing.order_jobs). It began with MoE models only (dense checks passed without it on
seeds 8-11, on an AMD EPYC CPU). On an Intel Xeon, whose BLAS rounds TP-sharded GEMMs differently
from whole ones, a dense llama_tiny_kv2 bf16 seed-26 check failed at step 1 in four tp2 recipes: one
element of `layers.1.mlp.down.bias` stepped +lr where the reference's stepped -lr, and column 11 of
the next step's `mlp.down` output moved by 75% of its rms. Dense fp8 does not replay: its honest
grads are ~10% off element by element, so its step-1 updates differ in size, not only in sign, and
the perturbed runs' own sign flips are what made their post-step envelope wide enough (with replay,
seed 27's gpt_tiny fp8 tp2 checks failed at `1/-/layers.0.ln2.bias/param`, 5 of 11; without, 0; see
docs/tolerance.md, "Grad-sign replay"). fp32 replays only when asked: a sign there flips only at a
gradient within fp32 noise of zero. `replay` turns it on for any check whose reference traces its
param grads in full (a user's job too: tracer/grad_signs.py).
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
    bf16 = recipe["precision"].get("name") == "bf16"
    return ((bf16 and routing.builtin_low_precision(recipe) or routing.replay(recipe))
            and routing.traces(recipe.get("trace") or {}, "param_grad"))


def validate(recipe: dict[str, Any]) -> None:
    mode = recipe["tolerance"].get("grad_signs", "auto")
    if mode not in MODES:
        raise ConfigError(f"tolerance.grad_signs={mode!r}: use auto, replay (the perturbed references and "
                          "the candidate take the reference's grad where their own disagrees in sign) or own")
    if mode == "replay" and not routing.traces(recipe.get("trace") or {}, "param_grad"):
        raise ConfigError("tolerance.grad_signs=replay reads the param grads of the reference's trace, "
                          "which trace.mode=stats or a trace.kinds without 'param_grad' does not keep; trace "
                          "them in full or set tolerance.grad_signs=own")
