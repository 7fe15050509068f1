"""Real faults for testing the orchestrator's failure handling (off by default).

`fault.kind` = raise | exit | hang | nan_grad on rank `fault.rank` at step `fault.step`, mid-step (after
the backward, before the gradient reduction): the rank really raises, really dies, really blocks
while its peers wait in the next collective, or produces a NaN gradient element (a numerical fault:
the check must fail on non-finite values, never pass). Only candidate jobs receive a fault.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

KINDS = ("none", "raise", "exit", "hang", "nan_grad")


class InjectedFault(RuntimeError):
    pass


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
        while True:
            time.sleep(3600)
    if kind == "nan_grad":
        from workloads import precision

        grad = next(g for p in model.parameters() if (g := precision.grad(p)) is not None)
        grad.view(-1)[0] = float("nan")
        return
    raise ValueError(f"unknown fault kind '{kind}' (known: {', '.join(KINDS)})")
