"""The chunked comparison (tracer.measure) equals the per-tensor definitions it vectorizes."""

import math

import pytest
import torch

from tracer.adam import ADAM_EPS, first_update
from tracer.errors import TraceError
from tracer.excusal import MIN_JUDGED
from tracer.kernels.loops import TILE as BLOCK  # a tile boundary of the compiled kernels
from tracer.measure import TensorKey, measure, prepare
from tracer.tolerance import (
    cosine,
    elem_err,
    elem_noise,
    max_err,
    noise_scale,
    own_err,
    projection,
    reference_norm,
    rel_err,
    rowcol_err,
    rowcol_noise,
    rowcol_shape,
)

K_ELEM = 6.0
U = 2.0**-24


def _beyond(dev, env, r, unit):
    """How many elements are beyond K_ELEM x their envelope (one ulp of room where nothing moved)."""
    return int((dev > K_ELEM * torch.maximum(env, r.abs() * unit)).sum())


def _others(ps, j, r):
    """The envelope of every perturbed run but run j."""
    return torch.stack([(q - r).abs() for i, q in enumerate(ps) if i != j]).amax(0)


def _oracle(keys, ref, cand, perts):
    """One tensor at a time, in float64, straight from the definitions (causal Adam excusal)."""
    masks, grad_dev, out, previous, updates = {}, {}, {}, {}, {}

    def add(path, m):
        masks[path] = m if path not in masks else masks[path] | m

    for k in keys:
        r, c = ref[k.name].double().flatten(), cand[k.name].double().flatten()
        ps = [p[k.name].double().flatten() for p in perts]
        if k.kind == "param" and k.path in grad_dev and ps:
            c_dg, p_dg, c_upd = grad_dev[k.path]
            dp = torch.stack([(p - r).abs() for p in ps]).amax(0)
            gain = torch.where(p_dg > 0, dp / p_dg, torch.zeros_like(dp))
            diff = (c - r).abs()
            explained = (c_dg > 0) & (diff <= K_ELEM * gain * c_dg)
            if k.first_update and k.path in previous:   # through Adam's first update (tracer/adam.py)
                explained |= diff <= K_ELEM * float((r - previous[k.path]).abs().max()) * c_upd
            add(k.path, (diff > 0) & explained)
        full_c, extra = c, {}
        if k.kind == "param":
            if k.path in previous:   # the reference's own updates, summed over the steps so far
                updates[k.path] = updates.get(k.path, 0.0) + float((r - previous[k.path]).abs().max())
            previous[k.path] = r
            extra["updates"] = updates.get(k.path, math.nan)
            extra["absmax"] = float(r.abs().max()) if r.numel() else 0.0
            if ps:
                env = torch.stack([(p - r).abs() for p in ps]).amax(0)
                extra["env_max"] = float(env.max()) if r.numel() else 0.0
        if k.kind == "param" and k.path in masks:
            m = masks[k.path]
            if 0 < m.numel() - int(m.sum()) < MIN_JUDGED <= m.numel():   # too few left: excused whole
                m = masks[k.path] = torch.ones_like(m)
            if m.any():   # the excused elements' bounds: largest move, and counts beyond the envelope
                extra["excused_dev"] = float((c - r).abs()[m].max())
                if ps:
                    extra["beyond"] = _beyond((c - r).abs()[m], env[m], r[m], k.unit)
                    noise = [_beyond((p - r).abs()[m], _others(ps, j, r)[m], r[m], k.unit)
                             for j, p in enumerate(ps)] if len(ps) > 1 else [0]
                    extra["beyond_noise"] = max(noise)
            keep = ~m
            norm = reference_norm(r, ps)   # the whole tensor's: excused elements add no error
            r, c, ps = r[keep], c[keep], [p[keep] for p in ps]
        else:
            norm = reference_norm(r, ps)
        nu = max((rel_err(p, r, norm) for p in ps), default=0.0)
        along = [projection(p, r) for p in ps]
        out[k.name] = extra | {
            "scale_err": projection(c, r),
            "scale_noise": max((abs(projection(p, r)) for p in ps), default=0.0),
            "scale_mean": sum(along) / len(along) if along else 0.0,
            "scale_spread": max(along) - min(along) if along else 0.0,
            "rel_err": rel_err(c, r, norm), "max_err": max_err(c, r), "cosine": cosine(c, r),
            "nonfinite": int((~torch.isfinite(full_c)).sum()), "noise": nu,
            "elem_noise": max(elem_noise(ps, r, k.unit), default=0.0),
            "max_noise": max((max_err(p, r) for p in ps), default=0.0),
            "elem_err": elem_err(c, r, noise_scale(ps, r, k.unit)), "excused": full_c.numel() - c.numel()}
        if k.rowcol:   # on the tensor's (rows, columns) view
            rv, pv = r.view(k.rowcol), [p.view(k.rowcol) for p in ps]
            out[k.name]["rowcol_err"] = rowcol_err(full_c.view(k.rowcol), rv, pv, k.unit)
            out[k.name]["rowcol_noise"] = max(rowcol_noise(pv, rv, k.unit), default=0.0)
            if ps:
                out[k.name]["own_err"] = own_err(full_c.view(k.rowcol) - rv, rv, k.unit)
                out[k.name]["own_noise"] = max(own_err(p - rv, rv, k.unit) for p in pv)
        if k.kind == "param_grad" and ps and r.numel():
            env = torch.stack([(p - r).abs() for p in ps]).amax(0)
            near = r.abs() <= K_ELEM * (env + (nu + k.unit) * r.square().mean().sqrt())
            add(k.path, near & ~((r == 0) & (env == 0) & (c == r)))   # exact zeros in every run: judged
            grad_dev[k.path] = ((c - r).abs(), env,
                                (first_update(c, k.first_update) - first_update(r, k.first_update)).abs()
                                if k.first_update else None)
    return out


def _traces(n_perturbed: int):
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g)
    sizes = {"a/output": (0,), "b/output": (1,), "c/output": (BLOCK - 1,), "d/output": (BLOCK,),
             "e/output": (3, BLOCK + 1), "zero/output": (40,), "big/output": (50, 70),
             "rc/output": (2, 16, 24)}
    keys, ref = [], {}
    for name, shape in sizes.items():
        t = torch.zeros(shape) if name.startswith("zero") else rnd(*shape)
        keys.append(TensorKey(f"0/0/{name}", "output", name, U, t.numel(), rowcol_shape(shape)))
        ref[keys[-1].name] = t
    for step in range(2):   # a parameter over two steps: its gradient, then its post-step value
        for kind in ("param_grad", "param"):
            # step 1's param is its first move (step 0's, untraced before it, is not): judged as Adam's
            # first update (at an eps of a clipped update), its figures equal to the definitions' too
            keys.append(TensorKey(f"{step}/-/w/{kind}", kind, "w", U, 300, rowcol_shape((10, 30), kind),
                                  first_update=1.1e-7 if step == 1 else 0.0))
            t = rnd(300) * (1e-3 if kind == "param_grad" else 1.0)
            t[::7] *= 1e-6   # gradient elements within noise of zero: excused at the param
            ref[keys[-1].name] = t
    noise = lambda t, s: t + s * t.abs().clamp_min(1e-3) * rnd(*t.shape)
    perts = [{n: noise(t, 1e-6) for n, t in ref.items()} for _ in range(n_perturbed)]
    cand = {n: noise(t, 2e-6) for n, t in ref.items()}
    for run in (ref, cand, *perts):   # gradient elements exactly zero in every run: never excused
        for step in range(2):
            run[f"{step}/-/w/param_grad"][3::11] = 0.0
    # ... except where the candidate's is not (an exact cancellation its rounding missed: within noise)
    cand["0/-/w/param_grad"][3:300:22] = 1e-12
    cand["0/0/e/output"][1, 5] = float("nan")        # counted, and kept out of the other figures
    cand["0/0/big/output"][7, 3] += 1.0              # one corrupted element
    excused = [i for i in range(0, 300, 7) if (i - 3) % 11]   # near-zero grads, not exact zeros
    cand["1/-/w/param"][excused] += 0.5              # error only on excused elements
    return keys, ref, cand, perts


@pytest.mark.parametrize("n_perturbed", [0, 1, 3])
@pytest.mark.parametrize("chunk_elems", [200, 1 << 18])
@pytest.mark.parametrize("wide", [False, True])
def test_chunked_figures_equal_the_per_tensor_definitions(n_perturbed, chunk_elems, wide):
    """`wide`: the candidate's tensors in float64 (partial sums, scaled records) widen their chunks."""
    keys, ref, cand, perts = _traces(n_perturbed)
    if wide:
        cand = {n: t.double() for n, t in cand.items()}
    got = measure(keys, ref, cand, perts, K_ELEM, chunk_elems=chunk_elems)
    want = _oracle(keys, ref, cand, perts)
    for k in keys:
        for field, w in want[k.name].items():
            g = getattr(got[k.name], field)
            if isinstance(w, float) and math.isnan(w):
                assert math.isnan(g), (k.name, field)
            else:
                assert g == pytest.approx(w, rel=1e-5, abs=1e-12), (k.name, field, g, w)
    if n_perturbed:   # the excusal did something, and the injected faults show
        assert got["1/-/w/param"].excused > 0 and got["1/-/w/param"].rel_err < 1e-3
        assert got["1/-/w/param"].excused_dev == pytest.approx(0.5, rel=1e-3)   # ... but stays measured
        assert got["1/-/w/param"].beyond > 4 * (got["1/-/w/param"].beyond_noise + 1)
        # Gradients exactly zero in every run (every 11th element) give a deterministic update: judged;
        # where the candidate's is not zero (every 22nd), its update is its own rounding's: excused.
        zeros, cand_moved = set(range(3, 300, 11)), set(range(3, 300, 22))
        assert got["0/-/w/param"].excused <= 300 - len(zeros - cand_moved)
        assert got["0/-/w/param"].excused >= len(cand_moved)
        assert got["0/0/big/output"].elem_err > 1e3
        if n_perturbed > 1:
            assert got["0/0/big/output"].rowcol_err > 1e3 > got["0/0/rc/output"].rowcol_err > 0
            assert got["0/0/rc/output"].rowcol_noise > 0 and got["0/0/e/output"].rowcol_err == 0   # 3 rows
            assert got["0/0/big/output"].own_err > 1e3 > got["0/0/rc/output"].own_err > 0
            assert got["0/0/rc/output"].own_noise > 0 and got["0/0/e/output"].own_err == 0
    assert got["0/0/e/output"].nonfinite == 1


def test_non_finite_reference_and_perturbed_values_are_counted():
    keys, ref, cand, perts = _traces(2)
    ref["0/0/d/output"][3] = float("inf")
    perts[1]["0/0/c/output"][0] = float("nan")
    ref["0/0/rc/output"][1, 2, 3] = float("nan")
    got = measure(keys, ref, cand, perts, K_ELEM)
    assert got["0/0/d/output"].ref_nonfinite == 1
    assert got["0/0/c/output"].perturbed_nonfinite == 1
    assert got["0/0/b/output"].ref_nonfinite == got["0/0/b/output"].perturbed_nonfinite == 0
    # A NaN in the reference is its largest |r| (the kernels' running maxima skip NaN, then restore it):
    # max_err of the candidate and of every perturbed run is inf, as tracer.tolerance.max_err defines it.
    rc = "0/0/rc/output"
    assert got[rc].ref_nonfinite == 1 and got[rc].max_err == max_err(cand[rc], ref[rc]) == math.inf
    assert got[rc].max_noise == max(max_err(p[rc], ref[rc]) for p in perts) == math.inf


def test_chunks_measured_on_threads_give_the_figures_of_the_walk_in_order():
    """Chunks on several threads (tracer/chunk_pool.py), the excusal state shared along parameter
    paths, give exactly the figures of measuring the chunks one by one."""
    keys, ref, cand, perts = _traces(3)
    masks_seq, masks_par = {}, {}
    seq = measure(keys, ref, cand, perts, K_ELEM, chunk_elems=200, workers=1, excused_masks=masks_seq)
    par = measure(keys, ref, cand, perts, K_ELEM, chunk_elems=200, workers=4, excused_masks=masks_par)
    assert seq["1/-/w/param"].excused > 0
    _assert_identical(seq, par, masks_seq, masks_par)


def _assert_identical(want, got, want_masks, got_masks):
    """Every figure of every tensor equal (NaN where NaN), and the same final excusal masks."""
    assert want.keys() == got.keys()
    for name in want:
        for field, a in vars(want[name]).items():
            b = getattr(got[name], field)
            assert a == b or (math.isnan(a) and math.isnan(b)), (name, field, a, b)
    assert want_masks.keys() == got_masks.keys()
    assert all(torch.equal(want_masks[p], got_masks[p]) for p in want_masks)


class _Reads(dict):
    """A run's tensors, remembering which were looked up."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen: set[str] = set()

    def __getitem__(self, name):
        self.seen.add(name)
        return super().__getitem__(name)


@pytest.mark.parametrize("n_perturbed", [1, 3])
@pytest.mark.parametrize("chunk_elems", [200, 5000])
@pytest.mark.parametrize("wide", [False, True])
def test_a_reference_side_prepared_before_the_candidate_gives_the_same_figures_bit_for_bit(n_perturbed,
                                                                                          chunk_elems, wide):
    """tracer/reference_side.py: chunks without a post-step param are prepared from the reference
    set alone; measured against them, only the candidate is read there, and every figure (the
    excusal state carried to later params included) is what measuring everything gives. A candidate
    tensor in float64 (`wide`: partial sums, a scaled record) makes its chunk float64: measured whole."""
    keys, ref, cand, perts = _traces(n_perturbed)
    cand["0/0/rc/output"][1, 3, 5] *= 1.5   # a row-column outlier in a prepared chunk
    if wide:
        cand["0/0/big/output"] = cand["0/0/big/output"].double()
    want_masks, got_masks = {}, {}
    want = measure(keys, ref, cand, perts, K_ELEM, chunk_elems=chunk_elems, excused_masks=want_masks)
    prepared = prepare(keys, ref, perts, chunk_elems)
    plain = {n for side in prepared.values() for n in side.names}
    assert plain and not any(k.kind == "param" for k in keys if k.name in plain)
    assert any(k.kind == "param_grad" for k in keys if k.name in plain) or chunk_elems == 5000
    reads = _Reads(ref)
    got = measure(keys, reads, cand, perts, K_ELEM, chunk_elems=chunk_elems, excused_masks=got_masks,
                  prepared=prepared)
    big = next(side.names for side in prepared.values() if "0/0/big/output" in side.names)
    # the prepared chunks read only the candidate; a widened one reads every run
    assert reads.seen & plain == (set(big) if wide else set())
    _assert_identical(want, got, want_masks, got_masks)
    assert got["0/0/rc/output"].rowcol_err > 10 and got["0/0/e/output"].nonfinite == 1


def test_a_prepared_side_of_other_chunks_is_an_error_not_a_silent_mix():
    keys, ref, cand, perts = _traces(2)
    prepared = prepare(keys, ref, perts, 200)
    first = next(iter(prepared))
    prepared[first] = prepare(keys[1:], ref, perts, 200)[keys[1].name]   # another chunking
    with pytest.raises(TraceError, match="prepared reference side"):
        measure(keys, ref, cand, perts, K_ELEM, chunk_elems=200, prepared=prepared, workers=1)


def _norm_weight(shift_judged: float, shift_all: float):
    """A 64-element weight over one step: its grad within noise of zero but at 4 elements, then its
    post-step value, the candidate off by `shift_judged` at those 4 and by `shift_all` everywhere."""
    g = torch.Generator().manual_seed(1)
    keys = [TensorKey(f"0/-/n/{kind}", kind, "n", U, 64) for kind in ("param_grad", "param")]
    grad = torch.randn(64, generator=g) * 1e-9
    grad[:4] = 1.0
    w = 1.0 + 0.1 * torch.randn(64, generator=g)
    ref = {keys[0].name: grad, keys[1].name: w}
    move = lambda s: {keys[0].name: grad + 1e-9 * torch.randn(64, generator=g), keys[1].name: w + s}
    perts = [move(1e-5 * torch.randn(64, generator=g)) for _ in range(3)]
    cand = {keys[0].name: grad.clone(), keys[1].name: w.clone() + shift_all}
    cand[keys[1].name][:4] += shift_judged
    return keys, ref, cand, perts


def test_a_param_with_too_few_elements_left_to_judge_is_excused_whole_and_still_bounded():
    """60 of 64 elements excused (their grads within noise of zero): a norm over the 4 left, its noise
    from 3 runs, is heavy-tailed, so the param is excused whole (clean bf16 norm weights failed on 2-6
    judged elements at up to 2x); its elements stay bounded: a move of every element beyond the
    perturbed runs' envelope is still counted."""
    keys, ref, cand, perts = _norm_weight(shift_judged=1e-3, shift_all=0.0)
    got = measure(keys, ref, cand, perts, K_ELEM)["0/-/n/param"]
    assert 4 < MIN_JUDGED and got.excused == 64 and got.rel_err == 0.0 and got.elem_err == 0.0
    assert got.excused_dev == pytest.approx(1e-3, rel=1e-3)   # measured, for the bound on excused moves
    keys, ref, cand, perts = _norm_weight(shift_judged=0.0, shift_all=1e-3)
    got = measure(keys, ref, cand, perts, K_ELEM)["0/-/n/param"]
    assert got.excused == 64 and got.beyond == 64 > K_ELEM * (got.beyond_noise + 1 + 64 / 2048)


def _adam_first_step(key_eps: float, moved_more: float = 0.0, eps: float = ADAM_EPS,
                     near: tuple[float, float] = (-8.6e-6, -9.5e-7), given_up: bool = False):
    """A weight's initial value, grad and Adam's first update (lr 1e-3, fresh state: lr x u(g) at `eps`,
    tracer/adam.py) in the reference, 3 perturbed runs and the candidate; the keys say it is a first
    update at `key_eps` (0: not one). Grads 0.1% apart, except element 5, near eps, where the
    candidate's own grad (by default -9.5e-7 against the reference's -8.6e-6, the same sign; kept by
    grad-sign replay, its update 0.92% of lr off) moves its first update 9e-6 and the perturbed runs'
    (within 0.35% of the reference's grad: 3e-4 of lr at most) far less: a clean hf bf16 tp2 check's
    element on an Intel Xeon (seed 315). `moved_more`: the candidate's element 9 (a grad of 2e-3: an
    update of lr whatever the rounding) moved that much beside its update, as a bug would. `given_up`: the
    perturbed runs' element 5 took the reference's grad (their replay found theirs too far off)."""
    g = torch.Generator().manual_seed(7)
    w0 = 0.02 * torch.randn(256, generator=g)
    grad = 1e-3 * torch.randn(256, generator=g)
    grad[5], grad[9] = near[0], 2e-3
    keys = [TensorKey("-1/-/w/param", "param", "w", U, 256),
            TensorKey("0/-/w/param_grad", "param_grad", "w", U, 256, first_update=key_eps),
            TensorKey("0/-/w/param", "param", "w", U, 256, first_update=key_eps)]

    def run(own: torch.Tensor) -> dict[str, torch.Tensor]:
        w = (w0.double() - 1e-3 * first_update(own.double(), eps)).float()
        return dict(zip([k.name for k in keys], (w0, own, w), strict=True))

    noisy = lambda: grad * (1 + 1e-3 * torch.randn(256, generator=g))
    ref = run(grad)
    perts = []
    for f in (1.0, 1.0, 1.0) if given_up else (1.0, 0.9965, 1.0035):   # the perturbed runs' at element 5
        own = noisy()
        own[5] = near[0] * f
        perts.append(run(own))
    own = noisy()
    own[5] = near[1]
    cand = run(own)
    cand["0/-/w/param"][9] += moved_more
    return keys, ref, cand, perts


def test_a_first_update_its_own_grad_moved_through_adams_eps_is_excused_and_a_move_beyond_it_is_not():
    """Adam's first update from a fresh state (TensorKey.first_update, tracer/excusal.py): the candidate's
    deviation at element 5 is what its own grad makes of the update (lr x |u(c_g) - u(r_g)|), 30x
    the perturbed runs' envelope: excused (and measured: excused_dev). Without the first-update rule,
    it is judged: far beyond its noise scale. A move of element 9, whose grad moves no update, is not
    excused by it."""
    keys, ref, cand, perts = _adam_first_step(ADAM_EPS)
    got = measure(keys, ref, cand, perts, K_ELEM)["0/-/w/param"]
    assert got.excused >= 1 and got.excused_dev == pytest.approx(9.2e-6, rel=0.05)
    assert got.elem_err < 4.0   # floor_elem, the least elementwise tolerance: passes
    keys, ref, cand, perts = _adam_first_step(0.0)
    without = measure(keys, ref, cand, perts, K_ELEM)["0/-/w/param"]
    assert without.excused_dev < 1e-6 and without.elem_err > 20   # judged: element 5 fails
    keys, ref, cand, perts = _adam_first_step(ADAM_EPS, moved_more=1e-5)
    bug = measure(keys, ref, cand, perts, K_ELEM)["0/-/w/param"]
    assert bug.elem_err > 20 and bug.excused == got.excused


def test_a_clipped_first_update_is_judged_at_the_eps_the_runs_fitted_not_adams_default():
    """Clipped 10x, Adam's eps acts as 1.1e-7 on the traced grads (tracer/adam.py): the candidate's own
    grad -1.7e-6 against the reference's -2e-5, kept by a replay at that eps (0.81% of lr off; the
    comparison's first-update rule reads the eps the runs' replay recorded), moves its element
    8e-6, where the perturbed runs gave theirs up (no gain to explain it by); at ADAM_EPS the rule reads
    0.08% of lr and judges it, far beyond its noise scale: an hf bf16 check clipping at 0.1 failed so on
    an Intel Xeon (seed 534, 1.16x on a step-0 weight)."""
    clipped = dict(eps=1.1e-7, near=(-2e-5, -8e-6), given_up=True)
    keys, ref, cand, perts = _adam_first_step(1.1e-7, **clipped)
    got = measure(keys, ref, cand, perts, K_ELEM)["0/-/w/param"]
    assert got.excused >= 1 and got.excused_dev == pytest.approx(8.1e-6, rel=0.05)
    assert got.elem_err < 4.0
    keys, ref, cand, perts = _adam_first_step(ADAM_EPS, **clipped)
    at_default = measure(keys, ref, cand, perts, K_ELEM)["0/-/w/param"]
    assert at_default.excused_dev < 1e-6 and at_default.elem_err > 20
