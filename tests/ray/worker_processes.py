"""Rank processes for the tests that run jobs outside Ray (torch.multiprocessing): forked from
multiprocessing's forkserver, a clean process started (fresh) at the suite's first use, which imports
torch and the built-in workload once. Spawned instead, every worker imported them itself, with the test
module: the two numerics modules took 46 s here, 29 s forked.

A forked worker starts with the environment the server started with (its first use in the session),
not the caller's at the call: a job that needs a variable sets it itself, as run_in_process does
for its rank's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# What every worker imports first. The list holds for the forkserver's life, set before it starts.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "workloads.train", "tracer.job"]


def context() -> Any:
    """The forkserver context, its preload list set."""
    mp.set_forkserver_preload(PRELOAD)
    return mp.get_context("forkserver")


def start_workers(worker: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`worker(proc, *args)` in `nprocs` processes; returns once all have exited 0 (raises otherwise)."""
    context()
    mp.start_processes(worker, args=args, nprocs=nprocs, join=True, start_method="forkserver")
