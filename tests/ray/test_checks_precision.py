"""Precision recipes through real Ray checks: BF16 and FP8 candidates pass clean against their
one-rank reference; FP8 amax not reduced over TP (BUGS.md #14) is caught; in FP8 one layer's grads
scaled by 5% are caught by the scale band."""

from test_checks import check

from tracer.compare import compare
from tracer.logical import load_logical
from tracer.tolerance import TolerancePolicy

SMALL = ["model.layers=2", "tolerance.perturbations=2"]   # the FP8 bug shows at the first GEMM


def test_fp8_tp2_clean_passes_and_unreduced_amax_is_caught(ray_cluster, workdir):
    clean = check(workdir, "parallel=tp2", "precision=fp8", "tracking.enabled=false", *SMALL)
    assert clean.verdict == "pass", clean.report.get("first_divergence") or clean.message
    dtypes = {t["name"]: t for t in clean.report["tensors"]}
    assert dtypes["0/0/layers.0.attn.qkv/output"]["rel_err"] == 0.0   # same scales: bit-exact shards
    assert "grad_signs" not in clean.report["reference"]   # dense fp8 keeps its own grad signs
    # Every grad of one layer scaled by 1.05, in the clean check's own traces: outside the range the
    # perturbed runs' projections span, where k_scale x the norm-wise noise (~15% in fp8) passes it.
    url = clean.report["reference"]["url"]
    ref, pert = load_logical(url, "reference", 1), [load_logical(url, f"perturbed-{r}", 1) for r in (1, 2)]
    cand = load_logical(clean.report["store"], "candidate", 2)
    grads = [n for n in ref.order if ref.info[n]["kind"] == "param_grad" and ref.info[n]["step"] == 0
             and n.split("/")[2].startswith("layers.1.") and len(ref.shape(n)) > 1]
    for n in grads:
        t = cand.tensors[n].tensor
        t.copy_((t.double() * 1.05).to(t.dtype))
    res = compare(ref, cand, pert, TolerancePolicy())
    assert res.verdict == "fail" and res.first_divergence.name in grads, res.first_divergence
    assert "outside the range the perturbed runs span" in res.first_divergence.reason
    assert compare(ref, cand, pert, TolerancePolicy(k_band=0.0)).verdict == "pass"
    buggy = check(workdir, "parallel=tp2", "precision=fp8", "bug=fp8_amax_unreduced",
                  "tracking.enabled=false", "localize=false", *SMALL)
    assert buggy.verdict == "fail" and buggy.exit_code == 1
    fd = buggy.report["first_divergence"]
    assert fd["name"] == "0/0/layers.0.attn.qkv/output", fd   # the first FP8 GEMM, first microbatch


def test_bf16_sequence_parallel_clean_passes(ray_cluster, workdir):
    clean = check(workdir, "parallel=tp2_sp", "precision=bf16", "tracking.enabled=false")
    assert clean.verdict == "pass", clean.report.get("first_divergence") or clean.message
    # A dense bf16 check replays the reference's grad signs (orchestrator/grad_signs.py), routing no.
    ref = clean.report["reference"]
    assert ref.get("grad_signs") == "replay" and "routing" not in ref
    # The elementwise metric and its tolerance are reported for every tensor.
    assert all(t["elem_tolerance"] >= 1.0 for t in clean.report["tensors"])


def test_fp8_delayed_scaling_clean_passes_and_unreduced_amax_is_caught(ray_cluster, workdir):
    """Delayed scaling (amax history over steps, as TransformerEngine's default recipe): the clean
    candidate matches its one-rank reference; the unreduced amax is still caught at the first GEMM."""
    from orchestrator.check import run_checks
    from orchestrator.recipe import compose

    common = ["parallel=tp2", "precision=fp8", "precision.scaling=delayed", "tracking.enabled=false",
              "localize=false", f"cluster.address={ray_cluster}", *SMALL]
    clean, buggy = run_checks([(compose(common), workdir / "clean"),
                               (compose([*common, "bug=fp8_amax_unreduced"]), workdir / "bug")],
                              base_dir=str(workdir))
    assert clean.verdict == "pass", clean.report.get("first_divergence") or clean.message
    assert buggy.verdict == "fail"
    assert buggy.report["first_divergence"]["module"] == "layers.0.attn.qkv"
