"""Data parallelism written by hand: every rank holds the whole model, trains on its slice of the
global batch, and averages every gradient over the ranks itself before the optimizer step.

    torchrun --nproc-per-node 2 examples/ddp_by_hand/train.py                        # plain, untraced
    ttrace "job.command=python examples/ddp_by_hand/train.py" parallel=dp2          # checked by ttrace
    ttrace job.entrypoint=train:main job.workdir=examples/ddp_by_hand parallel=dp2  # the same, as a function

`--bug skip_1d_allreduce` skips the all-reduce of 1-D parameters (biases and norm weights), as a
hand-rolled bucketing that only handled matrices would: each rank steps those with its own local
gradient, the replicas drift apart, and the loss still falls. The lines marked `# ttrace` are the
whole integration (7 lines).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tracer as ttrace  # ttrace

VOCAB, HIDDEN, LAYERS, SEQ = 128, 32, 2, 16
GLOBAL_BATCH, MICRO_BATCH = 8, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TokenMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def average_gradients(model: nn.Module, world: int, bug: str | None) -> None:
    for p in model.parameters():
        if bug == "skip_1d_allreduce" and p.ndim == 1:
            continue                                  # BUG: biases and norm weights stay local
        dist.all_reduce(p.grad)
        p.grad /= world


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bug", choices=["skip_1d_allreduce"], default=None)
    args = p.parse_args(argv or [])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tr = ttrace.session(seed=args.seed, steps=args.steps)                          # ttrace
    torch.manual_seed(tr.seed)                    # every rank builds the same model
    model = TokenMLP()
    tr.attach(model)                              # plain tensors: replicas over DP   # ttrace
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_rank = GLOBAL_BATCH // world
    local_micro = per_rank // MICRO_BATCH
    for step in range(tr.steps):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1),
                               generator=torch.Generator().manual_seed(tr.seed * 1000 + step))
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        with tr.step(step):                                                          # ttrace
            optimizer.zero_grad()
            total = torch.zeros(())
            for j, mb in enumerate(mine.split(MICRO_BATCH)):
                with tr.microbatch(rank * local_micro + j):      # global microbatch   # ttrace
                    loss = F.cross_entropy(model(mb[:, :-1]).flatten(0, 1), mb[:, 1:].flatten())
                (loss / local_micro).backward()
                total += loss.detach() / (local_micro * world)
            average_gradients(model, world, args.bug)
            tr.record_param_grads(model)                                             # ttrace
            optimizer.step()
            tr.record_params(model)                                                  # ttrace
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step} loss {total.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
