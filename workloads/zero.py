"""ZeRO-1 distributed optimizer (parallel.zero1=true), Megatron `--use-distributed-optimizer` style.

After finalize_grads has summed and averaged the grads over DP (gloo has no reduce-scatter on CPU:
all-reduce + keeping the local slice gives the same sums, as in workloads/mappings.py), each DP rank
keeps only its shard of every parameter's grad: dim 0 of the (TP-local) parameter split over DP.
Adam state and FP32 master weights exist for that shard only; after the step the updated shards are
all-gathered over DP into the parameters. The traced `param_grad` is the shard the optimizer reads,
with the plan's layout plus `Shard(0, "dp")` nested inside (the ZeRO-sharded optimizer view).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tracer import ConfigError, Layout, param_layouts
from workloads import bugs, grad_sync, precision
from workloads.config import Config
from workloads.parallel_state import ParallelState


def shard_layout(layout: Layout) -> Layout:
    """The plan's layout of a parameter with its dim 0 further split over DP (innermost)."""
    return Layout(shard=layout.shard + ((0, "dp"),), partial=layout.partial)


class DistributedOptimizer:
    def __init__(self, model: nn.Module, plan: Mapping[str, Any], ps: ParallelState, cfg: Config):
        self.model, self.ps, self.cfg = model, ps, cfg
        self.dp, self.dp_rank = ps.dp_size, ps.coords["dp"]
        layouts = param_layouts(model, plan)
        self.named = list(model.named_parameters())
        for name, p in self.named:
            if p.shape[0] % self.dp:
                raise ConfigError(f"zero1: parameter {name} has dim 0 of size {p.shape[0]} on this rank, "
                                  f"not divisible by dp={self.dp}; pick sizes divisible by dp")
        self.layouts = {name: shard_layout(layouts[name]) for name, _ in self.named}
        # FP32 master shards (the optimizer state lives only for this rank's shard).
        self.master = [self.mine(p.detach()).float().clone().requires_grad_(True) for _, p in self.named]
        self.adam = torch.optim.Adam(self.master, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                                     foreach=False)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.adam.param_groups   # the LR schedule sets the shards' Adam LR

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        """This DP rank's chunk (dim 0) of a TP-local tensor: a parameter, its grad, its Adam state."""
        return t.chunk(self.dp, dim=0)[self.dp_rank]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in self.named:
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()

    def _clip_coef(self, shards: list[torch.Tensor]) -> float:
        """Global grad norm over the shards: TP duplicates and the tied copy counted once, summed over
        the model-parallel group and over DP (each DP rank holds a disjoint shard)."""
        ps = self.ps
        sq = torch.zeros((), dtype=torch.float32, device=shards[0].device if shards else None)
        for (_, p), g in zip(self.named, shards, strict=True):
            counted = getattr(p, "tensor_model_parallel", False) or ps.tp_rank == 0
            if counted and not getattr(p, "norm_duplicate", False):
                sq = sq + g.float().pow(2).sum()
        for group in (ps.mp_group, ps.dp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
        total = math.sqrt(sq.item())
        coef = self.cfg.clip_grad / (total + 1e-6)
        return coef if self.cfg.clip_grad > 0 and coef < 1.0 else 1.0

    @torch.no_grad()
    def step(self, tracer: Any) -> None:
        """Take the grad shards (finalize_grads already reduced them), trace, clip, Adam, all-gather."""
        shards = [self.mine(precision.grad(p)).clone() for _, p in self.named]
        if bugs.active(self.cfg.bug, "tied_embedding_grad_distopt"):
            # BUG tied_embedding_grad_distopt: the embedding-group all-reduce runs on the full grad
            # buffer after the optimizer has taken its shards; the shards never see the other stage.
            grad_sync.reduce_tied_embedding(self.model, self.model.shared_groups, self.cfg.bug)
        tracer.record_param_grad_shards({name: (g, self.layouts[name])
                                         for (name, _), g in zip(self.named, shards, strict=True)})
        coef = self._clip_coef(shards)
        for m, g in zip(self.master, shards, strict=True):
            m.grad = (g.float() * coef) if coef != 1.0 else g.float()
        self.adam.step()
        for (_, p), m in zip(self.named, self.master, strict=True):
            parts = [torch.empty_like(m) for _ in range(self.dp)]
            dist.all_gather(parts, m.detach().contiguous(), group=self.ps.dp_group)
            if bugs.active(self.cfg.bug, "zero1_gather_offset_wrong"):
                parts = parts[1:] + parts[:1]   # BUG zero1_gather_offset_wrong: shard i lands at offset i-1
            p.copy_(torch.cat(parts, dim=0))
