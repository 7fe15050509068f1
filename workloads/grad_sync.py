"""Grad reductions: the data-parallel all-reduce in buckets (DPGradBuckets, called by finalize_grads),
and those of parameters that live on several ranks of a model-parallel group as copies of one logical
tensor (beyond DP and SP):

kv_replicated     GQA KV projection shared by the tp/kv_heads TP ranks of one KV head (workloads/llama.py):
                  each copy's grad is partial (its own query heads only): all-reduce over those ranks.
shared_embedding  tied word embedding held by the first and the last pipeline stage: sum the two
                  stages' grads over the embedding group (Megatron `_allreduce_embedding_grads`).

Groups are created on every rank in the same order (dist.new_group is collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workloads import bugs, precision
from workloads.parallel_state import ParallelState, rank_of

Group = dist.ProcessGroup | None


@dataclass
class SharedGroups:
    kv_replicas: Group = None    # TP ranks holding the same KV shard
    embedding: Group = None      # first and last stage with this rank's (tp, dp)
    experts: Any = None          # workloads.moe.ExpertGroups (ep, edp) for MoE models


def build_groups(ps: ParallelState, tied: bool) -> SharedGroups:
    out = SharedGroups()
    tp, dp, pp = ps.sizes["tp"], ps.sizes["dp"], ps.sizes["pp"]
    replicas, cps = ps.sizes.get("kvr", 1), range(ps.cp_size)
    if replicas > 1:
        for p in range(pp):
            for d in range(dp):
                for c in cps:
                    for kv in range(tp // replicas):
                        ranks = [rank_of(kv * replicas + i, d, p, ps.sizes, c) for i in range(replicas)]
                        g = dist.new_group(ranks)
                        if ps.rank in ranks:
                            out.kv_replicas = g
    if tied and pp > 1:
        for d in range(dp):
            for c in cps:
                for t in range(tp):
                    ranks = [rank_of(t, d, 0, ps.sizes, c), rank_of(t, d, pp - 1, ps.sizes, c)]
                    g = dist.new_group(ranks)
                    if ps.rank in ranks:
                        out.embedding = g
    return out


def all_reduce_coalesced(grads: list[torch.Tensor], group: Group) -> None:
    """Sum a list of grads over `group` in one flat buffer (same sums as per-tensor, fewer calls)."""
    if not grads or group is None or dist.get_world_size(group) == 1:
        return
    _reduce_flat(grads, torch.cat([g.reshape(-1) for g in grads]), group)


def _reduce_flat(grads: list[torch.Tensor], flat: torch.Tensor, group: Group) -> None:
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


# -- data-parallel grad buckets ------------------------------------------------------------------
BUCKET_CAP = 8192    # elements per DP grad bucket (DDP's bucket_cap_mb, scaled to the tiny models)
STALE_BUCKET = 1     # the bucket bug late_grad_bucket_stale keeps stale


def bucket_indices(numels: list[int], cap: int = BUCKET_CAP) -> list[list[int]]:
    """DDP's bucket assignment: params in reverse registration order (roughly the order backward
    produces their grads), a bucket closed once it holds at least `cap` elements."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in reversed(range(len(numels))):
        cur.append(i)
        size += numels[i]
        if size >= cap:
            out.append(cur)
            cur, size = [], 0
    return out + [cur] if cur else out


class DPGradBuckets:
    """The data-parallel grad all-reduce, one coalesced all-reduce per bucket (DDP / Megatron DDP).
    Bucketing changes no sum: each element is still the sum of its DP replicas.

    Bug late_grad_bucket_stale: from step `from_step` bucket STALE_BUCKET all-reduces the buffer it was
    filled with at the previous step, as after a re-bucketing whose bucket views still point at the old
    buffer (this step's grads are never copied in)."""

    def __init__(self, bug: str, from_step: int):
        self.stale_bug, self.from_step = bugs.active(bug, "late_grad_bucket_stale"), from_step
        self.kept: torch.Tensor | None = None   # the stale bucket's buffer as the previous step filled it

    def all_reduce(self, grads: list[torch.Tensor], group: Group, step: int) -> None:
        if not grads or group is None or dist.get_world_size(group) == 1:
            return
        for b, idx in enumerate(bucket_indices([g.numel() for g in grads])):
            bucket = [grads[i] for i in idx]
            flat = torch.cat([g.reshape(-1) for g in bucket])
            if self.stale_bug and b == STALE_BUCKET:
                fresh = flat.clone()
                if step >= self.from_step and self.kept is not None:
                    flat = self.kept   # BUG late_grad_bucket_stale: last step's grads are reduced again
                self.kept = fresh
            _reduce_flat(bucket, flat, group)


def _marked(model: nn.Module, attr: str) -> list[torch.Tensor]:
    return [g for p in model.parameters() if getattr(p, attr, False) and (g := precision.grad(p)) is not None]


def reduce_kv_replicas(model: nn.Module, groups: SharedGroups, bug: str) -> None:
    if bugs.active(bug, "kv_head_grad_unreduced"):
        return   # BUG kv_head_grad_unreduced: each KV copy keeps the grad of its own query heads only.
    all_reduce_coalesced(_marked(model, "kv_replicated"), groups.kv_replicas)


def reduce_tied_embedding(model: nn.Module, groups: SharedGroups, bug: str) -> None:
    if bugs.active(bug, "tied_embedding_grad_lost_pp"):
        return   # BUG tied_embedding_grad_lost_pp: each stage steps its copy with half of the grad.
    all_reduce_coalesced(_marked(model, "shared_embedding"), groups.embedding)


def reduce_experts(model: nn.Module, groups: SharedGroups, ps: ParallelState,
                   bug: str) -> None:
    """Expert grads (skipped by the dense DP average): summed over the expert-data-parallel group and
    divided by the full DP size (each expert already saw its whole EP group's tokens)."""
    grads = _marked(model, "expert")
    if not grads or groups.experts is None:
        return
    # BUG expert_tp_grad_wrong_group: expert grads synchronized over the TP group instead of EDP.
    group = ps.tp_group if bugs.active(bug, "expert_tp_grad_wrong_group") else groups.experts.edp
    all_reduce_coalesced(grads, group)
    # BUG expert_grad_scaling_wrong: divided by the EDP size instead of the DP size.
    div = ps.sizes["edp"] if bugs.active(bug, "expert_grad_scaling_wrong") else ps.dp_size
    for g in grads:
        g.div_(div)


def expert_norm_sq(params: list[nn.Parameter], ps: ParallelState, groups: SharedGroups,
                   bug: str) -> torch.Tensor:
    """Squared norm of this rank's expert grads, summed over the EP group (each EP rank holds other
    experts); TP-replicated expert params count on tp rank 0. The caller sums over TP/PP."""
    sq = torch.zeros((), dtype=torch.float32)
    for p in params:
        g = precision.grad(p)
        if g is not None and getattr(p, "expert", False) and (
                getattr(p, "tensor_model_parallel", False) or ps.tp_rank == 0):
            sq = sq + g.float().pow(2).sum()
    ep = None if groups.experts is None else groups.experts.ep
    # BUG grad_norm_wrong_group: the expert norm is reduced over the EDP group instead of EP.
    if bugs.active(bug, "grad_norm_wrong_group") and groups.experts is not None:
        ep = groups.experts.edp
    if ep is not None and dist.get_world_size(ep) > 1:
        dist.all_reduce(sq, group=ep)
    return sq


def reduce_context_parallel(model: nn.Module, ps: ParallelState) -> None:
    """Under CP every rank saw only its sequence chunks: sum the param grads over the CP group (the
    loss is already the mean over the whole sequence, so no division)."""
    all_reduce_coalesced([g for p in model.parameters() if (g := precision.grad(p)) is not None], ps.cp_group)


def reduce_shared(model: nn.Module, groups: SharedGroups, bug: str, *,
                  tied: bool = True, ps: ParallelState | None = None) -> None:
    if ps is not None:
        reduce_context_parallel(model, ps)
        reduce_experts(model, groups, ps, bug)
    reduce_kv_replicas(model, groups, bug)
    if tied:
        reduce_tied_embedding(model, groups, bug)
