"""Reproduce the DTensor state leak that made framework ranks run in fresh Ray workers.

Two processes each run two tiny 2-rank jobs (separate process groups) and swap ranks in the second:
a process that was rank 0 in job 1 is rank 1 in job 2. Each job shards an nn.Linear column-wise
with `ColwiseParallel(output_layouts=Replicate())` and records the gradient of the Linear's local
output. Measured with torch 2.13 on gloo: in job 2 each process gets the chunk of its job-1 rank.
Clearing DTensor's redistribute-planner and sharding-propagation caches between the jobs does not
change that; the stale state is elsewhere (not pinned down).

    python scripts/repro_dtensor_reused_process.py   # prints OK or WRONG per (process, job)
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module


def job(rank: int, port: int) -> list[float]:
    """One 2-rank job: the gradient this rank receives for its shard of the Linear's output."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    lin = nn.Linear(4, 8, bias=False)
    parallelize_module(lin, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
    seen: dict[str, torch.Tensor] = {}

    def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
        if isinstance(out, DTensor):   # runs before the style's all-gather: this rank's shard
            def grad_hook(g: torch.Tensor) -> None:
                seen["grad"] = (g.to_local() if isinstance(g, DTensor) else g).clone()
            out.register_hook(grad_hook)

    lin.register_forward_hook(hook, prepend=True)
    y = lin(torch.ones(2, 3, 4))
    (y * torch.arange(8.0)).sum().backward()   # d/dy = 0..7: rank r must get 4r..4r+3
    dist.destroy_process_group()
    return seen["grad"][0, 0].tolist()


def process(slot: int, ports: list[int], q: mp.Queue) -> None:
    q.put((slot, [(r, job(r, p)) for r, p in ((slot, ports[0]), (1 - slot, ports[1]))]))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = [_port(), _port()]
    procs = [ctx.Process(target=process, args=(s, ports, q)) for s in (0, 1)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    for slot, jobs in results:
        for i, (rank, grad) in enumerate(jobs):
            want = [float(v) for v in range(4 * rank, 4 * rank + 4)]
            print(f"process {slot}, job {i + 1}, rank {rank}: grad {grad}",
                  "OK" if grad == want else f"WRONG (expected {want})")
