"""A PASS must mean something (issue 14): the verdict's parts each catch what they exist for, so that
breaking any one of them fails a test here. Unit tests on hand-built traces (no Ray), then a real
check whose excused parameter elements are corrupted."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tracer.compare import compare
from tracer.compare_inputs import first_update_eps, tensor_keys
from tracer.errors import TraceError
from tracer.isolation import name_culprit
from tracer.logical import load_logical
from tracer.measure import measure
from tracer.tolerance import TolerancePolicy
from tracer.verdicts import Comparison, TensorResult


def _runs(tmp_path: Path) -> tuple:
    from test_store_compare import load, write_run

    write_run(tmp_path, "reference")
    write_run(tmp_path, "perturbed-1", fc_scale=1 + 2**-22)
    write_run(tmp_path, "perturbed-2", fc_scale=1 - 2**-22)
    write_run(tmp_path, "candidate", tp=2)
    return load(tmp_path, "reference"), load(tmp_path, "candidate", 2), [load(tmp_path, f"perturbed-{i}")
                                                                         for i in (1, 2)]


def test_a_few_corrupted_elements_fail_by_the_elementwise_verdict_alone(tmp_path):
    """One typical element moved by 0.7 x the norm-wise tolerance times the tensor's norm: the norm-wise
    error stays within its tolerance, so only the elementwise verdict (several noise scales) catches
    it (disabling that verdict must fail this test)."""
    ref, cand, pert = _runs(tmp_path)
    name = "0/0/fc/output"
    t = cand.tensors[name].tensor
    rms = t.square().mean().sqrt()
    i = int((t.abs() - rms).abs().argmin())            # an element of typical size
    tol = compare(ref, cand, pert, TolerancePolicy()).results[0].tolerance
    t.view(-1)[i] += 0.7 * tol * t.norm()
    res = compare(ref, cand, pert, TolerancePolicy())
    r = next(x for x in res.results if x.name == name)
    assert res.verdict == "fail" and res.first_divergence.name == name
    assert r.rel_err < r.tolerance and r.reason.startswith("elementwise"), r


def test_an_infinite_error_is_a_failure_not_zero(tmp_path):
    """A tensor the reference (and every perturbed run) holds at exactly zero, nonzero in the
    candidate: its relative error is infinite and must fail (mapping inf to 0 would pass it)."""
    ref, cand, pert = _runs(tmp_path)
    name = "0/-/out.weight/param_grad"
    for run in (ref, *pert):
        run.tensors[name].tensor.zero_()
    cand.tensors[name].tensor.zero_()[0, 0] = 1e-3
    res = compare(ref, cand, pert, TolerancePolicy())
    r = next(x for x in res.results if x.name == name)
    assert not r.ok and math.isinf(r.rel_err) and math.isinf(r.elem_err), r


def test_a_zero_reference_tensor_has_a_finite_tolerance(tmp_path):
    """A bias is zero at init and the perturbation moves it to +-denormals: relative to a zero norm every
    draw is infinitely far, which made its tolerance infinite (and, pooled per module, its weight's
    too). Relative to the perturbed runs' norm instead, a candidate bias of 1e-6 fails, zero passes,
    and the weight keeps its own tolerance."""
    ref, cand, pert = _runs(tmp_path)
    name = "0/-/out.weight/param"
    tiny = torch.tensor(float("inf"))
    for run in (ref, cand):
        run.tensors[name].tensor.zero_()
    for i, p in enumerate(pert):
        p.tensors[name].tensor.copy_(torch.nextafter(torch.zeros_like(p.tensors[name].tensor),
                                                     tiny if i else -tiny))
    ok = next(r for r in compare(ref, cand, pert, TolerancePolicy()).results if r.name == name)
    assert ok.ok and math.isfinite(ok.tolerance) and ok.tolerance < 1e3, ok
    cand.tensors[name].tensor[0, 0] = 1e-6
    bad = next(r for r in compare(ref, cand, pert, TolerancePolicy()).results if r.name == name)
    assert not bad.ok, bad


def _result(index: int, module: str, ok: bool, kind: str = "output") -> TensorResult:
    return TensorResult(name=f"0/0/{module}/{kind}", module=module, module_type="Linear", kind=kind, step=0,
                        microbatch=0, index=index, rel_err=0.0 if ok else 1.0, max_err=0.0, cosine=1.0,
                        nonfinite=0, replica_err=0.0, tolerance=1e-6, noise=0.0, max_noise=0.0,
                        analytic_bound=0.0, ok=ok, reason="" if ok else "rel_err 1 > tolerance 1e-6")


def test_the_culprit_is_the_first_module_beyond_tolerance_on_its_own_and_the_origin_is_said():
    """Normal run: a, b, c, d fail from b on. Isolated run: b and c are beyond tolerance on their own,
    d is not. The culprit is b (the first, not the last, flagged before the first divergence), the
    window {b} for a first divergence at b; for a first divergence at d, the window is {b, c} and d's
    error is inherited."""
    names = ["a", "b", "c", "d"]
    normal = [_result(i, m, ok=(m == "a")) for i, m in enumerate(names)]
    isolated = [_result(i, m, ok=m in ("a", "d")) for i, m in enumerate(names)]
    loc = name_culprit(Comparison("fail", normal, normal[1]), Comparison("fail", isolated, isolated[1]))
    assert loc["culprit"]["module"] == "b" and loc["origin"] == "local"
    assert loc["blame_window"]["modules"] == ["b"]
    loc = name_culprit(Comparison("fail", normal, normal[3]), Comparison("fail", isolated, isolated[1]))
    assert loc["culprit"]["module"] == "b" and loc["blame_window"]["modules"] == ["b", "c"]
    assert loc["origin"] == "inherited"


# -- the optimizer excusal is bounded (a real check's traces) ---------------------------------------
@pytest.fixture(scope="module")
def adam_check(ray_cluster, tmp_path_factory):
    """A clean bf16 tp2 check of gpt_tiny, 2 steps of Adam, its stored runs read back. In bf16 the
    excusal matters most: 35-61% of the parameter elements had been excused unconditionally. It
    is judged by the local verdict (on by default in bf16), so its isolation pass ran and
    judged too (`isolated`), and the honest check passed that as well."""
    from orchestrator.check import run_check
    from orchestrator.recipe import compose

    work = tmp_path_factory.mktemp("excusal")
    rec = compose(["parallel=tp2", "precision=bf16", "model.layers=2", "tracking.enabled=false",
                   f"cluster.address={ray_cluster}"])
    res = run_check(rec, work / "out", base_dir=str(work))
    assert res.verdict == "pass", res.report.get("first_divergence") or res.message
    local = res.report["local"]
    assert local["judged"] > 20 and local["failed"] == 0 and 0 < local["worst"]["local_err"] < 6, local
    url = res.report["reference"]["url"]
    load = lambda root, run, n: load_logical(root, run, n)
    ref = load(url, "reference", 1)
    pert = [load(url, f"perturbed-{r}", 1) for r in (1, 2, 3)]
    candidate = lambda: load(res.report["store"], "candidate", 2)
    candidate.isolated = lambda: load(res.report["store"], "isolated", 2)
    candidate.work = work   # its base directory: a check of the same recipe there reuses its references
    return ref, pert, candidate


def test_a_fresh_runs_step_0_param_grads_and_params_are_adams_first_update_and_no_other_tensor(adam_check):
    """tracer.compare_inputs.tensor_keys: a session writes whether its run started from a checkpoint
    (meta `from_checkpoint`); a fresh run's step-0 param grads and params make Adam's first update (the
    first-update excusal, tracer/excusal.py, at the eps given), no other tensor does, and no tensor of a
    run from a checkpoint or of a trace that does not say."""
    ref, _, _ = adam_check
    assert ref.meta["from_checkpoint"] is False
    keys = tensor_keys(ref)
    first = {k.name for k in keys if k.first_update}
    assert first == {k.name for k in keys if k.kind in ("param", "param_grad") and k.name.startswith("0/")}
    assert any(k.kind == "param" for k in keys if k.first_update)
    try:
        for said in (True, None):
            ref.meta["from_checkpoint"] = said
            assert not any(k.first_update for k in tensor_keys(ref)), said
    finally:
        ref.meta["from_checkpoint"] = False


def test_the_first_update_is_judged_at_the_eps_the_runs_replay_fitted_and_runs_that_disagree_are_an_error(
        adam_check):
    """The check replays grad signs (bf16): the candidate and the perturbed runs each fitted Adam's eps
    to the reference's first update (tracer.grad_signs.reference_eps) and recorded it; the comparison's
    first-update rule judges at it (tracer.compare_inputs.first_update_eps). Runs that say different
    eps replayed different references: an error, never a verdict."""
    ref, pert, candidate = adam_check
    cand = candidate()
    eps = first_update_eps([cand, *pert])
    assert eps > 0 and all(r.meta["first_update_eps"] == eps for r in (cand, *pert))
    assert {k.first_update for k in tensor_keys(ref, eps)} == {0.0, eps}
    try:
        pert[1].meta["first_update_eps"] = 2 * eps
        with pytest.raises(TraceError, match="different first updates"):
            compare(ref, cand, pert, TolerancePolicy())
    finally:
        pert[1].meta["first_update_eps"] = eps


def _near_zero_grads(ref, pert) -> dict[str, torch.Tensor]:
    """The parameter elements excused because their gradient is within noise of zero, whatever the
    candidate holds (measured with the reference as its own candidate: nothing else is excused)."""
    masks: dict[str, torch.Tensor] = {}
    plain = lambda t: {n: t.tensors[n].tensor for n in t.order}
    measure(tensor_keys(ref), plain(ref), plain(ref), [plain(p) for p in pert], TolerancePolicy().k_elem,
            excused_masks=masks)
    return masks


def test_excused_parameter_elements_are_still_judged(adam_check):
    """Elements whose gradient is within noise of zero are left out of the param's norm-wise and
    elementwise figures (Adam may step them either way under any honest reordering), but never
    unconditionally: +1.0 on every one of them fails (beyond what a flipped update can move them),
    and so does flipping all their updates (far more elements beyond their perturbed envelope than
    a perturbed run has); so does flipping every element the honest comparison excused."""
    ref, pert, candidate = adam_check
    honest = compare(ref, candidate(), pert, TolerancePolicy())
    assert honest.verdict == "pass"
    last = max(ref.info[n]["step"] for n in ref.order)
    params = [n for n in ref.order if ref.info[n]["kind"] == "param" and ref.info[n]["step"] == last]
    path = lambda n: n.split("/", 2)[2].rsplit("/", 1)[0]

    def mutate(masks: dict[str, torch.Tensor], how: str):
        cand = candidate()
        for n in params:
            m = masks.get(path(n))
            if m is None or not m.any():
                continue
            m, t, r = m.view(ref.shape(n)), cand.tensors[n].tensor, ref.tensors[n].tensor
            prev = ref.tensors[n.replace(f"{last}/-/", f"{last - 1}/-/", 1)].tensor
            # +1.0, or the reference's own update reversed (its sign flipped)
            moved = t.float() + 1.0 if how == "+1" else 2 * prev.float() - r.float()
            t[m] = moved[m].to(t.dtype)
        return compare(ref, cand, pert, TolerancePolicy())

    near_zero = _near_zero_grads(ref, pert)
    assert sum(int(near_zero[path(n)].sum()) for n in params if path(n) in near_zero) > 1000
    assert all(0 <= r.excused_fraction < 1 for r in honest.results)   # reported per tensor
    assert any(r.excused_fraction > 0.3 for r in honest.results if r.kind == "param")

    res = mutate(near_zero, "+1")
    fd = res.first_divergence
    assert res.verdict == "fail" and fd.kind == "param" and "excused element moved" in fd.reason, fd
    res = mutate(near_zero, "flip")
    fd = res.first_divergence
    assert res.verdict == "fail" and fd.kind == "param" and "beyond their perturbed envelope" in fd.reason, fd

    excused: dict[str, torch.Tensor] = {}
    plain = lambda t: {n: t.tensors[n].tensor for n in t.order}
    measure(tensor_keys(ref), plain(ref), plain(candidate()), [plain(p) for p in pert],
            TolerancePolicy().k_elem, excused_masks=excused)
    res = mutate(excused, "flip")
    assert res.verdict == "fail" and res.first_divergence.kind == "param", res.first_divergence


def _layer_grads(ref, layer: str = "layers.1."):
    """The step-0 param grads of one layer."""
    return [n for n in ref.order if ref.info[n]["kind"] == "param_grad" and ref.info[n]["step"] == 0
            and n.split("/")[2].startswith(layer)]


def _scale(trace, names, factor: float) -> None:
    """Scale the named tensors in place (computed in float64, stored in their own dtype)."""
    for n in names:
        t = trace.tensors[n].tensor
        t.copy_((t.double() * factor).to(t.dtype))


def test_two_percent_on_one_layers_grads_or_one_activation_fails_in_bf16(adam_check):
    """Every grad of one layer scaled by 1.02 in a bf16 tp2 check fails, on its projection on the
    reference (the issue's concrete miss was 1.03 at a norm-wise tolerance of 8.3%); so does one
    activation scaled by 1.02; the honest check passes (fixture). Without the scale metric
    (k_scale=0) the same 2% passes: the norm-wise tolerance alone cannot see it."""
    ref, pert, candidate = adam_check
    grads = _layer_grads(ref)
    act = "0/1/layers.1.mlp.fc1/output"
    assert grads and act in ref.order
    for names in (grads, [act]):
        cand = candidate()
        _scale(cand, names, 1.02)
        res = compare(ref, cand, pert, TolerancePolicy())
        fd = res.first_divergence
        assert res.verdict == "fail" and fd.name in names and fd.reason.startswith("scale"), fd
        assert abs(fd.scale_err - 0.02) < 0.005 and fd.rel_err < fd.tolerance   # norm-wise within
        assert compare(ref, cand, pert, TolerancePolicy(k_scale=0.0)).verdict == "pass"


def test_half_a_percent_on_one_layers_grads_fails_in_bf16_by_the_scale_band(adam_check):
    """Every grad of one layer scaled by 1.005 fails in a bf16 tp2 check: outside the range the
    perturbed runs' projections span (widened by k_band x their spread), where the tolerance of
    k_scale x the norm-wise noise (the rule before the band, k_band=0) passes it. The honest check
    passes with the band (fixture). docs/tolerance.md, "The scale band"."""
    ref, pert, candidate = adam_check
    grads = _layer_grads(ref)
    cand = candidate()
    _scale(cand, grads, 1.005)
    res = compare(ref, cand, pert, TolerancePolicy())
    fd = res.first_divergence
    assert res.verdict == "fail" and fd.name in grads, fd
    assert "outside the range the perturbed runs span" in fd.reason, fd
    assert not fd.scale_band[0] <= fd.scale_err <= fd.scale_band[1] and abs(fd.scale_err) < fd.scale_tolerance
    assert compare(ref, cand, pert, TolerancePolicy(k_band=0.0)).verdict == "pass"


def test_one_element_of_median_size_fails_in_bf16_by_its_row_and_column_noise(adam_check):
    """One element of median magnitude moved 40% in a bf16 tp2 check (an activation, an activation
    grad, a weight grad) fails by the row-column metric: the element is judged in units of its own
    row's and column's noise. The envelope metric alone (k_rowcol=k_own=0) needs 50-70% and passes it. The
    honest check passes (fixture). docs/tolerance.md, "Single elements"."""
    ref, pert, candidate = adam_check
    for name in ("0/1/layers.1.mlp.fc1/output", "0/1/layers.1.mlp.fc1/grad_output",
                 "0/-/layers.1.mlp.fc1.weight/param_grad"):
        cand = candidate()
        t = cand.tensors[name].tensor
        flat = t.view(-1)
        i = int((flat.float().abs() - flat.float().abs().median()).abs().argmin())
        flat[i] = (flat[i].double() * 1.4).to(t.dtype)
        res = compare(ref, cand, pert, TolerancePolicy())
        fd = res.first_divergence
        assert res.verdict == "fail" and fd.name == name and "row's and column's noise" in fd.reason, fd
        assert fd.rel_err < fd.tolerance and fd.elem_err < fd.elem_tolerance   # the other metrics pass it
        assert compare(ref, cand, pert, TolerancePolicy(k_rowcol=0.0, k_own=0.0)).verdict == "pass"


def test_one_element_moved_12_to_20_percent_in_bf16_fails_on_its_own_and_the_perturbed_runs_noise(
        adam_check):
    """One median element moved 12% (an activation), 15% (its grad) or 20% (a weight grad): within
    the row-column tolerance (the 40% above), but past k_own x the perturbed runs' figure in units of
    its row's and column's noise fitted to the candidate's own errors AND past k_joint x the
    perturbed runs' row-column noise, both at once, which no honest tensor of the calibration seeds
    reached (docs/tolerance.md). The honest check passes (fixture); without the rule (k_own=0), or
    were the perturbed runs not GEMM rounding draws (the rule's calibration), the same passes."""
    ref, pert, candidate = adam_check
    assert all(p.meta["perturbation"] == "gemm" for p in pert)
    for name, delta in (("0/1/layers.1.mlp.fc1/output", 0.12), ("0/1/layers.1.mlp.fc1/grad_output", 0.15),
                        ("0/-/layers.1.mlp.fc1.weight/param_grad", 0.2)):
        cand = candidate()
        flat = cand.tensors[name].tensor.view(-1)
        i = int((flat.float().abs() - flat.float().abs().median()).abs().argmin())
        flat[i] = (flat[i].double() * (1 + delta)).to(flat.dtype)
        res = compare(ref, cand, pert, TolerancePolicy())
        fd = res.first_divergence
        assert res.verdict == "fail" and fd.name == name and "past both at once" in fd.reason, fd
        assert fd.rowcol_err < fd.rowcol_tolerance and fd.elem_err < fd.elem_tolerance
        assert compare(ref, cand, pert, TolerancePolicy(k_own=0.0)).verdict == "pass"
        for p in pert:
            p.meta["perturbation"] = "weights"
        assert compare(ref, cand, pert, TolerancePolicy()).verdict == "pass"
        for p in pert:
            p.meta["perturbation"] = "gemm"


def test_the_row_column_metric_judges_the_first_step_only(adam_check):
    """After an optimizer step every run carries its own few Adam-amplified weight elements (gradients
    within noise of eps or zero), each shifting a column of the next step's outputs: a structure no
    row and column factor of the other runs describes (tracer.tolerance.rowcol_shape). So the metric
    judges step 0's tensors, and a step-1 tensor of the same shape is left to the others."""
    ref, pert, candidate = adam_check
    results = compare(ref, candidate(), pert, TolerancePolicy()).results
    judged = lambda step: {r.name.split("/", 1)[1] for r in results
                           if r.step == step and math.isfinite(r.rowcol_tolerance)}
    first = judged(0)
    assert "1/layers.1.mlp.fc1/output" in first and "-/layers.1.mlp.fc1.weight/param_grad" in first
    assert len(first) > 20 and not judged(1)
    assert "1/layers.1.mlp.fc1/output" in {r.name.split("/", 1)[1] for r in results if r.step == 1}


def test_a_scalar_is_judged_by_its_norm_not_its_microbatchs_envelope(tmp_path):
    """A microbatch's loss is one element: its norm-wise error is that element's, judged against the
    noise of every microbatch of the step (here the 16-ulp floor). Its elementwise scale, this
    microbatch's envelope alone, is not a second verdict: where the perturbed runs happened to leave
    the loss in place it reads an honest move as many noise scales (a bf16 MoE loss: 4.42). 0.9 of the
    norm-wise tolerance passes (7.2 noise scales), twice fails."""
    ref, cand, pert = _runs(tmp_path)
    name = next(n for n in ref.order if ref.info[n]["kind"] == "loss")
    for p in pert:   # no perturbed run moved this loss
        p.tensors[name].tensor.copy_(ref.tensors[name].tensor)
    base = ref.tensors[name].tensor.double()
    tol = TolerancePolicy().tolerance([0.0], "float32")
    for factor, ok in ((0.9, True), (2.0, False)):
        cand.tensors[name].tensor.copy_(base * (1 + factor * tol))
        r = next(x for x in compare(ref, cand, pert, TolerancePolicy()).results if x.name == name)
        assert r.tolerance == tol and r.elem_err > 4, r
        assert r.ok == ok and (ok or r.reason.startswith("rel_err")), r


def test_an_isolated_rerun_without_a_param_grad_is_judged_locally_on_the_rest(adam_check):
    """An isolated rerun that never trained a parameter (no param grad; its comparison fails it:
    tracer.compare, untrained) is judged by the local verdict on every tensor it has."""
    from tracer.local_verdict import local_errors

    ref, _, candidate = adam_check
    iso = candidate.isolated()
    lost = "0/-/layers.1.mlp.fc1.weight/param_grad"
    honest = local_errors(ref, iso, "bf16")
    assert lost in honest
    without = local_errors(ref, iso.restricted([n for n in iso.order if n != lost]), "bf16")
    assert set(without) == set(honest) - {lost}


def test_one_element_moved_8_percent_in_bf16_fails_the_local_verdict_where_the_check_as_run_passes(
        adam_check):
    """One median element moved 8% (an activation, an activation grad, a weight grad): within every
    rule of the comparison as the candidate ran (honest elements there are already 5-9% off), but
    the same element in the isolation pass, where each module is fed the reference's tensors and
    these tensors are bit-identical when honest, is past k_local = 6 of the module's own noise
    (tracer/local_verdict.py); 0.5% (about one bf16 rounding) is not."""
    from orchestrator.isolation_pass import judge_locally
    from orchestrator.outcome import PlannedCheck
    from orchestrator.recipe import compose
    from tracer.local_verdict import local_errors

    ref, pert, candidate = adam_check
    honest = local_errors(ref, candidate.isolated(), "bf16")
    assert honest and max(e.elem for e in honest.values()) < 6
    for name in ("0/1/layers.1.mlp.fc1/output", "0/1/layers.1.mlp.fc1/grad_output",
                 "0/-/layers.1.mlp.fc1.weight/param_grad"):
        assert honest[name].elem == 0.0   # column-parallel: bit-identical to the reference, fed its inputs
        mag = ref.tensors[name].tensor.view(-1).float().abs()
        i = int((mag - mag.median()).abs().argmin())   # an element of median size
        for delta, fails in ((0.08, True), (0.005, False)):
            cand, iso = candidate(), candidate.isolated()
            for trace in (cand, iso):   # a bug acts in both runs
                flat = trace.tensors[name].tensor.view(-1)
                flat[i] = (flat[i].double() * (1 + delta)).to(flat.dtype)
            assert (local_errors(ref, iso, "bf16")[name].elem > 6) == fails, (name, delta)
            if delta == 0.08:   # the check's own path: the local verdict turns its pass into a fail
                as_run = compare(ref, cand, pert, TolerancePolicy())
                assert as_run.verdict == "pass", name
                p = PlannedCheck(compose(["parallel=tp2", "precision=bf16"]),
                                 Path("."), "c", {}, 0.0)
                p.comparison = as_run
                judge_locally(p, ref, iso)
                fd = p.comparison.first_divergence
                assert p.comparison.verdict == "fail" and fd.name == name and fd.reason.startswith("local:")
                assert p.report["local"]["failed"] == 1 and fd.local_err > fd.local_tolerance == 6


def test_one_layers_grads_scaled_half_a_percent_fail_the_local_verdict_along_themselves(adam_check):
    """A uniform scale is what the local verdict's own fit absorbs (every element off by the same
    share of itself), so it is judged along the reference: fed the reference's tensors, an honest
    tensor moves along itself by a fraction of one rounding (K_LOCAL_SCALE). Every judged weight
    grad of layer 1 x 1.005 in both runs fails there, by that rule and not the elementwise one;
    x 1.001 (a quarter of a bf16 rounding) passes. (The comparison as run joined here is the honest
    candidate's, so what fails is the local verdict's alone: in bf16 the scale band already fails
    0.5% on the grads as run; the local rule is what sees it in fp8, docs/tolerance.md.)"""
    from orchestrator.isolation_pass import judge_locally
    from orchestrator.outcome import PlannedCheck
    from orchestrator.recipe import compose
    from tracer.local_verdict import K_LOCAL_SCALE, local_errors

    ref, pert, candidate = adam_check
    honest = local_errors(ref, candidate.isolated(), "bf16")
    assert all(e.ok(6) for e in honest.values()) and max(abs(e.scale) for e in honest.values()) < 0.5
    grads = [n for n, e in honest.items() if ref.info[n]["kind"] == "param_grad" and ".1." in n]
    assert len(grads) >= 4, grads
    as_run = compare(ref, candidate(), pert, TolerancePolicy())
    assert as_run.verdict == "pass"
    for factor, fails in ((1.005, True), (1.001, False)):
        iso = candidate.isolated()
        for name in grads:
            t = iso.tensors[name].tensor
            t.copy_((t.double() * factor).to(t.dtype))
        got = local_errors(ref, iso, "bf16")
        assert all((abs(got[n].scale) > K_LOCAL_SCALE) == fails and got[n].elem <= 6 for n in grads), factor
        p = PlannedCheck(compose(["parallel=tp2", "precision=bf16"]),
                         Path("."), "c", {}, 0.0)
        p.comparison = compare(ref, candidate(), pert, TolerancePolicy())
        judge_locally(p, ref, iso)
        fd = p.comparison.first_divergence
        if fails:
            assert fd is not None and "along itself" in fd.reason and fd.name == grads[0], fd
            assert p.report["local"]["failed"] == len(grads)
        else:
            assert p.comparison.verdict == "pass" and p.report["local"]["failed"] == 0


def test_one_grad_element_10_percent_off_in_bf16_exits_1(ray_cluster, adam_check):
    """Issue 14's acceptance as a real check: a silent fault (workloads/faults.py) scales the grad
    element of median size of layers.1.mlp.fc1.weight on TP rank 1 by 1.10, nothing else. The
    isolation pass runs the candidate's code, so the fault acts there too, and the local verdict (on
    by default in bf16, k_local = 6) fails the check at that grad: exit 1. Its clean counterpart is
    adam_check (the same recipe without the fault), which passes; its reference set is reused here."""
    from orchestrator.check import run_check
    from orchestrator.recipe import compose

    ref, _, clean = adam_check
    work = clean.work
    name = "0/-/layers.1.mlp.fc1.weight/param_grad"
    rec = compose(["parallel=tp2", "precision=bf16", "model.layers=2", "tracking.enabled=false",
                   f"cluster.address={ray_cluster}", "fault.kind=scale_grad_element",
                   "fault.rank=1", "fault.step=0", "fault.param=layers.1.mlp.fc1.weight", "fault.scale=0.1"])
    res = run_check(rec, work / "faulted", base_dir=str(work))
    assert res.verdict == "fail" and res.exit_code == 1, res.message
    fd = res.report["first_divergence"]
    assert fd["name"] == name, fd
    judged = next(t for t in res.report["tensors"] if t["name"] == name)
    assert judged["local_err"] > 6 and res.report["local"]["failed"] >= 1, judged
    assert res.report["reference"]["cache"] == "hit"   # the clean check's references: the same runs judged it
    # Only that element moved: fed the reference's tensors, this grad is bit-identical when honest
    # (column-parallel), and here differs in one element, by the fault's 10% (to bf16 rounding).
    iso = load_logical(res.report["store"], "isolated", 2).tensors[name].tensor.double()
    r = ref.tensors[name].tensor.double()
    (at,) = (iso != r).nonzero()
    assert abs(float(iso[tuple(at)] / r[tuple(at)]) - 1.1) < 0.01


def test_the_scale_band_judges_a_checks_first_two_steps_only(tmp_path):
    """The scale band (GEMM rounding draws) is calibrated on a check's first two traced steps; from the
    third on, honest excursions outgrow its floor (a clean 3-step bf16 tp2 check failed at step 2), so
    a scale is judged by k_scale alone there. Hand-built runs of 3 steps, the perturbed ones marked as
    rounding draws: steps 0 and 1 get a finite band, step 2 none, and the other scale rule stays."""
    from tracer import Tracer

    g = torch.Generator().manual_seed(3)
    base = [torch.randn(64, 32, generator=g) for _ in range(3)]

    def run(name: str, noise: float, perturbation: str | None = None) -> None:
        meta = {"fingerprint": "f", **({"perturbation": perturbation} if perturbation else {})}
        tr = Tracer(str(tmp_path), name, 0, coords={}, sizes={}, meta=meta)
        for step in range(3):
            with tr.step(step), tr.microbatch(0):
                tr.record("fc", "output", base[step] + noise * torch.randn(64, 32, generator=g))
        tr.close()

    run("reference", 0.0)
    for i in (1, 2, 3):
        run(f"perturbed-{i}", 1e-3, "gemm")
    run("candidate", 1e-3)
    load = lambda r: load_logical(str(tmp_path), r, 1)
    res = compare(load("reference"), load("candidate"), [load(f"perturbed-{i}") for i in (1, 2, 3)],
                  TolerancePolicy())
    by_step = {r.step: r for r in res.results}
    assert sorted(by_step) == [0, 1, 2]
    for step in (0, 1):
        assert all(math.isfinite(b) for b in by_step[step].scale_band), by_step[step]
    assert by_step[2].scale_band == (-math.inf, math.inf)
    assert math.isfinite(by_step[2].scale_tolerance)
