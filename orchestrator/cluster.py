"""Ray layer: start or join a cluster and gang-schedule each job's ranks. Scheduling only.

A job is one training run (reference, perturbed reference or candidate): `world_size` rank tasks
placed together in one placement group, so a job either gets all its ranks or waits. Jobs run
concurrently as the cluster's resources allow. A rank that raises, dies or outlives the job's
timeout fails the whole job: its other ranks are stopped (they would block in a collective).

Ranks are stopped by removing the job's placement group, which makes the raylet kill every worker
leased in it; their tasks then fail through Ray's ordinary worker-death path. `ray.cancel(force=True)`
is never used: in Ray 2.x it races with a task that is completing at the same moment (a peer that
just got the collective error) and aborts the driver process (`Check failed: it !=
submissible_tasks_.end()`, ray-project/ray#54846).
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.rank_logs import node_id
from orchestrator.rank_tasks import rank_host, rank_task, rendezvous, worker_env
from tracer.errors import ConfigError, JobError

MIN_LOCAL_CPUS = 8  # logical CPUs of a local cluster, so 8-rank recipes fit on a laptop
FAILURE_GRACE_S = 3.0


def ensure_ray(cluster: dict[str, Any]) -> float:
    """Start a local Ray (or join `cluster.address`) once per process; returns seconds spent."""
    t0 = time.perf_counter()
    if not ray.is_initialized():
        address = cluster.get("address")
        env = {"env_vars": worker_env()}
        if address:
            ray.init(address=address, runtime_env=env, log_to_driver=False, logging_level="ERROR")
        else:
            num_cpus = cluster.get("num_cpus") or max(os.cpu_count() or 1, MIN_LOCAL_CPUS)
            # Idle workers beyond the soft limit are killed after a second; warm ones are worth keeping
            # (a check's rank tasks and rendezvous each hold one; the rank hosts are actors).
            ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=env,
                     log_to_driver=False, logging_level="ERROR",
                     _system_config={"num_workers_soft_limit": 3 * num_cpus})
    return time.perf_counter() - t0


def rank_worker_pids() -> list[int]:
    """PIDs of the rank workers of a local cluster this process started (its descendants running a
    `_run_rank` task): for fault injection in tests and benchmarks."""
    import psutil

    pids = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.cmdline() and p.cmdline()[0].startswith("ray::_run_rank"):
                pids.append(p.pid)
        except psutil.Error:
            pass
    return pids


@dataclass
class Job:
    name: str
    spec: dict[str, Any]
    world_size: int
    results: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    label: str = ""                     # what the job is for (progress display): check or cache key
    timeout_s: float | None = None      # per-job override of run_jobs(timeout_s=...)
    error_dir: Path | None = None       # per-job override of run_jobs(error_dir=...)
    state: str = "queued"               # queued | running | done | failed
    relaunches: int = 0                 # rendezvous port lost to another process, job started again
    after: Job | None = None            # starts once this job is done (routing replay reads its trace)


def run_jobs(jobs: list[Job], *, cpus_per_rank: float, timeout_s: float, error_dir: Path,
             on_change: Callable[[list[Job]], None] | None = None) -> None:
    """Run every job to completion or failure (recorded in job.error); never hangs past timeouts.

    All jobs' placement groups are requested at once: Ray starts each job when all its ranks fit
    (gang scheduling) and never oversubscribes the bundles' CPUs. `on_change(jobs)` is called
    whenever a job changes state (progress display)."""
    use_gpu = ray.cluster_resources().get("GPU", 0) >= 1
    bundle = {"CPU": cpus_per_rank, **({"GPU": 1} if use_gpu else {})}
    capacity = ray.cluster_resources().get("CPU", 0)
    for job in jobs:
        if job.world_size * cpus_per_rank > capacity:
            raise ConfigError(f"job '{job.name}' needs {job.world_size} ranks x {cpus_per_rank} CPUs but "
                              f"the Ray cluster has {capacity:g} CPUs; lower cluster.cpus_per_rank or join a "
                              "larger cluster (cluster.address)")
        if job.after is not None and all(job.after is not j for j in jobs) and job.after.state != "done":
            raise ValueError(f"job '{job.name}' waits for job '{job.after.name}', which is not run with it")
    here = node_id()
    for job in jobs:   # a rank on the driver's node writes its log where the driver will look
        if isinstance(job.spec.get("log"), dict) and not job.spec["log"].get("node"):
            job.spec["log"]["node"] = here
    notify = (lambda: on_change(jobs)) if on_change else (lambda: None)
    def reserve(job: Job) -> tuple[Any, ray.ObjectRef]:
        """The job's placement group and the one ObjectRef that resolves when it is ready. Asked for
        once: each `pg.ready()` call is a new GCS request whose reply lands a few ms later, so
        polling fresh refs with a zero timeout only noticed readiness by chance (jobs started
        17-151 s late, or "could not be scheduled" on an idle cluster)."""
        pg = placement_group([dict(bundle) for _ in range(job.world_size)], strategy="PACK")
        return pg, pg.ready()

    running: dict[int, tuple[Job, tuple[Any, ray.ObjectRef] | None, list[ray.ObjectRef], float | None]] = {}
    for i, job in enumerate(jobs):
        job.state = "queued"
        # A job that waits for another reserves its ranks only once that one is done: its placement
        # group would otherwise hold CPUs the job it waits for may need.
        running[i] = (job, None if job.after is not None else reserve(job), [], None)
    notify()
    limit = lambda job: job.timeout_s if job.timeout_s is not None else timeout_s
    queue_deadline = time.monotonic() + max(limit(j) for j in jobs) * max(1, len(jobs)) if jobs else 0.0
    try:
        while running:
            unfinished: list[ray.ObjectRef] = []   # what this pass saw unfinished: the next pass waits on it
            for key, (job, reservation, refs, started) in list(running.items()):
                if reservation is None:   # waiting for job.after
                    if job.after.state == "done":
                        running[key] = (job, reserve(job), [], None)
                    elif job.after.state == "failed":
                        job.error = (f"job '{job.name}' did not start: it reads job '{job.after.name}', "
                                     f"which failed ({job.after.error or 'no reason recorded'})")
                        _finish(running, key)
                        notify()
                    continue
                pg, pg_ready = reservation
                if started is None:
                    ready, _ = ray.wait([pg_ready], timeout=0)
                    if ready:
                        try:
                            refs = _launch(job, pg)
                        except JobError as e:
                            job.error = f"job '{job.name}' could not start: {e}"
                            _finish(running, key, cancel=True)
                            notify()
                            continue
                        running[key] = (job, (pg, pg_ready), refs, time.monotonic())
                        job.state = "running"
                        unfinished += refs
                        notify()
                    elif time.monotonic() > queue_deadline:
                        job.error = (f"job '{job.name}' could not be scheduled: no room for "
                                     f"{job.world_size} ranks on the cluster within "
                                     f"{limit(job) * len(jobs):.0f}s")
                        _finish(running, key, cancel=True)
                        notify()
                    else:
                        unfinished.append(pg_ready)
                    continue
                done, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
                unfinished += pending
                if any(_failed(r) for r in done):
                    # Give the peers a moment to fail too, so the root cause (the rank that raised or
                    # died first) is reported beside the collective errors it caused.
                    done, pending = ray.wait(refs, num_returns=len(refs), timeout=FAILURE_GRACE_S)
                    error = _failures(job, refs, done, pending, job.error_dir or error_dir)
                    if _port_race(error) and job.relaunches < RELAUNCHES:
                        # The free port picked by the rendezvous was taken by another process before
                        # rank 0 bound it (concurrent sweeps on one node): nothing ran, start again
                        # in a fresh placement group (removing the old one stops the other ranks).
                        remove_placement_group(pg)
                        job.relaunches += 1
                        job.state = "queued"
                        running[key] = (job, reserve(job), [], None)
                        continue
                    job.error = error
                    _finish(running, key, cancel=True)
                    notify()
                elif not pending:
                    job.results = sorted(ray.get(done), key=lambda r: r["rank"])
                    job.seconds = time.monotonic() - started
                    _finish(running, key)
                    notify()
                elif time.monotonic() - started > limit(job):
                    waiting = sorted(i for i, r in enumerate(refs) if r in pending)
                    job.error = (f"job '{job.name}' timed out after {limit(job):.0f}s; rank(s) {waiting} "
                                 "never finished (a hang in a collective?); raise timeout_s if the job is "
                                 "just slow")
                    _finish(running, key, cancel=True)
                    notify()
            if running and unfinished:   # until the first of them finishes: a job is seen done when it is
                ray.wait(unfinished, num_returns=1, timeout=POLL_S)
            elif running:             # only jobs waiting for another's end (seen on the next pass)
                time.sleep(POLL_S)
    finally:
        for key in list(running):
            _finish(running, key, cancel=True)


RELAUNCHES = 2
POLL_S = 0.1   # longest wait between passes over the jobs (timeouts, placement, jobs waiting for others)


def _port_race(error: str) -> bool:
    return "EADDRINUSE" in error or "address already in use" in error.lower()


def _launch(job: Job, pg: Any) -> list[ray.ObjectRef]:
    strategy = lambda i: PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
    # The rendezvous result is passed as an ObjectRef: Ray resolves it before the ranks start, so
    # launching never blocks the scheduling loop.
    rdzv = rendezvous.options(scheduling_strategy=strategy(0)).remote()
    nodes = _bundle_nodes(pg, job.world_size)
    local = _local_ranks(nodes)
    task, pool = rank_task(job.spec)
    host = lambda i: (rank_host(pool, nodes[i]),) if pool else ()   # its pool's host forks it (rank_tasks)
    return [task.options(scheduling_strategy=strategy(i), num_cpus=pg.bundle_specs[i]["CPU"],
                         num_gpus=pg.bundle_specs[i].get("GPU", 0))
            .remote(job.spec, i, job.world_size, rdzv, local[i], *host(i)) for i in range(job.world_size)]


NODE_WAIT_S = 10.0   # how long a ready placement group's bundle nodes may stay unreported


def _bundle_nodes(pg: Any, world_size: int) -> list[str]:
    """The node each of the job's bundles was placed on (its placement group is ready): its ranks'
    hosts are started there. A JobError if Ray's table does not say within NODE_WAIT_S (a rank host
    given no node would raise inside the scheduling loop, taking the other checks with it)."""
    deadline, why = time.monotonic() + NODE_WAIT_S, "no node listed"
    while True:
        try:
            nodes = ray.util.placement_group_table(pg).get("bundles_to_node_id") or {}
        except Exception as e:   # the GCS did not answer
            nodes, why = {}, f"{type(e).__name__}: {e}"
        found = [nodes.get(i, "") for i in range(world_size)]
        if all(found):
            return found
        if time.monotonic() > deadline:
            lost = [i for i, n in enumerate(found) if not n]
            raise JobError(f"Ray did not report the node of bundle(s) {lost} of its placement group within "
                           f"{NODE_WAIT_S:.0f}s ({why}), so their ranks had nowhere to start; check the "
                           "cluster's health (`ray status`) and rerun")
        time.sleep(0.1)


def _local_ranks(node: list[str]) -> list[tuple[int, int]]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) of every rank: its index among the job's bundles on its node."""
    return [(node[:i].count(node[i]), node.count(node[i])) for i in range(len(node))]


def _failed(ref: ray.ObjectRef) -> bool:
    try:
        ray.get(ref, timeout=0)
        return False
    except ray.exceptions.RayError:
        return True


def _failures(job: Job, refs: list[ray.ObjectRef], done: list[ray.ObjectRef], pending: list[ray.ObjectRef],
              error_dir: Path) -> str:
    """One sentence per failed rank: what it raised (traceback saved to a file) or that it died."""
    msgs = []
    for rank, ref in enumerate(refs):
        if ref in pending:
            continue
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            error_dir.mkdir(parents=True, exist_ok=True)
            path = error_dir / f"{job.name}-rank{rank}.txt"
            path.write_text(str(e))
            if isinstance(cause, JobError):   # the launcher's own account: the rank, its exit, its stderr
                msgs.append((_secondary(str(cause)), f"{cause} (details: {path})"))
                continue
            last = "".join(traceback.format_exception_only(type(cause), cause)).strip().splitlines()[-1]
            secondary = _secondary(last)
            msgs.append((secondary, f"rank {rank} raised {last} (traceback: {path})"))
        except ray.exceptions.RayError as e:  # worker crashed, node lost, ...
            msgs.append((False, f"rank {rank}'s worker process died ({type(e).__name__})"))
    stuck = [refs.index(r) for r in pending]
    tail = f"; rank(s) {stuck} were still running and were cancelled" if stuck else ""
    return f"job '{job.name}' failed: " + "; ".join(m for _, m in sorted(msgs, key=lambda m: m[0])) + tail


def _secondary(text: str) -> bool:
    """A peer's failure surfaces as a collective error on the other ranks: those are listed last."""
    return any(w in text for w in ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer"))


def _finish(running: dict[int, Any], key: int, cancel: bool = False) -> None:
    """Release the job's placement group; with `cancel`, any rank still running is killed with it."""
    job, reservation, _, _ = running.pop(key)
    job.state = "failed" if (cancel or job.error) else "done"
    if reservation is not None:
        remove_placement_group(reservation[0])
