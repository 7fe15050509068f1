"""Comparison stage: reassemble each run's logical tensors, compare candidate with reference.

Importable and testable without Ray: the orchestrator only calls `load_logical` and `compare`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tracer.errors import TraceError
from tracer.layouts import Assembled, Layout, Piece, assemble
from tracer.store import read_run
from tracer.tolerance import TolerancePolicy, elem_err, elem_noise, noise_scale, unit_roundoff

KIND_ORDER = ("output", "loss", "grad_output", "param_grad", "param")


@dataclass
class LogicalTrace:
    """A run's traced tensors, reassembled to logical form, in execution order."""

    run: str
    world_size: int
    meta: dict[str, Any]
    order: list[str]                    # canonical names in execution order
    info: dict[str, dict[str, Any]]     # name -> manifest entry of the lowest rank
    tensors: dict[str, Assembled]


def load_logical(root: str, run: str, world_size: int) -> LogicalTrace:
    ranks = read_run(root, run, world_size)
    # One run, one recipe: a rank manifest written by another run (a stale or copied directory)
    # would otherwise be reassembled silently, since only rank 0's meta is compared across runs.
    prints = {rt.rank: rt.manifest.get("meta", {}).get("fingerprint") for rt in ranks}
    if len(set(prints.values())) > 1:
        odd = sorted(r for r, f in prints.items() if f != prints[ranks[0].rank])
        seen = sorted(set(map(str, prints.values())))
        raise TraceError(f"run '{run}' under {root}: rank(s) {odd} were traced from a different recipe "
                         f"than rank {ranks[0].rank} (fingerprints {seen}); "
                         "the run directory mixes runs, rerun the job into a fresh store path")
    pieces: dict[str, list[Piece]] = {}
    info: dict[str, dict[str, Any]] = {}
    for rt in ranks:
        by_key = {e["key"]: e for e in rt.entries}
        coords, seen = rt.manifest["coords"], set()
        for _, tensors in rt.load_parts():
            for key, t in tensors.items():
                e = by_key.get(key)
                if e is None:
                    raise TraceError(f"run '{run}' rank {rt.rank}: tensor '{key}' is not in the manifest")
                seen.add(key)
                scale = float(e.get("scale", 1.0))
                t = t.double() * scale if scale != 1.0 else t.double()
                pieces.setdefault(e["name"], []).append(Piece(coords, t, rt.rank))
                if e["name"] not in info or rt.rank < info[e["name"]]["rank"]:
                    info[e["name"]] = dict(e, rank=rt.rank)
        if len(seen) != len(by_key):
            lost = sorted(set(by_key) - seen)[:3]
            raise TraceError(f"run '{run}' rank {rt.rank}: manifest lists tensors not found in any part "
                             f"(e.g. {lost}); the trace is incomplete, rerun the job")
    sizes = ranks[0].manifest["sizes"]
    tensors = {name: assemble(name, Layout.from_json(info[name]["layout"]), ps, sizes)
               for name, ps in pieces.items()}
    # Execution order: by step, then the record order of the lowest rank holding the tensor (the
    # reference has a single rank, whose order is the one the comparison walks).
    order = sorted(info, key=lambda n: (info[n]["step"], info[n]["seq"]))
    return LogicalTrace(run, world_size, ranks[0].manifest.get("meta", {}), order, info, tensors)


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
    excused: int = 0             # param elements not judged: their update sign is within grad noise


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
            "tensors": [asdict(r) for r in self.results],
        }


def rel_err(c: torch.Tensor, r: torch.Tensor) -> float:
    diff = (c - r).norm().item()
    if diff == 0.0:
        return 0.0
    ref = r.norm().item()
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


def _explained_by_grad(r: torch.Tensor, c: torch.Tensor, ps: Sequence[torch.Tensor], c_dg: torch.Tensor,
                       p_dg: torch.Tensor, k: float) -> torch.Tensor | None:
    """Param elements whose candidate error is within k x (gain x the candidate's grad deviation),
    gain = max_r |p_r - r| / max_r |g_r - g| per element (0 where the perturbed grads did not move)."""
    if not ps or c.shape != r.shape or c_dg.shape != r.shape:
        return None
    r64 = r.double()
    dp = torch.stack([(p.double() - r64).abs() for p in ps]).amax(0)
    gain = torch.where(p_dg > 0, dp / p_dg.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(dp))
    diff = (c.double() - r64).abs()
    return (diff > 0) & (c_dg > 0) & (diff <= k * gain * c_dg)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else float("inf")


def compare(reference: LogicalTrace, candidate: LogicalTrace, perturbed: Sequence[LogicalTrace],
            policy: TolerancePolicy) -> Comparison:
    """Judge every reference tensor against the candidate; raise TraceError on mismatched runs."""
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

    # Noise is pooled over the microbatches of a step: the same module and kind computed on
    # exchangeable data, so R perturbed runs give R * microbatches draws of the same noise process
    # (quantization noise is heavy-tailed: a few draws can land unluckily small).
    family = lambda n: (reference.info[n]["step"], reference.info[n]["module"], reference.info[n]["kind"])
    pooled: dict[tuple, tuple[float, float]] = {}
    own: dict[str, tuple[float, float]] = {}
    # Adam's update is ~lr * sign(m): a parameter element whose gradient is within noise of zero
    # (as measured on this step's param_grad) may step either way under any honest reordering, so
    # the post-step `param` is judged on the other elements; such elements accumulate over steps.
    undetermined: dict[str, torch.Tensor] = {}
    path = lambda n: n.split("/", 2)[2].rsplit("/", 1)[0]

    def judged(name: str, t: torch.Tensor) -> torch.Tensor:
        m = undetermined.get(path(name)) if reference.info[name]["kind"] == "param" else None
        return t if m is None or m.shape != t.shape else t[~m]

    # A post-step parameter inherits its gradient's error through the optimizer, whose per-element
    # gain |dp/dg| is huge where |g| is near Adam's eps (lr * eps / (|g| + eps)**2). Elements whose
    # candidate error is explained by the candidate's own (accepted) gradient deviation times the gain
    # measured on the perturbed runs are judged at the param_grad, not again here.
    grad_dev: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # path -> (candidate, perturbed) |dg|

    for name in reference.order:
        e = reference.info[name]
        u = unit_roundoff(e["dtype"])
        if e["kind"] == "param" and path(name) in grad_dev and name in candidate.tensors:
            explained = _explained_by_grad(reference.tensors[name].tensor, candidate.tensors[name].tensor,
                                           [p.tensors[name].tensor for p in perturbed], *grad_dev[path(name)],
                                           policy.k_elem)
            if explained is not None:
                prev = undetermined.get(path(name))
                undetermined[path(name)] = explained if prev is None or prev.shape != explained.shape else (
                    prev | explained)
        r = judged(name, reference.tensors[name].tensor)
        ps = [judged(name, p.tensors[name].tensor) for p in perturbed]
        own[name] = (max((rel_err(p, r) for p in ps), default=0.0), max(elem_noise(ps, r, u), default=0.0))
        f = pooled.get(family(name), (0.0, 0.0))
        pooled[family(name)] = (max(f[0], own[name][0]), max(f[1], own[name][1]))
        if e["kind"] == "param_grad" and ps and r.numel():
            env = torch.stack([(p - r).abs() for p in ps]).amax(0)
            near_zero = r.abs() <= policy.k_elem * (env + (own[name][0] + u) * r.square().mean().sqrt())
            prev = undetermined.get(path(name))
            undetermined[path(name)] = near_zero if prev is None or prev.shape != r.shape else (
                prev | near_zero)
            c = candidate.tensors[name].tensor if name in candidate.tensors else None
            if c is not None and c.shape == r.shape:
                grad_dev[path(name)] = ((c.double() - r.double()).abs(),
                                        torch.stack([(p.double() - r.double()).abs() for p in ps]).amax(0))

    depth_of: dict[str, int] = {}
    results: list[TensorResult] = []
    for index, name in enumerate(reference.order):
        e = reference.info[name]
        r = reference.tensors[name].tensor
        got = candidate.tensors[name]
        c = got.tensor
        if c.shape != r.shape:
            raise TraceError(f"{name}: candidate reassembles to shape {tuple(c.shape)} but the reference has "
                             f"{tuple(r.shape)}: the runs do not match or a layout is declared wrong")
        c_dtype = candidate.info[name].get("dtype")
        if c_dtype and e.get("dtype") and c_dtype != e["dtype"]:
            raise TraceError(f"{name}: candidate traced it as {c_dtype} but the reference as {e['dtype']}: "
                             "the runs use different precision recipes; compare runs of the same recipe")
        if not torch.isfinite(r).all():
            raise TraceError(f"{name}: the reference itself has non-finite values; the recipe diverges "
                             "even on one device, fix it before comparing")
        depth = depth_of.setdefault(e["module"], len(depth_of))
        nonfinite = int((~torch.isfinite(c)).sum().item())
        noise, e_noise = pooled[family(name)]
        tol = policy.tolerance([noise], e["dtype"])
        u = unit_roundoff(e["dtype"])
        full_c = c
        r, c = judged(name, r), judged(name, c)
        ps = [judged(name, p.tensors[name].tensor) for p in perturbed]
        res = TensorResult(
            name=name, module=e["module"], module_type=e.get("module_type", ""), kind=e["kind"],
            step=e["step"], microbatch=e["microbatch"], index=index,
            rel_err=_finite(rel_err(c, r)), max_err=_finite(max_err(c, r)), cosine=cosine(c, r),
            excused=full_c.numel() - c.numel(),
            nonfinite=nonfinite, replica_err=_finite(got.replica_err), tolerance=tol,
            noise=own[name][0],
            max_noise=max((max_err(p, r) for p in ps), default=0.0),
            analytic_bound=policy.analytic_bound(depth, e["dtype"], reference.meta.get("precision")), ok=True,
            elem_err=_finite(elem_err(c, r, noise_scale(ps, r, u))), elem_noise=own[name][1],
            elem_tolerance=policy.elem_tolerance([e_noise]))
        if nonfinite:
            res.ok, res.reason = False, f"{nonfinite} non-finite values"
        elif res.rel_err > tol:
            res.ok, res.reason = False, f"rel_err {res.rel_err:.3g} > tolerance {tol:.3g}"
        elif res.elem_err > res.elem_tolerance:
            res.ok, res.reason = False, (f"elementwise: an element is {res.elem_err:.3g} noise scales off "
                                         f"(tolerance {res.elem_tolerance:.3g}; rel_err {res.rel_err:.3g})")
        elif res.replica_err > tol:
            res.ok, res.reason = False, (f"replicas on ranks {got.replica_ranks} disagree "
                                         f"(rel {res.replica_err:.3g} > {tol:.3g})")
        results.append(res)
    first = next((r for r in results if not r.ok), None)
    return Comparison("pass" if first is None else "fail", results, first)
