"""Issue 18's late bugs, single-process: the DP grad buckets they live in, the LR schedule, the recipe
keys that place them (bug.from_step, optim.lr_decay_from), and their catalog entries."""

import pytest

from orchestrator import nightly
from orchestrator.recipe import compose, job_spec, reference_key
from orchestrator.report.catalog import main as bugs_cli
from tracer.errors import ConfigError
from workloads import bugs, grad_sync, lr_schedule
from workloads.config import parse, validate
from workloads.model import GPTStage
from workloads.parallel_state import ParallelState

LATE = [n for n, b in bugs.CATALOG.items() if b.is_late]


def _cfg(*overrides: str):
    return parse(job_spec(compose(list(overrides)), role="candidate", store_url=""))


def _stage(cfg) -> GPTStage:
    """The stage a tp2 rank builds (groups unused until forward)."""
    tp, dp = cfg.parallel.tp, cfg.parallel.dp
    ps = ParallelState(rank=0, sizes={"tp": tp, "dp": dp, "pp": 1}, coords={"tp": 0, "dp": 0, "pp": 0},
                       tp_group=None, dp_group=None, pp_group=None, mp_group=None)
    return GPTStage(cfg, ps)


def test_buckets_fill_in_reverse_registration_order_up_to_the_cap():
    assert grad_sync.bucket_indices([5, 3, 4, 2], cap=6) == [[3, 2], [1, 0]]
    assert grad_sync.bucket_indices([5, 3, 4, 2], cap=100) == [[3, 2, 1, 0]]
    assert grad_sync.bucket_indices([], cap=6) == []
    # every parameter in exactly one bucket
    assert sorted(i for b in grad_sync.bucket_indices([7] * 9, cap=10) for i in b) == list(range(9))


@pytest.mark.parametrize("layers", [2, 4])
def test_the_stale_bucket_is_the_last_layers_fc1_under_tp2(layers):
    """Bug.expect of late_grad_bucket_stale (gpt_tiny, tp2_dp2): bucket 1 holds exactly the last
    layer's mlp.fc1 weight and bias, whatever the depth."""
    cfg = _cfg("parallel=tp2_dp2", f"model.layers={layers}")
    named = list(_stage(cfg).named_parameters())
    bucket = grad_sync.bucket_indices([p.numel() for _, p in named])[grad_sync.STALE_BUCKET]
    assert sorted(named[i][0] for i in bucket) == [f"layers.{layers - 1}.mlp.fc1.bias",
                                                   f"layers.{layers - 1}.mlp.fc1.weight"]
    if layers == 4:   # the catalog's trigger recipe (gpt_tiny has 4 layers)
        module, kind = bugs.CATALOG["late_grad_bucket_stale"].expect.split("/")
        assert (module, kind) == ("layers.3.mlp.fc1", "param_grad")


def test_lr_is_constant_until_the_decay_then_falls_linearly():
    cfg = _cfg("optim.lr_decay_from=3", "optim.lr_decay_steps=4")
    gb = cfg.global_batch
    lrs = [lr_schedule.lr_at(cfg, s * gb) for s in range(9)]
    assert lrs[:3] == [cfg.lr] * 3
    assert lrs[3] == pytest.approx(cfg.lr * (1 - 0.9 / 4)) and lrs[6:] == [pytest.approx(0.1 * cfg.lr)] * 3
    assert all(a > b for a, b in zip(lrs[2:7], lrs[3:7], strict=False))
    assert [lr_schedule.lr_at(_cfg(), s * gb) for s in range(5)] == [cfg.lr] * 5   # null: constant


def test_a_scheduler_stepped_by_local_samples_decays_dp_times_late():
    """The mechanism of lr_schedule_local_samples: identical LRs before the boundary, then not."""
    cfg = _cfg("parallel=tp2_dp2", "optim.lr_decay_from=2")

    class Opt:
        param_groups = [{"lr": None}]

    def lrs(increment: int) -> list[float]:
        sched, out = lr_schedule.Scheduler(cfg), []
        for _ in range(6):
            out.append(sched.set(Opt))
            sched.step(increment)
        return out

    right, local = lrs(cfg.global_batch), lrs(cfg.micro_batch * cfg.micro_batches_local)
    assert cfg.parallel.dp == 2 and right[:2] == local[:2] == [cfg.lr] * 2
    assert right[2] < cfg.lr and local[2:4] == [cfg.lr] * 2 and local[4] == right[2]


def test_from_step_reaches_the_rank_config_and_keys_the_reference():
    late = ["parallel=tp2_dp2", "bug=late_grad_bucket_stale"]
    assert _cfg(*late).bug_from_step == bugs.DEFAULT_FROM_STEP == 100
    assert _cfg(*late, "bug.from_step=7").bug_from_step == 7
    assert reference_key(compose([*late, "bug.from_step=7"])) != reference_key(compose(late))
    lr = ["parallel=tp2_dp2", "optim.lr_decay_from=5"]
    assert _cfg(*lr).lr_decay_from == 5
    assert reference_key(compose(lr)) != reference_key(compose(["parallel=tp2_dp2"]))


@pytest.mark.parametrize("overrides, what", [
    (["bug=late_grad_bucket_stale", "bug.from_step=0"], "bug.from_step=0 must be >= 1"),
    (["bug=dp_grad_not_averaged", "bug.from_step=5"], "read by late bugs only"),
    (["optim.lr_decay_from=-1"], "optim.lr_decay_from=-1"),
    (["optim.lr_decay_steps=0"], "optim.lr_decay_steps=0"),
])
def test_bad_late_keys_are_refused(overrides, what):
    with pytest.raises(ConfigError, match=what):
        validate(job_spec(compose(["parallel=tp2_dp2", *overrides]), role="candidate", store_url=""))


@pytest.mark.parametrize("name", LATE)
def test_a_late_bug_is_catalogued_with_its_real_step_and_an_early_one(name):
    bug = bugs.CATALOG[name]
    assert bug.source.startswith("https://") and bug.expect and bug.trigger
    early, late = dict(o.split("=", 1) for o in bug.early), dict(o.split("=", 1) for o in bug.late)
    assert early.keys() == late.keys() and len(early) == 1
    assert [int(v) for v in early.values()] == [1] and [int(v) for v in late.values()] == [bug.first_step]
    assert bug.recipe == (*bug.trigger, *bug.early) and bug.scan_recipe == (*bug.trigger, *bug.late)
    validate(job_spec(compose([*bug.recipe, f"bug={name}"]), role="candidate", store_url=""))
    # The nightly runs it as an ordinary 2-step check at its early step, and says so.
    entry = next(e for e in nightly.plan(["nightly=quick", f"bugs={name}", "clean="])[1]
                 if e["label"] == f"bug-{name}")
    assert entry["overrides"][:len(bug.recipe)] == list(bug.recipe) and entry["late_step"] == bug.first_step


def test_ttrace_bugs_shows_a_late_bugs_step(capsys):
    assert bugs_cli(["late_grad_bucket_stale"]) == 0
    out = capsys.readouterr().out
    assert "first_step: 100" in out and "bug.from_step=100" in out
    assert "run it:  ttrace parallel=tp2_dp2 bug.from_step=1 bug=late_grad_bucket_stale" in out

