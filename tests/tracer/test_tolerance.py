"""The tolerance estimator and the metrics (tracer/tolerance.py), on maps whose error is computable."""

import math

import pytest
import torch

from tracer import perturb_ulp
from tracer.tolerance import (
    TolerancePolicy,
    compute_roundoff,
    elem_err,
    elem_noise,
    noise_scale,
    own_err,
    rel_err,
    unit_roundoff,
)

G = lambda s: torch.Generator().manual_seed(s)
W = torch.randn(64, 256, generator=G(0))
X = torch.randn(32, 256, generator=G(1))


def test_perturbation_noise_of_a_linear_map_is_its_first_order_error():
    """y = X W^T: moving every weight one ulp (random sign) moves y by exactly X dW^T, whose expected
    squared norm is sum_b,i,j ulp_ij^2 x_bj^2 (independent signs). Computed in float64, so the only
    error is the perturbation's."""
    r = X.double() @ W.double().t()
    for seed in (1, 2, 3):
        dw = perturb_ulp(W, seed, "w").double() - W.double()
        assert (dw != 0).all()                                   # every element moved
        assert ((dw.abs() / W.double().abs()) <= 2.0**-23).all()  # by one fp32 ulp
        p = X.double() @ (W.double() + dw).t()
        expected = math.sqrt((X.double().square() @ dw.square().t()).sum().item()) / r.norm().item()
        assert rel_err(p, r) == pytest.approx(expected, rel=0.1)


def test_honest_reordering_passes_and_a_small_scale_error_fails():
    """fp32 row-parallel split (partial GEMMs over 4 shards, summed) vs one GEMM: within k x noise."""
    ref = X @ W.t()
    pert = [X @ perturb_ulp(W, s, "w").t() for s in (1, 2, 3)]
    cand = sum(x @ w.t() for x, w in zip(X.chunk(4, 1), W.chunk(4, 1), strict=True))
    policy = TolerancePolicy()
    noise = [rel_err(p.double(), ref.double()) for p in pert]
    tol = policy.tolerance(noise, "float32")
    assert tol == pytest.approx(max(4.0 * max(noise), 16 * 2.0**-24))
    assert 0 < rel_err(cand.double(), ref.double()) <= tol
    assert rel_err((cand * (1 + 1e-5)).double(), ref.double()) > tol
    u = unit_roundoff("float32")
    ps = [p.double() for p in pert]
    etol = policy.elem_tolerance(elem_noise(ps, ref.double(), u))
    assert elem_err(cand.double(), ref.double(), noise_scale(ps, ref.double(), u)) <= etol


def _noisy(r: torch.Tensor, sigma: float, seed: int) -> torch.Tensor:
    return r * (1 + sigma * torch.randn(r.shape, generator=G(seed), dtype=torch.float64))


def test_elementwise_metric_flags_one_corrupted_element_the_normwise_error_misses():
    r = torch.randn(128, 128, generator=G(5), dtype=torch.float64)
    sigma, u = 1e-4, unit_roundoff("float32")
    pert = [_noisy(r, sigma, s) for s in (10, 11, 12)]
    policy = TolerancePolicy()
    tol = policy.tolerance([rel_err(p, r) for p in pert], "float32")
    etol = policy.elem_tolerance(elem_noise(pert, r, u))
    scale = noise_scale(pert, r, u)
    clean = _noisy(r, sigma, 13)
    assert rel_err(clean, r) <= tol and elem_err(clean, r, scale) <= etol
    # One element of the second "shard" (columns 64..127), of median magnitude there, off by 1%.
    shard = r[:, 64:].abs()
    i, j = divmod(int((shard - shard.median()).abs().argmin()), 64)
    bad = clean.clone()
    bad[i, 64 + j] *= 1.01
    assert rel_err(bad, r) <= tol                  # the norm-wise error cannot see it
    assert elem_err(bad, r, scale) > etol          # the elementwise metric does


def test_heavy_tails_near_zero_elements_and_sign_flips_stay_within_tolerance():
    """Elements whose true value is ~0, and a few elements that flip by O(1) in every noisy run (Adam's
    sign-like first step): the honest candidate, with its own flips elsewhere, passes."""
    r = torch.randn(4096, generator=G(7), dtype=torch.float64) * 1e-3
    r[:100] = 0.0                     # exact zeros: only the rms(r) term keeps their scale finite
    u = unit_roundoff("float32")

    def run(seed: int) -> torch.Tensor:
        p = _noisy(r, 1e-5, seed)
        p += 1e-9 * torch.randn(r.shape, generator=G(seed + 100), dtype=torch.float64)
        flips = torch.randint(0, 4096, (3,), generator=G(seed + 200))
        p[flips] = -p[flips]          # sign flips on random elements (different ones each run)
        return p

    pert = [run(s) for s in (1, 2, 3)]
    policy = TolerancePolicy()
    etol = policy.elem_tolerance(elem_noise(pert, r, u))
    cand = run(4)
    assert math.isfinite(etol)
    assert elem_err(cand, r, noise_scale(pert, r, u)) <= etol
    assert rel_err(cand, r) <= policy.tolerance([rel_err(p, r) for p in pert], "float32")


def test_elem_noise_is_leave_one_out():
    r = torch.randn(100, generator=G(3), dtype=torch.float64)
    ps = [_noisy(r, 1e-3, s) for s in (1, 2, 3)]
    u = 2.0**-24
    loo = elem_noise(ps, r, u)
    assert loo[0] == pytest.approx(elem_err(ps[0], r, noise_scale(ps[1:], r, u)))
    # scored against its own envelope a run could never exceed 1: leave-one-out is what makes it a test
    assert elem_err(ps[0], r, noise_scale(ps, r, u)) <= 1.0 < max(loo)
    assert elem_noise(ps[:1], r, u)[0] == pytest.approx(elem_err(ps[0], r, noise_scale([], r, u)))


def test_policy_floors_config_and_analytic_bound():
    p = TolerancePolicy.from_config({"k": 3, "floor_ulps": 8, "k_elem": 5, "floor_elem": 2,
                                     "perturbations": 3})
    assert (p.k, p.floor_ulps, p.k_elem, p.floor_elem) == (3.0, 8.0, 5.0, 2.0)
    assert p.tolerance([0.0], "bfloat16") == 8 * 2.0**-8
    assert p.elem_tolerance([0.1]) == 2.0 and p.elem_tolerance([1.0]) == 5.0
    assert p.elem_tolerance([0.1], numel=1) == math.inf   # a scalar: its norm-wise verdict is its element's
    # Megatron-CI style bound: the compute precision's eps, never finer than the tensor's dtype.
    assert p.analytic_bound(0, "float32", "bf16") == 3 * compute_roundoff("bf16")
    assert p.analytic_bound(2, "float32", "fp32") == pytest.approx(3 * 1.03**2 * 2.0**-24)


def test_scale_is_judged_on_outputs_and_grads_of_two_or_more_dims_only():
    """A norm's weight or a bias (one dim) has a grad summed over every token; from trained weights a
    TP layout's honest error lies along it (docs/tolerance.md), so its projection is not judged; a
    matrix's is, and so is nothing of `param` or `loss`."""
    policy = TolerancePolicy()
    assert policy.scale_tolerance([1e-3], "float32", "param_grad", (64, 32)) == pytest.approx(1.5e-3)
    assert policy.scale_tolerance([1e-3], "float32", "output", (2, 16, 32)) == pytest.approx(1.5e-3)
    assert math.isinf(policy.scale_tolerance([1e-3], "float32", "param_grad", (64,)))
    assert math.isinf(policy.scale_tolerance([1e-3], "float32", "param", (64, 32)))
    assert math.isinf(policy.scale_tolerance([1e-3], "float32", "loss", ()))


def test_own_err_reads_an_element_in_its_row_and_columns_noise_fitted_without_it():
    """Noise whose size is a row factor times a column factor: an element set to 10 of its own noise
    scales reads ~10 (its square is left out of the fit, so it cannot hide in its own row and
    column), honest noise reads the extreme of its 4096 draws, and the figure does not depend on the
    noise's overall size (self-normalized: a layout noisier than the perturbed runs alike)."""
    g = torch.Generator().manual_seed(0)
    rows, cols = torch.rand(64, 1, generator=g) + 0.5, torch.rand(1, 64, generator=g) + 0.5
    sigma = rows * cols * 1e-3
    x = torch.randn(64, 64, generator=g, dtype=torch.float64) * sigma
    r = torch.randn(64, 64, generator=g, dtype=torch.float64)
    honest = own_err(x, r, 0.0)
    assert 2.5 < honest < 5 and own_err(x * 100, r, 0.0) == pytest.approx(honest)
    x[5, 7] = 10 * sigma[5, 7]
    assert own_err(x, r, 0.0) == pytest.approx(10, rel=0.15)
    assert own_err(torch.zeros(64, 64), r, 2**-8) == 0 and own_err(x[:4], r[:4], 0.0) == 0   # 4 rows: no view


def test_the_joint_single_element_rule_is_judged_under_gemm_rounding_draws_only():
    p = TolerancePolicy()
    assert p.own_tolerances(3.0, 2.0, (64, 64), draws=True) == (4.5, 4.0)
    assert p.own_tolerances(1.0, 2.0, (64, 64), draws=True) == (4.0, 4.0)   # floor_elem
    assert p.own_tolerances(3.0, 2.0, (64, 64), draws=False) == (math.inf, math.inf)
    assert p.own_tolerances(3.0, 2.0, None, draws=True) == (math.inf, math.inf)
    assert TolerancePolicy(k_own=0).own_tolerances(3.0, 2.0, (64, 64), True) == (math.inf, math.inf)
    configured = TolerancePolicy.from_config({"k_own": 2, "k_joint": 3})
    assert configured.own_tolerances(3.0, 2.0, (8, 8), True) == (6, 6)


def test_the_scale_band_spans_zero_and_the_perturbed_runs_mean_widened_by_their_spread():
    """Under GEMM rounding draws the projection must lie between 0 (an exact candidate) and the
    perturbed runs' mean projection (a noisy candidate shares their bias: its own rounding noise
    projected on itself), widened by k_band x their spread, at least band_floor x the norm-wise
    noise and one unit roundoff; it is not judged without draws, where the scale is not judged, or
    with k_band = 0."""
    p = TolerancePolicy()
    lo, hi = p.scale_band(-0.01, 0.002, 0.05, "float32", "param_grad", (64, 32), draws=True)
    assert (lo, hi) == (pytest.approx(-0.01 - 8 * 0.002), pytest.approx(8 * 0.002))
    lo, hi = p.scale_band(0.002, 0.0001, 0.05, "float32", "output", (2, 8, 32), draws=True)
    assert (lo, hi) == (pytest.approx(-0.25 * 0.05), pytest.approx(0.002 + 0.25 * 0.05))   # the floor
    assert p.scale_band(0.0, 0.0, 0.0, "bfloat16", "output", (8, 8), draws=True) == (-2.0**-8, 2.0**-8)
    unbounded = (-math.inf, math.inf)
    assert p.scale_band(-0.01, 0.001, 0.05, "float32", "param_grad", (64, 32), draws=False) == unbounded
    assert p.scale_band(-0.01, 0.001, 0.05, "float32", "param_grad", (64,), draws=True) == unbounded
    assert p.scale_band(-0.01, 0.001, 0.05, "float32", "param", (64, 32), draws=True) == unbounded
    for off in (TolerancePolicy(k_band=0), TolerancePolicy(k_scale=0)):
        assert off.scale_band(-0.01, 0.001, 0.05, "float32", "output", (8, 8), True) == unbounded
    configured = TolerancePolicy.from_config({"k_band": 4, "band_floor": 0.5})
    assert configured.scale_band(0.0, 0.01, 0.05, "float32", "output", (8, 8), True) == (-0.04, 0.04)
