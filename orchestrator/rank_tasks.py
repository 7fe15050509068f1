"""What Ray runs for one rank: the rendezvous task, the rank tasks, and the rank hosts that fork the
ranks needing a fresh process (scheduling: cluster.py).

Every job's ranks, the built-in trainer's included, are fresh processes forked by the *rank host* of
the job's pool on the rank's node (forked_rank.py): a Ray actor whose fork server (fork_server.py)
imports torch (and ttrace's trainer or adapter) once and forks every rank of that pool,
`python SCRIPT` commands (warm_python.py) and in-process entrypoints alike. Only a command that
cannot start warm (another program) runs as a child of the rank's own worker. The rank's task holds
the rank's place in the job's placement group and waits for its fork; stopping the job kills that
task, and the fork dies with it.

One host per pool and node, not one warm worker per concurrent rank: Ray starts a worker for every
rank task it runs at once, and a check runs 1 + R + 1 jobs at once (plus an isolation pass). Each
such worker paid Ray, torch and the adapter (5-7 s of CPU) to fork one or two ranks: a clean HF
check and a bug check started 8 of them and 7 more for the rendezvous tasks (whose workers the rank
tasks now share). The built-in trainer's ranks ran in such workers too until 2026-11-27: a `make
test` started 36 of them (each importing torch and the trainer, ~4 s of CPU), and a first tp2 check
on a fresh cluster took 15-27 s (29-53 CPU-seconds) against 8.5-9 s (14-15) forked; a fork costs
~0.1 s. This module imports nothing heavy at the top: a worker that only runs a rendezvous or waits
for a hosted rank never imports torch.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

# Variables Ray sets for a rank task's accelerators: a hosted rank (forked by an actor that holds
# none) takes them from its task.
DEVICE_ENV = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
HOST_FORKS = 128   # ranks one host forks and waits for at once (its thread pool; more would queue)


def worker_env() -> dict[str, str]:
    """Ray workers must import this checkout's packages, wherever the driver was started from."""
    return {"PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p)}


def free_port(host: str = "") -> int:
    """A port for a TCP store on this node, held back from other port pickers for a minute.

    A port merely bound and released is the one the kernel hands to the next `bind(("", 0))`, often
    at once (9,300 repeats in 20,000 binds here): two jobs launched together got the same rendezvous
    port, and the second job's ranks joined the first's store and hung it. So the port is left in
    TIME_WAIT (our side closes an accepted connection first): `bind(0)` and gloo's listeners skip it
    for 60 s, while the store, which binds with SO_REUSEADDR, can take it. A process that binds it
    anyway (outgoing connections) still makes rank 0 fail with EADDRINUSE: cluster._port_race."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, 0))
        server.listen(1)
        port = server.getsockname()[1]
        with socket.create_connection((host or "127.0.0.1", port)):
            accepted, _ = server.accept()
            accepted.close()   # the closing side keeps the TIME_WAIT: ours, the listening port
    return port


@ray.remote(num_cpus=0)
def rendezvous() -> tuple[str, int]:
    """Address and a free port on the node of rank 0, for torch.distributed's TCP store."""
    return ray.util.get_node_ip_address(), free_port()


def _run_rank(spec: dict[str, Any], rank: int, world_size: int, rdzv: tuple[str, int],
              local: tuple[int, int]) -> dict[str, Any]:
    from orchestrator.jobs import run_rank

    return run_rank(spec, rank, world_size, *rdzv, *local)


def _run_rank_hosted(spec: dict[str, Any], rank: int, world_size: int, rdzv: tuple[str, int],
                     local: tuple[int, int], host: Any) -> dict[str, Any]:
    """The rank, forked by `host` (a RankHost on this node); this task waits for it. The fork watches
    this process and dies with it (forked_rank.py): a stopped job stops its hosted ranks."""
    devices = {k: os.environ[k] for k in DEVICE_ENV if k in os.environ}
    try:
        return ray.get(host.run.remote(spec, rank, world_size, rdzv, local, os.getpid(), devices))
    except ray.exceptions.RayTaskError as e:   # what the rank raised, as an in-worker rank's would read
        from orchestrator.fork_server import ChildTraceback

        raise e.cause from ChildTraceback(str(e))
    except ray.exceptions.RayActorError as e:
        from tracer.errors import JobError

        raise JobError(f"rank {rank}'s process died with its rank host, the warm process that forks "
                       f"this job's ranks on its node ({type(e).__name__}: {e})") from None


_rank = ray.remote(max_retries=0)(_run_rank)
_rank_hosted = ray.remote(max_retries=0)(_run_rank_hosted)


class RankHost:
    """A warm process that forks ranks, one per pool and node. It never runs a job itself: DTensor,
    megatron-core and transformers keep process-global state (a Ray worker reused for rank 1 after
    hosting rank 0 of an earlier job silently took rank 0's chunk in the backward of an all-gather:
    scripts/repro_dtensor_reused_process.py), and each fork starts from a clean state. Nor does it
    fork: a Ray worker runs ~150 threads, so it starts a single-threaded fork server that does
    (fork_server.py says why), again if that one died. Its runtime_env names the pool
    (fork_server.HOST_ENV), so an adapter's imports and shims never reach another pool's ranks."""

    def __init__(self) -> None:
        from orchestrator.fork_server import HOST_ENV, pool_preloads

        self.preload = pool_preloads(os.environ.get(HOST_ENV, "torch._dynamo"))
        self.server = self._start()
        self._restart = threading.Lock()   # rank tasks run on the actor's threads at once

    def _start(self) -> Any:
        from orchestrator.fork_server import ForkServer

        return ForkServer(self.preload)

    def run(self, spec: dict[str, Any], rank: int, world_size: int, rdzv: tuple[str, int],
            local: tuple[int, int], requester: int, devices: dict[str, str]) -> dict[str, Any]:
        from orchestrator.rank_logs import node_id

        return self.live_server().run("orchestrator.jobs:run_rank", spec, rank, world_size, *rdzv, *local,
                                      node=node_id(), requester=requester, env=devices)

    def live_server(self) -> Any:
        """The fork server, started anew if it died (the ranks it was forking failed; later ones fork
        from the new one): once, however many rank tasks find it dead at the same time."""
        server = self.server
        if not server.alive():
            with self._restart:
                if self.server is server:
                    server.close()   # reaped
                    self.server = self._start()
        return self.server


_RankHost = ray.remote(RankHost)
_HOSTS: dict[tuple[str, str, str], Any] = {}   # (Ray job, pool, node) -> this driver's host there


def rank_host(pool: str, node: str) -> Any:
    """This driver's rank host for `pool` on `node`, started on first use. It lives as long as the
    driver's Ray job (restarted if it dies: the ranks it was forking fail, later ones fork anew)."""
    from orchestrator.fork_server import HOST_ENV

    key = (ray.get_runtime_context().get_job_id(), pool, node)
    if key not in _HOSTS:
        _HOSTS[key] = _RankHost.options(
            num_cpus=0, max_concurrency=HOST_FORKS, max_restarts=-1, max_task_retries=0,
            runtime_env={"env_vars": {**worker_env(), HOST_ENV: pool}},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    return _HOSTS[key]


def rank_task(spec: dict[str, Any]) -> tuple[Any, str | None]:
    """The remote function a job's ranks run, and the pool whose host forks them (None: the rank
    runs in its worker). A command that cannot start warm (another program, an interpreter flag,
    job.warm_start=false) runs as its worker's child. A warm `python SCRIPT` forks from the
    torch-only pool (warm_python.py), an in-process entrypoint, the built-in trainer's included, from
    its own (fork_server.preloads)."""
    from orchestrator.fork_server import host_key
    from orchestrator.jobs import command_argv
    from orchestrator.warm_python import warm_start

    job = spec.get("job") or {}
    if job.get("command"):
        argv = command_argv(str(job["command"]), {**os.environ, **(job.get("env") or {})})
        return (_rank_hosted, host_key(spec)) if warm_start(job, argv) else (_rank, None)
    return _rank_hosted, host_key(spec)
