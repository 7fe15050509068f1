"""What the comparison stage concludes: one TensorResult per reference tensor, and the Comparison
(verdict, first divergence) that report.json carries."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TensorResult:
    name: str
    module: str
    module_type: str
    kind: str
    step: int
    microbatch: int | None
    index: int                 # position in the reference's execution order
    rel_err: float             # ||c - r||_F / ||r||_F
    max_err: float             # max |c - r| / max |r|
    cosine: float
    nonfinite: int             # non-finite values in the candidate
    replica_err: float         # disagreement between candidate replicas that must be identical
    tolerance: float           # on rel_err and replica_err
    noise: float               # largest rel_err of a perturbed reference (this tensor; the tolerance
                               # uses the max over the step's microbatches of the same module and kind)
    max_noise: float           # largest max_err of a perturbed reference (reported, not judged)
    analytic_bound: float      # Megatron-CI style k * C**depth * eps, for comparison
    ok: bool
    reason: str = ""
    elem_err: float = 0.0        # max_i |c_i - r_i| / per-element noise scale (tracer.tolerance)
    elem_noise: float = 0.0      # largest leave-one-out elem_err of a perturbed reference
    elem_tolerance: float = math.inf   # on elem_err
    rowcol_err: float = 0.0      # max_i |c_i - r_i| / row-column noise scale_i (tracer.tolerance)
    rowcol_noise: float = 0.0    # largest leave-one-out rowcol_err of a perturbed reference
    rowcol_tolerance: float = math.inf  # on rowcol_err (inf: the tensor is not judged by it)
    own_err: float = 0.0         # the same in units of a row-column noise fitted to c - r itself
    own_noise: float = 0.0       # largest own_err of a perturbed reference
    own_tolerance: float = math.inf    # on own_err, with rowcol_err > k_joint x rowcol_noise as well
    joint_tolerance: float = math.inf  #   that bound on rowcol_err (inf: not judged this way)
    local_err: float = 0.0       # own_err of the isolation pass's tensor (tracer/local_verdict.py)
    local_tolerance: float = math.inf  # on local_err: tolerance.k_local (inf: not judged this way)
    local_scale: float = 0.0     # its deviation's projection on the reference, in roundings (K_LOCAL_SCALE)
    scale_err: float = 0.0       # <c - r, r> / ||r||^2: a uniform scale error (1 + d) shows as d
    scale_tolerance: float = math.inf  # on |scale_err|
    scale_band: tuple[float, float] = (-math.inf, math.inf)   # the range scale_err may take (GEMM draws)
    excused: int = 0             # param elements left out of rel_err/elem_err (Adam excusal), judged by:
    excused_fraction: float = 0.0
    excused_dev: float = 0.0     #   their largest |c - r|, against excused_bound
    excused_bound: float = 0.0   #   k x the largest move of any perturbed run, any parameter, this step
    beyond: int = 0              #   how many are beyond k_elem x their own perturbed envelope, against
    beyond_noise: int = 0        #   the most any perturbed run has beyond the others' (x k, +1)
    replica_differ: int = 0      # elements in which two candidate replicas differ bitwise
    # trace.mode=stats (tracer/stats_compare.py): rel_err is the norm's relative error, max_err the
    # max-abs statistic's (judged against max_tolerance), scale_err the sum's; replica_differ counts
    # replicas whose hash differs
    max_tolerance: float = math.inf


@dataclass
class Comparison:
    verdict: str
    results: list[TensorResult] = field(default_factory=list)
    first_divergence: TensorResult | None = None

    def to_json(self) -> dict[str, Any]:
        fd = self.first_divergence
        return {
            "verdict": self.verdict,
            "first_divergence": None if fd is None else {
                "name": fd.name, "module": fd.module, "module_type": fd.module_type, "kind": fd.kind,
                "rel_err": fd.rel_err, "tolerance": fd.tolerance, "reason": fd.reason,
            },
            # a shallow copy: every field is a scalar or a string (asdict's deep copy took 0.18 s of a
            # demo check's 850 results)
            "tensors": [dict(vars(r)) for r in self.results],
        }
