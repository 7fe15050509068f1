"""Your own training code under ttrace (the job contract): the examples checked by `ttrace
job.command=...` from a directory outside the package (a user's repository), a function as
`job.entrypoint`, jobs that fail or trace nothing, and runs made by plain torchrun, without Ray, judged
by `ttrace compare`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.console import report_paths

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TTRACE = str(Path(sys.executable).parent / "ttrace")


@pytest.fixture(scope="module")
def user_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's repository: their scripts, nothing of ttrace's but the installed `ttrace` command."""
    root = tmp_path_factory.mktemp("user_repo")
    shutil.copytree(EXAMPLES, root / "examples")
    # The team's own recipe options beside its code (found with --config-dir, the Hydra way).
    (root / "recipes" / "job").mkdir(parents=True)
    (root / "recipes" / "parallel").mkdir()
    (root / "recipes" / "job" / "ddp_by_hand.yaml").write_text(
        "name: ddp-by-hand\nentrypoint: train:main\nworkdir: examples/ddp_by_hand\n")
    (root / "recipes" / "parallel" / "two_replicas.yaml").write_text(
        "name: two_replicas\nworld_size: 2\ntp: 1\npp: 1\nsp: false\n")
    return root


CHECKS = {
    "tp_sp": ["job.command=python examples/dtensor_tp_sp/train.py", "parallel=tp2_sp"],
    "tp_sp_bug": ["job.command=python examples/dtensor_tp_sp/train.py --bug norm_not_sequence_parallel",
                  "parallel=tp2_sp", "tracking.enabled=false"],
    # Detection only: the isolation pass of a command job is the tp_sp_bug check's.
    "ddp_bug": ["job.command=python examples/ddp_by_hand/train.py --bug skip_1d_allreduce", "parallel=dp2",
                "localize=false", "tracking.enabled=false"],
    "ddp_entrypoint": ["--config-dir", "recipes", "job=ddp_by_hand", "parallel=two_replicas"],
    # torch.distributed.pipelining's 1F1B at pp=2 against the same script's plain loop on one device
    "pipelining": ["job.command=python examples/pipelining/train.py", "parallel=pp2",
                   "tracking.enabled=false"],
    "pipelining_bug": ["job.command=python examples/pipelining/train.py --bug grads_not_scaled",
                       "parallel=pp2", "localize=false", "tracking.enabled=false"],
}


@pytest.fixture(scope="module")
def checks(ray_cluster: str, user_repo: Path) -> dict[str, tuple[int, str, dict]]:
    """The issue's commands as a user types them (plus the entrypoint form), run at once on the test
    session's Ray cluster: {name: (exit code, output, report)}."""
    # R=2 perturbed runs (the default is 3): 4 fewer jobs of fresh rank processes, same verdicts.
    procs = {name: subprocess.Popen([TTRACE, *args, "tolerance.perturbations=2",
                                     f"cluster.address={ray_cluster}"], cwd=user_repo,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, args in CHECKS.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=1200)
        paths = report_paths(stdout, user_repo)
        report = json.loads(paths[-1].read_text()) if paths else {}
        out[name] = (proc.returncode, stdout[-3000:] + stderr[-5000:], report)
    return out


def test_a_clean_dtensor_tp_sp_script_passes_and_keeps_every_ranks_log(checks, user_repo):
    code, output, report = checks["tp_sp"]
    assert code == 0 and report["verdict"] == "pass", output
    assert len(report["tensors"]) > 300 and all(t["ok"] for t in report["tensors"])
    assert report["job"]["label"] == "python examples/dtensor_tp_sp/train.py"
    logs = report["logs"]
    assert sorted(logs) == ["candidate", "perturbed-1", "perturbed-2", "reference"]
    assert logs["candidate"] == ["logs/candidate/rank00000.log", "logs/candidate/rank00001.log"]
    (path,) = [p for p in user_repo.glob("outputs/*/*/report.json") if json.loads(p.read_text())["check_id"]
               == report["check_id"]]
    assert "step 1 loss" in (path.parent / logs["candidate"][0]).read_text()   # the script's own output
    assert 'href="logs/candidate/rank00001.log"' in (path.parent / "report.html").read_text()


def test_a_norm_left_out_of_sequence_parallel_is_named_by_shape_and_isolated(checks):
    code, output, report = checks["tp_sp_bug"]
    assert code == 1 and report["verdict"] == "fail", output
    fd, culprit = report["first_divergence"], report["culprit"]
    assert fd["module"] == "layers.1.ffn_norm" and fd["kind"] == "output", fd
    assert fd["reason"].startswith("shape: candidate reassembles to shape (2, 8, 32)"), fd
    assert culprit["resolved"] and culprit["module"] == "layers.1.ffn_norm", culprit
    assert report["blame_window"]["size"] == 1 and report["origin"] == "local"


def test_data_parallel_by_hand_skipping_1d_all_reduces_fails_at_a_1d_param(checks):
    code, output, report = checks["ddp_bug"]
    assert code == 1 and report["verdict"] == "fail", output
    fd = report["first_divergence"]
    assert fd["kind"] == "param_grad" and fd["module"] == "blocks.0.norm", fd


def test_a_pipelined_script_passes_and_its_unscaled_microbatch_grads_fail(checks):
    """tracer.integrations.pipelining in a user's script: the schedule's microbatches traced under
    their indices (the clean check matches the one-device loop), and grads left n_microbatches times
    too large (scale_grads=False with a mean loss) fail at the first param grad, 4x off."""
    code, output, report = checks["pipelining"]
    assert code == 0 and report["verdict"] == "pass", output
    assert {t["microbatch"] for t in report["tensors"] if t["kind"] == "output"} == {0, 1, 2, 3}
    code, output, report = checks["pipelining_bug"]
    assert code == 1 and report["verdict"] == "fail", output
    fd = report["first_divergence"]
    assert fd["kind"] == "param_grad" and fd["rel_err"] == pytest.approx(3.0, rel=1e-3), fd


def test_a_function_is_a_job_too_and_a_teams_own_recipe_options_are_found(checks):
    """job=ddp_by_hand and parallel=two_replicas live in the user's recipes/ (--config-dir); the job is
    a function (job.entrypoint=train:main) in job.workdir."""
    code, output, report = checks["ddp_entrypoint"]
    assert code == 0 and report["verdict"] == "pass", output
    assert report["job"]["entrypoint"] == "train:main" and report["job"]["label"] == "ddp-by-hand"
    assert report["recipe"]["parallel"]["name"] == "two_replicas"
    assert any(t["kind"] == "param" for t in report["tensors"])


def test_user_jobs_are_logged_to_mlflow_with_their_job(checks, user_repo):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{user_repo}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["ttrace"], output_format="list")
    by_check = {r.data.tags["check_id"]: r for r in runs}
    for name in ("tp_sp", "ddp_entrypoint"):   # the checks that log (the bug checks do not)
        report = checks[name][2]
        run = by_check[report["check_id"]]
        assert run.data.tags["job"] == report["job"]["label"]
        assert run.data.tags["verdict"] == report["verdict"]


# -- jobs that fail, never set up the tracer, or trace nothing: exit 2 naming the rank -----------------
SCRIPTS = {
    "crash.py": "import sys\nprint('loading shards...')\n"
                "print('CUDA out of memory (pretend)', file=sys.stderr)\nsys.exit(3)\n",
    "untraced.py": "print('training without ever calling tracer.session()')\n",
    "unattached.py": "import tracer\ntr = tracer.session()\nprint('set up, but no model attached')\n",
    # Rank 1 dies while rank 0 waits for it in the process group's rendezvous (as in a collective):
    # the error names rank 1, however late its worker started.
    "rank1_dies.py": "import os, sys, tracer\nimport torch.distributed as dist\ntr = tracer.session()\n"
                     "if os.environ['RANK'] == '1':\n    print('rank 1 gives up', file=sys.stderr)\n"
                     "    sys.exit(5)\ndist.init_process_group('gloo')\n",
}


FAILING = {
    "crash.py": ("single", ["job 'candidate' failed: rank 0 exited with code 3",
                            "CUDA out of memory (pretend)"]),
    "untraced.py": ("single", ["rank 0 finished but committed no trace", "never called tracer.session()",
                               "training without ever calling"]),
    "unattached.py": ("single", ["rank 0 traced nothing: it called tracer.session() but never "
                                 "tr.attach(model)"]),
    "rank1_dies.py": ("dp2", ["rank 1 exited with code 5", "rank 1 gives up"]),
}


@pytest.fixture(scope="module")
def faulty(ray_cluster, tmp_path_factory):
    """Every job below that fails, hangs or aborts, as one batch of checks on the cluster (as a sweep
    runs them: they overlap instead of queueing one after the other)."""
    from orchestrator.check import run_checks
    from orchestrator.recipe import compose

    base = tmp_path_factory.mktemp("faulty")
    scripts = {**{name: SCRIPTS[name] for name in FAILING}, "hang_forever.py": HANGS,
               "after.py": ABORTS_AT_EXIT, "before.py": ABORTS_AT_EXIT.replace("tr.close()\n", "")}
    for name, text in scripts.items():
        (base / name).write_text(text)
    common = ["tolerance.perturbations=2", "tracking.enabled=false", f"cluster.address={ray_cluster}"]
    recipes = {name: [f"job.command=python {name}", f"parallel={parallel}", *common]
               for name, (parallel, _) in FAILING.items()}
    recipes["hang_forever.py"] = ["job.command=python hang_forever.py", "parallel=single", "timeout_s=10",
                                  *common]
    for name in ("after.py", "before.py"):
        recipes[name] = [f"job.command=python {name}", "parallel=single", "+job.env.ABORT=after", *common]
    recipes["before.py"].append("job.warm_start=false")   # the same exits from a fresh interpreter
    results = run_checks([(compose(r), base / name.removesuffix(".py")) for name, r in recipes.items()],
                         base_dir=str(base))
    return base, dict(zip(recipes, results, strict=True))


@pytest.mark.parametrize("script", list(FAILING))
def test_a_job_that_fails_or_traces_nothing_is_an_error_naming_the_rank(faulty, script):
    base, results = faulty
    res = results[script]
    assert res.verdict == "error" and res.exit_code == 2, res.report.get("first_divergence")
    for needle in FAILING[script][1]:
        assert needle in res.message, res.message
    saved = json.loads(res.report_path.read_text())
    assert saved["verdict"] == "error" and saved["tensors"] == []
    logs = saved["logs"]["candidate"]   # what the failed ranks wrote is kept
    out = base / script.removesuffix(".py")
    assert logs and all((out / p).exists() for p in logs)


HANGS = ("import os, time, tracer\ntr = tracer.session()\nprint('hanging in', os.getpid(), flush=True)\n"
         "time.sleep(3600)\n")


def test_a_hung_command_is_stopped_with_its_process(faulty):
    """A command job that hangs is stopped at its timeout like any job (its placement group removed,
    its Ray worker killed), and its child process dies with the worker: nothing is left running."""
    import time

    import psutil

    base, results = faulty
    res = results["hang_forever.py"]
    assert res.verdict == "error" and "timed out after 10s" in res.message, res.message
    out = base / "hang_forever"
    logs = [out / p for ps in json.loads(res.report_path.read_text())["logs"].values() for p in ps]
    pids = [int(m) for log in logs for m in re.findall(r"hanging in (\d+)", log.read_text())]
    assert pids, logs   # the hung ranks said who they are
    alive = lambda: [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    deadline = time.monotonic() + 20
    while alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(), alive()


ABORTS_AT_EXIT = """
import sys
print("torch preloaded:", "torch" in sys.modules)   # a warm start: the rank forked after importing it
import os, torch, tracer
tr = tracer.session()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
tr.attach(model)
with tr.step(0):
    with tr.microbatch(0):
        loss = model(torch.ones(3, 4)).square().mean()
    loss.backward()
    tr.record_param_grads(model)
tr.close()
if os.environ.get("ABORT") == "after":
    os.abort()          # what torch's gloo teardown does in about 1 of 10 runs here
"""


def test_an_abort_after_a_complete_trace_is_a_warning_and_before_it_an_error(faulty):
    """torch's gloo teardown can abort a finished rank at interpreter exit (SIGABRT): its trace is
    complete, the check goes on and says so. A rank that aborts before committing its trace fails.
    Both hold for a rank forked warm (after.py) and for one started fresh (before.py)."""
    base, results = faulty
    after, before = results["after.py"], results["before.py"]
    for name, warm in (("after", True), ("before", False)):
        logs = list((base / name / "logs").glob("*/rank00000.log"))
        assert logs and all(f"torch preloaded: {warm}" in p.read_text() for p in logs), logs
    assert after.verdict == "pass", after.message or after.report.get("first_divergence")
    assert any("rank 0 was killed by signal 6 (SIGABRT) after committing a complete trace" in w
               for w in after.report["warnings"]), after.report.get("warnings")
    assert before.verdict == "error" and "rank 0 was killed by signal 6 (SIGABRT)" in before.message, \
        before.message


# -- runs made elsewhere: plain torchrun, no Ray ---------------------------------------------------
def _torchrun(cwd: Path, nproc: int, env: dict[str, str], *flags: str) -> subprocess.Popen:
    # TMPDIR in the user's (pytest's) directory: torchrun leaves a torchelastic_* directory behind in it
    # at every launch, which in /tmp pile up (152 on one machine).
    (cwd / "tmp").mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={nproc}", "examples/ddp_by_hand/train.py", *flags],
                            cwd=cwd, env={**os.environ, "TMPDIR": str(cwd / "tmp"), **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _losses(proc: subprocess.Popen) -> str:
    """The launch's loss lines, once it has exited 0."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    return "\n".join(ln for ln in out.splitlines() if ln.startswith("step "))


def test_runs_made_by_plain_torchrun_are_judged_by_ttrace_compare(user_repo, tmp_path, monkeypatch, capsys,
                                                                   ray_cluster):
    """The path of a GPU cluster that never saw Ray: the same script launched by torchrun in each role
    (TTRACE_* variables), then `ttrace compare STORE`. Untraced, the script trains unchanged: the
    candidate's losses are bit-identical to a plain run's."""
    from orchestrator.compare_cli import main

    store = tmp_path / "store"
    # The plain launch and the five traced ones are independent (each traced one its own run in the
    # store): started together.
    plain_launch = _torchrun(user_repo, 2, {})
    t = {"TTRACE_STORE": str(store)}
    launches = [_torchrun(user_repo, 1, {**t, "TTRACE_ROLE": "reference"}),
                *(_torchrun(user_repo, 1, {**t, "TTRACE_ROLE": "perturbed", "TTRACE_PERTURB": str(r)})
                  for r in (1, 2)),
                _torchrun(user_repo, 2, {**t, "TTRACE_ROLE": "candidate", "TTRACE_RUN": "candidate-bug"},
                          "--bug", "skip_1d_allreduce"),
                _torchrun(user_repo, 2, {**t, "TTRACE_ROLE": "candidate"})]
    losses = [_losses(launches[0])]
    # The buggy candidate's isolation pass feeds on the reference's tensors: launched once it is stored.
    iso = {**t, "TTRACE_ROLE": "isolated", "TTRACE_RUN": "isolated-bug",
           "TTRACE_REFERENCE": f"{store}/reference"}
    isolated = _torchrun(user_repo, 2, iso, "--bug", "skip_1d_allreduce")
    losses += [_losses(p) for p in launches[1:]]
    plain = _losses(plain_launch)
    assert plain.count("step ") == 2 and losses[-1] == plain
    _losses(isolated)
    # The plain launch wrote nothing: the store holds the traced launches' runs alone.
    assert sorted(p.name for p in store.iterdir()) == ["candidate", "candidate-bug", "isolated-bug",
                                                       "perturbed-1", "perturbed-2", "reference"]

    # `ttrace compare` as a user types it, logging to MLflow; while it runs, three more judgements of
    # the same store by the same function in this process (a process of its own each cost ~5 s of CPU).
    clean = subprocess.Popen([TTRACE, "compare", str(store)], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    monkeypatch.chdir(tmp_path)

    def judged(*args: str) -> tuple[int, dict, str]:
        code = main([str(store), *args, "tracking.enabled=false"])
        out = capsys.readouterr()
        paths = report_paths(out.out, tmp_path)
        return code, json.loads(paths[-1].read_text()) if paths else {}, out.out + out.err

    buggy = ("--candidate", "candidate-bug", "--isolated", "isolated-bug")
    code, report, out = judged(*buggy)
    assert code == 1 and report["first_divergence"]["module"] == "blocks.0.norm", out
    # The isolation pass's run names the culprit: the unreduced norm's own gradient, not inherited.
    assert report["culprit"]["module"] == "blocks.0.norm" and report["culprit"]["resolved"], report
    assert report["origin"] == "local" and report["isolation"]["run"] == "isolated-bug"
    # The same judgement measured in 2 Ray tasks (cluster.compare_workers; here on the test session's
    # Ray, as on a cluster `ttrace compare STORE cluster.address=auto` joins), the isolated run's too:
    # the same first divergence and culprit.
    code, split, out = judged(*buggy, "cluster.compare_workers=2")
    assert code == 1 and split["compare_workers"] == split["isolation"]["compare_workers"] == 2, out
    assert split["first_divergence"] == report["first_divergence"] and split["culprit"] == report["culprit"]
    assert split["isolation"]["flagged"] == report["isolation"]["flagged"] > 0
    oks = lambda r: [(t["name"], t["ok"]) for t in r["tensors"]]
    assert oks(split) == oks(report) and len(oks(report)) > 10
    code, _, out = judged("--perturbed", "reference,perturbed-1")
    assert code == 2 and "bit-identical to reference" in out, out
    # The local verdict asked for on stored runs without an isolated run: an error, never a pass.
    code, report, out = judged("tolerance.local=on", "precision=bf16")
    assert code == 2 and "TTRACE_ROLE=isolated" in out and report["verdict"] == "error", out
    stdout, stderr = clean.communicate(timeout=300)
    paths = report_paths(stdout, tmp_path)
    report = json.loads(paths[-1].read_text()) if paths else {}
    assert clean.returncode == 0 and report["verdict"] == "pass", stdout + stderr
    assert report["reference"]["runs"]["perturbed"] == ["perturbed-1", "perturbed-2"]
    assert report["recipe"]["parallel"]["world_size"] == 2
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = mlflow.search_runs(experiment_names=["ttrace"], output_format="list")   # the command's alone
    assert run.data.tags["verdict"] == "pass"


def test_ttrace_compare_help_names_its_options(capsys):
    # In-process: `ttrace compare` itself runs as a command in the torchrun test above.
    from orchestrator.compare_cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--reference", "--candidate", "--perturbed", "--isolated", "TTRACE_ROLE=perturbed"):
        assert option in out, option
