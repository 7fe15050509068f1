"""Real faults for testing the orchestrator's failure handling and the verdict's sensitivity (off by
default).

`fault.kind` = raise | exit | hang | nan_grad | scale_grad_element on rank `fault.rank` at step
`fault.step`, mid-step (after the backward, before the gradient reduction): the rank really raises,
really dies, really blocks while its peers wait in the next collective, produces a NaN gradient
element (a numerical fault: the check must fail on non-finite values, never pass), or silently
scales one element of `fault.param`'s gradient, the one of median magnitude in this rank's shard, by
(1 + fault.scale): a wrong value and nothing else, the smallest silent bug there is.

Only candidate jobs receive a fault: the reference must stay trustworthy. A silent one (SILENT) also
reaches the candidate's isolation pass, which runs the candidate's code: a bug acts there too.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any

KINDS = ("none", "raise", "exit", "hang", "nan_grad", "scale_grad_element")
SILENT = ("scale_grad_element",)


class InjectedFault(RuntimeError):
    pass


def for_role(fault: Mapping[str, Any] | None, role: str) -> Mapping[str, Any] | None:
    """The fault a job of `role` receives (module doc): the candidate's, and a silent one in its
    isolation pass too; never the reference's or a perturbed run's."""
    if role == "candidate" or (role == "isolated" and (fault or {}).get("kind") in SILENT):
        return fault
    return None


def maybe_inject(spec: Mapping[str, Any], rank: int, step: int, model: Any = None) -> None:
    fault = spec.get("fault") or {}
    kind = fault.get("kind", "none")
    if kind == "none" or int(fault.get("rank", 0)) != rank or int(fault.get("step", 0)) != step:
        return
    if kind == "raise":
        raise InjectedFault(f"injected fault on rank {rank} at step {step}")
    if kind == "exit":
        os._exit(17)
    if kind == "hang":
        # Said in the rank's log: a job stopped at its timeout is then known to have hung here.
        print(f"injected hang on rank {rank} at step {step}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    if kind == "nan_grad":
        from workloads import precision

        grad = next(g for p in model.parameters() if (g := precision.grad(p)) is not None)
        grad.view(-1)[0] = float("nan")
        return
    if kind == "scale_grad_element":
        _scale_grad_element(model, str(fault["param"]), float(fault["scale"]), rank)
        return
    raise ValueError(f"unknown fault kind '{kind}' (known: {', '.join(KINDS)})")


def _scale_grad_element(model: Any, param: str, scale: float, rank: int) -> None:
    from workloads import precision

    params = dict(model.named_parameters())
    if param not in params:
        raise InjectedFault(f"fault.param={param} is not a parameter on rank {rank} (its parameters: "
                            f"{', '.join(list(params)[:6])}, ...); name one this rank holds")
    grad = precision.grad(params[param])
    if grad is None:
        raise InjectedFault(f"fault.param={param} has no gradient on rank {rank} at this step")
    flat = grad.view(-1)
    mag = flat.detach().double().abs()
    i = int((mag - mag.median()).abs().argmin())
    flat[i] = flat[i] * (1 + scale)
