"""Comparison stage: judge every reference tensor against the candidate's logical tensor.

Importable and testable without Ray: the orchestrator only calls `load_logical` (tracer.logical)
and `compare`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tracer.compare_inputs import first_update_eps, tensor_keys
from tracer.compare_shares import Measured, measure_keys
from tracer.errors import TraceError
from tracer.heap import gc_paused
from tracer.judge import judge
from tracer.logical import LogicalTrace
from tracer.measure import TensorKey
from tracer.reference_side import ReferenceSide
from tracer.stats_compare import compare_stats
from tracer.tolerance import TolerancePolicy
from tracer.verdicts import Comparison, TensorResult


def rounding_draws(perturbed: Sequence[LogicalTrace]) -> bool:
    """Are the perturbed runs GEMM rounding draws, the joint single-element rule's calibration
    (tracer.tolerance.own_err)? The built-in trainer records what its perturbed runs moved; traces
    from before it did drew them exactly when they were bf16 or fp8 (tolerance.perturbation=auto)."""
    def drawn(meta: Mapping[str, Any]) -> bool:
        if "perturbation" in meta:
            return meta["perturbation"] == "gemm"
        return meta.get("job") == "builtin" and meta.get("precision") in ("bf16", "fp8")
    return bool(perturbed) and all(drawn(p.meta) for p in perturbed)


def _check_perturbed_moved(reference: LogicalTrace, perturbed: Sequence[LogicalTrace],
                           stats: Mapping[str, Any]) -> None:
    """A perturbed run bit-identical to the reference everywhere never had its perturbation applied
    (its tolerances would all be the floor: a wall of false FAILs). That is an error, not a verdict."""
    moved = 0
    for st in stats.values():
        moved |= st.moved
    still = [p.run for i, p in enumerate(perturbed) if not moved >> i & 1]
    if still:
        raise TraceError(
            f"perturbed reference run(s) {still} are bit-identical to reference '{reference.run}' in all "
            f"{len(stats)} tensors: the perturbation did not apply, so no tolerance can be estimated. A job "
            "must call tr.attach(model) after its weights are set (and not reload them afterwards), and a "
            "perturbed run must be launched with TTRACE_ROLE=perturbed TTRACE_PERTURB=<r>")


def _per_step(trace: LogicalTrace) -> LogicalTrace:
    """The run's tensors of whole steps (no microbatch index): parameters and their gradients."""
    return trace.restricted([n for n in trace.order if trace.info[n].get("microbatch") is None])


def compare(reference: LogicalTrace, candidate: LogicalTrace, perturbed: Sequence[LogicalTrace],
            policy: TolerancePolicy, *, per_step_only: bool = False,
            prepared: Mapping[str, ReferenceSide] | None = None,
            measurer: Callable[[Sequence[TensorKey]], Measured] | None = None) -> Comparison:
    """Judge every reference tensor against the candidate; raise TraceError on mismatched runs.
    `per_step_only`: judge the tensors of a whole step (param_grad, param) only, when the runs cut the
    global batch into different microbatches (a reference without gradient accumulation).
    `prepared`: the reference set's side, made before the candidate was done
    (tracer.compare_inputs.prepare_reference_side). `measurer`: measures the keys elsewhere, e.g. in
    shares on several workers (tracer/compare_shares.py, orchestrator/compare_tasks.py); default: here,
    on this process's cores. The cyclic GC is paused meanwhile: the walk makes
    no cycles, but its allocations (part views, figures) triggered passes that rescanned all it holds
    (a 16x comparison: 2.45 s with them, 1.73 s without)."""
    with gc_paused():
        _same_recipe(reference, candidate, perturbed)
        if per_step_only:
            prepared = None   # other tensors, other chunks
            reference, candidate = _per_step(reference), _per_step(candidate)
            perturbed = [_per_step(p) for p in perturbed]
        untrained = untrained_grads(reference, candidate)
        if not untrained:
            return _compare(reference, candidate, perturbed, policy, per_step_only, prepared, measurer)
        # Judged without them (other chunks than the prepared ones), then failed where they lie.
        keep = [n for n in reference.order if n not in untrained]
        judged = _compare(reference.restricted(keep), candidate, [p.restricted(keep) for p in perturbed],
                          policy, True, None, measurer)
        return with_untrained(judged, reference, untrained, policy)


def _same_recipe(reference: LogicalTrace, candidate: LogicalTrace, perturbed: Sequence[LogicalTrace]) -> None:
    for other in (candidate, *perturbed):
        fa, fb = reference.meta.get("fingerprint"), other.meta.get("fingerprint")
        if fa and fb and fa != fb:
            raise TraceError(f"run '{other.run}' was traced from a different recipe than reference "
                             f"'{reference.run}' (fingerprint {fb} != {fa}: model, data, steps, seed or "
                             "precision differ); compare runs of the same recipe")


def untrained_grads(reference: LogicalTrace, candidate: LogicalTrace) -> set[str]:
    """The reference's param grads the candidate lacks, where that is all the runs' tensors differ in;
    any other difference is an error (the runs do not match). A param_grad is recorded where the
    parameter has a .grad after the step's backward: the candidate's step never trained those
    parameters (a gradient its parallel wrappers never delivered, e.g. torch 2.13's zero-bubble
    schedules with per-block FSDP2: scripts/repro_zb_fsdp_grads.py). That is a verdict on the
    candidate, judged with the rest (`with_untrained`), not an error of the comparison."""
    missing = [n for n in reference.order if n not in candidate.tensors]
    extra = [n for n in candidate.order if n not in reference.tensors]
    if not extra and all(reference.info[n]["kind"] == "param_grad" for n in missing):
        return set(missing)
    raise TraceError(
        f"candidate run '{candidate.run}' and reference run '{reference.run}' traced different tensors "
        f"({len(missing)} missing from the candidate, e.g. {missing[:3]}; {len(extra)} extra, e.g. "
        f"{extra[:3]}): the runs do not match (different recipe, steps or tracing plan)")


UNTRAINED = ("no gradient: the candidate's backward left this parameter's .grad unset where the reference's "
             "set it, so its step never trained it (a gradient its parallel wrappers never delivered)")


def with_untrained(judged: Comparison, reference: LogicalTrace, untrained: set[str],
                    policy: TolerancePolicy) -> Comparison:
    """`judged` (the comparison without the `untrained` param grads) with each of them failed at its
    place in the reference's execution order, and every result's index that place."""
    at = {n: i for i, n in enumerate(reference.order)}
    results = sorted(judged.results + [_untrained_result(reference, n, at[n], policy) for n in untrained],
                     key=lambda r: at[r.name])
    for r in results:
        r.index = at[r.name]
    return Comparison("fail", results, next(r for r in results if not r.ok))


def _untrained_result(reference: LogicalTrace, name: str, index: int,
                      policy: TolerancePolicy) -> TensorResult:
    e = reference.info[name]
    return TensorResult(name=name, module=e["module"], module_type=e.get("module_type", ""), kind=e["kind"],
                        step=e["step"], microbatch=e["microbatch"], index=index, rel_err=math.inf,
                        max_err=math.inf, cosine=math.nan, nonfinite=0, replica_err=0.0,
                        tolerance=policy.tolerance([0.0], e["dtype"]), noise=0.0, max_noise=0.0,
                        analytic_bound=0.0, ok=False, reason=UNTRAINED)


def _compare(reference: LogicalTrace, candidate: LogicalTrace, perturbed: Sequence[LogicalTrace],
             policy: TolerancePolicy, some: bool, prepared: Mapping[str, ReferenceSide] | None,
             measurer: Callable[[Sequence[TensorKey]], Measured] | None) -> Comparison:
    """The comparison of runs that traced the same tensors. `some`: the runs' tensors are some of those
    stored (a walk reads and holds only their parts, none after it)."""
    for p in perturbed:
        lost = [n for n in reference.order if n not in p.tensors]
        if lost:
            raise TraceError(f"perturbed reference '{p.run}' lacks {len(lost)} tensors (e.g. {lost[:3]})")

    # A dtype that differs means the runs do not match: say so before reading any tensor.
    for name in reference.order:
        c_dtype, r_dtype = candidate.info[name].get("dtype"), reference.info[name].get("dtype")
        if c_dtype and r_dtype and c_dtype != r_dtype:
            raise TraceError(f"{name}: candidate traced it as {c_dtype} but the reference as {r_dtype}: "
                             "the runs use different precision recipes; compare runs of the same recipe")

    if any(t.mode == "stats" for t in (reference, candidate, *perturbed)):   # trace.mode=stats
        return compare_stats(reference, candidate, perturbed, policy)

    # Adam's update is ~lr * sign(m): a parameter element whose gradient is within noise of zero
    # (as measured on this or an earlier step's param_grad) may step either way under any honest
    # reordering, so the post-step `param` is judged on the other elements. A post-step parameter
    # also inherits its gradient's error through the optimizer, whose per-element gain |dp/dg| is
    # huge where |g| is near Adam's eps: elements whose candidate error is explained by the
    # candidate's own (accepted) gradient deviation times the gain measured on the perturbed runs
    # are judged at the param_grad, not again here. Both live in tracer.measure.
    keys = tensor_keys(reference, first_update_eps([candidate, *perturbed]))
    if measurer is None:
        got = measure_keys(reference, candidate, perturbed, keys, policy.k_elem, prepared, only=some)
    else:
        got = measurer(keys)
        lost = [k.name for k in keys if k.name not in got.stats or k.name not in got.replicas]
        if lost:
            raise TraceError(f"the comparison's measurement returned no figures for {len(lost)} of "
                             f"{len(keys)} tensors (e.g. {lost[:3]}): a share was lost; compare again")
    stats = got.stats
    _check_perturbed_moved(reference, perturbed, stats)
    for name in reference.order:
        if stats[name].ref_nonfinite:
            raise TraceError(f"{name}: the reference itself has non-finite values; the recipe diverges "
                             "even on one device, fix it before comparing")
        if stats[name].perturbed_nonfinite:
            raise TraceError(f"{name}: a perturbed reference run has non-finite values where the reference "
                             "has none; the recipe is unstable under a one-ulp weight change, so no "
                             "tolerance can be estimated (fix the recipe: lower lr, fewer steps)")
    results = judge(reference, keys, stats, policy, rounding_draws(perturbed), got.replicas, got.mismatch)
    first = next((r for r in results if not r.ok), None)
    return Comparison("pass" if first is None else "fail", results, first)
