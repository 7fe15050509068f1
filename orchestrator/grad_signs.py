"""Grad-sign replay, the orchestrator's side: which checks take the reference's sign for every gradient
element whose sign their own run disagrees on (the rank's side: tracer/grad_signs.py).

Adam's first update is lr * sign(g) for every element, whatever |g|: an element whose reference grad
is at noise level (3e-5 where the perturbed runs move it 3e-4) moves by +-lr, its sign a coin toss
between layouts. One such flip on a bias shifts a whole column of the next step's outputs, for all
the tokens of that expert, and which elements flip differs from run to run: R perturbed runs cannot
cover the candidate's flips element by element (the step-1 MoE false alarms of docs/tolerance.md,
"Grad-sign replay"). Under replay the perturbed references and the candidate take the reference's grad
where their own has the other sign (or is zero where the reference's is not, or the reference's is
below tracer.grad_signs.EPS_BAND eps, near Adam's eps, where an update's size follows |g|, or their own first
update would differ from the reference's by over 1% of lr), after the grads are traced and before the
optimizer reads them. The traced grads are the run's own and judged as
before; the update no longer amplifies noise into a discrete move.

`auto` replays for ttrace's own jobs in bf16 (the built-in trainer, every model family; the
Hugging Face and PyTorch-native jobs) and where routing replays (the built-in MoE models in fp8),
traced in full: the perturbed references and candidate then start after the reference
(orchestrator/routing.order_jobs). Dense bf16 joined after a false positive on an Intel Xeon (a
`mlp.down.bias` update flipped, moving a column of the next step's output by 75% of its rms). The
DTensor jobs joined on 2026-12-06, once replay was symmetric there (a `Partial` grad not reduced yet
takes the reference's value where its sum's sign differs, tracer/grad_signs.py) and covered Adam's
eps. Without replay clean `job=hf` tp2 checks failed on seeds 3 and 60 (1.41x, 1.00x); under it they
pass. Held out (seeds 51-60; hf tp2, torch-native tp2_sp and tp2_dp2), by a rule fixed before they
ran: 0 false positives in 30 under replay, 1 in 30 without. Seeds 61-90 afterwards found two faults
(a band decided per run, params judged on a handful of elements: fixed); seeds 91-105, never looked
at, with both fixes: 45 of 45 pass (bench/results/2026-12-06-epyc-2cpu-dtensor-bf16-replay.md).
Dense fp8 stays out: its honest grads are ~10% off element by element, so its step-1 updates differ
in size, not only sign, and the perturbed runs' own flips are what keep their post-step envelope
wide enough (with replay, 5 of 11 gpt_tiny fp8 checks failed on seed 27; without, 0). fp32 replays
only when asked. `replay` turns it on for any check whose reference traces its param grads in full
(a user's job too: tracer/grad_signs.py). Measurements: docs/tolerance.md, "On an Intel Xeon".
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
    bf16 = recipe["precision"].get("name") == "bf16" and routing.own(recipe)
    return (bf16 or routing.replay(recipe)) and routing.traces(recipe.get("trace") or {}, "param_grad")


def validate(recipe: dict[str, Any]) -> None:
    mode = recipe["tolerance"].get("grad_signs", "auto")
    if mode not in MODES:
        raise ConfigError(f"tolerance.grad_signs={mode!r}: use auto, replay (the perturbed references and "
                          "the candidate take the reference's grad where their own disagrees in sign) or own")
    if mode == "replay" and not routing.traces(recipe.get("trace") or {}, "param_grad"):
        raise ConfigError("tolerance.grad_signs=replay reads the param grads of the reference's trace, "
                          "which trace.mode=stats or a trace.kinds without 'param_grad' does not keep; trace "
                          "them in full or set tolerance.grad_signs=own")
