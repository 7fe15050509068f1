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


def test_in_process_jobs_other_than_the_builtin_run_each_rank_in_a_fresh_worker_process():
    """torch's DTensor keeps per-process state across process groups: a worker reused for rank 1
    after rank 0 of another job took rank 0's gradient chunk (a clean torch_native tp2_sp check
    failed this way; scripts/repro_dtensor_reused_process.py). Entrypoint jobs get a fresh process
    per rank; the built-in trainer, which keeps no such state, reuses warm workers, and so does a
    command job, whose rank is a child process of its own."""
    from orchestrator import cluster
    from orchestrator.recipe import compose, job_of

    assert cluster.rank_task({"job": job_of(compose([]))}) is cluster._rank
    assert cluster.rank_task({"job": job_of(compose(["job.command=python train.py"]))}) is cluster._rank
    for job in ("torch_native", "hf", "megatron_core"):
        assert cluster.rank_task({"job": job_of(compose([f"job={job}"]))}) is cluster._rank_fresh
    assert cluster.rank_task({"job": {"entrypoint": "mypkg.train:main"}}) is cluster._rank_fresh
    assert cluster._rank_fresh._default_options.get("max_calls") == 1
    assert not cluster._rank._default_options.get("max_calls")
