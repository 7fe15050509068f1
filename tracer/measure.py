"""Per-tensor error statistics of the comparison stage, computed on flat chunks of many tensors.

A trace holds thousands of mostly small tensors: judged one at a time, each costs ~100 torch
dispatches whatever its size, and the comparison ran at ~0.1 GB/s. Here consecutive tensors (in the
reference's execution order) are concatenated into flat chunks of about `chunk_elems` elements,
every elementwise formula runs once per chunk, and per-tensor figures come from blocked
reductions (see Blocks). Chunks stay cache-sized, and their temporaries come from the heap
(tracer/heap.py).

What needs no candidate is tracer/reference_side.py's: `prepare` computes it ahead for chunks
without a post-step param, and `measure(..., prepared=)` then reads only the candidate there.

The formulas are the per-tensor definitions of `tracer.tolerance` (tests/test_measure.py holds the
two equal). Elementwise work runs in the widest dtype of the chunk's inputs (float32 for float32,
bf16 and fp8 traces: differences of nearby values are exact), sums of squares in float64.

Adam excusal (see `tracer.compare.compare`): a post-step `param` element is not judged where this
or an earlier step's gradient was within noise of zero, or where its error is explained by the
candidate's accepted gradient deviation. The masks are causal (built from the steps up to the
param's own), so chunks are cut such that a param never shares a chunk with an earlier tensor of
the same parameter path that updates its mask.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tracer.blocks import Blocks, leave_one_out, max_rows, no_nan, ratio
from tracer.chunk_pool import default_workers, ordered_map, single_threaded_ops
from tracer.errors import TraceError
from tracer.heap import heap_keeps_chunks
from tracer.reference_side import ReferenceSide, reference_side
from tracer.rowcol import rowcol_err

CHUNK_ELEMS = 1 << 18   # ~1 MB of float32 per run and chunk: stays in cache across the formulas


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


@dataclass(frozen=True)
class TensorKey:
    """What the measurement needs to know of a tensor besides its values."""

    name: str
    kind: str
    path: str             # parameter path (shared by a parameter's param_grad and param entries)
    unit: float           # unit roundoff of the tensor's traced dtype
    numel: int            # elements of the logical tensor
    rowcol: tuple[int, int] | None = None   # (rows, columns) of the row-column metric; None: not judged


class _Excusal:
    """Per parameter path: the accumulated not-judged mask, the latest gradient deviation, and how far
    the reference's own optimizer updates moved it (the scale an update flipped by noise can reach)."""

    def __init__(self, k_elem: float, masks: dict[str, torch.Tensor] | None = None):
        self.k = k_elem
        self.masks: dict[str, torch.Tensor] = {} if masks is None else masks   # flat bool
        self.grad_dev: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # (candidate, perturbed) |dg|
        self.previous: dict[str, torch.Tensor] = {}                       # the reference's last param value
        self.updates: dict[str, float] = {}                               # sum over steps of max |update|

    def add(self, path: str, mask: torch.Tensor) -> None:
        prev = self.masks.get(path)
        self.masks[path] = mask if prev is None or prev.shape != mask.shape else prev | mask


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
    """Figures of every key (in execution order). Each run's tensor is looked up once, chunk by
    chunk in that order, and must have key.numel elements (the caller checks shapes).
    `excused_masks`, if given, receives each parameter path's final excusal mask (flat).
    `prepared`: `prepare`'s reference sides (same keys and runs): a chunk found there reads only the
    candidate. Chunks are measured on `workers` threads (default: every core, tracer/chunk_pool.py)."""
    excusal, prepared = _Excusal(k_elem, excused_masks), prepared or {}

    def load(chunk: list[TensorKey]) -> tuple[ReferenceSide | None, list[Mapping[str, torch.Tensor]]]:
        read = lambda run: {k.name: run[k.name] for k in chunk}
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
                names, blocks = [k.name for k in chunk], Blocks([k.numel for k in chunk])
                dtype = _dtype(names, [reference, *perturbed])
                out[names[0]] = reference_side(names, [k.unit for k in chunk], [k.rowcol for k in chunk],
                                               blocks, dtype, blocks.flat(reference, names, dtype),
                                               [blocks.flat(p, names, dtype) for p in perturbed])
    return out


def _dtype(names: Sequence[str], runs: Sequence[Mapping[str, torch.Tensor]]) -> torch.dtype:
    """The chunk's working dtype: float64 if any run holds a float64 tensor in it, else float32."""
    wide = any(run[n].dtype == torch.float64 for run in runs for n in names)
    return torch.float64 if wide else torch.float32


def _measure_chunk(chunk: Sequence[TensorKey], runs: Sequence[Mapping[str, torch.Tensor]], excusal: _Excusal,
                   side: ReferenceSide | None = None) -> dict[str, TensorStats]:
    """The chunk's figures from runs = (reference, candidate, *perturbed), or the candidate and `side`."""
    names = [k.name for k in chunk]
    reference, candidate, *perturbed = runs
    if side is not None:
        if side.names != tuple(names):
            raise TraceError(f"the prepared reference side of chunk {names[0]!r} does not match the chunk "
                             "(runs or keys changed since it was prepared); compare without it")
        dtype, blocks, r = side.dtype, side.blocks, side.r
        ps: list[torch.Tensor] = []
    else:
        dtype = _dtype(names, [reference, candidate, *perturbed])
        blocks = Blocks([k.numel for k in chunk])
        r = blocks.flat(reference, names, dtype)
        ps = [blocks.flat(p, names, dtype) for p in perturbed]
    lengths = torch.tensor(blocks.lens, dtype=torch.float64)
    c = blocks.flat(candidate, names, dtype)
    dc_full = c - r   # once: for the figures, the excusal and the row-column metric
    if side is None:
        d_full = [p - r for p in ps]
        a_full = [d.abs() for d in d_full]
        env_full = max_rows(a_full) if ps else torch.zeros_like(r)

    # Params (never in a prepared chunk): update each path's mask with the elements its gradient
    # deviation explains, then judge the elements outside the mask with the figures below, and the
    # excused ones against bounds (excused_dev, beyond; tracer.compare): never unconditionally.
    judged, counts = None, lengths
    params = [(i, k) for i, k in enumerate(chunk) if k.kind == "param"]
    n = len(names)
    excused_dev, env_max, beyond, beyond_noise = [0.0] * n, [0.0] * n, [0] * n, [0] * n
    updates, absmax = [math.nan] * n, [0.0] * n
    if params:
        flat = lambda x: x.view(-1)
        diff_full, env_flat = flat(dc_full.abs()), flat(env_full)
        loo_full = [flat(x) for x in leave_one_out(a_full)] if len(ps) > 1 else []
        tiny = torch.finfo(dtype).tiny
        judged, excused = torch.ones_like(r, dtype=torch.bool), [0.0] * n
        for i, k in params:
            sl = blocks.slice(i)
            if k.numel:
                env_max[i] = float(env_flat[sl].max())
            r_abs = (r_now := flat(r)[sl]).abs()
            absmax[i] = float(r_abs.max()) if k.numel else 0.0
            before = excusal.previous.get(k.path)
            if before is not None and before.numel() == k.numel:
                step_max = float((r_now - before.to(dtype)).abs().max()) if k.numel else 0.0
                excusal.updates[k.path] = excusal.updates.get(k.path, 0.0) + step_max
            excusal.previous[k.path] = r_now.clone()
            updates[i] = excusal.updates.get(k.path, math.nan)
            dev = excusal.grad_dev.get(k.path)
            if ps and dev is not None and dev[0].numel() == k.numel:
                c_dg, p_dg = (x.to(dtype) for x in dev)
                gain = torch.where(p_dg > 0, env_flat[sl] / p_dg.clamp_min(tiny), 0.0)
                diff = diff_full[sl]
                excusal.add(k.path, (diff > 0) & (c_dg > 0) & (diff <= excusal.k * gain * c_dg))
            mask = excusal.masks.get(k.path)
            if mask is not None and mask.numel() == k.numel:
                flat(judged)[sl] = ~mask
                excused[i] = float(mask.sum())
                if excused[i]:
                    d_ex = diff_full[sl][mask]
                    excused_dev[i] = float(d_ex.max())
                    # Beyond its own envelope (one ulp of room where no run moved it): honest
                    # candidates do that about as often as a perturbed run does against the others.
                    room = r_abs[mask] * k.unit   # this tensor's elements, not the chunk's
                    beyond[i] = int((d_ex > excusal.k * torch.maximum(env_flat[sl][mask], room)).sum())
                    beyond_noise[i] = max((int((flat(a_full[j])[sl][mask] > excusal.k * torch.maximum(
                        loo[sl][mask], room)).sum()) for j, loo in enumerate(loo_full)), default=0)
        counts = lengths - torch.tensor(excused, dtype=torch.float64)
    if side is None:
        side = reference_side(names, [k.unit for k in chunk], [k.rowcol for k in chunk], blocks, dtype, r, ps,
                              d_full, a_full, judged, counts if judged is not None else None)

    # The candidate against the reference side: every figure over the judged elements.
    dc = dc_full if judged is None else torch.where(judged, dc_full, 0.0)
    adc = dc.abs()
    elem_err = blocks.max(no_nan(adc / torch.addcmul(side.env, side.mag, side.room)))
    dc2 = blocks.sumsq(dc)
    rel = ratio(dc2.sqrt(), side.rn_eff)
    max_err = ratio(blocks.max(adc), side.r_absmax)
    # cosine from ||r||, ||c - r|| and r.(c - r): c.r = ||r||^2 + r.dc, ||c||^2 = ||r||^2 + 2 r.dc + ||dc||^2
    rn2, rn = side.rn2, side.rn
    r_dc = blocks.dot(side.rj.double(), dc)
    # Projections on r: a uniform scale error shows in full, honest noise (nearly orthogonal) barely.
    scale_err = torch.where(rn2 > 0, r_dc / rn2.clamp_min(1e-300), 0.0)
    cn = (rn2 + 2 * r_dc + dc2).clamp_min(0).sqrt()
    cos = torch.where((cn == 0) | (rn == 0), (cn == rn).double(), (rn2 + r_dc) / (cn * rn).clamp_min(1e-300))
    # Non-finite values: ||c - r||^2 is finite exactly when c is (where r is; the reference side counts r)
    zero = torch.zeros(n, dtype=torch.float64)
    finite = judged is None and bool(torch.isfinite(dc2).all())
    nonfinite = zero if finite else blocks.count(~torch.isfinite(c))
    ref_nonfinite = zero if side.ref_nonfinite is None else side.ref_nonfinite
    pert_nonfinite = zero if side.pert_nonfinite is None else side.pert_nonfinite

    # param_grad: elements within noise of zero, and the per-element deviations a later param's
    # excusal is measured against (unmasked: a gradient is always judged whole).
    if side.runs:
        for i, k in enumerate(chunk):
            if k.kind != "param_grad" or not k.numel:
                continue
            sl = blocks.slice(i)
            e = side.env_full.view(-1)[sl]
            rv = r.view(-1)[sl]
            near_zero = rv.abs() <= excusal.k * (e + (side.noise[i].item() + k.unit) * side.rms[i].item())
            # Zero in every run, the candidate too: a deterministic (zero) update, never excused.
            near_zero &= ~((rv == 0) & (e == 0) & (dc_full.view(-1)[sl] == 0))
            excusal.add(k.path, near_zero)
            # a copy, not a view: the chunk's buffers are freed when the chunk is done
            excusal.grad_dev[k.path] = (dc_full.view(-1)[sl].abs(), e.clone())

    (rc_err, own_err), rc, moved = rowcol_err(side.rowcol, blocks, dc_full), side.rowcol, side.moved
    noise, elem_noise, max_noise, scale_noise = side.noise, side.elem_noise, side.max_noise, side.scale_noise
    rows = torch.stack([rel, max_err, cos, nonfinite, ref_nonfinite, pert_nonfinite, noise, elem_noise,
                        max_noise, elem_err, lengths - counts, scale_err, scale_noise]).tolist()
    return {k.name: TensorStats(rel_err=rows[0][i], max_err=rows[1][i], cosine=rows[2][i],
                                nonfinite=int(rows[3][i]), ref_nonfinite=int(rows[4][i]),
                                perturbed_nonfinite=int(rows[5][i]), noise=rows[6][i],
                                elem_noise=rows[7][i], max_noise=rows[8][i], elem_err=rows[9][i],
                                excused=int(rows[10][i]), moved=moved[i], excused_dev=excused_dev[i],
                                env_max=env_max[i], beyond=beyond[i], beyond_noise=beyond_noise[i],
                                updates=updates[i], absmax=absmax[i], scale_err=rows[11][i],
                                scale_noise=rows[12][i], rowcol_err=rc_err[i], rowcol_noise=rc.noise[i],
                                own_err=own_err[i], own_noise=rc.own_noise[i])
            for i, k in enumerate(chunk)}
