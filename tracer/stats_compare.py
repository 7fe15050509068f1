"""The comparison of `trace.mode=stats` runs (docs/stats_mode.md): each logical tensor's statistics
(tracer/stats.py) against the reference's, with tolerances from the perturbed runs' own deviations.

Per tensor, three relative errors of the candidate c against the reference r:
  norm    | ||c|| - ||r|| | / ||r||
  absmax  | max|c| - max|r| | / max|r|
  sum     | sum(c) - sum(r) | / (sqrt(numel) ||r||)   (sqrt(n) ||r|| >= ||r||_1 bounds any sum; a sum
                                                       near zero would make a relative error meaningless)
and each statistic's noise, the largest of the same error over the perturbed runs (pooled over a
step's microbatches like the full comparison), gives its tolerance: max(k_stats x noise, floor_ulps x u).
The sum is the tensor's projection on the all-ones direction, so it is judged where the full mode
judges a projection (tracer.tolerance.TolerancePolicy.scale_tolerance), not on a post-step param,
the loss, or a tensor of one dimension, where honest errors lie along the tensor: a norm's weight
grad (torch-native bf16 tp2_dp2, 2026-11-29: 1.28x its sum's tolerance clean, within its norm's) or
a bias (megatron-core tp2_sp at R=2). Those are judged by their norm and largest magnitude.

Every statistic is judged at `k_stats` (24), not `k` (4), in every precision (docs/stats_mode.md
"Tolerances"). A statistic is one number per tensor that each perturbed run samples once: an honest
layout's deviation exceeds k times the largest of R such samples far more often than it exceeds k
times a figure pooled over a tensor's elements, as the full mode's are:
- under GEMM rounding draws (bf16, fp8) a draw moves one ulp of a quarter of a GEMM's results at
  random, whose effect on a norm, sum or largest magnitude is far smaller than an honest TP
  layout's (its roundings of partial sums act alike on many elements): clean bf16/fp8 TP checks
  needed up to 15.6 x their statistics' noise (seed 11, 2026-11-29);
- in fp32, the largest magnitude is one element's, the argmax's (gpt_tiny tp2/tp2_sp/tp2_dp2/tp2_cp2
  seed 9: a bias grad's at 4.5-9 x), and a norm's change is close to the tensor's projection, whose
  honest values reach 6 x the perturbed runs' largest (docs/tolerance.md "Scale errors"; gpt_tiny
  tp2_cp2 seed 14: a bias grad's norm at 5.3 x). At k the stats check failed them (2026-12-06).
The largest magnitude's noise is at least the norm's: the norm's relative change is an average of
the elements' (weights r_i^2 / ||r||^2), so one element's is no smaller in expectation. Its own can
read zero where the norm's does not: bf16 rounding of a grad's largest element absorbed every
perturbed run's GEMM draws (a clean bf16 tp2 check with reference.micro_batch, whose candidate
accumulates microbatches, failed 8 grads' largest magnitudes at the fp32 floor, 0.2-1% off).
A scan (tracer/scan_judge.py) judges at k a step whose band holds more than its look-ahead's steps;
a scan no longer than that has a stats check's band, and is judged at k_stats.
Replicas must agree bitwise (their hashes; tolerance.replicas=tolerance: their norms within the
norm tolerance). A full-mode run compared with stats-mode runs contributes its tensors' statistics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from tracer.errors import TraceError
from tracer.layouts import Layout
from tracer.logical import LogicalTrace
from tracer.stats import Stat, combine, of_tensor
from tracer.tolerance import TolerancePolicy
from tracer.verdicts import Comparison, TensorResult

STATS = ("norm", "absmax", "sum")
STAT_FIELDS = (("rel_err", "tolerance"), ("max_err", "max_tolerance"), ("scale_err", "scale_tolerance"))


def logical_stats(trace: LogicalTrace, name: str) -> Stat:
    """A tensor's logical statistics: combined from the ranks' records in a stats-mode run (partial
    sums, stored in full, reassembled), computed from the reassembled tensor in a full-mode run."""
    pieces = getattr(trace.tensors, "pieces", None)
    if trace.mode == "stats" and pieces is not None:
        got = pieces(name)
        if all("stats" in e for _, e in got):
            return combine(name, Layout.from_json(trace.info[name]["layout"]),
                           [(rt.manifest["coords"], e["stats"], rt.rank, float(e.get("scale", 1.0)))
                            for rt, e in got], trace.sizes)
    assembled = trace.tensors[name]
    st = of_tensor(assembled.tensor)
    st.replica_differ, st.replica_err = assembled.replica_differ, assembled.replica_err
    st.replica_ranks = assembled.replica_ranks
    return st


def _ratio(num: float, den: float) -> float:
    if num == 0:
        return 0.0
    return num / den if den > 0 else math.inf


def stat_ratios(row: Mapping[str, float]) -> dict[str, float]:
    """A stats-mode result's error over tolerance per statistic (STATS): `row` is a TensorResult's
    fields (`vars`) or a report's tensor. An error over a zero tolerance is inf."""
    return {stat: _ratio(row[err], row[tol]) for stat, (err, tol) in zip(STATS, STAT_FIELDS, strict=True)}


def over_tolerance(row: Mapping[str, float]) -> tuple[float, str]:
    """The largest of `stat_ratios`, and its statistic."""
    return max((x, stat) for stat, x in stat_ratios(row).items())


def errors(x: Stat, r: Stat, norm: float, absmax: float) -> tuple[float, float, float]:
    """(norm, absmax, sum) relative errors of x against r; `norm`/`absmax` are the scales (||r||, or
    the perturbed runs' largest where the reference is exactly zero)."""
    return (_ratio(abs(x.norm - r.norm), norm), _ratio(abs(x.absmax - r.absmax), absmax),
            _ratio(abs(x.sum - r.sum), norm * math.sqrt(max(1, r.numel))))


@dataclass
class Band:
    """What the perturbed runs say about a reference's tensors: each one's statistics, its scales, its
    own noise per statistic (norm, absmax, sum), and the noise pooled per family (step, module path,
    kind: over a step's microbatches), of which the tolerances are made; `perturbed`: each perturbed
    run's statistics (tracer/scan_judge.py adds their pairwise deviations); `symmetric`: errors
    relative to the larger of the two runs' norm and max-abs, not the reference's (the scan's)."""
    ref: dict[str, Stat]
    scales: dict[str, tuple[float, float]]
    noise: dict[str, list[float]]
    pooled: dict[tuple[int, str, str], list[float]]
    perturbed: list[dict[str, Stat]] = field(default_factory=list)
    symmetric: bool = False

    def errors(self, x: Stat, r: Stat, name: str) -> tuple[float, float, float]:
        """`errors` of x against r at this band's scales for tensor `name`."""
        norm, absmax = self.scales[name]
        if self.symmetric:
            norm, absmax = max(norm, x.norm, r.norm), max(absmax, x.absmax, r.absmax)
        return errors(x, r, norm, absmax)

    def family(self, reference: LogicalTrace, name: str) -> tuple[int, str, str]:
        e = reference.info[name]
        return (e["step"], name.split("/", 2)[2].rsplit("/", 1)[0], e["kind"])


def band(reference: LogicalTrace, perturbed: Sequence[LogicalTrace], symmetric: bool = False,
         must_move: bool = True, where: str = "") -> Band:
    """The perturbed runs' band around the reference (errors: a perturbation that did not apply, a
    reference or perturbed run with non-finite values); `symmetric`: see Band. `must_move=False`: the
    runs may all equal the reference (a scan's initial parameters, step -1, before GEMM rounding draws
    have moved anything: the band is then zero and the candidate is held to the floor). `where`
    names the part of the run in errors (a scan's step)."""
    order = reference.order
    ref = {n: logical_stats(reference, n) for n in order}
    pert = [{n: logical_stats(p, n) for n in order} for p in perturbed]
    still = [p.run for p, ps in zip(perturbed, pert, strict=True)
             if all(ps[n].hash == ref[n].hash for n in order)]
    if still and must_move:
        raise TraceError(f"perturbed reference run(s) {still} are bit-identical to reference "
                         f"'{reference.run}' in all {len(order)} tensors{where}: the perturbation did not "
                         "apply, so no tolerance can be estimated (a job must call tr.attach(model) after "
                         "its weights are set)")
    for n in order:
        if not ref[n].finite:
            raise TraceError(f"{n}: the reference itself has non-finite values; the recipe diverges even on "
                             "one device, fix it before comparing")
        if any(not ps[n].finite for ps in pert):
            raise TraceError(f"{n}: a perturbed reference run has non-finite values where the reference has "
                             "none; no tolerance can be estimated (fix the recipe: lower lr, fewer steps)")
    out = Band(ref, {}, {}, {}, pert, symmetric)
    for n in order:
        r = ref[n]
        out.scales[n] = (r.norm or max((ps[n].norm for ps in pert), default=0.0),
                         r.absmax or max((ps[n].absmax for ps in pert), default=0.0))
        noise = out.noise[n] = [max((out.errors(ps[n], r, n)[i] for ps in pert), default=0.0)
                                for i in range(3)]
        noise[1] = max(noise[1], noise[0])   # the largest magnitude moves no less than the norm (module doc)
        f = out.family(reference, n)
        out.pooled[f] = [max(a, b) for a, b in zip(out.pooled.get(f, [0.0, 0.0, 0.0]), noise, strict=True)]
    return out


def compare_stats(reference: LogicalTrace, candidate: LogicalTrace, perturbed: Sequence[LogicalTrace],
                  policy: TolerancePolicy) -> Comparison:
    """Judge every reference tensor's statistics (the runs were matched by tracer.compare.compare), at
    k_stats (module doc)."""
    return judge(reference, candidate, band(reference, perturbed), replace(policy, k=policy.k_stats))


def judge(reference: LogicalTrace, candidate: LogicalTrace, b: Band, policy: TolerancePolicy) -> Comparison:
    """Every reference tensor's statistics in the candidate against the band `b`."""
    order, ref, noise = reference.order, b.ref, b.noise
    depth_of: dict[str, int] = {}
    results: list[TensorResult] = []
    for index, n in enumerate(order):
        e, r = reference.info[n], ref[n]
        c = logical_stats(candidate, n)
        depth = depth_of.setdefault(e["module"], len(depth_of))
        tol = [policy.tolerance([x], e["dtype"]) for x in b.pooled[b.family(reference, n)]]
        if math.isinf(policy.scale_tolerance([0.0], e["dtype"], e["kind"], reference.shape(n))):
            tol[2] = math.inf   # the sum, a projection: judged where the full mode judges one (module doc)
        err = b.errors(c, r, n) if c.finite else (math.inf,) * 3
        res = TensorResult(
            name=n, module=e["module"], module_type=e.get("module_type", ""), kind=e["kind"], step=e["step"],
            microbatch=e["microbatch"], index=index, rel_err=err[0], max_err=err[1], cosine=math.nan,
            nonfinite=0 if c.finite else 1, replica_err=c.replica_err, tolerance=tol[0], noise=noise[n][0],
            max_noise=noise[n][1], ok=True, replica_differ=c.replica_differ, scale_err=err[2],
            scale_tolerance=tol[2], max_tolerance=tol[1], elem_tolerance=math.inf,
            analytic_bound=policy.analytic_bound(depth, e["dtype"], reference.meta.get("precision")))
        if c.numel != math.prod(reference.shape(n)):
            res.ok, res.reason = False, (f"shape: the candidate reassembles to {c.numel} elements, the "
                                         f"reference has {math.prod(reference.shape(n))}")
        elif not c.finite:
            res.ok, res.reason = False, "non-finite values (a statistic is inf or nan)"
        elif policy.replicas == "exact" and c.replica_differ:
            res.ok, res.reason = False, (f"replicas on ranks {c.replica_ranks} differ bitwise (their hashes; "
                                         f"norms {c.replica_err:.3g} apart)")
        elif c.replica_err > tol[0]:
            res.ok, res.reason = False, (f"replicas on ranks {c.replica_ranks} disagree (norms "
                                         f"{c.replica_err:.3g} apart > {tol[0]:.3g})")
        else:
            for stat, x, t in zip(STATS, err, tol, strict=True):
                if x > t:
                    res.ok, res.reason = False, f"{stat}: relative error {x:.3g} > tolerance {t:.3g}"
                    break
        results.append(res)
    first = next((r for r in results if not r.ok), None)
    return Comparison("pass" if first is None else "fail", results, first)
