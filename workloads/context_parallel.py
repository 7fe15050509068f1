"""Context parallelism (parallel.cp > 1): the sequence is split over the CP group, load-balanced.

Zigzag: the sequence is cut into 2*cp chunks; CP rank i holds chunks i and 2*cp-1-i, so every rank
gets the same amount of causal-attention work. Tokens, labels and position ids are sliced that way
(`localize`, `positions`); activations keep their layouts with the sequence dim zigzag-sharded over
`cp` (`with_cp`, the one CP rule, applied to a model's plan).

Ring attention: K and V blocks travel around the CP ring with explicit send/recv (each rank sees
every block once); queries attend with a causal mask on GLOBAL positions. Backward: dQ is local,
and each rank's partial dK/dV for every visiting block is sent back to the block's owner and summed.

Loss: each rank computes its tokens' losses; `CPTokenLoss` all-gathers them into the full sequence
in natural order (replicated over CP, so the loss is the mean over the whole sequence) and its
backward keeps this rank's tokens' grads only. Param grads are then partial sums over CP
(grad_sync.reduce_context_parallel).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tracer import Layout, ModuleLayout
from workloads.model import TokenLoss
from workloads.parallel_state import ParallelState
from workloads.schedule import Microbatch

RING_TAG = 11
Group = dist.ProcessGroup | None


def zigzag_index(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by CP rank `rank`, in local order."""
    chunk = seq // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([first, second])


def positions(ps: ParallelState, seq: int, device: torch.device | None = None) -> torch.Tensor:
    return zigzag_index(seq, ps.cp_size, ps.coords.get("cp", 0)).to(device)


def local_chunks(mbs: Sequence[Microbatch], ps: ParallelState) -> list[Microbatch]:
    """This CP rank's zigzag slice of every microbatch's tokens and labels."""
    if ps.cp_size == 1:
        return list(mbs)
    idx = positions(ps, mbs[0].ids.shape[1], mbs[0].ids.device)
    return [Microbatch(mb.index, mb.ids[:, idx], mb.labels[:, idx]) for mb in mbs]


def with_cp(plan: dict[str, ModuleLayout]) -> dict[str, ModuleLayout]:
    """Every traced activation [b, s, ...] gets its sequence dim zigzag-sharded over cp (outermost).
    The per-token loss is gathered over CP (CPTokenLoss) and stays as declared."""
    def cp(layout: Layout) -> Layout:
        return Layout(shard=((1, "cp"),) + layout.shard, partial=layout.partial,
                      zigzag=("cp",) + layout.zigzag)
    return {name: entry if name == "loss" else replace(
        entry, output=cp(entry.output), grad=None if entry.grad is None else cp(entry.grad))
        for name, entry in plan.items()}


# -- ring attention ----------------------------------------------------------------------------------
def _ring_ranks(group: Group) -> tuple[int, int, int, int]:
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    return me, n, ranks[(me + 1) % n], ranks[(me - 1) % n]


def _exchange(t: torch.Tensor, send_to: int, recv_from: int) -> torch.Tensor:
    buf = torch.empty_like(t)
    work = dist.isend(t.contiguous(), dst=send_to, tag=RING_TAG)
    dist.irecv(buf, src=recv_from, tag=RING_TAG).wait()
    work.wait()
    return buf


class _RingAttention(torch.autograd.Function):
    """q, k, v [b, h, s_local, d], pos [s_local] (global positions) -> out [b, h, s_local, d]."""

    @staticmethod
    def forward(ctx, q, k, v, pos, scale, group, dq_scale_bug, backward_bug):
        me, n, nxt, prv = _ring_ranks(group)
        blocks = [(k, v, pos.to(torch.float64))]   # block i came from ring rank (me - i) % n
        cur = torch.cat([k, v], dim=-1), pos.to(torch.float64)
        for _ in range(n - 1):   # pass K/V (and their positions) one hop around the ring
            kv = _exchange(cur[0], nxt, prv)
            p = _exchange(cur[1], nxt, prv)
            cur = kv, p
            blocks.append((*kv.split(k.shape[-1], dim=-1), p))
        keys = torch.cat([b[0] for b in blocks], dim=-2)
        values = torch.cat([b[1] for b in blocks], dim=-2)
        kpos = torch.cat([b[2] for b in blocks])
        scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
        masked = pos.to(torch.float64)[:, None] < kpos[None, :]
        probs = scores.masked_fill(masked, float("-inf")).softmax(dim=-1)
        ctx.save_for_backward(q, keys, values, probs)
        ctx.scale, ctx.group, ctx.block = scale, group, k.shape[-2]
        ctx.dq_scale_bug, ctx.backward_bug = dq_scale_bug, backward_bug
        return torch.matmul(probs, values)

    @staticmethod
    def backward(ctx, d_out):
        q, keys, values, probs = ctx.saved_tensors
        me, n, _, _ = _ring_ranks(ctx.group)
        ranks = dist.get_process_group_ranks(ctx.group)
        d_values = torch.matmul(probs.transpose(-1, -2), d_out)
        d_probs = torch.matmul(d_out, values.transpose(-1, -2))
        d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
        d_q = torch.matmul(d_scores, keys) * (1.0 if ctx.dq_scale_bug else ctx.scale)
        d_keys = torch.matmul(d_scores.transpose(-1, -2), q) * ctx.scale
        partial = torch.cat([d_keys, d_values], dim=-1).split(ctx.block, dim=-2)
        # Send each visiting block's partial dK/dV back to its owner; sum the ones for our block.
        pending = [dist.isend(partial[i].contiguous(), dst=ranks[(me - i) % n], tag=RING_TAG)
                   for i in range(1, n)]
        total = partial[0].clone()
        for i in range(1, n):
            buf = torch.empty_like(partial[0])
            dist.irecv(buf, src=ranks[(me + i) % n], tag=RING_TAG).wait()
            # BUG cp_attention_backward_wrong: the received partial replaces the accumulator.
            total = buf if ctx.backward_bug else total + buf
        for w in pending:
            w.wait()
        d_k, d_v = total.split(d_keys.shape[-1], dim=-1)
        return d_q, d_k, d_v, None, None, None, None, None


def ring_attention(q, k, v, pos, group: Group, *, dq_scale_bug: bool = False,
                   backward_bug: bool = False) -> torch.Tensor:
    return _RingAttention.apply(q, k, v, pos, 1.0 / math.sqrt(q.shape[-1]), group, dq_scale_bug, backward_bug)


class CPCoreAttention(nn.Module):
    """GPT's CoreAttention (workloads/model.py) as ring attention: qkv [b, s_local, lh*3*d] ->
    [b, s_local, lh*d]."""

    def __init__(self, head_dim: int, ps: ParallelState, seq_len: int, backward_bug: bool):
        super().__init__()
        self.head_dim, self.group, self.backward_bug = head_dim, ps.cp_group, backward_bug
        self.register_buffer("pos", positions(ps, seq_len), persistent=False)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        b, s, _ = qkv.shape
        dtype, qkv = qkv.dtype, qkv.float()
        q, k, v = qkv.view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        ctx = ring_attention(q, k, v, self.pos, self.group, backward_bug=self.backward_bug)
        return ctx.transpose(1, 2).reshape(b, s, -1).to(dtype)


# -- loss --------------------------------------------------------------------------------------------
class _GatherZigzagTokens(torch.autograd.Function):
    """Local per-token losses [b, s_local] -> full sequence [b, s] in natural order, on every CP rank.
    Backward keeps this rank's tokens (every rank holds the same full loss)."""

    @staticmethod
    def forward(ctx, x, idx, group, scale_bug):
        n = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        seq = x.shape[1] * n
        out = torch.empty(x.shape[0], seq, dtype=x.dtype, device=x.device)
        for r, part in enumerate(parts):
            out[:, zigzag_index(seq, n, r).to(x.device)] = part
        ctx.save_for_backward(idx)
        ctx.factor = float(n) if scale_bug else 1.0
        return out

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        # BUG cp_loss_scaling_wrong (factor = cp): each CP rank's copy of the loss is backpropagated
        # as if the CP ranks' losses were summed, so every grad is cp times too large.
        return g[:, idx] * ctx.factor, None, None, None


class CPTokenLoss(TokenLoss):
    """TokenLoss whose output is the whole sequence's per-token loss (gathered over CP)."""

    def __init__(self, ps: ParallelState, vocab: int, seq_len: int, scale_bug: bool):
        super().__init__(ps, vocab)
        self.cp_group, self.scale_bug = ps.cp_group, scale_bug
        self.register_buffer("idx", positions(ps, seq_len), persistent=False)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = super().forward(logits, labels)
        return _GatherZigzagTokens.apply(losses, self.idx, self.cp_group, self.scale_bug)


def apply(model: nn.Module, ps: ParallelState, cfg: Any) -> None:
    """Swap in the CP modules (GPT attention cores, the loss) and tell every attention core that runs
    context-parallel itself (`enable_cp`: llama's GQA core) its positions."""
    from workloads import bugs
    from workloads.model import CoreAttention, Embedding

    seq = cfg.model.seq_len
    backward_bug = bugs.active(cfg.bug, "cp_attention_backward_wrong")
    for name, module in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(module, CoreAttention):
            setattr(parent, attr, CPCoreAttention(module.head_dim, ps, seq, backward_bug))
        elif isinstance(module, Embedding):
            module.register_buffer("positions", positions(ps, seq), persistent=False)
        elif callable(getattr(module, "enable_cp", None)):
            module.enable_cp(ps, seq, backward_bug=backward_bug,
                             rope_bug=bugs.active(cfg.bug, "cp_rope_offset_wrong"))
        elif isinstance(module, TokenLoss) and not isinstance(module, CPTokenLoss):
            loss_bug = bugs.active(cfg.bug, "cp_loss_scaling_wrong")
            setattr(parent, attr, CPTokenLoss(ps, cfg.model.vocab, seq, loss_bug))
