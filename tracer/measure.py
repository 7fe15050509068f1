"""Per-tensor error statistics of the comparison stage, computed on flat chunks of many tensors.

A trace holds thousands of mostly small tensors: judged one at a time, each costs ~100 torch
dispatches whatever its size, and the comparison ran at ~0.1 GB/s. Here consecutive tensors (in the
reference's execution order) are concatenated into flat chunks of about `chunk_elems` elements,
every elementwise formula runs once per chunk, and per-tensor figures come from blocked
reductions (see Blocks). Chunks stay cache-sized, and their temporaries come from the heap
(tracer/heap.py).

The formulas are the per-tensor definitions of `tracer.tolerance` (noise_scale, elem_err, elem_noise,
rel_err, max_err, cosine, rowcol_*); tests/test_measure.py holds the two equal. Elementwise work
runs in the widest dtype of the chunk's inputs (float32 for float32, bf16 and fp8 traces, so
differences of nearby values are exact), sums of squares in float64.

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
from tracer.chunk_pool import default_workers, ordered_map
from tracer.heap import heap_keeps_chunks
from tracer.rowcol import rowcol_figures

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
            workers: int | None = None) -> dict[str, TensorStats]:
    """Figures of every key (in execution order). Each run's tensor is looked up once, chunk by
    chunk in that order, and must have key.numel elements (the caller checks shapes).
    `excused_masks`, if given, receives each parameter path's final excusal mask (flat).
    Chunks are measured on `workers` threads (default: every core, tracer/chunk_pool.py); 1 measures
    them one by one on this thread with torch's own intra-op threads."""
    excusal = _Excusal(k_elem, excused_masks)
    runs = (reference, candidate, *perturbed)
    load = lambda chunk: [{k.name: run[k.name] for k in chunk} for run in runs]
    work = lambda chunk, got: _measure_chunk(chunk, got[0], got[1], got[2:], excusal)
    # A parameter path's excusal state is written by its param_grad and param: measured in order.
    touches = lambda chunk: {k.path for k in chunk if k.kind in ("param_grad", "param")}
    out: dict[str, TensorStats] = {}
    with heap_keeps_chunks():
        for figures in ordered_map(_chunks(keys, chunk_elems), load, work, touches,
                                   default_workers() if workers is None else workers):
            out.update(figures)
    return out


def _measure_chunk(chunk: Sequence[TensorKey], reference: Mapping[str, torch.Tensor],
                   candidate: Mapping[str, torch.Tensor], perturbed: Sequence[Mapping[str, torch.Tensor]],
                   excusal: _Excusal) -> dict[str, TensorStats]:
    names = [k.name for k in chunk]
    wide = any(run[n].dtype == torch.float64 for run in (reference, candidate, *perturbed) for n in names)
    dtype = torch.float64 if wide else torch.float32
    blocks = Blocks([k.numel for k in chunk])
    lengths = torch.tensor(blocks.lens, dtype=torch.float64)
    zero = torch.zeros(len(names), dtype=torch.float64)

    r, c = blocks.flat(reference, names, dtype), blocks.flat(candidate, names, dtype)
    ps = [blocks.flat(p, names, dtype) for p in perturbed]
    d_full = [p - r for p in ps]
    dc_full = c - r   # once: for the figures, the excusal and the row-column metric
    a_full = [d.abs() for d in d_full]
    env_full = max_rows(a_full) if ps else torch.zeros_like(r)

    # Params: update each path's mask with the elements its gradient deviation explains, then
    # judge the elements outside the mask with the figures below, and the excused ones against
    # bounds (excused_dev, beyond; tracer.compare): never unconditionally.
    judged, counts = None, lengths
    params = [(i, k) for i, k in enumerate(chunk) if k.kind == "param"]
    n = len(names)
    excused_dev, env_max, beyond, beyond_noise = [0.0] * n, [0.0] * n, [0] * n, [0] * n
    updates, absmax = [math.nan] * n, [0.0] * n
    if params:
        flat = lambda x: x.view(-1)
        diff_full = flat(dc_full.abs())
        env_flat = flat(env_full)
        loo_full = [flat(x) for x in leave_one_out(a_full)] if len(ps) > 1 else []
        tiny = torch.finfo(dtype).tiny
        judged = torch.ones_like(r, dtype=torch.bool)
        excused = [0.0] * n
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
        keep = lambda x: torch.where(judged, x, 0.0)
        d = [keep(x) for x in d_full]
        a = [x.abs() for x in d]
        env = max_rows(a) if ps else env_full
    else:
        keep = lambda x: x
        d, a, env = d_full, a_full, env_full

    rj = keep(r)
    dc = keep(dc_full)
    adc = dc.abs()
    units = torch.tensor([k.unit for k in chunk], dtype=torch.float64)

    rn2 = blocks.sumsq(rj)
    rn = rn2.sqrt()
    rms = torch.where(counts > 0, rn / counts.clamp_min(1).sqrt(), 0.0)
    r_absmax = blocks.max(rj.abs())
    mag = rj.abs() + blocks.per_block(rms, dtype)
    pn = [blocks.sumsq(x).sqrt() for x in d]
    noise_scl = [torch.where(rn > 0, x / rn.clamp_min(1e-300), 0.0) for x in pn]   # noise_scale's nu
    # Norm-wise errors are relative to ||r|| of the whole tensor (a param's excused elements add no
    # error, but its scale stays the tensor's: relative to the few judged elements of a mostly
    # excused bias, one element's honest move read as 7-16% against a 16-ulp floor), or, for a
    # reference that is exactly zero (a bias at init), to the largest perturbed run's norm:
    # relative to nothing, every perturbed draw would be infinitely far and the tolerance infinite
    # (tracer.compare.reference_norm).
    rn_all = rn if judged is None else blocks.sumsq(r).sqrt()
    rn_eff = torch.where(rn_all > 0, rn_all, max_rows(pn)) if ps else rn_all
    noise = max_rows([ratio(x, rn_eff) for x in pn]) if ps else zero           # max_r rel_err(p_r, r)
    # max_r max_i |p_ri - r_i| = max_i env_i: one reduction for all runs (likewise below)
    max_noise = ratio(blocks.max(env), r_absmax) if ps else zero

    # Leave-one-out elementwise noise of each perturbed run against the others' scale (fmax skips
    # the 0/0 of elements no run moved), then the candidate against all runs' scale.
    elem_noise = zero
    if ps:
        env_loo, nu_loo = leave_one_out(a), leave_one_out(noise_scl)
        worst = None
        for i in range(len(ps)):
            q = a[i] / torch.addcmul(env_loo[i], mag, blocks.per_block(nu_loo[i] + units, dtype))
            worst = q if worst is None else torch.fmax(worst, q)
        elem_noise = blocks.max(no_nan(worst))
    nu = max_rows(noise_scl) if ps else zero
    elem_err = blocks.max(no_nan(adc / torch.addcmul(env, mag, blocks.per_block(nu + units, dtype))))

    dc2 = blocks.sumsq(dc)
    rel = ratio(dc2.sqrt(), rn_eff)
    max_err = ratio(blocks.max(adc), r_absmax)
    # cosine from ||r||, ||c - r|| and r.(c - r): c.r = ||r||^2 + r.dc, ||c||^2 = ||r||^2 + 2 r.dc + ||dc||^2
    r_dc = blocks.dot(rj64 := rj.double(), dc)   # rj in float64 once, for every projection on r
    # Projections on r: a uniform scale error shows in full, honest noise (nearly orthogonal) barely.
    along = lambda x: torch.where(rn2 > 0, x / rn2.clamp_min(1e-300), 0.0)
    scale_err = along(r_dc)
    scale_noise = max_rows([along(blocks.dot(rj64, x)).abs() for x in d]) if ps else zero
    cn = (rn2 + 2 * r_dc + dc2).clamp_min(0).sqrt()
    cos = torch.where((cn == 0) | (rn == 0), (cn == rn).double(), (rn2 + r_dc) / (cn * rn).clamp_min(1e-300))

    # Non-finite values: the sums of squares are finite exactly when the values are, so only a chunk
    # with a non-finite sum (or judged on part of its elements) is counted element by element.
    sums = torch.stack([rn2, dc2, *pn])
    if judged is None and bool(torch.isfinite(sums).all()):
        nonfinite = ref_nonfinite = pert_nonfinite = zero
    else:
        bad = lambda x: blocks.count(~torch.isfinite(x))
        nonfinite, ref_nonfinite = bad(c), bad(r)
        pert_nonfinite = sum((bad(p) for p in ps), zero)

    # param_grad: elements within noise of zero, and the per-element deviations a later param's
    # excusal is measured against (unmasked: a gradient is always judged whole).
    if ps:
        for i, k in enumerate(chunk):
            if k.kind != "param_grad" or not k.numel:
                continue
            sl = blocks.slice(i)
            e = env_full.view(-1)[sl]
            rv = r.view(-1)[sl]
            near_zero = rv.abs() <= excusal.k * (e + (noise[i].item() + k.unit) * rms[i].item())
            # Zero in every run, the candidate too: a deterministic (zero) update, never excused.
            near_zero &= ~((rv == 0) & (e == 0) & (dc_full.view(-1)[sl] == 0))
            excusal.add(k.path, near_zero)
            # a copy, not a view: the chunk's buffers are freed when the chunk is done
            excusal.grad_dev[k.path] = (dc_full.view(-1)[sl].abs(), e.clone())

    rc_err, rc_noise = rowcol_figures([k.rowcol for k in chunk], [k.unit for k in chunk], blocks, r,
                                      dc_full, d_full)
    bits = torch.tensor([1 << r for r in range(len(ps))], dtype=torch.int64)[:, None]
    moved = ((torch.stack(pn) > 0).long() * bits).sum(0).tolist() if ps else [0] * len(chunk)
    rows = torch.stack([rel, max_err, cos, nonfinite, ref_nonfinite, pert_nonfinite, noise, elem_noise,
                        max_noise, elem_err, lengths - counts, scale_err, scale_noise]).tolist()
    return {k.name: TensorStats(rel_err=rows[0][i], max_err=rows[1][i], cosine=rows[2][i],
                                nonfinite=int(rows[3][i]), ref_nonfinite=int(rows[4][i]),
                                perturbed_nonfinite=int(rows[5][i]), noise=rows[6][i],
                                elem_noise=rows[7][i], max_noise=rows[8][i], elem_err=rows[9][i],
                                excused=int(rows[10][i]), moved=moved[i], excused_dev=excused_dev[i],
                                env_max=env_max[i], beyond=beyond[i], beyond_noise=beyond_noise[i],
                                updates=updates[i], absmax=absmax[i], scale_err=rows[11][i],
                                scale_noise=rows[12][i], rowcol_err=rc_err[i], rowcol_noise=rc_noise[i])
            for i, k in enumerate(chunk)}
