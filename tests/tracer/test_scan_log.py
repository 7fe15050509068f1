"""`ttrace scan`'s per-step fingerprint log (tracer/fingerprint_log.py, fingerprint_read.py) and its
band logic (tracer/scan_judge.py), in one process: the log round-trips the statistics of
tracer/stats.py, its writer's memory does not grow with the steps, a corrupt block is an error naming
it, and the first step a candidate leaves the perturbed runs' band is the step it started to differ."""

import math

import pytest
import torch

from tracer import Replicate, Shard
from tracer.collector import Tracer
from tracer.errors import TraceError
from tracer.fingerprint_log import FingerprintLog
from tracer.fingerprint_read import FingerprintRun, step_of
from tracer.logical import load_logical
from tracer.scan_judge import judge_steps
from tracer.stats import local_stats
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


def write_run(root, run, steps, *, tp=1, eps=0.0, seed=0, bug_from=None, block_steps=4):
    """A run of `steps` steps (plus the initial weights, step -1) traced through the Tracer in scan mode;
    with tp=2, w is sharded on dim 0 and b replicated; from `bug_from`, one shard of w is scaled."""
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
