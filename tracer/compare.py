"""Comparison stage: judge every reference tensor against the candidate's logical tensor.

Importable and testable without Ray: the orchestrator only calls `load_logical` (tracer.logical)
and `compare`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from tracer.compare_inputs import tensor_keys
from tracer.compare_shares import Measured, measure_keys
from tracer.errors import TraceError
from tracer.heap import gc_paused
from tracer.judge import judge
from tracer.layouts import Assembled
from tracer.logical import LogicalTrace
from tracer.measure import TensorKey
from tracer.reference_side import ReferenceSide
from tracer.stats_compare import compare_stats
from tracer.tolerance import TolerancePolicy
from tracer.verdicts import Comparison


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
        self.stored, self._names = tensors, names   # `stored`: what a walk restricts (compare_shares)

    def __getitem__(self, name: str) -> Assembled:
        if name not in self._names:
            raise KeyError(name)
        return self.stored[name]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def pieces(self, name: str) -> Any:
        """The ranks' entries of a tensor (tracer.logical.StoredTensors.pieces; stats mode)."""
        return self.stored.pieces(name)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


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
        return _compare(reference, candidate, perturbed, policy, per_step_only, prepared, measurer)


def _compare(reference: LogicalTrace, candidate: LogicalTrace, perturbed: Sequence[LogicalTrace],
             policy: TolerancePolicy, per_step_only: bool, prepared: Mapping[str, ReferenceSide] | None,
             measurer: Callable[[Sequence[TensorKey]], Measured] | None) -> Comparison:
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
        # A param_grad is recorded where the parameter has a .grad: one the candidate lacks alone is a
        # parameter its step never trained (a gradient its parallel wrappers never delivered)
        grads_only = not extra and all(n.endswith("/param_grad") for n in missing)
        raise TraceError(
            f"candidate run '{candidate.run}' and reference run '{reference.run}' traced different tensors "
            f"({len(missing)} missing from the candidate, e.g. {missing[:3]}; {len(extra)} extra, e.g. "
            f"{extra[:3]}): " + ("the candidate's parameters had no gradient after its backward: its step "
                                 "never trained them (a gradient its parallel wrappers never delivered?)"
                                 if grads_only else "the runs do not match (different recipe, steps or "
                                 "tracing plan)"))
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
    keys = tensor_keys(reference)
    if measurer is None:
        # A walk of some tensors only (per step) reads and holds only their parts, none after it.
        got = measure_keys(reference, candidate, perturbed, keys, policy.k_elem, prepared, only=per_step_only)
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
