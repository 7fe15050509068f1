"""A small language model trained with torch.distributed.pipelining, written the way torchtitan writes
it: the model keeps global layer names (an `nn.ModuleDict` keyed by layer id), a stage is the model
with the other stages' layers deleted, and a schedule runs the microbatches.

    torchrun --nproc-per-node 2 examples/pipelining/train.py --pp 2             # plain, untraced
    ttrace "job.command=python examples/pipelining/train.py" parallel=pp2      # checked by ttrace

Under ttrace the reference runs the same command on one device (pp=1): the whole model, the same
microbatches in a plain loop. `--bug grads_not_scaled` builds the schedule with `scale_grads=False`
while each microbatch's loss is a mean, so every gradient is n_microbatches times too large; Adam
hides most of it from the loss curve. The lines marked `# ttrace` are the whole integration (11 lines,
two of them imports).
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tracer as ttrace  # ttrace
from tracer.integrations.pipelining import trace_microbatches  # ttrace

VOCAB, HIDDEN, LAYERS, SEQ = 128, 32, 4, 16
GLOBAL_BATCH, MICRO_BATCH = 8, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.RMSNorm(HIDDEN), nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(),
                                                                nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm: nn.Module | None = nn.RMSNorm(HIDDEN)
        self.output: nn.Module | None = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(h) if self.tok_embeddings is not None else h
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def stage_of(model: LM, stage: int, stages: int) -> LM:
    """torchtitan's split: a copy of the model without the other stages' modules."""
    part, per = copy.deepcopy(model), LAYERS // stages
    for key in list(part.layers):
        if not stage * per <= int(key) < (stage + 1) * per:
            del part.layers[key]
    if stage > 0:
        part.tok_embeddings = None
    if stage < stages - 1:
        part.norm = part.output = None
    return part


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (default: all ranks)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bug", choices=["grads_not_scaled"], default=None)
    args = p.parse_args(argv or [])
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    tr = ttrace.session(pp=args.pp or world, seed=args.seed, steps=args.steps)   # ttrace
    pp = tr.parallel.pp
    if pp != world:
        raise SystemExit(f"this example is pipeline-parallel only: pp={pp} must equal the world size {world}")
    torch.manual_seed(tr.seed)                  # every rank builds the same full model
    model = LM()
    micro = GLOBAL_BATCH // MICRO_BATCH
    if pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        model = stage_of(model, rank, pp)
        stage = PipelineStage(model, rank, pp, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=micro, loss_fn=loss_fn,
                                scale_grads=args.bug != "grads_not_scaled")
        trace_microbatches(tr, [stage])                                              # ttrace
        tr.set_grad_scale(1 / micro)   # each microbatch's own mean loss is backpropagated  # ttrace
    tr.attach(model)                                                                 # ttrace
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(tr.steps):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1),
                               generator=torch.Generator().manual_seed(tr.seed * 1000 + step))
        with tr.step(step):                                                          # ttrace
            optimizer.zero_grad()
            losses: list[torch.Tensor] = []
            if pp > 1:
                inputs = (tokens[:, :-1],) if rank == 0 else ()
                schedule.step(*inputs, target=tokens[:, 1:], losses=losses)
            else:
                for j, mb in enumerate(tokens.split(MICRO_BATCH)):
                    with tr.microbatch(j):                                           # ttrace
                        losses.append(loss_fn(model(mb[:, :-1]), mb[:, 1:]))
                    (losses[-1] / micro).backward()
            tr.record_param_grads(model)                                             # ttrace
            optimizer.step()
            tr.record_params(model)                                                  # ttrace
        if losses:
            print(f"step {step} loss {sum(x.item() for x in losses) / micro:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
