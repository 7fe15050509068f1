"""Scheduling (orchestrator.cluster) on the session's real Ray cluster."""

import threading
import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from orchestrator.cluster import Job, run_jobs


def test_a_queued_job_asks_once_whether_its_placement_group_is_ready(ray_cluster, tmp_path, monkeypatch):
    """Each `pg.ready()` is a fresh GCS request answered a few ms later: a scheduler that polls new
    refs with a zero timeout sees readiness only when it wins that race, and jobs started up to
    minutes late (or were reported unschedulable on an idle cluster). The job below must wait ~1 s
    for the CPUs a blocker holds, over ~10 polls, and must ask exactly once."""
    calls = []
    real_ready = PlacementGroup.ready
    monkeypatch.setattr(PlacementGroup, "ready", lambda self: calls.append(self.id) or real_ready(self))
    blocker = placement_group([{"CPU": ray.cluster_resources()["CPU"]}])
    ray.get(blocker.ready(), timeout=60)
    t0 = time.monotonic()
    threading.Timer(1.0, remove_placement_group, args=(blocker,)).start()
    job = Job("no-spec", {}, world_size=1)   # the rank fails at once: only the scheduling matters
    run_jobs([job], cpus_per_rank=1, timeout_s=120, error_dir=tmp_path)
    assert time.monotonic() - t0 >= 1.0       # it did wait for the blocker, polling meanwhile
    assert job.error and "rank 0 raised" in job.error, job.error
    assert len(calls) == 2 and calls[0] == blocker.id   # the blocker's own ready(), then the job's once


def test_a_job_whose_bundle_nodes_ray_does_not_report_fails_alone_with_a_message(ray_cluster, tmp_path,
                                                                               monkeypatch):
    """A ready placement group whose bundles' nodes Ray's table does not list (a GCS that did not
    answer: a fault that cannot be caused on a healthy local cluster, so its answer is withheld here)
    leaves its job's ranks nowhere to start: that job fails with a message and the scheduling loop
    goes on with the others, which finish as usual."""
    from orchestrator import cluster

    real = ray.util.placement_group_table
    cut = {}

    def table(pg=None):
        got = real(pg)
        if pg is not None and pg.id == cut.get("pg"):
            got = dict(got, bundles_to_node_id={})
        return got

    real_launch = cluster._launch

    def launch(job, pg):
        if job.name == "lost":
            cut["pg"] = pg.id
        return real_launch(job, pg)

    monkeypatch.setattr(ray.util, "placement_group_table", table)
    monkeypatch.setattr(cluster, "_launch", launch)
    monkeypatch.setattr(cluster, "NODE_WAIT_S", 0.5)
    lost, other = Job("lost", {}, world_size=1), Job("other", {}, world_size=1)
    run_jobs([lost, other], cpus_per_rank=1, timeout_s=120, error_dir=tmp_path)
    assert lost.state == "failed" and lost.error.startswith("job 'lost' could not start: Ray did not report "
                                                           "the node of bundle(s) [0]"), lost.error
    assert "ray status" in lost.error
    assert other.state == "failed" and "rank 0 raised" in other.error, other.error   # ran: its spec is empty


def test_which_ranks_run_in_the_worker_and_which_are_forked_by_a_host_of_their_pool():
    """A command's rank is a child process: `python SCRIPT` forked by the host of the torch-only pool
    (warm_python.py), any other program (or job.warm_start=false) started from any warm worker.
    Entrypoints are forked, the built-in trainer and each adapter by the host of its own pool
    (megatron-core's import-time shims never reach another job's ranks), a user's entrypoint by the
    torch-only host (its module is never imported before the fork, so a long-lived host cannot run a
    stale copy)."""
    from orchestrator import rank_tasks
    from orchestrator.fork_server import preloads
    from orchestrator.recipe import compose, job_of

    builtin = {"job": job_of(compose([]))}
    assert rank_tasks.rank_task(builtin) == (rank_tasks._rank_hosted, "workloads.train")
    assert "workloads.train" in preloads(builtin)
    command = {"job": job_of(compose(["job.command=python train.py"]))}
    assert rank_tasks.rank_task(command) == (rank_tasks._rank_hosted, "torch._dynamo")
    for fresh in (["job.command=bash train.sh"], ["job.command=python -u train.py"],
                  ["job.command=python train.py", "job.warm_start=false"]):
        assert rank_tasks.rank_task({"job": job_of(compose(fresh))}) == (rank_tasks._rank, None), fresh
    pools = {"workloads.train"}
    for job in ("torch_native", "hf", "megatron_core"):
        spec = {"job": job_of(compose([f"job={job}"]))}
        task, pool = rank_tasks.rank_task(spec)
        assert task is rank_tasks._rank_hosted and pool == preloads(spec)[-1] == f"workloads.adapters.{job}"
        pools.add(pool)
    user = {"job": {"entrypoint": "mypkg.train:main"}}
    assert "mypkg.train" not in preloads(user)
    pools.add(rank_tasks.rank_task(user)[1])
    assert len(pools) == 5


_PROBE = """
import os, sys, time
TORCH_AT_IMPORT = "torch" in sys.modules   # preloaded by the rank host before the fork
CALLS = []

def main():
    CALLS.append(1)
    name = f"{os.environ['RUN']}-{os.environ['RANK']}.pid"
    with open(os.path.join(os.environ["PROBE_DIR"], name), "w") as f:
        f.write(str(os.getpid()))
    mode = os.environ.get("MODE", "")
    if mode == "die" and os.environ["RANK"] == "1":
        os.kill(os.getpid(), 9)
    if mode == "raise" and os.environ["RANK"] == "0":
        raise ZeroDivisionError("probe")
    if mode == "hang":
        time.sleep(600)
    return {"pid": os.getpid(), "parent": os.getppid(), "calls": len(CALLS),
            "torch_at_import": TORCH_AT_IMPORT, "ended": time.time(), "rank": os.environ["RANK"],
            "title": open("/proc/self/cmdline").read().replace(chr(0), " ").strip(),
            "parent_title": open(f"/proc/{os.getppid()}/cmdline").read().replace(chr(0), " ").strip(),
            "parent_threads": len(os.listdir(f"/proc/{os.getppid()}/task"))}
"""


def _probe_job(name: str, workdir, mode: str = "") -> Job:
    env = {"PROBE_DIR": str(workdir), "RUN": name, "MODE": mode}
    return Job(name, {"job": {"entrypoint": "probe_rank:main", "workdir": str(workdir), "env": env},
                      "trace": {"enabled": False}, "parallel": {"dp": 2}}, world_size=2)


def test_entrypoint_ranks_are_fresh_processes_forked_by_one_warm_host(ray_cluster, tmp_path):
    """Entrypoint jobs other than the built-in trainer need a fresh process per rank (DTensor,
    megatron-core and transformers keep process-global state: scripts/repro_dtensor_reused_process.py).
    Each rank is forked by the pool's warm host, which imported torch once: module state never
    carries over from one job to the next, the host serves every job, and a child's failure is
    reported by rank."""
    (tmp_path / "probe_rank.py").write_text(_PROBE)
    first = _probe_job("first", tmp_path)
    run_jobs([first], cpus_per_rank=1, timeout_s=120, error_dir=tmp_path)
    second, dies, raises = (_probe_job("second", tmp_path), _probe_job("dies", tmp_path, "die"),
                            _probe_job("raises", tmp_path, "raise"))
    # Jobs that wait for another (routing replay reads the reference's trace): one starts after it is
    # done, one never starts because what it waits for failed.
    waits, orphan = _probe_job("waits", tmp_path), _probe_job("orphan", tmp_path)
    waits.after, orphan.after = second, raises
    run_jobs([waits, orphan, second, dies, raises], cpus_per_rank=1, timeout_s=120, error_dir=tmp_path)
    assert waits.error is None and orphan.state == "failed" and not list(tmp_path.glob("orphan-*.pid"))
    assert "did not start" in orphan.error and "'raises'" in orphan.error and "probe" in orphan.error
    started = min((tmp_path / f"waits-{r}.pid").stat().st_mtime for r in (0, 1))
    assert started >= max(r["ended"] for r in second.results) - 0.01, (started, second.results)
    assert first.error is None and second.error is None, (first.error, second.error)
    ranks = first.results + second.results
    assert all(r["calls"] == 1 for r in ranks), ranks           # a fresh module in every rank
    assert all(r["torch_at_import"] for r in ranks), ranks     # forked after the warm import
    assert len({r["pid"] for r in ranks}) == 4
    assert all(r["title"] == f"ttrace job rank {r['rank']}: probe_rank:main" for r in ranks), ranks   # ps
    # One warm host per pool and node forks every rank of every job (not a worker per concurrent
    # rank, each importing torch), and each rank's task is another process, whose end it dies with.
    assert len({r["parent"] for r in ranks + waits.results}) == 1, ranks
    # ... through its fork server, a process with no other thread: never from the Ray actor itself,
    # whose ~150 threads leave a fork their locks held (orchestrator/fork_server.py).
    assert all(r["parent_title"] == "ttrace fork server: torch._dynamo" and r["parent_threads"] == 1
               for r in ranks), ranks
    assert dies.error and "rank 1's process died (killed by SIGKILL)" in dies.error, dies.error
    assert raises.error and "rank 0 raised ZeroDivisionError: probe" in raises.error, raises.error


def test_a_stopped_job_stops_its_forked_ranks(ray_cluster, tmp_path):
    """Stopping a job removes its placement group, which kills its rank tasks; the forked children
    must die with them (each watches its task's process), or a hung rank would outlive its job."""
    import psutil

    (tmp_path / "probe_rank.py").write_text(_PROBE)
    # The pool's host warmed first (a no-op when an earlier test did), so the hung ranks are forked
    # at once and a short timeout stops them after they wrote their pid files, not before.
    warm = _probe_job("warm", tmp_path)
    run_jobs([warm], cpus_per_rank=1, timeout_s=120, error_dir=tmp_path)
    assert warm.error is None, warm.error
    hung = _probe_job("hung", tmp_path, "hang")
    run_jobs([hung], cpus_per_rank=1, timeout_s=4, error_dir=tmp_path)
    assert hung.error and "timed out" in hung.error, hung.error
    pids = [int((tmp_path / f"hung-{r}.pid").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"forked ranks {pids} outlived their stopped job"
        time.sleep(0.2)
