"""`ttrace scan`'s per-step fingerprint log (tracer/fingerprint_log.py, fingerprint_read.py) and its
band logic (tracer/scan_judge.py), in one process: the log round-trips the statistics of
tracer/stats.py, its writer's memory does not grow with the steps, a corrupt block is an error naming
it, and the first step a candidate leaves the perturbed runs' band is the step it started to differ."""

import json
import math

import pytest
import torch
import xxhash

from tracer import Partial, Replicate, Shard
from tracer.collector import Tracer
from tracer.errors import TraceError
from tracer.fingerprint_log import FingerprintLog
from tracer.fingerprint_read import FingerprintRun, step_of
from tracer.logical import load_logical
from tracer.scan_judge import judge_steps, pair_noise
from tracer.stats import local_stats
from tracer.stats_compare import Band, band, logical_stats
from tracer.tolerance import TolerancePolicy

NAMES = ("w", "b")


def logical(step: int, seed: int, run_eps: float = 0.0) -> dict[str, torch.Tensor]:
    """A run's logical tensors at `step`: a shared trajectory moved by `run_eps` (a perturbed run)."""
    g = torch.Generator().manual_seed(1000 + step)
    base = {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g)}
    if run_eps:
        u = torch.Generator().manual_seed(seed)
        base = {n: t * (1 + run_eps * (2 * torch.rand(t.shape, generator=u) - 1)) for n, t in base.items()}
    return base


def write_run(root, run, steps, *, tp=1, eps=0.0, seed=0, bug_from=None, block_steps=4, grads=False,
              lost_grad_from=None):
    """A run of `steps` steps (plus the initial weights, step -1) traced through the Tracer in scan mode;
    with tp=2, w is sharded on dim 0 and b replicated; from `bug_from`, one shard of w is scaled.
    `grads`: b's param grad is logged too, except from step `lost_grad_from` on."""
    for rank in range(tp):
        tr = Tracer(str(root), run, rank, {"tp": rank}, {"tp": tp}, {"fingerprint": "f"}, mode="scan",
                    kinds=("param", "param_grad", "loss"))
        tr._writer.block_steps = block_steps
        for step in range(-1, steps):
            with tr.step(step):
                full = logical(step, seed, eps)
                w = full["w"].chunk(tp)[rank] if tp > 1 else full["w"]
                if bug_from is not None and step >= bug_from and rank == 0:
                    w = w * 1.01
                tr.record("layer.w", "param", w, Shard(0) if tp > 1 else Replicate(), module_type="Linear")
                tr.record("layer.b", "param", full["b"], Replicate(), module_type="Linear")
                tr.record("layer.w", "output", w)   # not a selected kind: never logged
                if grads and step >= 0 and (lost_grad_from is None or step < lost_grad_from):
                    tr.record("layer.b", "param_grad", full["b"] * 0.1, Replicate(), module_type="Linear")
                if step >= 0:   # the loss moves with the bug (every rank logs the same value)
                    bugged = bug_from is not None and step >= bug_from
                    tr.record_loss(full["w"].double().sum() * (1.005 if bugged else 1.0), microbatch=0)
        tr.close()


def test_the_log_round_trips_the_statistics_of_stats_mode(tmp_path):
    write_run(tmp_path, "reference", 5)
    run = FingerprintRun(str(tmp_path), "reference", 1)
    views = list(run.steps())
    assert [step_of(v) for v in views] == [-1, 0, 1, 2, 3, 4]
    assert run.blocks == 2 and run.bytes > 0          # 6 steps in blocks of 4
    v = views[3]
    full = logical(2, 0)
    names = sorted(v.order)
    assert names == ["2/-/layer.b/param", "2/-/layer.w/param", "2/0/loss/loss"]   # no output: kinds
    (_, rec), = v.tensors.pieces("2/-/layer.w/param")
    assert rec["stats"] == local_stats([full["w"]])[0]   # the same four statistics, hash included
    assert v.info["2/-/layer.w/param"]["kind"] == "param" and v.shape("2/-/layer.w/param") == (8, 6)
    with pytest.raises(TraceError, match="fingerprint log"):
        load_logical(str(tmp_path), "reference", 1)


def test_the_writers_memory_and_the_manifest_do_not_grow_with_steps(tmp_path):
    log = FingerprintLog(str(tmp_path), "r", 0, {"rank": 0, "coords": {}, "sizes": {}}, block_steps=3)
    t = torch.ones(4)
    held = []
    for step in range(20):
        log.add((f"{step}/-/a/param", "a", "", "param", step, None, 0, Replicate().to_json(), 1.0), t)
        log.flush()
        held.append((len(log.names), len(log._rows), len(log._pending)))
    assert {h[0] for h in held} == {1} and max(h[1] for h in held) < 3 and {h[2] for h in held} == {0}
    assert log.entries == []
    log.close()
    run = FingerprintRun(str(tmp_path), "r", 1)
    assert len(run.ranks[0].manifest["names"]) == 1 and run.blocks == 7
    assert [step_of(v) for v in run.steps()] == list(range(20))


def test_a_corrupt_block_is_an_error_naming_its_file(tmp_path):
    write_run(tmp_path, "reference", 5)
    block = tmp_path / "reference" / "rank00000" / "fp-00001.safetensors"
    data = bytearray(block.read_bytes())
    data[-3] ^= 0xFF
    block.write_bytes(bytes(data))
    run = FingerprintRun(str(tmp_path), "reference", 1)
    with pytest.raises(TraceError, match="fp-00001.safetensors.*corrupt"):
        list(run.steps())


def judge(root, world=2):
    runs = lambda name, w=1: FingerprintRun(str(root), name, w).steps()
    perturbed = [runs("perturbed-1"), runs("perturbed-2")]
    return judge_steps(runs("reference"), runs("candidate", world), perturbed, TolerancePolicy(), start=0)


@pytest.mark.parametrize("bug_from", [None, 0, 3])
def test_the_first_step_out_of_the_band_is_the_step_the_candidate_started_to_differ(tmp_path, bug_from):
    write_run(tmp_path, "reference", 6)
    write_run(tmp_path, "perturbed-1", 6, eps=1e-6, seed=1)
    write_run(tmp_path, "perturbed-2", 6, eps=1e-6, seed=2)
    write_run(tmp_path, "candidate", 6, tp=2, eps=3e-7, seed=3, bug_from=bug_from)
    out = judge(tmp_path)
    assert [s.step for s in out.steps] == [-1, 0, 1, 2, 3, 4, 5]
    if bug_from is None:
        assert out.verdict == "pass" and out.first_step is None and all(s.ok for s in out.steps)
        assert 0 < max(s.worst for s in out.steps) <= 1
        return
    assert out.verdict == "fail" and out.first_step == bug_from
    assert out.first is not None and out.first.first_divergence.name == f"{bug_from}/-/layer.w/param"
    before = [s for s in out.steps if s.step < bug_from]
    assert all(s.ok for s in before) and not out.steps[bug_from + 1].ok
    s = out.steps[bug_from + 1]
    assert s.modules["layer"] > 1 and s.kinds["param"] > 1 and s.failing[0].endswith("layer.w/param")
    # the loss moved with w: the candidate's gap against the perturbed runs' spread
    assert abs(s.loss["candidate"] - s.loss["reference"]) > s.loss["spread"] > 0


def test_a_step_whose_candidate_lacks_a_param_grad_fails_there_as_untrained(tmp_path):
    """From step 2 on the candidate logs no grad for b (its step never trained it): the scan's first
    step is 2, failed at that param grad as untrained (tracer.compare), where it once stopped with an
    error; the steps before pass."""
    for run, kw in (("reference", {}), ("perturbed-1", {"eps": 1e-6, "seed": 1}),
                    ("perturbed-2", {"eps": 1e-6, "seed": 2})):
        write_run(tmp_path, run, 5, grads=True, **kw)
    write_run(tmp_path, "candidate", 5, tp=2, eps=3e-7, seed=3, grads=True, lost_grad_from=2)
    out = judge(tmp_path)
    assert out.verdict == "fail" and out.first_step == 2 and all(s.ok for s in out.steps[:3])
    fd = out.first.first_divergence
    assert fd.name == "2/-/layer.b/param_grad" and fd.reason.startswith("no gradient"), fd
    assert [s.failing for s in out.steps[3:]] == [[f"{t}/-/layer.b/param_grad"] for t in (2, 3, 4)]
    assert out.steps[3].worst > 1e8   # a failure no statistic measures: beyond any band


def test_replicas_that_differ_fail_the_step_even_within_the_band(tmp_path):
    write_run(tmp_path, "reference", 2)
    write_run(tmp_path, "perturbed-1", 2, eps=1e-6, seed=1)
    write_run(tmp_path, "perturbed-2", 2, eps=1e-6, seed=2)
    for rank in range(2):   # b is replicated over tp, but rank 1's copy differs in its last bit at step 1
        tr = Tracer(str(tmp_path), "candidate", rank, {"tp": rank}, {"tp": 2}, {}, mode="scan")
        for step in range(-1, 2):
            with tr.step(step):
                full = logical(step, 0)
                b = full["b"].clone()
                if step == 1 and rank == 1:
                    b[0] = torch.nextafter(b[0], torch.tensor(math.inf))
                tr.record("layer.w", "param", full["w"].chunk(2)[rank], Shard(0))
                tr.record("layer.b", "param", b, Replicate())
                if step >= 0:
                    tr.record_loss(full["w"].double().sum(), microbatch=0)
        tr.close()
    out = judge(tmp_path)
    assert out.first_step == 1 and "replicas" in out.first.first_divergence.reason
    assert out.steps[2].worst >= 1e9


def write_scaled(root, run, factors, steps=5):
    """A run whose positive params (every statistic moves with a scale) are the same at every step,
    times factors.get(step, 1) (one rank)."""
    tr = Tracer(str(root), run, 0, {}, {}, {"fingerprint": "f"}, mode="scan", kinds=("param",))
    for step in range(steps):
        with tr.step(step):
            for n, t in logical(0, 0).items():
                t = t.abs() + 0.5
                tr.record(f"layer.{n}", "param", t * factors.get(step, 1.0), Replicate())
    tr.close()


E = 1e-4   # a deviation well above the band's floor (16 ulps of fp32)


def judged_drift(tmp_path, **kw):
    """5 steps: a perturbed run E off at step 0 only (E/100 later), the other E/100 off throughout, the
    candidate 3E off at step 3 alone; judged by judge_steps(**kw)."""
    write_scaled(tmp_path, "reference", {})
    write_scaled(tmp_path, "perturbed-1", {0: 1 + E, **{k: 1 + E / 100 for k in range(1, 5)}})
    write_scaled(tmp_path, "perturbed-2", {k: 1 - E / 100 for k in range(5)})
    write_scaled(tmp_path, "candidate", {3: 1 + 3 * E})
    runs = lambda name: FingerprintRun(str(tmp_path), name, 1).steps()
    return judge_steps(runs("reference"), runs("candidate"), [runs("perturbed-1"), runs("perturbed-2")],
                       TolerancePolicy(), **kw)


@pytest.mark.parametrize("window", [None, 1])
def test_the_band_never_narrows_a_deviation_honest_runs_showed_earlier_is_in_it(tmp_path, window):
    """Honest runs decorrelate and do not recorrelate: a deviation the perturbed runs reached at step 0
    stays in the band at step 3 (the default); a band of that step alone flags it."""
    out = judged_drift(tmp_path, window=window, ahead=0)
    if window is None:
        assert out.verdict == "pass" and 0.5 < out.steps[3].worst <= 1   # 3E against 4 x ~1.01E
    else:
        assert out.first_step == 3 and out.steps[3].worst > 10           # 3E against 4 x 0.02E


@pytest.mark.parametrize("ahead", [32, 4])
def test_a_scan_no_longer_than_its_look_ahead_is_judged_at_k_stats(tmp_path, ahead):
    """5 steps looking 32 ahead: every step's band holds those 5 steps alone, a sample no larger than a
    stats check's, and is judged at k_stats (24) as a stats check is (a clean 2-step scan had flagged
    a bias grad's norm at 1.15 of its band at k). Looking 4 ahead the same bands, longer than the
    look-ahead, are judged at k (4). The candidate's 3E at step 3 against a band of 1.01E."""
    out = judged_drift(tmp_path, ahead=ahead)
    k = 24.0 if ahead == 32 else 4.0
    assert out.k == k and out.verdict == "pass"
    assert out.steps[3].worst * k == pytest.approx(3 / 1.01, rel=1e-2)


def test_two_perturbed_runs_deviation_joins_the_band(tmp_path):
    """Two perturbed runs on either side of the reference are 2E apart: their pair is a sample of the
    honest deviation too, so the family's noise is 2E, not the reference's E."""
    write_scaled(tmp_path, "reference", {}, steps=1)
    write_scaled(tmp_path, "perturbed-1", {0: 1 + E}, steps=1)
    write_scaled(tmp_path, "perturbed-2", {0: 1 - E}, steps=1)
    ref, p1, p2 = (next(FingerprintRun(str(tmp_path), n, 1).steps())
                   for n in ("reference", "perturbed-1", "perturbed-2"))
    b = band(ref, [p1, p2])
    norm_noise = b.pooled[(0, "layer.w", "param")][0]
    assert norm_noise == pytest.approx(E, rel=1e-3)
    assert pair_noise(b, ref)[(0, "layer.w", "param")][0] == pytest.approx(2 * E, rel=1e-3)


@pytest.mark.parametrize("ahead", [3, 0])
def test_a_step_band_looks_ahead_at_the_honest_runs(tmp_path, ahead):
    """Honest runs leave the reference at random times: the candidate's 3E at step 1 is in the band
    when a perturbed run reaches E by step 3 (looking 3 steps ahead; the default looks 32), out of it
    without. (5 steps, longer than either look-ahead: judged at k.)"""
    write_scaled(tmp_path, "reference", {})
    write_scaled(tmp_path, "perturbed-1", {**{k: 1 + E / 100 for k in range(3)}, 3: 1 + E, 4: 1 + E})
    write_scaled(tmp_path, "perturbed-2", {k: 1 - E / 100 for k in range(5)})
    write_scaled(tmp_path, "candidate", {k: 1 + 3 * E for k in range(1, 5)})
    runs = lambda name: FingerprintRun(str(tmp_path), name, 1).steps()
    out = judge_steps(runs("reference"), runs("candidate"), [runs("perturbed-1"), runs("perturbed-2")],
                      TolerancePolicy(), ahead=ahead)
    assert [s.step for s in out.steps] == [0, 1, 2, 3, 4]
    if ahead:
        assert out.verdict == "pass" and 0.5 < out.steps[1].worst <= 1
    else:
        assert out.first_step == 1 and out.steps[1].worst > 10 and out.steps[3].ok


def test_the_scan_scales_errors_by_the_larger_run():
    """A decorrelated run's gradient spike: 1000x a quiet reference is an error of 999 at the
    reference's scale, 0.999 at the larger run's (the scan's band), and the two agree near the reference."""
    from tracer.stats import Stat

    def st(norm):
        return Stat(sumsq=norm * norm, absmax=norm, sum=norm, numel=4, hash="")
    r = st(1.0)
    plain = Band({"g": r}, {"g": (1.0, 1.0)}, {}, {})
    sym = Band({"g": r}, {"g": (1.0, 1.0)}, {}, {}, symmetric=True)
    assert plain.errors(st(1000.0), r, "g")[0] == pytest.approx(999.0)
    assert sym.errors(st(1000.0), r, "g")[0] == pytest.approx(0.999)
    assert sym.errors(r, st(1000.0), "g")[0] == pytest.approx(0.999)          # symmetric in the two runs
    assert sym.errors(st(1 + E), r, "g")[0] == pytest.approx(plain.errors(st(1 + E), r, "g")[0], rel=2 * E)


def write_partial(root, run, steps, *, tp=2, eps=0.0, seed=0, scale_rank1_from=None):
    """A run whose `layer.w` param_grad is a partial sum over tp (each rank holds a part that adds up to
    the logical grad, as a DTensor replica's unreduced grad does); world size 1: the logical grad."""
    for rank in range(tp):
        tr = Tracer(str(root), run, rank, {"tp": rank}, {"tp": tp}, {}, mode="scan")
        tr._writer.block_steps = 2
        for step in range(steps):
            with tr.step(step):
                full = logical(step, seed, eps)
                g = full["w"]
                part = g if tp == 1 else g * (0.25 if rank == 0 else 0.75)
                if scale_rank1_from is not None and step >= scale_rank1_from and rank == 1:
                    part = part * 1.01
                tr.record("layer.w", "param_grad", part, Partial("tp") if tp > 1 else Replicate())
                tr.record("layer.b", "param", full["b"], Replicate())
        tr.close()


@pytest.mark.parametrize("bug_from", [None, 1])
def test_a_partial_sum_is_logged_in_full_and_judged_by_the_statistics_of_its_sum(tmp_path, bug_from):
    """Partial sums cannot be combined from their parts' statistics (stats mode records them in full):
    a scan logs them in full too, and judges the statistics of the reassembled sum."""
    write_partial(tmp_path, "reference", 4, tp=1)
    write_partial(tmp_path, "perturbed-1", 4, tp=1, eps=1e-6, seed=1)
    write_partial(tmp_path, "perturbed-2", 4, tp=1, eps=1e-6, seed=2)
    write_partial(tmp_path, "candidate", 4, eps=3e-7, seed=3, scale_rank1_from=bug_from)
    run = FingerprintRun(str(tmp_path), "candidate", 2)
    names = {e["name"]: e for e in run.ranks[0].manifest["names"]}
    assert names["-/layer.w/param_grad"].get("values") and "values" not in names["-/layer.b/param"]
    view = list(run.steps())[2]
    g = logical(2, 3, 3e-7)["w"]
    sum_stats = local_stats([g * 0.25 + g * 0.75 * (1 if bug_from is None else 1.01)])[0]
    got = logical_stats(view, "2/-/layer.w/param_grad")   # of the sum, not the parts'
    assert got.sumsq == pytest.approx(sum_stats["sumsq"], rel=1e-6) and got.numel == 48
    out = judge_steps(FingerprintRun(str(tmp_path), "reference", 1).steps(), run.steps(),
                      [FingerprintRun(str(tmp_path), p, 1).steps() for p in ("perturbed-1", "perturbed-2")],
                      TolerancePolicy(), start=0)
    if bug_from is None:
        assert out.verdict == "pass" and all(s.ok for s in out.steps), [s.worst for s in out.steps]
    else:
        assert out.first_step == 1 and out.first.first_divergence.name == "1/-/layer.w/param_grad"


def test_a_block_missing_a_partial_sums_values_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    write_partial(tmp_path, "candidate", 2)
    block = tmp_path / "candidate" / "rank00001" / "fp-00000.safetensors"
    data = load_file(block)
    del data[next(k for k in data if k.startswith("values/"))]
    save_file(data, block)
    rank = tmp_path / "candidate" / "rank00001" / "manifest.json"
    manifest = json.loads(rank.read_text())
    digest = xxhash.xxh3_64(block.read_bytes()).hexdigest()   # checksummed anew: the log is whole, not right
    manifest["files"][0].update(bytes=block.stat().st_size, xxh3_64=digest)
    rank.write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="logged in full but its values are missing"):
        list(FingerprintRun(str(tmp_path), "candidate", 2).steps())
