"""The Adam excusal of the comparison (tracer/measure.py walks it; tracer.compare.compare says why).

A post-step `param` element is not judged where this or an earlier step's gradient was within noise
of zero (its update may go either way), or where its error is explained by the candidate's accepted
gradient deviation: times the gain the perturbed runs show (their parameter envelope over their
gradient envelope), or, in Adam's first update from a fresh state (TensorKey.first_update: its eps),
through Adam's own formula (tracer/adam.py): lr x |u(c_g) - u(r_g)|, lr the reference's largest move in
that update, u at the eps the runs' grad-sign replay fitted to the reference's first update
(tracer.compare_inputs.first_update_eps). The perturbed runs' gain is linear and 0 where grad-sign
replay gave them the reference's grad, while near eps a candidate's honest grad moves its first
update by up to 1% of lr (UPDATE_AGREE): clean hf bf16 checks on an Intel Xeon failed so at
1.06-2.46x (docs/tolerance.md, "Known gaps"). A param with fewer than MIN_JUDGED elements left is
excused whole. Excused elements are still bounded (excused_dev, beyond; tracer.judge): never
unconditionally. The masks are causal (built from the steps up to the param's own; measure.py cuts
its chunks so).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tracer import kernels

Key = Any   # a tracer.measure.TensorKey (measure.py imports this module)

MIN_JUDGED = 16   # fewer judged elements: a heavy-tailed figure (noise from 3 runs; docs/tolerance.md)


class Excusal:
    """Per path: the not-judged mask, the last gradient deviation, how far the reference's updates moved it;
    numpy arrays the kernels fill (the torch calls they replaced cost a 16x comparison ~0.1 s of CPU)."""

    def __init__(self, k_elem: float):
        self.k = k_elem
        self.masks: dict[str, np.ndarray] = {}                            # flat bool
        # (candidate, perturbed) |dg|, and the candidate's first-update deviation |u(c) - u(r)|
        self.grad_dev: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.previous: dict[str, np.ndarray] = {}                         # the reference's last param value
        self.updates: dict[str, float] = {}                               # sum over steps of max |update|

    def add(self, path: str, mask: np.ndarray) -> None:
        prev = self.masks.get(path)
        self.masks[path] = mask if prev is None or prev.shape != mask.shape else prev | mask

    def gradient(self, key: Key, r: np.ndarray, c: np.ndarray, env_full: np.ndarray, lo: int,
                 room: float) -> None:
        """A param_grad at flat offset `lo` of the chunk (r, c; env_full the perturbed runs' envelope):
        its elements within noise of zero join the path's mask, its deviations are kept for the param.
        `room` = (noise + unit) x rms(r)."""
        n, eps = key.numel, key.first_update   # Adam's eps where it makes the first update (else 0)
        near, dev, env, upd = np.empty(n, np.bool_), np.empty(n), np.empty(n), np.empty(n if eps else 0)
        kernels.excusal.gradient(r, c, env_full, np.uint64(lo), n, self.k, room, eps, near, dev, env, upd)
        self.add(key.path, near)
        self.grad_dev[key.path] = (dev, env, upd)

    def param(self, key: Key, start: int, r: np.ndarray, c: np.ndarray, runs: int, p_runs: tuple,
              judged: np.ndarray) -> tuple[int, float, int, int, float, float, float]:
        """A post-step param at flat offset `start` of the chunk (r, c; p_runs: `runs` perturbed runs,
        tracer.kernels.runs): its mask updated, judged[start:][:numel] written (1.0 judged, 0.0
        excused). Returns (excused, excused_dev, beyond, beyond_noise, env_max, absmax, updates) as
        TensorStats names them."""
        n, path, none = key.numel, key.path, np.zeros(0)
        before = self.previous.get(path)
        moved = before is not None and before.size == n
        keep = self.previous[path] = np.empty(n, r.dtype)
        dev = self.grad_dev.get(path)
        explain = runs > 0 and dev is not None and dev[0].size == n
        mask = self.masks.get(path)
        known = mask is not None and mask.size == n
        mask = mask if known else np.zeros(n, np.bool_)
        before = before.astype(r.dtype, copy=False) if moved else keep[:0]
        for ex in (explain, False):   # again with the whole mask where too few are left to judge
            first = ex and key.first_update > 0 and dev[2].size == n   # its grad's |u(c) - u(r)| is there
            figures = kernels.excusal.param(
                r, p_runs, runs, c, np.uint64(start), n, mask, dev[0] if ex else none, dev[1] if ex else none,
                dev[2] if ex else none, first, ex, self.k, key.unit, before, keep, judged)
            if not 0 < n - figures[3] < MIN_JUDGED <= n:
                break
            mask[:], known = True, True
        added, env_max, absmax, excused, excused_dev, beyond, beyond_noise, step = figures
        if moved:
            self.updates[path] = self.updates.get(path, 0.0) + step
        if known or added:
            self.masks[path] = mask
        return excused, excused_dev, beyond, beyond_noise, env_max, absmax, self.updates.get(path, math.nan)
