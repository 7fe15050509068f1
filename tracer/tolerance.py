"""Per-tensor tolerance from perturbed reference runs (TTrace's method).

R reference runs start from weights moved one ulp each (random sign). How far each traced tensor
of a perturbed run lands from the unperturbed reference is the numerical noise the computation
itself amplifies up to that point; an honest parallel layout reorders the same floating-point
operations and lands within a small multiple of it. `tol = max(k * max_r err_r, floor)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

UNIT_ROUNDOFF = {
    "float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11,
    "float8_e4m3fn": 2.0**-4, "float8_e5m2": 2.0**-3,
}


def unit_roundoff(dtype: str | torch.dtype) -> float:
    name = str(dtype).removeprefix("torch.")
    return UNIT_ROUNDOFF.get(name, 2.0**-24)


@dataclass(frozen=True)
class TolerancePolicy:
    k: float = 4.0            # head-room over the largest perturbation-induced error
    floor_ulps: float = 16.0  # minimum tolerance, in unit roundoffs of the tensor's dtype
    depth_c: float = 1.03     # Megatron-LM CI's analytic bound k * C**depth * eps, reported beside

    def tolerance(self, noise: Sequence[float], dtype: str) -> float:
        floor = self.floor_ulps * unit_roundoff(dtype)
        return max(self.k * max(noise, default=0.0), floor)

    def analytic_bound(self, depth: int, dtype: str) -> float:
        return self.k * self.depth_c**depth * unit_roundoff(dtype)
