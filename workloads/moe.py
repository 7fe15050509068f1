"""Mixture of experts (model.experts > 0, model=moe_tiny): top-k router with a load-balancing
auxiliary loss, experts sharded over an expert-parallel (EP) group with all-to-all token dispatch and
combine, expert tensor parallelism (each expert's SwiGLU is column/row-parallel over TP).

EP is carved out of DP (Megatron): the `ep` consecutive DP ranks of a block form an EP group and hold
different experts; DP ranks with the same EP index form the expert-data-parallel (EDP) group and hold
the same experts. Dense grads are averaged over DP as usual; expert grads are summed over EDP and
divided by the full DP size (each expert already saw the tokens of its whole EP group).

Local expert j on EP rank r is global expert r * experts/ep + j (`ExpertRenaming`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tracer import routing
from workloads.config import Config
from workloads.layers import ColumnParallelLinear, RowParallelLinear
from workloads.mappings import gather_from_sp_region
from workloads.parallel_state import ParallelState, rank_of

Group = dist.ProcessGroup | None
A2A_TAG = 23


@dataclass
class ExpertGroups:
    ep: Group = None     # ranks holding different experts (same tp/cp/pp, consecutive dp)
    edp: Group = None    # ranks holding the same experts


def add_ep_axes(ps: ParallelState, ep: int) -> None:
    ps.sizes.update(ep=ep, edp=ps.dp_size // ep)
    ps.coords.update(ep=ps.coords["dp"] % ep, edp=ps.coords["dp"] // ep)


def build_groups(ps: ParallelState, ep: int) -> ExpertGroups:
    out = ExpertGroups()
    tp, dp, pp, cps = ps.sizes["tp"], ps.sizes["dp"], ps.sizes["pp"], range(ps.cp_size)
    for p in range(pp):
        for c in cps:
            for t in range(tp):
                for b in range(dp // ep):
                    ranks = [rank_of(t, b * ep + e, p, ps.sizes, c) for e in range(ep)]
                    g = dist.new_group(ranks)
                    if ps.rank in ranks:
                        out.ep = g
                for e in range(ep):
                    ranks = [rank_of(t, b * ep + e, p, ps.sizes, c) for b in range(dp // ep)]
                    g = dist.new_group(ranks)
                    if ps.rank in ranks:
                        out.edp = g
    return out


@dataclass(frozen=True)
class ExpertRenaming:
    """Local expert number -> global (after the inner, e.g. pipeline, renaming)."""

    first_expert: int
    inner: Any
    pattern: str = r"(\.experts\.)(\d+)"

    def __call__(self, name: str) -> str:
        name = self.inner(name)
        return re.sub(self.pattern, lambda m: m.group(1) + str(int(m.group(2)) + self.first_expert), name,
                      count=1)


class _AllToAll(torch.autograd.Function):
    """Send parts[i] to EP peer i (explicit send/recv: gloo has no all_to_all); backward reverses."""

    @staticmethod
    def forward(ctx, group, counts_in, counts_out, *parts):
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        h = parts[0].shape[-1]
        ctx.group, ctx.counts_in, ctx.counts_out = group, counts_in, counts_out
        ctx.h, ctx.dtype = h, parts[0].dtype
        received: list[torch.Tensor] = []
        works = [dist.isend(parts[i].contiguous(), dst=ranks[i], tag=A2A_TAG)
                 for i in range(len(ranks)) if i != me and counts_in[i] > 0]
        for i in range(len(ranks)):
            if i == me:
                received.append(parts[i].clone())
            elif counts_out[i] > 0:
                buf = torch.empty(counts_out[i], h, dtype=parts[0].dtype, device=parts[0].device)
                dist.irecv(buf, src=ranks[i], tag=A2A_TAG).wait()
                received.append(buf)
            else:
                received.append(parts[0].new_empty(0, h))
        for w in works:
            w.wait()
        return tuple(received)

    @staticmethod
    def backward(ctx, *grads):
        grads = tuple(torch.zeros(c, ctx.h, dtype=ctx.dtype) if g is None else g
                      for g, c in zip(grads, ctx.counts_out, strict=True))
        back = _AllToAll.apply(ctx.group, ctx.counts_out, ctx.counts_in, *grads)
        return (None, None, None, *back)


def _exchange_counts(counts: list[int], group: Group) -> list[int]:
    n = dist.get_world_size(group)
    mine = torch.tensor(counts, dtype=torch.int64)
    allc = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(allc, mine, group=group)
    me = dist.get_process_group_ranks(group).index(dist.get_rank())
    return [int(allc[i][me]) for i in range(n)]   # what each peer sends me


class Expert(nn.Module):
    """SwiGLU expert, tensor-parallel over TP (expert TP = TP)."""

    def __init__(self, cfg: Config, ps: ParallelState):
        super().__init__()
        h, f = cfg.model.hidden, cfg.model.ffn_hidden
        self.gate = ColumnParallelLinear(h, f, ps.tp_size, ps.tp_group, bias=False)
        self.up = ColumnParallelLinear(h, f, ps.tp_size, ps.tp_group, bias=False)
        self.down = RowParallelLinear(f, h, ps.tp_size, ps.tp_group)
        for p in self.parameters():
            p.expert = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Router(nn.Module):
    """Token -> expert logits [b, s, E] (FP32, replicated)."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class _AuxLossScaler(torch.autograd.Function):
    """Identity on the layer output; backward injects d(coeff * aux)/d(aux) (Megatron's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, g):
        (aux,) = ctx.saved_tensors
        return g, torch.full_like(aux, ctx.scale), None


class MoE(nn.Module):
    """Under SP (Megatron requires it for MoE with TP) the router sees this rank's sequence chunk (its
    weight grad is then partial over TP: marked sequence_parallel, all-reduced in finalize_grads);
    tokens, routing and gates are all-gathered over TP for the tensor-parallel experts, and the output
    is scattered back to the sequence chunk."""

    def __init__(self, cfg: Config, ps: ParallelState, groups: ExpertGroups, *,
                 router_unmarked: bool = False):
        super().__init__()
        m = cfg.model
        self.num_experts, self.top_k, self.aux_coeff = m.experts, m.top_k, m.aux_loss_coeff
        self.ep = ps.sizes.get("ep", 1)
        self.local = m.experts // self.ep
        self.first = ps.coords.get("ep", 0) * self.local
        self.group = groups.ep
        self.router = Router(m.hidden, m.experts)
        self.sp, self.tp_group = cfg.parallel.sp and ps.tp_size > 1, ps.tp_group
        # BUG moe_router_grad_unreduced: the router weight lacks the sequence-parallel marking.
        self.router.weight.sequence_parallel = self.sp and not router_unmarked
        self.experts = nn.ModuleList(Expert(cfg, ps) for _ in range(self.local))
        # The aux loss is added per microbatch like the main loss: divided by the local microbatches.
        self.aux_scale = 1.0 / cfg.micro_batches_local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)                                         # [b, s(/tp), E]
        probs = logits.softmax(-1)
        replayed = routing.replayed(logits)   # routing replay: the reference's logits (tracer/routing.py)
        if replayed is None:
            gates, idx = probs.topk(self.top_k, dim=-1)                 # [b, s(/tp), k]
        else:   # the reference's experts, weighted by this run's own probabilities (its grads flow)
            idx = replayed.softmax(-1).topk(self.top_k, dim=-1).indices
            gates = probs.gather(-1, idx)
        gates = (gates / gates.sum(-1, keepdim=True)).to(x.dtype)
        # Load balancing (Switch/GShard): E * sum_e fraction_e * mean_prob_e, over the whole sequence.
        counts = F.one_hot(idx, self.num_experts).sum((0, 1, 2)).float()
        prob_sum = probs.sum((0, 1))
        n_tok = probs.shape[0] * probs.shape[1]
        if self.sp:
            from workloads.mappings import reduce_from_tp_region

            counts, prob_sum = reduce_from_tp_region(counts, self.tp_group), reduce_from_tp_region(
                prob_sum, self.tp_group)
            n_tok *= dist.get_world_size(self.tp_group)
            # the experts compute the same tokens on every TP rank: backward keeps this rank's chunk
            x = gather_from_sp_region(x, self.tp_group, tensor_parallel_output_grad=False)
            gates = gather_from_sp_region(gates, self.tp_group, tensor_parallel_output_grad=False)
            parts = [torch.empty_like(idx) for _ in range(dist.get_world_size(self.tp_group))]
            dist.all_gather(parts, idx.contiguous(), group=self.tp_group)
            idx = torch.cat(parts, dim=1)
        aux = self.num_experts * (counts / (n_tok * self.top_k) * prob_sum / n_tok).sum()

        b, s, h = x.shape
        idx, gates = idx.reshape(-1, self.top_k), gates.reshape(-1, self.top_k)
        tokens = x.reshape(-1, h)
        flat_expert = idx.reshape(-1)                                   # [T*k]
        order = torch.argsort(flat_expert, stable=True)
        sorted_expert = flat_expert[order]
        routed = tokens[order // self.top_k]                            # [T*k, h], grouped by expert
        owner = sorted_expert // self.local
        counts = [int((owner == r).sum()) for r in range(self.ep)]
        if self.ep > 1:
            counts_out = _exchange_counts(counts, self.group)
            parts = _AllToAll.apply(self.group, counts, counts_out, *routed.split(counts))
            eparts = _AllToAll.apply(self.group, counts, counts_out,
                                     *sorted_expert.to(x.dtype).unsqueeze(-1).split(counts))
            local_tokens, local_expert = torch.cat(parts), torch.cat(eparts).squeeze(-1).long()
        else:
            local_tokens, local_expert = routed, sorted_expert
        out_local = torch.zeros_like(local_tokens)
        for j, expert in enumerate(self.experts):
            sel = (local_expert == self.first + j).nonzero().squeeze(-1)
            if sel.numel():
                out_local = out_local.index_add(0, sel, expert(local_tokens[sel]))
        if self.ep > 1:
            back = _AllToAll.apply(self.group, counts_out, counts, *out_local.split(counts_out))
            out_sorted = torch.cat(back)
        else:
            out_sorted = out_local
        weighted = out_sorted * gates.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(tokens).index_add(0, order // self.top_k, weighted).view(b, s, h)
        if self.sp:
            from workloads.mappings import scatter_to_sp_region

            out = scatter_to_sp_region(out, self.tp_group)
        return _AuxLossScaler.apply(out, aux, self.aux_coeff * self.aux_scale)
