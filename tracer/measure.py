"""Per-tensor error statistics of the comparison stage, computed on flat chunks of many tensors.

A trace holds thousands of mostly small tensors: judged one at a time (~100 torch dispatches each)
the comparison ran at ~0.1 GB/s. Here consecutive tensors (in the reference's execution order) are
concatenated into cache-sized flat chunks of about `chunk_elems` elements (tracer/chunk.py), and
compiled kernels (tracer/kernels/) compute every tensor's figures in two passes over a chunk (their
temporaries from tracer/heap.py).

What needs no candidate is tracer/reference_side.py's: `prepare` computes it ahead for chunks
without a post-step param, and `measure(..., prepared=)` then reads only the candidate there.

The formulas are the per-tensor definitions of `tracer.tolerance` (tests/test_measure.py holds the
two equal). Elementwise work runs in the widest dtype of the chunk's inputs (float32 for float32,
bf16 and fp8 traces: differences of nearby values are exact), sums of squares in float64.

Adam excusal (tracer/excusal.py): some elements of a post-step `param` are not judged like the
others. Its masks are causal (built from the steps up to the param's own): chunks are cut such that a
param never shares a chunk with an earlier tensor of the same parameter path that updates its mask.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from tracer import kernels
from tracer.chunk import ChunkLayout
from tracer.chunk_pool import default_workers, ordered_map, single_threaded_ops
from tracer.errors import TraceError
from tracer.excusal import Excusal
from tracer.heap import heap_keeps_chunks
from tracer.reference_side import ReferenceSide, reference_side

CHUNK_ELEMS = 1 << 18   # ~1 MB of float32 per run and chunk: stays in cache across the formulas
Run = Mapping[str, torch.Tensor] | torch.Tensor   # a run's tensors of a chunk, or the chunk already flat


@dataclass
class TensorStats:
    """One tensor's figures (before tolerances, which pool noise over tensors)."""

    rel_err: float        # ||c - r|| / ||r|| over judged elements
    max_err: float        # max |c - r| / max |r|
    cosine: float
    nonfinite: int        # non-finite candidate values (all elements)
    ref_nonfinite: int    # non-finite values in the reference, then in any perturbed run
    perturbed_nonfinite: int
    noise: float          # max_r rel_err(p_r, r)
    elem_noise: float     # max_r leave-one-out elem_err(p_r)
    max_noise: float      # max_r max_err(p_r, r)
    elem_err: float       # max_i |c_i - r_i| / noise scale_i
    excused: int          # param elements left out of the figures above (Adam excusal)
    moved: int = 0        # bit r set: perturbed run r differs from the reference in this tensor
    scale_err: float = 0.0     # <c - r, r> / ||r||^2 (tracer.tolerance.projection), judged elements
    scale_noise: float = 0.0   # max_r |<p_r - r, r>| / ||r||^2
    scale_mean: float = 0.0    # mean_r <p_r - r, r> / ||r||^2
    scale_spread: float = 0.0  # max_r minus min_r of <p_r - r, r> / ||r||^2
    # Excused elements are still bounded (tracer.compare judges these):
    excused_dev: float = 0.0   # largest |c_i - r_i| among the excused elements
    env_max: float = 0.0       # largest |p_r,i - r_i| of any perturbed run, any element (params)
    updates: float = math.nan  # sum over the steps so far of the reference's largest update of this
                               # parameter (nan: its initial value is not in the trace)
    absmax: float = 0.0        # largest |r_i| of a parameter (one ulp of room for its bound)
    beyond: int = 0            # excused elements beyond k_elem x their perturbed envelope
    beyond_noise: int = 0      # the same count for each perturbed run against the others (max over runs)
    rowcol_err: float = 0.0    # max_i |c_i - r_i| / row-column noise scale_i (tracer/rowcol.py)
    rowcol_noise: float = 0.0  # max_r leave-one-out rowcol_err(p_r)
    own_err: float = 0.0       # the same in units of a row-column noise fitted to c - r itself
    own_noise: float = 0.0     # max_r own_err(p_r)


class TensorKey(NamedTuple):
    """What the measurement needs to know of a tensor besides its values (a tuple: a 16x comparison
    makes 6,113 of them before its walk)."""

    name: str
    kind: str
    path: str             # parameter path (shared by a parameter's param_grad and param entries)
    unit: float           # unit roundoff of the tensor's traced dtype
    numel: int            # elements of the logical tensor
    rowcol: tuple[int, int] | None = None   # (rows, columns) of the row-column metric; None: not judged
    # A param_grad or post-step param of Adam's first update from a fresh state: its eps (excusal.py); 0: not
    first_update: float = 0.0


def _chunks(keys: Sequence[TensorKey], chunk_elems: int) -> list[list[TensorKey]]:
    """Consecutive keys, ~chunk_elems elements each; a param starts a new chunk if its path's mask was
    updated (by its param_grad or an earlier step's param) within the current chunk."""
    out: list[list[TensorKey]] = []
    cur: list[TensorKey] = []
    size, written = 0, set()
    for k in keys:
        n = k.numel
        if cur and (size + n > chunk_elems or (k.kind == "param" and k.path in written)):
            out.append(cur)
            cur, size, written = [], 0, set()
        cur.append(k)
        size += n
        if k.kind in ("param_grad", "param"):
            written.add(k.path)
    return out + [cur] if cur else out


def measure(keys: Sequence[TensorKey], reference: Mapping[str, torch.Tensor],
            candidate: Mapping[str, torch.Tensor], perturbed: Sequence[Mapping[str, torch.Tensor]],
            k_elem: float, chunk_elems: int = CHUNK_ELEMS,
            excused_masks: dict[str, torch.Tensor] | None = None,
            workers: int | None = None, prepared: Mapping[str, ReferenceSide] | None = None
            ) -> dict[str, TensorStats]:
    """Figures of every key (in execution order). Each run's tensors are read once, chunk by chunk in
    that order (looked up one by one, or a stored single-rank run's chunk as one view of its part),
    and must have key.numel elements (the caller checks shapes).
    `excused_masks`, if given, receives each parameter path's final excusal mask (flat).
    `prepared`: `prepare`'s reference sides (same keys and runs): a chunk found there reads only the
    candidate. Chunks are measured on `workers` threads (default: every core, tracer/chunk_pool.py)."""
    excusal, prepared = Excusal(k_elem), prepared or {}

    def load(chunk: list[TensorKey]) -> tuple[ReferenceSide | None, list[Run]]:
        names = [k.name for k in chunk]

        def read(run: Mapping[str, torch.Tensor]) -> Run:
            flat = _span(run, names)
            return flat if flat is not None else {n: run[n] for n in names}

        got, side = read(candidate), prepared.get(chunk[0].name)
        # A candidate tensor in float64 (partial sums, a scaled record) widens the chunk: measured whole.
        if side is not None and (side.dtype == torch.float64 or _dtype(side.names, [got]) == side.dtype):
            return side, [{}, got]
        return None, [read(reference), got, *map(read, perturbed)]

    work = lambda chunk, loaded: _measure_chunk(chunk, loaded[1], excusal, loaded[0])
    # A parameter path's excusal state is written by its param_grad and param: measured in order.
    touches = lambda chunk: {k.path for k in chunk if k.kind in ("param_grad", "param")}
    out: dict[str, TensorStats] = {}
    with heap_keeps_chunks():
        for figures in ordered_map(_chunks(keys, chunk_elems), load, work, touches,
                                   default_workers() if workers is None else workers):
            out.update(figures)
    if excused_masks is not None:
        excused_masks.update({path: torch.from_numpy(m) for path, m in excusal.masks.items()})
    return out


def prepare(keys: Sequence[TensorKey], reference: Mapping[str, torch.Tensor],
            perturbed: Sequence[Mapping[str, torch.Tensor]], chunk_elems: int = CHUNK_ELEMS
            ) -> dict[str, ReferenceSide]:
    """The reference side (tracer/reference_side.py) of every chunk without a post-step parameter,
    keyed by the chunk's first tensor: what `measure` needs of the runs besides the candidate."""
    out = {}
    with single_threaded_ops():   # a background thread's work (orchestrator/prefetch.py): one core
        for chunk in _chunks(keys, chunk_elems) if perturbed else []:
            if not any(k.kind == "param" for k in chunk):
                names, layout = [k.name for k in chunk], ChunkLayout([k.numel for k in chunk])
                dtype = _dtype(names, [reference, *perturbed])
                out[names[0]] = reference_side(names, [k.unit for k in chunk], [k.rowcol for k in chunk],
                                               layout, dtype, layout.flat(reference, names, dtype),
                                               [layout.flat(p, names, dtype) for p in perturbed])
    return out


def _span(run: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor | None:
    """The chunk of a stored run as one view, where it lies back to back (compare_inputs.span)."""
    span = getattr(run, "span", None)
    return span(names) if span is not None else None


def _dtype(names: Sequence[str], runs: Sequence[Run]) -> torch.dtype:
    """The chunk's working dtype: float64 if any run holds a float64 tensor in it, else float32."""
    wide = lambda run: (run.dtype == torch.float64 if isinstance(run, torch.Tensor)
                        else any(run[n].dtype == torch.float64 for n in names))
    return torch.float64 if any(map(wide, runs)) else torch.float32


def _measure_chunk(chunk: Sequence[TensorKey], runs: Sequence[Run], excusal: Excusal,
                   side: ReferenceSide | None = None) -> dict[str, TensorStats]:
    """The chunk's figures from runs = (reference, candidate, *perturbed), or the candidate and `side`."""
    names = [k.name for k in chunk]
    reference, candidate, *perturbed = runs
    if side is not None:
        if side.names != tuple(names):
            raise TraceError(f"the prepared reference side of chunk {names[0]!r} does not match the chunk "
                             "(runs or keys changed since it was prepared); compare without it")
        dtype, layout, r = side.dtype, side.layout, side.r
    else:
        dtype = _dtype(names, [reference, candidate, *perturbed])
        layout = ChunkLayout([k.numel for k in chunk])
        r = layout.flat(reference, names, dtype)
        ps = [layout.flat(p, names, dtype) for p in perturbed]
    c = layout.flat(candidate, names, dtype)
    n, r_np, c_np = len(names), r.numpy(), c.numpy()

    # Params (never in a prepared chunk): update each path's mask with the elements its gradient
    # deviation explains, then judge the elements outside the mask with the figures below, and the
    # excused ones against bounds (excused_dev, beyond; tracer.compare): never unconditionally.
    params, judged = [(i, k) for i, k in enumerate(chunk) if k.kind == "param"], None
    excused, excused_dev, env_max, beyond, beyond_noise = [0] * n, [0.0] * n, [0.0] * n, [0] * n, [0] * n
    updates, absmax = [math.nan] * n, [0.0] * n
    if params:
        judged = np.ones(layout.size)   # 1.0 / 0.0 per element (the kernels' form), written per param
        p_runs = kernels.runs([p.numpy() for p in ps], r_np)
        for i, k in params:
            (excused[i], excused_dev[i], beyond[i], beyond_noise[i], env_max[i], absmax[i],
             updates[i]) = excusal.param(k, layout.slice(i).start, r_np, c_np, len(ps), p_runs, judged)
    if side is None:
        side = reference_side(names, [k.unit for k in chunk], [k.rowcol for k in chunk], layout, dtype, r, ps,
                              judged)

    # The candidate against the reference side: every figure over the judged elements.
    rc = side.rowcol
    dc2, dc_max, r_dc, elem_err, nonfinite, rc_err, own_err = kernels.candidate(
        c_np, r_np, side.env.numpy(), side.judged, layout.starts, layout.lengths,
        side.units, side.rms, side.nu, rc.rows, rc.cols, rc.a_off, rc.c_off, rc.a_all, rc.cf_all, rc.rms)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = _ratio(np.sqrt(dc2), side.rn_eff)
        max_err = _ratio(dc_max, side.r_absmax)
        # Projections on r: a uniform scale error shows in full, honest noise (nearly orthogonal) barely.
        rn2 = side.rn2
        scale_err = np.where(rn2 > 0, r_dc / np.maximum(rn2, 1e-300), 0.0)
        # cosine from ||r||, ||c - r|| and r.dc: c.r = ||r||^2 + r.dc, ||c||^2 = ||r||^2 + 2 r.dc + ||dc||^2
        rn, cn = np.sqrt(rn2), np.sqrt(np.maximum(rn2 + 2 * r_dc + dc2, 0.0))
        cos = np.where((cn == 0) | (rn == 0), (cn == rn).astype(np.float64),
                       (rn2 + r_dc) / np.maximum(cn * rn, 1e-300))

    # param_grad: elements within noise of zero, and the per-element deviations a later param's
    # excusal is measured against (unmasked: a gradient is always judged whole).
    env_full = side.env_full.numpy()
    if side.runs:
        for i, k in enumerate(chunk):
            if k.kind != "param_grad" or not k.numel:
                continue
            room = float((side.noise[i] + k.unit) * side.rms[i])
            excusal.gradient(k, r_np, c_np, env_full, layout.offsets[i], room)

    # Plain floats and ints per tensor (tolist, not float() per element: 6,113 tensors at 16x).
    (rel, max_err, cos, elem_err, scale_err, rc_err, own_err, noise, elem_noise, max_noise, scale_noise,
     scale_mean, scale_spread, rc_noise, own_noise) = (a.tolist() for a in (
        rel, max_err, cos, elem_err, scale_err, rc_err, own_err, side.noise, side.elem_noise, side.max_noise,
        side.scale_noise, side.scale_mean, side.scale_spread, rc.noise, rc.own_noise))
    nonfinite, ref_nf, pert_nf = (np.asarray(a).astype(np.int64).tolist()
                                  for a in (nonfinite, side.ref_nonfinite, side.pert_nonfinite))
    return {k.name: TensorStats(rel_err=rel[i], max_err=max_err[i], cosine=cos[i], nonfinite=nonfinite[i],
                                ref_nonfinite=ref_nf[i], perturbed_nonfinite=pert_nf[i], noise=noise[i],
                                elem_noise=elem_noise[i], max_noise=max_noise[i], elem_err=elem_err[i],
                                excused=excused[i], moved=side.moved[i], excused_dev=excused_dev[i],
                                env_max=env_max[i], beyond=beyond[i], beyond_noise=beyond_noise[i],
                                updates=updates[i], absmax=absmax[i], scale_err=scale_err[i],
                                scale_noise=scale_noise[i], scale_mean=scale_mean[i],
                                scale_spread=scale_spread[i], rowcol_err=rc_err[i], rowcol_noise=rc_noise[i],
                                own_err=own_err[i], own_noise=own_noise[i]) for i, k in enumerate(chunk)}


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den per tensor with 0/x = 0 and x/0 = inf (the per-tensor definitions' conventions)."""
    return np.where(num == 0, 0.0, np.where(den > 0, num / np.where(den > 0, den, 1.0), math.inf))
