"""Per-tensor tolerance from perturbed reference runs (TTrace's method); see docs/tolerance.md.

R perturbed reference runs start from weights moved one ulp each (random sign), or in bf16/fp8
redraw every GEMM result's rounding. How far each traced tensor of a perturbed run lands from the
reference is the noise the computation itself amplifies up to that point; an honest parallel
layout lands within a small multiple of it. The metrics, each with its own tolerance:

norm-wise    rel_err = ||c - r|| / ||r||;  tol = max(k * max_r rel_err(p_r, r), floor_ulps * u)
elementwise  elem_err = max_i |c_i - r_i| / s_i, with the per-element noise scale
             s_i = max_r |p_r,i - r_i| + (nu + u) * (|r_i| + rms(r)),  nu = max_r rel_err(p_r, r)
             (the envelope + pooled relative noise and a unit roundoff at the element's magnitude)
             tol = max(k_elem * max_r elem_err_loo(p_r), floor_elem), elem_err_loo: run r against
             the envelope of the OTHER runs (leave-one-out), the statistic the candidate meets.
scale        scale_err = <c - r, r> / ||r||^2, the error's component along the reference;
             tol = max(k_scale * max_r rel_err(p_r, r), u)   (outputs and grads)
             A uniform scale error (1 + d) shows in full (scale_err = d = rel_err), honest rounding
             noise nearly orthogonal to r hardly at all (clean checks: at most 0.78 of the noise).
scale band   under GEMM rounding draws (bf16, fp8) scale_err must also lie between 0 (an exact
             candidate) and the perturbed runs' mean projection m (a noisy candidate shares their
             bias, its own noise projected on itself), widened by max(k_band * their spread,
             band_floor * max_r rel_err(p_r, r), u): the projection's own spread is tenfold smaller
             than the norm-wise noise there (docs/tolerance.md "The scale band").
row-column   rowcol_err = max_i |c_i - r_i| / w_i, for a tensor of >= 8 rows and >= 8 columns (its
             last dim; rows are the rest): the per-element noise variance modelled as separable,
             v_ij = a_i b_j / m (a_i, b_j: row and column means of the perturbed runs' mean squared
             deviation, m: its overall mean), w = sqrt(v) + u (|r| + rms(r));
             tol = max(k_rowcol * max_r rowcol_err_loo(p_r), floor_elem), the leave-one-out draw
             scored against the variance of the other runs. A token's activations or a weight
             row's grads carry their own noise scale, which a row and a column factor capture
             (docs/tolerance.md "Single elements").
own noise   own_err = max_i |c_i - r_i| / w_i with v_ij = a_i b_j / m fitted to c - r itself, the
             element's own square left out of its row's, column's and the total sums (self-
             normalized: a layout whose noise differs in size from the perturbed runs' but not in
             shape reads alike); own_noise = max_r own_err(p_r). Under GEMM rounding draws an
             element fails when own_err > max(k_own * own_noise, floor_elem) AND rowcol_err >
             k_joint * rowcol_noise: the two metrics' honest extremes fall on different tensors
             (docs/tolerance.md "Two views of one element").
The elementwise metrics see a few corrupted elements that the norm-wise error averages away.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from tracer.errors import ConfigError

UNIT_ROUNDOFF = {
    "float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11,
    "float8_e4m3fn": 2.0**-4, "float8_e5m2": 2.0**-3,
}


def unit_roundoff(dtype: str | torch.dtype) -> float:
    name = str(dtype).removeprefix("torch.")
    return UNIT_ROUNDOFF.get(name, 2.0**-24)


# The compute precision of a recipe: BF16 for bf16; for fp8 the E4M3 quantization step, which every
# transformer-layer GEMM applies to its inputs (used by the analytic bound, not by the floors).
COMPUTE_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp8": 2.0**-4}


def compute_roundoff(precision: str | None) -> float:
    return COMPUTE_ROUNDOFF.get(str(precision or "fp32"), 2.0**-24)


def reference_norm(r: torch.Tensor, perturbed: Sequence[torch.Tensor] = ()) -> float:
    """What norm-wise errors are relative to: ||r||, or for an all-zero reference (a bias at init,
    which the perturbation moves to +-denormals) the largest perturbed run's ||p - r||."""
    ref = r.double().norm().item()
    if ref > 0 or not perturbed:
        return ref
    return max((p.double() - r.double()).norm().item() for p in perturbed)


def rel_err(c: torch.Tensor, r: torch.Tensor, norm: float | None = None) -> float:
    """||c - r|| / norm (default ||r||); 0 if c == r, inf against a zero norm."""
    diff = (c.double() - r.double()).norm().item()
    if diff == 0.0:
        return 0.0
    ref = r.double().norm().item() if norm is None else norm
    return diff / ref if ref > 0 else math.inf


def max_err(c: torch.Tensor, r: torch.Tensor) -> float:
    if c.numel() == 0:
        return 0.0
    diff = (c - r).abs().max().item()
    if diff == 0.0:
        return 0.0
    ref = r.abs().max().item()
    return diff / ref if ref > 0 else math.inf


def cosine(c: torch.Tensor, r: torch.Tensor) -> float:
    nc, nr = c.norm().item(), r.norm().item()
    if nc == 0.0 or nr == 0.0:
        return 1.0 if nc == nr else 0.0
    return float((c.flatten() @ r.flatten()).item() / (nc * nr))


def noise_scale(perturbed: Sequence[torch.Tensor], r: torch.Tensor, u: float) -> torch.Tensor:
    """Per-element noise scale: the perturbed runs' envelope max_r |p_r - r| plus the tensor's pooled
    relative noise nu (and one unit roundoff) times the element's magnitude |r_i| + rms(r).

    The envelope alone is a max of R draws per element: where those draws land near zero by chance
    the ratio |c_i - r_i| / env_i is heavy-tailed (a ratio of small numbers), and over thousands of
    elements some honest ratio is huge. The pooled term bounds that tail; rms(r) covers elements
    whose true value is ~0."""
    r = r.double()
    if r.numel() == 0:
        return r.abs()
    rms = r.square().mean().sqrt()
    env, nu = torch.zeros_like(r), 0.0
    rn = r.norm().item()
    for p in perturbed:
        d = p.double() - r
        env = torch.maximum(env, d.abs())
        nu = max(nu, d.norm().item() / rn if rn > 0 else 0.0)
    return env + (nu + u) * (r.abs() + rms)


def projection(c: torch.Tensor, r: torch.Tensor) -> float:
    """<c - r, r> / ||r||^2: the error's component along the reference, relative to it. A uniform scale
    error (1 + d) gives exactly d; honest rounding noise, nearly orthogonal to r, gives ~rel_err/sqrt(N).
    0 for a zero reference."""
    r64 = r.double().flatten()
    n2 = r64.dot(r64).item()
    return (c.double().flatten() - r64).dot(r64).item() / n2 if n2 > 0 else 0.0


def elem_err(c: torch.Tensor, r: torch.Tensor, scale: torch.Tensor) -> float:
    """max_i |c_i - r_i| / scale_i (inf if the scale is zero where c differs: nothing may move)."""
    if c.numel() == 0:
        return 0.0
    diff = (c.double() - r.double()).abs()
    return float((diff / scale).nan_to_num(nan=0.0, posinf=math.inf).max().item())


def elem_noise(perturbed: Sequence[torch.Tensor], r: torch.Tensor, u: float) -> list[float]:
    """Leave-one-out elementwise error of each perturbed run against the others' noise scale."""
    return [elem_err(p, r, noise_scale([q for j, q in enumerate(perturbed) if j != i], r, u))
            for i, p in enumerate(perturbed)]


ROWCOL_MIN = 8   # rows and columns a tensor needs for the row-column noise model (fewer: not judged)


def rowcol_shape(shape: Sequence[int], kind: str = "", after_update: bool = False) -> tuple[int, int] | None:
    """(rows, columns) the row-column metric views a tensor as, or None if it does not judge it: too
    few rows or columns for the model, a post-step `param` (judged through its excusal), or a tensor
    computed `after_update`, i.e. after the trace's first optimizer step. The separable model is
    that of rounding noise from identical weights; after a step each run also carries its own few
    Adam-amplified weight elements (gradients within noise of eps or zero), each shifting a whole
    column of the next step's outputs, which no row and column factor of the other runs describes
    (docs/tolerance.md, "Single elements")."""
    if (kind == "param" or after_update or len(shape) < 2
            or min(shape[-1], math.prod(shape) // shape[-1]) < ROWCOL_MIN):
        return None
    return math.prod(shape) // shape[-1], shape[-1]


def rowcol_scale(mean_sq: torch.Tensor, r: torch.Tensor, u: float) -> torch.Tensor:
    """w = sqrt(a_i b_j / m) + u (|r| + rms(r)) for a (rows, columns) mean squared deviation."""
    m = mean_sq.mean()
    v = mean_sq.mean(1, keepdim=True) * mean_sq.mean(0, keepdim=True) / m if m > 0 else mean_sq * 0
    return v.sqrt() + u * (r.abs() + r.square().mean().sqrt())


def _ratio_max(diff: torch.Tensor, scale: torch.Tensor) -> float:
    return float((diff / scale).nan_to_num(nan=0.0, posinf=math.inf).max().item())


def rowcol_err(c: torch.Tensor, r: torch.Tensor, perturbed: Sequence[torch.Tensor], u: float) -> float:
    """max_i |c_i - r_i| / w_i under the row-column model of all perturbed runs (0 if not judged)."""
    rc = rowcol_shape(r.shape)
    if rc is None or not perturbed:
        return 0.0
    r2 = r.double().reshape(rc)
    ms = sum((p.double().reshape(rc) - r2).square() for p in perturbed) / len(perturbed)
    return _ratio_max((c.double().reshape(rc) - r2).abs(), rowcol_scale(ms, r2, u))


def rowcol_noise(perturbed: Sequence[torch.Tensor], r: torch.Tensor, u: float) -> list[float]:
    """Leave-one-out rowcol_err of each perturbed run against the other runs' model."""
    return [rowcol_err(p, r, [q for j, q in enumerate(perturbed) if j != i], u)
            for i, p in enumerate(perturbed)]


def own_err(x: torch.Tensor, r: torch.Tensor, u: float) -> float:
    """max |x_ij| / w_ij for a (rows, columns) deviation x = c - r (or p - r), in units of the
    row-column noise fitted to x itself with x_ij left out: a_i, b_j, m the means of x's squares
    over row i, column j and all elements, each without x_ij's own; w = sqrt(a_i b_j / m) + u (|r| +
    rms(r)). 0 for a tensor without a row-column view."""
    rc = rowcol_shape(r.shape)
    if rc is None:
        return 0.0
    x, r = x.double().reshape(rc), r.double().reshape(rc)
    sq = x.square()
    a = (sq.sum(1, keepdim=True) - sq).clamp_min(0) / (rc[1] - 1)
    b = (sq.sum(0, keepdim=True) - sq).clamp_min(0) / (rc[0] - 1)
    m = (sq.sum() - sq).clamp_min(0) / (sq.numel() - 1)
    v = torch.where(m > 0, a * b / m.clamp_min(1e-300), 0.0)
    return _ratio_max(x.abs(), v.sqrt() + u * (r.abs() + r.square().mean().sqrt()))


@dataclass(frozen=True)
class TolerancePolicy:
    k: float = 4.0            # head-room over the largest perturbation-induced error
    floor_ulps: float = 16.0  # minimum tolerance, in unit roundoffs of the tensor's dtype
    depth_c: float = 1.03     # Megatron-LM CI's analytic bound k * C**depth * eps, reported beside
    k_elem: float = 6.0       # head-room over the largest leave-one-out elementwise error
    floor_elem: float = 4.0   # minimum elementwise tolerance, in units of the per-element noise scale
    # Scale (projection on r), in units of the norm-wise noise; 0 turns it off. Not the projection's
    # own noise: one scalar per tensor from R draws is too noisy to scale (honest projections
    # reached 6x the perturbed runs' largest; docs/tolerance.md, "Scale errors").
    k_scale: float = 1.5
    # Row-column metric, in units of its leave-one-out noise; 0 turns it off. Honest candidates
    # reached 2.6x on the calibration seeds (fp32, weights perturbation; 1.6x with GEMM draws).
    k_rowcol: float = 4.0
    # One element under GEMM rounding draws, seen by two views at once (own_err above): own_err past
    # k_own x the perturbed runs' and rowcol_err past k_joint x its noise. Calibrated on seeds 26
    # and 27 (honest maxima on one view fall below 1 on the other); 0 turns it off.
    k_own: float = 1.5
    k_joint: float = 2.0
    # Scale band (module doc) under GEMM rounding draws: k_band x the projections' spread, at least
    # band_floor x the norm-wise noise (docs/tolerance.md "The scale band"); k_band = 0 turns it off.
    k_band: float = 8.0
    band_floor: float = 0.25
    k_stats: float = 24.0   # stats mode's k, any precision; a short scan's (docs/stats_mode.md)
    # Replicas (the same logical tensor on several ranks): "exact" (the default) requires bitwise
    # agreement, as the same kernels on the same inputs give; "tolerance" judges their distance
    # against the norm-wise tolerance, for recipes with nondeterministic kernels.
    replicas: str = "exact"

    @classmethod
    def from_config(cls, tol: Mapping[str, Any]) -> TolerancePolicy:
        """From a recipe's `tolerance` section (its keys named as the fields; others are ignored)."""
        kinds = {f.name: f.type for f in fields(cls)}
        kw = {k: (str(v) if kinds[k] == "str" else float(v)) for k, v in tol.items() if k in kinds}
        if kw.get("replicas", "exact") not in ("exact", "tolerance"):
            raise ConfigError(f"tolerance.replicas={kw['replicas']!r}: use exact or tolerance")
        return cls(**kw)

    def tolerance(self, noise: Sequence[float], dtype: str) -> float:
        floor = self.floor_ulps * unit_roundoff(dtype)
        return max(self.k * max(noise, default=0.0), floor)

    def scale_tolerance(self, noise: Sequence[float], dtype: str, kind: str,
                        shape: Sequence[int]) -> float:
        """On |projection|: k_scale x the norm-wise noise, at least one unit roundoff (not the
        norm-wise floor: 16 BF16 ulps are 6.25%). inf (not judged) with k_scale = 0, for `param`
        (Adam's update ignores its grad's scale: judged at the grad), `loss` (its norm-wise error is
        its projection) and tensors of one dimension (from trained weights a TP layout's honest
        error on a norm's or bias's grad lies along it; docs/tolerance.md "Scale errors")."""
        if self.k_scale <= 0 or kind in ("param", "loss") or len(shape) < 2:
            return math.inf
        return max(self.k_scale * max(noise, default=0.0), unit_roundoff(dtype))

    def scale_band(self, mean: float, spread: float, noise: float, dtype: str, kind: str,
                   shape: Sequence[int], draws: bool) -> tuple[float, float]:
        """The range scale_err may take (module doc, "scale band"); unbounded where the scale is not
        judged (scale_tolerance) or the perturbed runs are not GEMM rounding draws (`draws`)."""
        if (self.k_band <= 0 or not draws
                or math.isinf(self.scale_tolerance([noise], dtype, kind, shape))):
            return -math.inf, math.inf
        width = max(self.k_band * spread, self.band_floor * noise, unit_roundoff(dtype))
        return min(0.0, mean) - width, max(0.0, mean) + width

    def elem_tolerance(self, noise: Sequence[float], numel: int | None = None) -> float:
        """On elem_err; inf (not judged) for a tensor of one element (a microbatch's loss): judged
        norm-wise against every microbatch's noise, where this microbatch's envelope alone read an
        honest bf16 MoE loss as 4.42 noise scales. The metric is for the few elements a norm averages."""
        if numel == 1:
            return math.inf
        return max(self.k_elem * max(noise, default=0.0), self.floor_elem)

    def rowcol_tolerance(self, noise: Sequence[float], view: tuple[int, int] | None) -> float:
        """On rowcol_err; inf (not judged) for a tensor without a view (rowcol_shape), or k_rowcol = 0."""
        if self.k_rowcol <= 0 or view is None:
            return math.inf
        return max(self.k_rowcol * max(noise, default=0.0), self.floor_elem)

    def own_tolerances(self, own_noise: float, rowcol_noise: float, view: tuple[int, int] | None,
                       draws: bool) -> tuple[float, float]:
        """(on own_err, on rowcol_err): an element past both fails. inf (not judged) without GEMM
        rounding draws (`draws`: under the weights perturbation honest fp32 extremes reached 2.7x on
        both views at once), for a tensor without a row-column view, or k_own = 0."""
        if self.k_own <= 0 or view is None or not draws:
            return math.inf, math.inf
        return max(self.k_own * own_noise, self.floor_elem), self.k_joint * rowcol_noise

    def analytic_bound(self, depth: int, dtype: str, precision: str | None = None) -> float:
        eps = max(unit_roundoff(dtype), compute_roundoff(precision) if precision else 0.0)
        return self.k * self.depth_c**depth * eps
