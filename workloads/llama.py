"""Llama-style pipeline stage (model.arch=llama): RMSNorm, RoPE, SwiGLU, grouped-query attention.

GQA with fewer KV heads than TP ranks: the KV projection is then *replicated* across the tp/kv_heads
ranks that share a KV head (Megatron's rule). Each of those ranks only backpropagates its own query
heads through its KV copy, so the KV weight grad is a partial sum over the sharing ranks and is
all-reduced over them in grad finalization (`workloads/grad_sync.py`). Two derived mesh axes name
this: `kv` (which KV shard a rank holds, size min(kv_heads, tp)) and `kvr` (the replica index among
the ranks sharing it, size tp / min(kv_heads, tp)); both are functions of the tp coordinate.

Module names are the tracing contract (workloads/plan.py `llama_plan`). Linear layers are the
existing Column/RowParallelLinear classes, so precision recipes swap their GEMMs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workloads.config import Config
from workloads.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from workloads.mappings import copy_to_tp_region, gather_from_sp_region, scatter_to_sp_region
from workloads.model import TokenLoss, core_attention, run_layers
from workloads.parallel_state import ParallelState

ROPE_THETA = 10000.0


def add_kv_axes(ps: ParallelState, kv_heads: int) -> None:
    """Derived mesh axes for GQA (see module doc); idempotent."""
    shards = min(kv_heads, ps.tp_size)
    replicas = ps.tp_size // shards
    ps.sizes.update(kv=shards, kvr=replicas)
    ps.coords.update(kv=ps.tp_rank // replicas, kvr=ps.tp_rank % replicas)


def _rms_norm(hidden: int, sp: bool) -> nn.RMSNorm:
    norm = nn.RMSNorm(hidden, eps=1e-5)
    norm.weight.sequence_parallel = sp   # partial over TP under SP: all-reduced in finalize_grads
    return norm


def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half form) on x [b, h, s, d] at integer `positions` [s], computed in FP32."""
    d = x.shape[-1]
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]          # [s, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class _CausalAttention(torch.autograd.Function):
    """softmax(q k^T * scale, causal) v with an explicit backward (the "fused kernel" code path).

    q, k, v: [b, h, s, d] (k, v already expanded to the query heads)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, dq_scale_bug):
        s = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        ctx.save_for_backward(q, k, v, probs)
        ctx.scale, ctx.dq_scale_bug = scale, dq_scale_bug
        return torch.matmul(probs, v)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, probs = ctx.saved_tensors
        d_v = torch.matmul(probs.transpose(-1, -2), d_out)
        d_probs = torch.matmul(d_out, v.transpose(-1, -2))
        d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
        # BUG attention_dq_scale_wrong: dQ misses the softmax scale (dK keeps it).
        d_q = torch.matmul(d_scores, k) * (1.0 if ctx.dq_scale_bug else ctx.scale)
        d_k = torch.matmul(d_scores.transpose(-1, -2), q) * ctx.scale
        return d_q, d_k, d_v, None, None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The same forward as _CausalAttention, its backward left to autograd (a reference's
    `model.attention=autograd`: no hand-written backward to share a bug with)."""
    s = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    return torch.matmul(scores.masked_fill(causal, float("-inf")).softmax(dim=-1), v)


class GQACoreAttention(nn.Module):
    """Local query heads attend to their (local or replicated) KV heads, with RoPE.

    q [b, s, lq*d] (this rank's query heads), kv [b, s, lk*2*d] (per KV head [k; v]) -> [b, s, lq*d]."""

    def __init__(self, cfg: Config, ps: ParallelState, dq_scale_bug: bool):
        super().__init__()
        m = cfg.model
        self.head_dim, self.dq_scale_bug, self.autograd = m.head_dim, dq_scale_bug, m.attention == "autograd"
        local_q = m.heads // ps.tp_size
        local_kv = m.num_kv_heads // ps.sizes["kv"]
        q_per_kv = m.heads // m.num_kv_heads
        first_q, first_kv = ps.tp_rank * local_q, ps.coords["kv"] * local_kv
        # Local KV head serving each local query head.
        self.register_buffer("kv_index", torch.tensor(
            [(first_q + j) // q_per_kv - first_kv for j in range(local_q)]), persistent=False)
        self.cp_group: Any = None

    def enable_cp(self, ps: ParallelState, seq_len: int, *, backward_bug: bool, rope_bug: bool) -> None:
        """Context parallelism: ring attention over this rank's zigzag chunks (context_parallel.py)."""
        from workloads.context_parallel import positions

        self.cp_group, self.cp_backward_bug = ps.cp_group, backward_bug
        pos = positions(ps, seq_len)
        # BUG cp_rope_offset_wrong: rotary ids count 0.. over the local chunks instead of their global
        # (zigzag) positions; the attention mask still uses the right ones.
        self.register_buffer("rope_pos", torch.arange(len(pos)) if rope_bug else pos, persistent=False)
        self.register_buffer("cp_pos", pos, persistent=False)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, s, _ = q.shape
        d, dtype = self.head_dim, q.dtype
        q = q.float().view(b, s, -1, d).transpose(1, 2)                       # [b, lq, s, d]
        k, v = kv.float().view(b, s, -1, 2, d).permute(3, 0, 2, 1, 4).unbind(0)  # each [b, lk, s, d]
        if self.cp_group is not None:
            positions = self.rope_pos
        q, k = rotary(q, positions), rotary(k, positions)
        k, v = k.index_select(1, self.kv_index), v.index_select(1, self.kv_index)
        if self.cp_group is not None:
            from workloads.context_parallel import ring_attention

            out = ring_attention(q, k, v, self.cp_pos, self.cp_group, dq_scale_bug=self.dq_scale_bug,
                                 backward_bug=self.cp_backward_bug)
        elif self.autograd:
            out = causal_attention(q, k, v, 1.0 / math.sqrt(d))
        else:
            out = _CausalAttention.apply(q, k, v, 1.0 / math.sqrt(d), self.dq_scale_bug)
        return out.transpose(1, 2).reshape(b, s, -1).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Config, ps: ParallelState, dq_scale_bug: bool):
        super().__init__()
        m, sp = cfg.model, cfg.parallel.sp
        d, kv_heads = m.head_dim, m.num_kv_heads
        self.sp, self.group = sp, ps.tp_group
        self.q = ColumnParallelLinear(m.hidden, m.hidden, ps.tp_size, ps.tp_group, bias=False,
                                      sequence_parallel=sp)
        # Sharded over the `kv` axis; its input grad is still all-reduced over the whole TP group
        # (each rank's copy carries only its own query heads' contribution).
        self.kv = ColumnParallelLinear(m.hidden, 2 * kv_heads * d, ps.sizes["kv"], ps.tp_group, bias=False,
                                       sequence_parallel=sp)
        for p in self.kv.parameters():
            p.kv_replicated = ps.sizes["kvr"] > 1
        self.core = GQACoreAttention(cfg, ps, dq_scale_bug)
        self.proj = RowParallelLinear(m.hidden, m.hidden, ps.tp_size, ps.tp_group, sequence_parallel=sp)
        self.selective = cfg.parallel.recompute == "selective"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1] * (self.group.size() if self.sp and self.group is not None else 1)
        positions = torch.arange(s, device=x.device)
        return self.proj(core_attention(self.core, self.selective, self.q(x), self.kv(x), positions))


class SwiGLU(nn.Module):
    def __init__(self, cfg: Config, ps: ParallelState):
        super().__init__()
        h, f, sp = cfg.model.hidden, cfg.model.ffn_hidden, cfg.parallel.sp
        self.gate = ColumnParallelLinear(h, f, ps.tp_size, ps.tp_group, bias=False, sequence_parallel=sp)
        self.up = ColumnParallelLinear(h, f, ps.tp_size, ps.tp_group, bias=False, sequence_parallel=sp)
        self.down = RowParallelLinear(f, h, ps.tp_size, ps.tp_group, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: Config, ps: ParallelState, dq_scale_bug: bool, expert_groups: Any = None,
                 router_bug: bool = False):
        super().__init__()
        self.norm1 = _rms_norm(cfg.model.hidden, cfg.parallel.sp)
        self.attn = Attention(cfg, ps, dq_scale_bug)
        self.norm2 = _rms_norm(cfg.model.hidden, cfg.parallel.sp)
        if cfg.model.experts:
            from workloads.moe import MoE

            self.mlp: nn.Module = MoE(cfg, ps, expert_groups, router_unmarked=router_bug)
        else:
            self.mlp = SwiGLU(cfg, ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embedding(nn.Module):
    """Word embedding only (positions are rotary); scattered over the sequence under SP."""

    def __init__(self, cfg: Config, ps: ParallelState):
        super().__init__()
        self.sp, self.group = cfg.parallel.sp, ps.tp_group
        self.word = VocabParallelEmbedding(cfg.model.vocab, cfg.model.hidden, ps.tp_size, ps.tp_rank,
                                           ps.tp_group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.word(ids)
        return scatter_to_sp_region(h, self.group) if self.sp else h


class TiedHead(ColumnParallelLinear):
    """LM head whose weight is the word embedding's (`shared` holds it; not a registered module)."""

    def __init__(self, cfg: Config, ps: ParallelState, shared: VocabParallelEmbedding):
        super().__init__(cfg.model.hidden, cfg.model.vocab, ps.tp_size, ps.tp_group, bias=False,
                         sequence_parallel=cfg.parallel.sp)
        self.register_parameter("weight", None)
        self.shared = [shared]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sp = self.sequence_parallel
        x = gather_from_sp_region(x, self.group) if sp else copy_to_tp_region(x, self.group)
        return self.linear(x, self.shared[0].weight)


class LlamaStage(nn.Module):
    """One pipeline stage. With tied embeddings the last stage (if not also the first) holds its own
    copy of `embedding.word.weight` (same name, same initial values): its grad is summed with the
    first stage's over the embedding group, and the pp axis is then a replica axis of that tensor."""

    def __init__(self, cfg: Config, ps: ParallelState, *, dq_scale_bug: bool = False,
                 expert_groups: Any = None, router_bug: bool = False):
        super().__init__()
        add_kv_axes(ps, cfg.model.num_kv_heads)
        per_stage = cfg.model.layers // ps.pp_size
        self.layer_offset = ps.pp_rank * per_stage
        self.is_first, self.is_last = ps.is_first_stage, ps.is_last_stage
        tied = cfg.model.tie_embeddings
        if self.is_first or (self.is_last and tied):
            self.embedding = Embedding(cfg, ps)
            if tied:
                self.embedding.word.weight.shared_embedding = ps.pp_size > 1
                # Clipping counts the tied weight once, on the first stage.
                self.embedding.word.weight.norm_duplicate = not self.is_first
        self.layers = nn.ModuleList(Block(cfg, ps, dq_scale_bug, expert_groups, router_bug)
                                    for _ in range(per_stage))
        self.recompute = cfg.parallel.recompute
        if cfg.model.experts:
            from tracer import PipelineRenaming
            from workloads.moe import ExpertRenaming

            local = cfg.model.experts // ps.sizes.get("ep", 1)
            first = ps.coords.get("ep", 0) * local
            self.renaming = ExpertRenaming(first, PipelineRenaming(self.layer_offset))
        if self.is_last:
            self.final_norm = _rms_norm(cfg.model.hidden, cfg.parallel.sp)
            self.head = (TiedHead(cfg, ps, self.embedding.word) if tied else
                         ColumnParallelLinear(cfg.model.hidden, cfg.model.vocab, ps.tp_size, ps.tp_group,
                                              bias=False, sequence_parallel=cfg.parallel.sp))
            self.loss = TokenLoss(ps, cfg.model.vocab)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embedding(x) if self.is_first else x
        h = run_layers(self.layers, h, self.recompute)
        if not self.is_last:
            return h
        return self.loss(self.head(self.final_norm(h)), labels)
