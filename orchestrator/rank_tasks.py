"""What Ray runs for one rank: the rendezvous task and the rank tasks (scheduling: cluster.py).

The built-in trainer's ranks run in a warm Ray worker itself. Every other job gets a fresh process per
rank: a command's own child process, forked from a warm worker of the pool for `python SCRIPT`
(warm_python.py), and for an in-process entrypoint forked from a warm worker of its own pool
(forked_rank.py).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import ray

from orchestrator.forked_rank import HOST_ENV, host_key, run_forked
from orchestrator.jobs import BUILTIN_ENTRYPOINT, command_argv
from orchestrator.rank_logs import node_id
from orchestrator.warm_python import warm_start


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


def _run_rank_forked(spec: dict[str, Any], rank: int, world_size: int, rdzv: tuple[str, int],
                     local: tuple[int, int]) -> dict[str, Any]:
    from orchestrator.jobs import run_rank

    return run_forked(run_rank, spec, rank, world_size, *rdzv, *local, node=node_id())


_rank = ray.remote(max_retries=0)(_run_rank)
# A fresh process per rank for in-process jobs other than the built-in trainer, forked from a warm
# worker (forked_rank.py). torch's DTensor keeps process-global state across process groups: a Ray
# worker reused for rank 1 after hosting rank 0 of an earlier job silently takes rank 0's chunk in the
# backward of an all-gather (a clean torch_native tp2_sp check failed with rank 1's logits gradient
# equal to rank 0's half; torch 2.13, gloo; scripts/repro_dtensor_reused_process.py; clearing
# DTensor's redistribute and sharding caches does not help). Megatron and transformers keep
# process-global state too, and so may any user entrypoint. The built-in trainer keeps none and runs
# in warm workers itself; a command job runs in a child process of its own (warm_python.py).
_rank_forked = ray.remote(max_retries=0)(_run_rank_forked)


def rank_task(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The remote function a job's ranks run, and its extra options: in the worker itself for the
    built-in trainer or a command (whose rank is a child process: a fork of a warm worker of the pool
    for `python SCRIPT`), else forked from a warm worker of the job's own pool (its runtime_env names
    the pool)."""
    job = spec.get("job") or {}
    pool = {"runtime_env": {"env_vars": {**worker_env(), HOST_ENV: host_key(spec)}}}
    if job.get("command"):   # `python SCRIPT`: forked by a worker of the pool (warm_python.py)
        argv = command_argv(str(job["command"]), {**os.environ, **(job.get("env") or {})})
        return (_rank, pool) if warm_start(job, argv) else (_rank, {})
    if job.get("entrypoint") in (None, "", BUILTIN_ENTRYPOINT):
        return _rank, {}
    return _rank_forked, pool
