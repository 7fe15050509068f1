"""A small language model trained with PyTorch-native tensor + sequence parallelism (DTensor), written
the way torchtitan writes it: the model knows nothing of parallelism, `parallelize` applies a plan.

    torchrun --nproc-per-node 2 examples/dtensor_tp_sp/train.py --tp 2 --sp          # plain, untraced
    ttrace "job.command=python examples/dtensor_tp_sp/train.py" parallel=tp2_sp     # checked by ttrace

`--bug norm_not_sequence_parallel` leaves one norm (layers.1.ffn_norm) out of the SequenceParallel
plan: the forward is still right (a norm is per token), but that norm's weight gradient is each rank's
partial sum over its own sequence chunk, never reduced; the replicas drift apart while the loss keeps
falling. The lines marked `# ttrace` are the whole integration (7 lines).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import tracer as ttrace  # ttrace

VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 128, 32, 4, 2, 16
GLOBAL_BATCH, MICRO_BATCH = 8, 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # this rank's heads
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(HIDDEN), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(HIDDEN), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.output = nn.RMSNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model: LM, mesh: object, sp: bool, bug: str | None) -> None:
    """Tensor parallelism (+ sequence parallelism between the blocks' matmuls), torchtitan's plan."""
    seq = Shard(1) if sp else Replicate()     # the residual stream: sharded on sequence under SP
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
        **({"norm": SequenceParallel()} if sp else {}),
    })
    for i, block in enumerate(model.layers):
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=seq),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan.update({"attention_norm": SequenceParallel(), "attention": gather,
                         "ffn_norm": SequenceParallel(), "feed_forward": gather})
            if bug == "norm_not_sequence_parallel" and i == 1:
                del plan["ffn_norm"]          # BUG: this norm's weight grad is never reduced over TP
        parallelize_module(block, mesh, plan)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: all ranks)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bug", choices=["norm_not_sequence_parallel"], default=None)
    args = p.parse_args(argv or [])
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    tr = ttrace.session(tp=args.tp or world, sp=args.sp, seed=args.seed, steps=args.steps)   # ttrace
    tp, sp = tr.parallel.tp, tr.parallel.sp
    if tp != world:
        raise SystemExit(f"this example is tensor-parallel only: tp={tp} must equal the world size {world}")
    torch.manual_seed(tr.seed)                  # every rank builds the same full model
    model = LM()
    if tp > 1:
        parallelize(model, init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)), sp, args.bug)
    tr.attach(model)                                                                 # ttrace
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro = GLOBAL_BATCH // MICRO_BATCH
    for step in range(tr.steps):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1),
                               generator=torch.Generator().manual_seed(tr.seed * 1000 + step))
        with tr.step(step):                                                          # ttrace
            optimizer.zero_grad()
            total = 0.0
            for j, mb in enumerate(tokens.split(MICRO_BATCH)):
                with tr.microbatch(j):                                               # ttrace
                    logits = model(mb[:, :-1])
                    loss = F.cross_entropy(logits.flatten(0, 1), mb[:, 1:].flatten())
                (loss / micro).backward()
                total += loss.item() / micro
            tr.record_param_grads(model)                                             # ttrace
            optimizer.step()
            tr.record_params(model)                                                  # ttrace
        if dist.get_rank() == 0:
            print(f"step {step} loss {total:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
