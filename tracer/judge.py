"""Each tensor's verdict from its figures (tracer/measure.py): the tests a tensor must pass, in the
order its report gives the first it fails.

A verdict needs more than its own tensor's figures: the noise pooled over its *family* (the same
module and kind at the same step, over the step's microbatches) and, for a post-step parameter, the
largest move of any of that step's parameters, so tensors are judged once the comparison's walk has
measured them all. (Judging each as soon as its family was measured, while the walk went on, took
the 0.12 s of a 16x comparison's verdicts off its end and added as much to its walk on 2 busy cores:
measured, not kept.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from tracer.layouts import Assembled
from tracer.logical import LogicalTrace
from tracer.measure import TensorKey, TensorStats
from tracer.tolerance import TolerancePolicy
from tracer.verdicts import TensorResult

BANDED_STEPS = 2   # the traced steps the scale band judges (see judge)
_UNBOUNDED = (-math.inf, math.inf)

# Excused elements per excused element that may lie beyond their perturbed envelope where the
# perturbed runs among themselves show none (see beyond_limit).
BEYOND_RATE = 1 / 2048


def beyond_limit(excused: int, beyond_noise: int, k: float) -> float:
    """How many excused elements of a param may lie beyond k_elem x their perturbed envelope:
    k x (the most a perturbed run has beyond the others', + 1, + BEYOND_RATE x the excused count).
    The rate term is for trained optimizer state: from loaded Adam moments an element whose gradient
    is within noise still moves by its momentum, and its deviation is its gradient deviation times
    Adam's gain. An honest layout's gradient deviation (accepted up to k_elem noise scales, which
    include a tensor-wide floor) exceeds k_elem x the envelope of 3 perturbed runs on up to ~1 in
    700 excused elements where the runs among themselves show none (6 of 4,185, against 0). Update
    signs flipped on 10% of a weight's excused elements put 0.3% (bf16: most flips are below one
    ulp) to 10% of them beyond (docs/tolerance.md "From trained weights")."""
    return k * (beyond_noise + 1 + BEYOND_RATE * excused)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else float("inf")


def judge(reference: LogicalTrace, keys: Sequence[TensorKey], stats: Mapping[str, TensorStats],
          policy: TolerancePolicy, draws: bool, replicas: Mapping[str, Assembled],
          mismatch: Mapping[str, str]) -> list[TensorResult]:
    """Every reference tensor's verdict, in execution order. `draws`: the perturbed runs are GEMM
    rounding draws (tracer.compare.rounding_draws); `replicas`, `mismatch`: what reading the candidate
    found (tracer.compare_inputs.ShapeCheckedReads)."""
    order, info = reference.order, reference.info
    # Noise is pooled over the microbatches of a step: the same module and kind computed on
    # exchangeable data, so R perturbed runs give R * microbatches draws of the same noise process
    # (quantization noise is heavy-tailed: a few draws can land unluckily small). A parameter's
    # param_grad and param are their own family (a module's weight and its zero bias have nothing
    # in common); a module's outputs pool over the step's microbatches.
    families = [(info[n]["step"], key.path, key.kind) for n, key in zip(order, keys, strict=True)]
    pooled: dict[tuple, tuple[float, ...]] = {}
    move: dict[int, float] = {}   # a step's largest parameter move (_bound)
    for name, fam in zip(order, families, strict=True):
        st, f = stats[name], pooled.get(fam, (0.0,) * 5)
        pooled[fam] = tuple(map(max, f, (st.noise, st.elem_noise, st.rowcol_noise, st.own_noise,
                                         st.scale_spread)))
        if fam[2] == "param":
            move[fam[0]] = max(move.get(fam[0], 0.0), st.env_max)
    depth: dict[str, int] = {}   # a module's depth: its rank among modules in execution order
    for name in order:
        depth.setdefault(info[name]["module"], len(depth))
    # The scale band is calibrated on a check's first two traced steps (every bench and matrix runs
    # 2-step checks). Later, honest excursions outgrow its floor (a clean 3-step bf16 tp2 check, seed
    # 77: a step-2 weight grad at 0.5x its norm-wise noise along itself, past the band's 0.25x):
    # from the third step on, a scale is judged by k_scale alone.
    first = reference.first_step()
    precision = reference.meta.get("precision")
    # What the tensors of one family and shape share: its tolerances, computed once (a 16x comparison
    # judges 6,113 tensors after its walk, on one core).
    shared: dict[tuple, tuple[float, ...]] = {}
    results = []
    for index, (name, key, fam) in enumerate(zip(order, keys, families, strict=True)):
        e, st, got, shape = info[name], stats[name], replicas[name], reference.shape(name)
        dtype, kind, module = e["dtype"], e["kind"], e["module"]
        banded = draws and int(e["step"]) < first + BANDED_STEPS
        noise, e_noise, rc_noise, own_noise, spread = pooled[fam]
        at = (fam, dtype, shape, module)
        tols = shared.get(at)
        if tols is None:
            tols = shared[at] = (
                policy.tolerance([noise], dtype), policy.elem_tolerance([e_noise], key.numel),
                policy.rowcol_tolerance([rc_noise], key.rowcol),
                policy.scale_tolerance([noise], dtype, kind, shape),
                policy.analytic_bound(depth[module], dtype, precision),
                *policy.own_tolerances(own_noise, rc_noise, key.rowcol, draws),
                # unbounded at the family's scale for every mean (not judged that way, not draws)
                policy.scale_band(0.0, spread, noise, dtype, kind, shape, banded) == _UNBOUNDED)
        tol, elem_tol, rowcol_tol, scale_tol, analytic, own_tol, joint_tol, unbounded = tols
        res = TensorResult(
            name=name, module=module, module_type=e.get("module_type", ""), kind=kind,
            step=e["step"], microbatch=e["microbatch"], index=index,
            rel_err=_finite(st.rel_err), max_err=_finite(st.max_err), cosine=st.cosine, excused=st.excused,
            nonfinite=st.nonfinite, replica_err=_finite(got.replica_err), replica_differ=got.replica_differ,
            tolerance=tol, noise=st.noise, max_noise=st.max_noise, analytic_bound=analytic, ok=True,
            elem_err=_finite(st.elem_err), elem_noise=st.elem_noise, elem_tolerance=elem_tol,
            rowcol_err=_finite(st.rowcol_err), rowcol_noise=st.rowcol_noise, rowcol_tolerance=rowcol_tol,
            own_err=_finite(st.own_err), own_noise=st.own_noise, own_tolerance=own_tol,
            joint_tolerance=joint_tol, scale_err=_finite(st.scale_err), scale_tolerance=scale_tol,
            scale_band=_UNBOUNDED if unbounded else policy.scale_band(st.scale_mean, spread, noise, dtype,
                                                                      kind, shape, banded),
            excused_fraction=st.excused / max(1, key.numel), excused_dev=_finite(st.excused_dev),
            excused_bound=_bound(policy, st, move.get(e["step"], 0.0), key.unit),
            beyond=st.beyond, beyond_noise=st.beyond_noise)
        res.ok, res.reason = _reason(res, policy, mismatch.get(name), got)
        if name in mismatch:
            res.rel_err = res.max_err = res.elem_err = math.inf
            res.cosine, res.nonfinite, res.excused = math.nan, 0, 0
        results.append(res)
    return results


def _bound(policy: TolerancePolicy, st: TensorStats, step_move: float, unit: float) -> float:
    """Excused param elements are bounded by what the optimizer can do to them: an update flipped by
    noise moves an element by twice its update, so k x (2 x the reference's largest update of that
    parameter, summed over the steps so far, + one ulp of its largest element: a BF16 weight of 1.0
    that an Adam step of 1e-3 leaves unchanged may round the other way in another layout). Traces
    without the initial parameters (step -1, written by tracer.job sessions) fall back on the
    largest move any perturbed run made at that step (`step_move`)."""
    update = 2 * st.updates if not math.isnan(st.updates) else step_move
    return policy.k * (update + unit * st.absmax)


def _reason(res: TensorResult, policy: TolerancePolicy, mismatch: str | None, got: Assembled
            ) -> tuple[bool, str]:
    """(ok, why not): the first test the tensor fails, in the order they are reported."""
    tol = res.tolerance
    if mismatch is not None:
        return False, (f"shape: {mismatch} (the tensor's layout is not what its placements or plan "
                       "declare, e.g. a module left out of the parallel plan)")
    if res.nonfinite:
        return False, f"{res.nonfinite} non-finite values"
    if res.rel_err > tol:
        return False, f"rel_err {res.rel_err:.3g} > tolerance {tol:.3g}"
    if abs(res.scale_err) > res.scale_tolerance:
        return False, (f"scale: the candidate is {1 + res.scale_err:.5g} x the reference along its "
                       f"direction (tolerance +-{res.scale_tolerance:.3g}; rel_err {res.rel_err:.3g})")
    if not res.scale_band[0] <= res.scale_err <= res.scale_band[1]:
        low, high = res.scale_band
        return False, (f"scale: the candidate is {1 + res.scale_err:.5g} x the reference along its "
                       f"direction, outside the range the perturbed runs span there "
                       f"[{1 + low:.5g}, {1 + high:.5g}] (rel_err {res.rel_err:.3g})")
    if res.elem_err > res.elem_tolerance:
        return False, (f"elementwise: an element is {res.elem_err:.3g} noise scales off "
                       f"(tolerance {res.elem_tolerance:.3g}; rel_err {res.rel_err:.3g})")
    if res.rowcol_err > res.rowcol_tolerance:
        return False, (f"elementwise: an element is {res.rowcol_err:.3g} x its row's and column's noise "
                       f"off (tolerance {res.rowcol_tolerance:.3g}; rel_err {res.rel_err:.3g})")
    if res.own_err > res.own_tolerance and res.rowcol_err > res.joint_tolerance:
        return False, (
            f"elementwise: an element is {res.own_err:.3g} x its row's and column's noise fitted to the "
            f"candidate's own errors (tolerance {res.own_tolerance:.3g}) and {res.rowcol_err:.3g} x the "
            f"perturbed runs' (tolerance {res.joint_tolerance:.3g}): past both at once (rel_err "
            f"{res.rel_err:.3g})")
    if policy.replicas == "exact" and res.replica_differ:
        return False, (f"replicas on ranks {got.replica_ranks} differ in {res.replica_differ} element(s) "
                       f"(rel {res.replica_err:.3g}); replicas agree bit for bit unless the recipe "
                       "declares nondeterministic kernels (tolerance.replicas=tolerance)")
    if res.replica_err > tol:
        return False, (f"replicas on ranks {got.replica_ranks} disagree "
                       f"(rel {res.replica_err:.3g} > {tol:.3g})")
    if res.excused and res.excused_dev > res.excused_bound:
        return False, (f"an excused element moved {res.excused_dev:.3g}, beyond {res.excused_bound:.3g} "
                       "(k x twice the largest update the optimizer made to this parameter): more than a "
                       "step flipped by noise can explain")
    if res.beyond > (limit := beyond_limit(res.excused, res.beyond_noise, policy.k)):
        return False, (f"{res.beyond} of {res.excused} excused elements are beyond their perturbed "
                       f"envelope (a perturbed run: at most {res.beyond_noise}; limit {limit:.1f}): a "
                       "systematic change of the update, not noise")
    return True, ""
