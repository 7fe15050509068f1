"""Reproduce torch's zero-bubble pipeline leaving the last stage's inner FSDP2 units without grads.

4 gloo ranks, pp=2 x dp=2; each rank holds two stages (looped: r, r + 2) of one residual Linear
block each, the last with a head, wrapped as torchtitan wraps them: `fully_shard` per block, then per
stage. After one `schedule.step`, each rank prints the parameters left without a `.grad`. Measured with
torch 2.13 on gloo: `ScheduleInterleavedZeroBubble` leaves the last stage's block (`layers.3.lin`)
without grads on both of its ranks, so an optimizer skips it and that layer never trains, silently;
`Interleaved1F1B`, and either schedule with `fully_shard` on the stage alone ("flat"), give every
parameter its grad. ttrace's check of job=torch_native at pp2_vpp2 x dp2 (`parallel.world_size=4`)
with `parallel.pp_schedule=InterleavedZeroBubble` or `ZBVZeroBubble` names the last layer's 18
missing param grads (exit 2).

    python scripts/repro_zb_fsdp_grads.py [InterleavedZeroBubble|Interleaved1F1B] [nested|flat]
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Stage(nn.Module):
    def __init__(self, stage: int, head: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(stage): Block()})
        self.head = nn.Linear(8, 8) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.head is not None else x


def _step(schedule: str, nested: bool, mesh: object) -> list[tuple[int, nn.Module]]:
    """Fresh stages of this rank (same weights every call), one `schedule.step`; the stages."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    pp = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    parts = []
    for s in range(4):   # every rank draws every stage's weights: the same weights whichever it holds
        m = Stage(s, head=s == 3)
        if s not in (pp, pp + 2):
            continue
        if nested:
            for block in m.layers.values():
                fully_shard(block, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
        parts.append((s, m))
    stages = [PipelineStage(m, s, 4, torch.device("cpu"), group=mesh["pp"].get_group()) for s, m in parts]
    sched = get_schedule_class(schedule)(stages, n_microbatches=4, loss_fn=lambda o, y: (o - y).pow(2).mean())
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    sched.step(*((x,) if pp == 0 else ()), target=y)
    return parts


def rank(r: int, port: int, schedule: str, nested: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    got = _step(schedule, nested, mesh)
    want = _step("Interleaved1F1B", nested, mesh)   # the same stages under a schedule that trains them right
    for (s, m), (_, ref) in zip(got, want, strict=True):
        missing = [n for n, p in m.named_parameters() if p.grad is None]
        off = {n: (p.grad.to_local() - q.grad.to_local()).norm().item() / q.grad.to_local().norm().item()
               for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters(), strict=True)
               if p.grad is not None}
        wrong = {n: f"{e:.2g}" for n, e in off.items() if e > 1e-5}
        verdict = "OK" if not missing and not wrong else (
            f"WRONG, no grad: {missing}; " * bool(missing) + f"grads off Interleaved1F1B's (rel): {wrong}"
            * bool(wrong))
        print(f"rank {r} stage {s}: {verdict}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    args = (free, sys.argv[1] if len(sys.argv) > 1 else "InterleavedZeroBubble",
            (sys.argv[2] if len(sys.argv) > 2 else "nested") == "nested")
    mp.start_processes(rank, args=args, nprocs=4, start_method="fork")
