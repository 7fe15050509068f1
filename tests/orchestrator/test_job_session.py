"""The job contract on the job's side (tracer/job.py), without Ray: what a session reads from its
environment, that it does nothing outside ttrace, that its perturbation is the same logical move in
every layout, and that the recipe refuses keys it would ignore."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from tracer import ModuleLayout, Shard
from tracer.errors import ConfigError
from tracer.job import Session
from tracer.job_config import JobConfig
from tracer.parameters import init_parameters, perturb_parameters
from tracer.plan import param_layouts


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def test_outside_ttrace_the_session_is_disabled_and_changes_nothing(tmp_path):
    cfg = JobConfig.from_env({"RANK": "0", "WORLD_SIZE": "2"}, tp=2, sp=True, seed=5, steps=3)
    tr = Session(cfg)
    assert not tr.enabled and tr.role == "untraced"
    assert (tr.parallel.tp, tr.parallel.sp, tr.parallel.dp, tr.seed, tr.steps) == (2, True, 1, 5, 3)
    m = model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    assert tr.attach(m) is m
    with tr.step(0), tr.microbatch(0):
        m(torch.randn(2, 4)).sum().backward()
    tr.record_param_grads(m)
    tr.record_params(m)
    tr.close()
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters())   # bit-identical weights
    assert not any(mod._forward_hooks or "forward" in mod.__dict__ for mod in m.modules())
    assert list(tmp_path.iterdir()) == []


def test_the_recipe_reaches_the_job_and_wins_over_the_scripts_defaults():
    spec = {"parallel": {"name": "tp2_sp", "world_size": 2, "tp": 2, "pp": 1, "sp": True}, "seed": 7,
            "steps": 4, "trace": {"store_url": "memory://s", "role": "candidate", "run": "candidate",
                                  "fingerprint": "f"}}
    cfg = JobConfig.from_spec(spec, env={"RANK": "1", "WORLD_SIZE": "2"}, tp=1, seed=0, steps=99)
    got = (cfg.parallel.tp, cfg.parallel.sp, cfg.seed, cfg.steps, cfg.rank, cfg.role)
    assert got == (2, True, 7, 4, 1, "candidate")
    with pytest.raises(ConfigError, match="WORLD_SIZE=4"):
        JobConfig.from_spec(spec, env={"RANK": "0", "WORLD_SIZE": "4"})
    # What ttrace's launcher exports gives the same config back in the job's process.
    env = {"RANK": "1", "WORLD_SIZE": "2", **cfg.env()}
    assert JobConfig.from_env(env) == cfg


@pytest.mark.parametrize("env, needle", [
    ({"TTRACE_ROLE": "perturbed", "TTRACE_STORE": "/x"}, "TTRACE_PERTURB=r"),
    ({"TTRACE_ROLE": "candidate"}, "needs TTRACE_STORE"),
    ({"TTRACE_STORE": "/x"}, "set TTRACE_ROLE"),
    ({"TTRACE_ROLE": "baseline", "TTRACE_STORE": "/x"}, "not a role"),
    ({"TTRACE_ROLE": "isolated", "TTRACE_STORE": "/x"}, "TTRACE_REFERENCE"),
    ({"TTRACE_ROLE": "candidate", "TTRACE_STORE": "/x", "TTRACE_PERTURB": "1"}, "only perturbed"),
    ({"TTRACE_ROLE": "candidate", "TTRACE_STORE": "/x", "TTRACE_MODE": "scan"}, "made by `ttrace scan`"),
    ({"TTRACE_ROLE": "candidate", "TTRACE_STORE": "/x", "TTRACE_MODE": "stat"}, "use full or stats"),
])
def test_a_wrong_environment_is_refused_with_what_to_set(env, needle):
    with pytest.raises(ConfigError, match=needle):
        JobConfig.from_env(env)


def test_ttrace_launches_its_ranks_with_the_recipes_trace_mode(tmp_path):
    """A run made by hand traces in full unless TTRACE_MODE says otherwise; ttrace's launcher sets
    TTRACE_MODE from the recipe, so a shell's never overrides one (stats by hand: the test below)."""
    from orchestrator.jobs import rank_env
    from orchestrator.recipe import compose, job_spec

    base = {"TTRACE_STORE": str(tmp_path), "RANK": "0", "WORLD_SIZE": "1", "TTRACE_ROLE": "reference"}
    assert JobConfig.from_env(base).mode == "full"
    launched = lambda *over: rank_env(job_spec(compose(["parallel=single", *over]), role="candidate",
                                               store_url=str(tmp_path)), 0, 1, "127.0.0.1", 1, 0, 1)
    assert launched()["TTRACE_MODE"] == "full"   # set, over whatever the worker's environment holds
    assert JobConfig.from_env({"RANK": "0", "WORLD_SIZE": "1", **launched("trace.mode=scan")}).mode == "scan"


def test_a_manual_launch_names_its_runs_by_role():
    base = {"TTRACE_STORE": "/x", "RANK": "0", "WORLD_SIZE": "1"}
    assert JobConfig.from_env({**base, "TTRACE_ROLE": "reference"}).run == "reference"
    perturbed = {**base, "TTRACE_ROLE": "perturbed", "TTRACE_PERTURB": "2"}
    assert JobConfig.from_env(perturbed).run == "perturbed-2"
    assert JobConfig.from_env({**base, "TTRACE_ROLE": "candidate", "TTRACE_RUN": "tp4"}).run == "tp4"


PLAN = {"0": ModuleLayout(output=Shard(-1, "tp"), params={"weight": Shard(0, "tp"), "bias": Shard(0, "tp")}),
        "2": ModuleLayout(params={"weight": Shard(1, "tp")})}


def _shard(full: nn.Module, tp: int, r: int) -> nn.Module:
    """Rank r's column/row-parallel shard of `model()` (the plan's layouts)."""
    m = nn.Sequential(nn.Linear(4, 8 // tp), nn.LayerNorm(8), nn.Linear(8 // tp, 3))
    layouts = param_layouts(m, PLAN)
    with torch.no_grad():
        for (name, p), (_, q) in zip(m.named_parameters(), full.named_parameters(), strict=True):
            p.copy_(layouts[name].local(q, {"tp": r}, {"tp": tp}))
    return m


def test_the_perturbation_moves_every_weight_one_ulp_the_same_way_in_every_layout():
    """A perturbed run of any layout moves the same logical weights the same way (signs per element of
    the logical tensor, sliced by the layout), and moves every element (a one-ulp step, not a
    multiplication by 1 + eps that rounds back)."""
    full = model()
    orig = {n: p.detach().clone() for n, p in full.named_parameters()}
    perturb_parameters(full, param_layouts(full, {}), 3, {}, {})
    for n, p in full.named_parameters():
        assert (p != orig[n]).all(), n
        assert ((p.double() - orig[n].double()).abs() <= orig[n].double().abs() * 2**-23 + 1e-44).all()
    for r in range(2):
        shard = _shard(model(), 2, r)
        perturb_parameters(shard, param_layouts(shard, PLAN), 3, {"tp": r}, {"tp": 2})
        layouts = param_layouts(shard, PLAN)
        for (name, p), (_, q) in zip(shard.named_parameters(), full.named_parameters(), strict=True):
            assert torch.equal(p, layouts[name].local(q.detach(), {"tp": r}, {"tp": 2})), (name, r)
    other = model()
    perturb_parameters(other, param_layouts(other, {}), 4, {}, {})
    assert not torch.equal(other[0].weight, full[0].weight)   # another run r, other signs


def test_consistent_weights_are_the_same_logical_tensor_in_every_layout():
    full = model()
    init_parameters(full, param_layouts(full, {}), 11, {}, {})
    assert torch.equal(full[1].weight, torch.ones(8)) and torch.equal(full[0].bias, torch.zeros(8))
    for r in range(2):
        shard = _shard(model(), 2, r)
        layouts = param_layouts(shard, PLAN)
        init_parameters(shard, layouts, 11, {"tp": r}, {"tp": 2})
        for (name, p), (_, q) in zip(shard.named_parameters(), full.named_parameters(), strict=True):
            assert torch.equal(p, layouts[name].local(q.detach(), {"tp": r}, {"tp": 2})), name


def test_a_plan_needs_the_ranks_mesh_coordinates(tmp_path):
    tr = Session(JobConfig.from_env({"TTRACE_ROLE": "candidate", "TTRACE_STORE": str(tmp_path)}))
    with pytest.raises(ConfigError, match="coords and sizes"):
        tr.attach(model(), PLAN)


def test_a_session_never_attached_commits_an_empty_trace_that_says_so(tmp_path):
    import json

    tr = Session(JobConfig.from_env({"TTRACE_ROLE": "candidate", "TTRACE_STORE": str(tmp_path)}))
    tr.close()
    manifest = json.loads((tmp_path / "candidate" / "rank00000" / "manifest.json").read_text())
    assert manifest["entries"] == [] and manifest["meta"]["attached"] is False


@pytest.mark.parametrize("given_by", ["recipe", "TTRACE_MODE"])
def test_trace_mode_stats_reaches_any_jobs_tracer_through_the_session(tmp_path, given_by):
    """The mode lives in the tracer: a user's job gets it from its spec (under ttrace) or from
    TTRACE_MODE=stats (a run made by hand, plain torchrun), with no code of its own."""
    import json

    from orchestrator.recipe import compose, job_spec

    env = {"RANK": "0", "WORLD_SIZE": "1"}
    if given_by == "recipe":
        spec = job_spec(compose(["trace.mode=stats", "parallel=single"]), role="candidate",
                        store_url=str(tmp_path))
        env["TTRACE_SPEC"] = json.dumps(spec)
    else:
        env.update(TTRACE_ROLE="candidate", TTRACE_STORE=str(tmp_path), TTRACE_MODE="stats")
    tr = Session(JobConfig.from_env(env))
    m = tr.attach(model())
    with tr.step(0):
        with tr.microbatch(0):
            m(torch.randn(2, 4)).sum().backward()
        tr.record_param_grads(m)
    tr.close()
    manifest = json.loads((tmp_path / "candidate" / "rank00000" / "manifest.json").read_text())
    assert manifest["mode"] == "stats" and manifest["files"] == []
    grad = next(e for e in manifest["entries"] if e["name"] == "0/-/0.weight/param_grad")
    assert grad["stats"]["sumsq"] == pytest.approx(float(m[0].weight.grad.double().square().sum()))


def test_an_unknown_recipe_key_exits_2_naming_it(tmp_path):
    """`+key=...` bypasses Hydra's struct mode; a key ttrace would ignore must not yield a PASS."""
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "+framework._target_=x",
                           "tracking.enabled=false"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown recipe key 'framework'" in proc.stderr and "PASS" not in proc.stdout


def test_a_renamed_recipe_key_is_named_with_its_new_name_when_hydra_refuses_it(tmp_path):
    """Hydra refuses a key its struct does not hold before ttrace's schema sees it; ttrace's line after
    Hydra's message then says what a renamed key is called now."""
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "tolerance.k_stats_draws=24",
                           "tracking.enabled=false"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "could not be composed" in proc.stderr
    assert "tolerance.k_stats_draws is now tolerance.k_stats" in proc.stderr


@pytest.mark.parametrize("overrides, needle", [
    (["+model.dropout=0.1"], "unknown recipe key 'model.dropout'"),
    (["steps=two"], "'steps'='two' must be int"),
    (["job.command=python train.py", "bug=dp_grad_not_averaged"], "unused by job"),
    (["job=torch_native", "job.command=python train.py"], "both set"),
    (["job.command=python no_such_script.py"], "no_such_script.py not found"),
    (["job.entrypoint=no_such_module:main"], "cannot be imported"),
    (["job=torch_native", "tolerance.perturbation=gemm"], "built-in trainer only"),
    (["tolerance.perturbation=gemms"], "use auto, weights or gemm"),
    (["trace.mode=fast"], "trace.mode='fast': use full"),
    (["+tolerance.k_stats_draws=24"], "'tolerance.k_stats_draws' is now tolerance.k_stats"),
])
def test_recipes_a_check_would_misread_are_refused(tmp_path, overrides, needle):
    from orchestrator.recipe import compose, validate

    with pytest.raises(ConfigError, match=needle):
        validate(compose(overrides), str(tmp_path))


def test_a_command_is_split_like_a_shell_line_with_the_ranks_variables():
    from orchestrator.jobs import command_argv

    env = {"TTRACE_RUN": "candidate", "RANK": "1"}
    assert command_argv("python 'my train.py' --run $TTRACE_RUN --r=${RANK}", env) == \
        ["python", "my train.py", "--run", "candidate", "--r=1"]


class _NullTracer:
    """Records nothing (the session's tracer_factory): the test looks at the weights only."""
    def __getattr__(self, name):
        import contextlib

        return lambda *a, **k: contextlib.nullcontext() if name in ("step", "microbatch") else None


@pytest.mark.parametrize("steps_mode", ["first", "every"])
def test_a_perturbed_run_moves_its_weights_after_every_step_only_when_asked(steps_mode):
    """tolerance.perturbation_steps=every (`ttrace scan`): after each optimizer step (record_params) the
    perturbed run's weights move one ulp again, with new signs each step; `first` moves them once."""
    spec = {"parallel": {"name": "single", "world_size": 1}, "seed": 7, "steps": 3,
            "trace": {"store_url": "memory://s", "role": "perturbed", "run": "perturbed-1", "perturb": 1,
                      "fingerprint": "f", "perturbation_steps": steps_mode}}
    tr = Session(JobConfig.from_spec(spec, env={"RANK": "0", "WORLD_SIZE": "1"}),
                 tracer_factory=lambda *a: _NullTracer())
    m = model()
    start = {n: p.detach().clone() for n, p in m.named_parameters()}
    tr.attach(m)
    attached = {n: p.detach().clone() for n, p in m.named_parameters()}
    assert all(not torch.equal(start[n], attached[n]) for n in start)   # the initial one-ulp move
    moves = []
    for step in range(2):
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        with tr.step(step):
            tr.record_params(m)
        moves.append({n: p.detach() - before[n] for n, p in m.named_parameters()})
    w = "0.weight"
    if steps_mode == "first":
        assert all(not d.any() for mv in moves for d in mv.values())
    else:   # every element moved, each step by one ulp, with different signs in the two steps
        assert all(d.ne(0).all() for mv in moves for d in mv.values())
        assert not torch.equal(moves[0][w].sign(), moves[1][w].sign())
        assert (moves[0][w].abs() <= torch.finfo(torch.float32).eps * attached[w].abs().max()).all()


def test_a_reused_process_keeps_no_finished_jobs_session(tmp_path):
    """A process that runs job after job (the built-in trainer's ranks in Ray workers did until they
    were forked; bench/perf.py's sessions still do): once a job is done nothing may keep its session
    alive. An exit handler per session once did, with the writer's 32 MB slabs: +100 MB of RSS per
    job until Ray's memory monitor killed ranks. The worker's own
    objects are frozen out of the GC's passes while a job runs, and thawed after it."""
    script = f"""
import gc, socket
import workloads.train
from orchestrator import recipe
from orchestrator.jobs import run_rank
from tracer.job import Session
frozen = []
def main(real=workloads.train.main):
    frozen.append(gc.get_freeze_count())
    return real()
workloads.train.main = main
rec = recipe.compose(["parallel=single", "tracking.enabled=false", "model.layers=1", "steps=1"])
for i in range(2):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = recipe.job_spec(rec, run="candidate", store_url="{tmp_path}/" + str(i), role="candidate")
    run_rank(spec, 0, 1, "127.0.0.1", port)
    gc.collect()
    print("live sessions", sum(isinstance(o, Session) for o in gc.get_objects()))
print("frozen in each job", all(n > 10000 for n in frozen), len(frozen), "after", gc.get_freeze_count())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["live sessions 0", "live sessions 0",
                                          "frozen in each job True 2 after 0"], out.stdout


@pytest.mark.parametrize("init", [{}, {"checkpoint": "/ckpt/step-200"}])
def test_a_runs_meta_says_whether_it_started_from_a_checkpoint(init):
    """A trace records whether its step 0 may be Adam's first update from a fresh state (the
    comparison's first-update excusal, tracer/excusal.py): not so from a checkpoint, which may hold
    the optimizer's moments."""
    spec = {"parallel": {"name": "single", "world_size": 1}, "seed": 7, "steps": 2, "init": init,
            "trace": {"store_url": "memory://s", "role": "candidate", "run": "candidate", "fingerprint": "f"}}
    meta = JobConfig.from_spec(spec, env={"RANK": "0", "WORLD_SIZE": "1"}).meta()
    assert meta["from_checkpoint"] is bool(init)
