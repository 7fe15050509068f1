"""Comparison stage: judge every reference tensor against the candidate's logical tensor.

Importable and testable without Ray: the orchestrator only calls `load_logical` (tracer.logical)
and `compare`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tracer.compare_inputs import ShapeCheckedReads, tensor_keys
from tracer.errors import TraceError
from tracer.heap import gc_paused
from tracer.layouts import Assembled
from tracer.logical import LogicalTrace
from tracer.measure import measure
from tracer.reference_side import ReferenceSide
from tracer.stats_compare import compare_stats
from tracer.tolerance import TolerancePolicy
from tracer.verdicts import Comparison, TensorResult


def _finite(x: float) -> float:
    return x if math.isfinite(x) else float("inf")


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
    keep = [n for n in trace.order if trace.info[n].get("microbatch") is None]
    return LogicalTrace(trace.run, trace.world_size, trace.meta, keep, {n: trace.info[n] for n in keep},
                        _Subset(trace.tensors, set(keep)), trace.sizes, trace.mode)


class _Subset(Mapping[str, Assembled]):
    """A run's tensors restricted to some names (read lazily as the run's own mapping does)."""

    def __init__(self, tensors: Mapping[str, Assembled], names: set[str]):
        self._tensors, self._names = tensors, names

    def __getitem__(self, name: str) -> Assembled:
        if name not in self._names:
            raise KeyError(name)
        return self._tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def pieces(self, name: str) -> Any:
        """The ranks' entries of a tensor (tracer.logical.StoredTensors.pieces; stats mode)."""
        return self._tensors.pieces(name)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


BANDED_STEPS = 2   # the traced steps the scale band judges (see _compare)

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


def compare(reference: LogicalTrace, candidate: LogicalTrace, perturbed: Sequence[LogicalTrace],
            policy: TolerancePolicy, *, per_step_only: bool = False,
            prepared: Mapping[str, ReferenceSide] | None = None) -> Comparison:
    """Judge every reference tensor against the candidate; raise TraceError on mismatched runs.
    `per_step_only`: judge the tensors of a whole step (param_grad, param) only, when the runs cut the
    global batch into different microbatches (a reference without gradient accumulation).
    `prepared`: the reference set's side, made before the candidate was done
    (tracer.compare_inputs.prepare_reference_side). The cyclic GC is paused meanwhile: the walk makes
    no cycles, but its allocations (part views, figures) triggered passes that rescanned all it holds
    (a 16x comparison: 2.45 s with them, 1.73 s without)."""
    with gc_paused():
        return _compare(reference, candidate, perturbed, policy, per_step_only, prepared)


def _compare(reference: LogicalTrace, candidate: LogicalTrace, perturbed: Sequence[LogicalTrace],
             policy: TolerancePolicy, per_step_only: bool, prepared: Mapping[str, ReferenceSide] | None
             ) -> Comparison:
    if per_step_only:
        prepared = None   # other tensors, other chunks
        reference, candidate = _per_step(reference), _per_step(candidate)
        perturbed = [_per_step(p) for p in perturbed]
    for other in (candidate, *perturbed):
        fa, fb = reference.meta.get("fingerprint"), other.meta.get("fingerprint")
        if fa and fb and fa != fb:
            raise TraceError(f"run '{other.run}' was traced from a different recipe than reference "
                             f"'{reference.run}' (fingerprint {fb} != {fa}: model, data, steps, seed or "
                             "precision differ); compare runs of the same recipe")
    missing = [n for n in reference.order if n not in candidate.tensors]
    extra = [n for n in candidate.order if n not in reference.tensors]
    if missing or extra:
        raise TraceError(
            f"candidate run '{candidate.run}' and reference run '{reference.run}' traced different tensors "
            f"({len(missing)} missing from the candidate, e.g. {missing[:3]}; {len(extra)} extra, e.g. "
            f"{extra[:3]}): the runs do not match (different recipe, steps or tracing plan)")
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

    if any(t.mode == "stats" for t in (reference, candidate, *perturbed)):
        return compare_stats(reference, candidate, perturbed, policy)   # trace.mode=stats

    # Adam's update is ~lr * sign(m): a parameter element whose gradient is within noise of zero
    # (as measured on this or an earlier step's param_grad) may step either way under any honest
    # reordering, so the post-step `param` is judged on the other elements. A post-step parameter
    # also inherits its gradient's error through the optimizer, whose per-element gain |dp/dg| is
    # huge where |g| is near Adam's eps: elements whose candidate error is explained by the
    # candidate's own (accepted) gradient deviation times the gain measured on the perturbed runs
    # are judged at the param_grad, not again here. Both live in tracer.measure.
    keys = tensor_keys(reference)
    replicas: dict[str, Assembled] = {}
    arriving = ShapeCheckedReads(candidate, reference, replicas)
    stats = measure(keys, ShapeCheckedReads(reference, reference), arriving,
                    [ShapeCheckedReads(p, reference) for p in perturbed], policy.k_elem, prepared=prepared)
    _check_perturbed_moved(reference, perturbed, stats)
    for name in reference.order:
        if stats[name].ref_nonfinite:
            raise TraceError(f"{name}: the reference itself has non-finite values; the recipe diverges "
                             "even on one device, fix it before comparing")
        if stats[name].perturbed_nonfinite:
            raise TraceError(f"{name}: a perturbed reference run has non-finite values where the reference "
                             "has none; the recipe is unstable under a one-ulp weight change, so no "
                             "tolerance can be estimated (fix the recipe: lower lr, fewer steps)")

    # Noise is pooled over the microbatches of a step: the same module and kind computed on
    # exchangeable data, so R perturbed runs give R * microbatches draws of the same noise process
    # (quantization noise is heavy-tailed: a few draws can land unluckily small).
    # A parameter's param_grad and param are their own family (a module's weight and its zero bias
    # have nothing in common); a module's outputs pool over the step's microbatches.
    path = lambda n: n.split("/", 2)[2].rsplit("/", 1)[0]
    family = lambda n: (reference.info[n]["step"], path(n), reference.info[n]["kind"])
    pooled: dict[tuple, tuple[float, ...]] = {}
    families = [family(name) for name in reference.order]
    for name, fam in zip(reference.order, families, strict=True):
        st, f = stats[name], pooled.get(fam, (0.0,) * 5)
        pooled[fam] = tuple(map(max, f, (st.noise, st.elem_noise, st.rowcol_noise, st.own_noise,
                                         st.scale_spread)))
    draws = rounding_draws(perturbed)
    # The scale band is calibrated on a check's first two traced steps (every bench and matrix runs
    # 2-step checks). Later, honest excursions outgrow its floor (a clean 3-step bf16 tp2 check, seed
    # 77: a step-2 weight grad at 0.5x its norm-wise noise along itself, past the band's 0.25x):
    # from the third step on, a scale is judged by k_scale alone.
    first = reference.first_step()
    banded = lambda step: draws and int(step) < first + BANDED_STEPS

    # Excused param elements are bounded by what the optimizer can do to them: an update flipped by
    # noise moves an element by twice its update, so k x (2 x the reference's largest update of that
    # parameter, summed over the steps so far, + one ulp of its largest element: a BF16 weight of 1.0
    # that an Adam step of 1e-3 leaves unchanged may round the other way in another layout). Traces
    # without the initial parameters (step -1, written by tracer.job sessions) fall back on the
    # largest move any perturbed run made at that step.
    move: dict[int, float] = {}
    for name in reference.order:
        if reference.info[name]["kind"] == "param":
            step = reference.info[name]["step"]
            move[step] = max(move.get(step, 0.0), stats[name].env_max)
    bound = lambda st, step, unit: policy.k * (
        (2 * st.updates if not math.isnan(st.updates) else move.get(step, 0.0)) + unit * st.absmax)

    depth_of: dict[str, int] = {}
    results: list[TensorResult] = []
    for index, (name, key, fam) in enumerate(zip(reference.order, keys, families, strict=True)):
        e, st, got, shape = reference.info[name], stats[name], replicas[name], reference.shape(name)
        depth = depth_of.setdefault(e["module"], len(depth_of))
        noise, e_noise, rc_noise, own_noise, spread = pooled[fam]
        tol = policy.tolerance([noise], e["dtype"])
        res = TensorResult(
            name=name, module=e["module"], module_type=e.get("module_type", ""), kind=e["kind"],
            step=e["step"], microbatch=e["microbatch"], index=index,
            rel_err=_finite(st.rel_err), max_err=_finite(st.max_err), cosine=st.cosine, excused=st.excused,
            nonfinite=st.nonfinite, replica_err=_finite(got.replica_err), replica_differ=got.replica_differ,
            tolerance=tol,
            noise=st.noise, max_noise=st.max_noise,
            analytic_bound=policy.analytic_bound(depth, e["dtype"], reference.meta.get("precision")), ok=True,
            elem_err=_finite(st.elem_err), elem_noise=st.elem_noise,
            elem_tolerance=policy.elem_tolerance([e_noise], key.numel),
            rowcol_err=_finite(st.rowcol_err), rowcol_noise=st.rowcol_noise,
            rowcol_tolerance=policy.rowcol_tolerance([rc_noise], key.rowcol),
            own_err=_finite(st.own_err), own_noise=st.own_noise,
            scale_err=_finite(st.scale_err),
            scale_tolerance=policy.scale_tolerance([noise], e["dtype"], e["kind"], shape),
            scale_band=policy.scale_band(st.scale_mean, spread, noise, e["dtype"], e["kind"], shape,
                                         banded(e["step"])),
            excused_fraction=st.excused / max(1, key.numel), excused_dev=_finite(st.excused_dev),
            excused_bound=bound(st, e["step"], key.unit),
            beyond=st.beyond, beyond_noise=st.beyond_noise)
        res.own_tolerance, res.joint_tolerance = policy.own_tolerances(own_noise, rc_noise, key.rowcol, draws)
        if name in arriving.mismatch:
            res.rel_err = res.max_err = res.elem_err = math.inf
            res.cosine, res.nonfinite, res.excused = math.nan, 0, 0
            res.ok, res.reason = False, (f"shape: {arriving.mismatch[name]} (the tensor's layout is not what "
                                         "its placements or plan declare, e.g. a module left out of the "
                                         "parallel plan)")
        elif res.nonfinite:
            res.ok, res.reason = False, f"{res.nonfinite} non-finite values"
        elif res.rel_err > tol:
            res.ok, res.reason = False, f"rel_err {res.rel_err:.3g} > tolerance {tol:.3g}"
        elif abs(res.scale_err) > res.scale_tolerance:
            res.ok, res.reason = False, (f"scale: the candidate is {1 + res.scale_err:.5g} x the reference "
                                         f"along its direction (tolerance +-{res.scale_tolerance:.3g}; "
                                         f"rel_err {res.rel_err:.3g})")
        elif not res.scale_band[0] <= res.scale_err <= res.scale_band[1]:
            res.ok, res.reason = False, (f"scale: the candidate is {1 + res.scale_err:.5g} x the reference "
                                         f"along its direction, outside the range the perturbed runs span "
                                         f"there [{1 + res.scale_band[0]:.5g}, {1 + res.scale_band[1]:.5g}] "
                                         f"(rel_err {res.rel_err:.3g})")
        elif res.elem_err > res.elem_tolerance:
            res.ok, res.reason = False, (f"elementwise: an element is {res.elem_err:.3g} noise scales off "
                                         f"(tolerance {res.elem_tolerance:.3g}; rel_err {res.rel_err:.3g})")
        elif res.rowcol_err > res.rowcol_tolerance:
            res.ok, res.reason = False, (f"elementwise: an element is {res.rowcol_err:.3g} x its row's and "
                                         f"column's noise off (tolerance {res.rowcol_tolerance:.3g}; "
                                         f"rel_err {res.rel_err:.3g})")
        elif res.own_err > res.own_tolerance and res.rowcol_err > res.joint_tolerance:
            res.ok, res.reason = False, (
                f"elementwise: an element is {res.own_err:.3g} x its row's and column's noise fitted to the "
                f"candidate's own errors (tolerance {res.own_tolerance:.3g}) and {res.rowcol_err:.3g} x the "
                f"perturbed runs' (tolerance {res.joint_tolerance:.3g}): past both at once (rel_err "
                f"{res.rel_err:.3g})")
        elif policy.replicas == "exact" and res.replica_differ:
            res.ok, res.reason = False, (f"replicas on ranks {got.replica_ranks} differ in "
                                         f"{res.replica_differ} element(s) (rel {res.replica_err:.3g}); "
                                         "replicas agree bit for bit unless the recipe declares "
                                         "nondeterministic kernels "
                                         "(tolerance.replicas=tolerance)")
        elif res.replica_err > tol:
            res.ok, res.reason = False, (f"replicas on ranks {got.replica_ranks} disagree "
                                         f"(rel {res.replica_err:.3g} > {tol:.3g})")
        elif res.excused and res.excused_dev > res.excused_bound:
            res.ok, res.reason = False, (f"an excused element moved {res.excused_dev:.3g}, beyond "
                                         f"{res.excused_bound:.3g} (k x twice the largest update the "
                                         "optimizer made to this parameter): more than a step flipped by "
                                         "noise can explain")
        elif res.beyond > (limit := beyond_limit(res.excused, res.beyond_noise, policy.k)):
            res.ok, res.reason = False, (f"{res.beyond} of {res.excused} excused elements are beyond their "
                                         f"perturbed envelope (a perturbed run: at most {res.beyond_noise}; "
                                         f"limit {limit:.1f}): a systematic change of the update, not noise")
        results.append(res)
    first = next((r for r in results if not r.ok), None)
    return Comparison("pass" if first is None else "fail", results, first)
