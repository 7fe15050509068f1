"""Sweeps on one Ray cluster with the reference cache, S3 object storage, report.html in Chromium,
`ttrace report`, and the nightly regression run. Real Ray jobs, a real S3-compatible server (moto)."""

import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from orchestrator.check import run_check, run_checks
from orchestrator.recipe import code_version, compose, reference_key

ROOT = Path(__file__).resolve().parents[2]


def cli(workdir, ray_cluster, *args, timeout=900):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, f"cluster.address={ray_cluster}"],
                          capture_output=True, text=True, cwd=workdir, timeout=timeout)


def reports_of(proc):
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("report: "), proc.stdout[-2000:] + proc.stderr[-3000:]
    paths = [Path(line.removeprefix("report: ")) for line in lines if line.startswith("report: ")]
    return [json.loads(p.read_text()) | {"_path": p} for p in paths]


def attempts(workdir, key):
    entry = workdir / "ttrace_runs" / "refcache" / key
    return sorted(p.name for p in entry.iterdir() if p.is_dir())


def test_sweep_computes_each_distinct_reference_once_and_reuses_the_cache(ray_cluster, workdir, monkeypatch):
    # Pin the code version: tracer/ and workloads/ may be edited while the test runs.
    monkeypatch.setenv("TTRACE_CODE_VERSION", "test-sweep-cache")
    # 2 configurations sharing one reference key: the reference set is computed once.
    small = ["steps=1", "model.layers=2", "tolerance.perturbations=2"]    # keep the test short
    proc = cli(workdir, ray_cluster, "-m", "parallel=tp2_sp,dp2", "seed=1", *small)
    reps = reports_of(proc)
    assert len(reps) == 2
    # ttrace's Hydra launcher set each job up the Hydra way (its own directory, .hydra/ configs) and
    # ran the two as one batch (the shared references below).
    for r in reps:
        job_dir = (workdir / r["_path"]).parent
        assert (job_dir / ".hydra" / "overrides.yaml").exists()
        assert (job_dir / ".hydra" / "config.yaml").exists()
    # Two clean checks: every one passes (an exit code equal to the worst verdict would hide a false FAIL).
    assert proc.returncode == 0, [(r.get("error"), r.get("first_divergence")) for r in reps]
    assert all(r["verdict"] == "pass" for r in reps), [r.get("first_divergence") for r in reps]
    assert all(set(r["timings"]) >= {"ray_start", "jobs", "compare", "tracking", "total"} for r in reps)
    # The shared set was read while the candidates ran (orchestrator/prefetch.py), once for both.
    ahead = {r["timings"]["reference_read_ahead"] for r in reps}
    assert len(ahead) == 1, ahead
    by_key = defaultdict(list)
    for r in reps:
        by_key[r["reference"]["key"]].append(r)
    assert len(by_key) == 1
    for key, group in by_key.items():
        assert len({r["recipe"]["seed"] for r in group}) == 1
        caches = sorted(r["reference"]["cache"] for r in group)
        assert caches == ["miss", "shared"], caches
        computer = next(r for r in group if r["reference"]["cache"] == "miss")
        assert {r["reference"]["computed_by"] for r in group} == {computer["check_id"]}
        assert len({r["reference"]["url"] for r in group}) == 1
        assert len(attempts(workdir, key)) == 1     # one computation in the store, not two
        assert (workdir / "ttrace_runs" / "refcache" / key / "COMPLETE.json").exists()

    # Second sweep: a cache hit reuses the entry (no new computation); cache=false recomputes.
    key1 = next(k for k, g in by_key.items() if g[0]["recipe"]["seed"] == 1)
    url1 = by_key[key1][0]["reference"]["url"]
    items = [(compose(["parallel=tp2", "seed=1", *small, f"cache={c}"]),
              workdir / "again" / str(c)) for c in (True, False)]
    again = {res.report["recipe"]["cache"]: res.report for res in run_checks(items, str(workdir))}
    assert all(r["verdict"] == "pass" for r in again.values()), [r.get("first_divergence")
                                                                  for r in again.values()]
    assert again[True]["reference"]["cache"] == "hit" and again[True]["reference"]["url"] == url1
    assert "reference" not in again[True]["timings"]["jobs"]
    assert all("reference_read_ahead" in r["timings"] for r in again.values())   # a hit too, from the start
    assert again[False]["reference"]["cache"] == "off" and again[False]["reference"]["url"] != url1
    assert len(attempts(workdir, key1)) == 2

    # Per-module-kind metrics and report.html reach MLflow, for side-by-side comparison of a sweep.
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["ttrace"], output_format="list")
    assert len(runs) == 4
    run = runs[0]
    assert any(re.fullmatch(r"rel_err/LayerNorm/param_grad", m) for m in run.data.metrics)
    assert len([m for m in run.data.metrics if m.startswith(("rel_err/", "err_over_tol/"))]) < 100
    arts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"report.json", "report.html"} <= arts
    assert run.data.tags["reference.cache"] in ("hit", "miss", "shared", "off")

    # `ttrace report <path>` and `ttrace report <mlflow run id>` print the summary.
    rep = reps[0]
    for target in (str(rep["_path"]), rep["mlflow_run_id"]):
        out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "report", target],
                             capture_output=True, text=True, cwd=workdir, timeout=120)
        assert out.returncode == 0, out.stderr
        assert rep["check_id"] in out.stdout and f"cache {rep['reference']['cache']}" in out.stdout

    # report.html renders in a headless browser: the inline script built the table, SVG plots exist.
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("chromium is not installed: run `make test` (scripts/ensure_chromium.sh installs it)")
    html_path = rep["_path"].with_name("report.html")
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          "--no-first-run", f"--user-data-dir={workdir / 'chromium'}", "--dump-dom",
                          html_path.as_uri()], capture_output=True, text=True, timeout=120).stdout
    n = len(rep["tensors"])
    assert f'data-rendered="{n}"' in dom                       # the inline JS ran to the end
    assert len(re.findall(r'<svg class="plot"', dom)) == 3       # forward, backward, after-step panels
    assert len(re.findall(r"<circle", dom)) == n                 # one dot per tensor
    body = dom.split('<tbody>', 1)[1].split('</tbody>', 1)[0]
    assert body.count("<tr") == n and rep["tensors"][0]["name"] in body
    page = html_path.read_text()                                 # self-contained: nothing fetched
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page) and "<link" not in page


def test_reference_key_covers_what_a_reference_depends_on(monkeypatch):
    monkeypatch.delenv("TTRACE_CODE_VERSION", raising=False)
    assert len(code_version()) == 16
    base = reference_key(compose([]))
    for same in (["parallel=tp2"], ["cache=false"], ["timeout_s=9"]):
        assert reference_key(compose(same)) == base, same
    # The reference runs the candidate's code: its bug switch, and the reference's own settings, count.
    for other in (["seed=7"], ["steps=1"], ["tolerance.perturbations=2"], ["model.layers=2"],
                  ["data.micro_batch=4"], ["bug=row_parallel_bias_per_rank"], ["reference.micro_batch=8"]):
        assert reference_key(compose(other)) != base, other
    monkeypatch.setenv("TTRACE_CODE_VERSION", "other-code")
    assert reference_key(compose([])) != base


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def test_check_through_s3_object_storage(ray_cluster, workdir, s3_endpoint):
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    fs.mkdir("ttrace-test")
    rec = compose(["parallel=tp2", "bug=row_parallel_bias_per_rank", "store=s3",
                   "store.url=s3://ttrace-test/runs", f"store.endpoint_url={s3_endpoint}", "model.layers=2"])
    res = run_check(rec, workdir / "out", base_dir=str(workdir))
    assert res.verdict == "fail", res.message
    fd = res.report["first_divergence"]      # the per-rank bias shows at (or right after) attn.proj
    assert fd["module"].endswith(".attn.proj"), fd
    assert res.report["store"].startswith("s3://ttrace-test/runs/")
    # The ranks (Ray workers) wrote to the S3 server: manifests of candidate ranks and the reference cache.
    fs.invalidate_cache()
    cand = res.report["store"].removeprefix("s3://")
    assert fs.exists(f"{cand}/candidate/rank00000/manifest.json")
    assert fs.exists(f"{cand}/candidate/rank00001/manifest.json")
    key = res.report["reference"]["key"]
    assert fs.exists(f"ttrace-test/runs/refcache/{key}/COMPLETE.json")
    assert not (workdir / "ttrace_runs").exists()
    # Credentials are never written to the report or to MLflow params.
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    assert secret not in res.report_path.read_text()
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    (run,) = mlflow.search_runs(experiment_names=["ttrace"], output_format="list")
    assert all(secret not in v for v in run.data.params.values())
    assert run.data.params["store.endpoint_url"] == s3_endpoint


def test_nightly_exits_nonzero_when_a_catalog_bug_is_missed(ray_cluster, workdir):
    # With one training step, row_parallel_bias_per_rank cannot show (biases start at zero, so step 0
    # is exact): the nightly must flag it as MISSED. (A caught bug's row: `make nightly`.)
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.nightly", "nightly=quick", "clean=",
         "bugs=row_parallel_bias_per_rank", "steps=1", "model.layers=2", "tolerance.perturbations=2",
         f"cluster.address={ray_cluster}"],
        capture_output=True, text=True, cwd=workdir, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    day = next((workdir / "nightly").iterdir())
    summary = json.loads((day / "summary.json").read_text())
    rows = {r["check"]: r for r in summary["checks"]}
    assert rows["bug-row_parallel_bias_per_rank"]["status"] == "regression"
    assert "MISSED" in rows["bug-row_parallel_bias_per_rank"]["detail"]
    assert "REGRESSION" in (day / "summary.md").read_text()
    # One MLflow parent run, one child per check.
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["ttrace"], output_format="list")
    parent = summary["mlflow_parent_run_id"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent]
    assert len(children) == 1 and any(r.info.run_id == parent for r in runs)
