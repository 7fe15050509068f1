"""GPT pipeline-stage model. Module names are the tracing contract (see plan.py); layers are
numbered locally on each PP stage, like Megatron, and renamed to global indices by the tracer."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from workloads.config import Config
from workloads.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from workloads.mappings import scatter_to_sp_region
from workloads.parallel_state import ParallelState


def _layer_norm(hidden: int, sp: bool) -> nn.LayerNorm:
    ln = nn.LayerNorm(hidden, eps=1e-5)
    for p in ln.parameters():
        # Under SP each TP rank normalizes only its sequence chunk: the grads are partial sums
        # over TP and must be all-reduced in grad finalization (Megatron's marking).
        p.sequence_parallel = sp
    return ln


class Embedding(nn.Module):
    """word (vocab-parallel) + learned position embedding, then scattered over the sequence under SP."""

    def __init__(self, cfg: Config, ps: ParallelState):
        super().__init__()
        self.sp, self.group = cfg.parallel.sp, ps.tp_group
        self.word = VocabParallelEmbedding(cfg.model.vocab, cfg.model.hidden, ps.tp_size, ps.tp_rank,
                                           ps.tp_group)
        self.position = nn.Embedding(cfg.model.seq_len, cfg.model.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = getattr(self, "positions", None)   # context parallelism: this rank's zigzag positions
        pos = torch.arange(ids.shape[1], device=ids.device) if pos is None else pos
        h = self.word(ids) + self.position(pos).unsqueeze(0)
        return scatter_to_sp_region(h, self.group) if self.sp else h


class CoreAttention(nn.Module):
    """Causal softmax attention over this rank's heads: qkv [b, s, lh*3*d] -> [b, s, lh*d]."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        b, s, _ = qkv.shape
        dtype, qkv = qkv.dtype, qkv.float()   # FP32 inside, output in the input dtype (flash-attention style)
        # Per-head layout [heads, 3, head_dim]: a TP shard of contiguous heads is contiguous.
        q, k, v = qkv.view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)  # each [b, lh, s, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool, device=qkv.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        ctx = torch.matmul(probs, v)                                    # [b, lh, s, d]
        return ctx.transpose(1, 2).reshape(b, s, -1).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Config, ps: ParallelState, row_bias_bug: bool):
        super().__init__()
        h, sp = cfg.model.hidden, cfg.parallel.sp
        self.qkv = ColumnParallelLinear(h, 3 * h, ps.tp_size, ps.tp_group, sequence_parallel=sp)
        self.core = CoreAttention(cfg.model.head_dim)
        self.proj = RowParallelLinear(h, h, ps.tp_size, ps.tp_group, sequence_parallel=sp,
                                      bias_per_rank=row_bias_bug)
        self.selective = cfg.parallel.recompute == "selective"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(core_attention(self.core, self.selective, self.qkv(x)))


class MLP(nn.Module):
    def __init__(self, cfg: Config, ps: ParallelState, row_bias_bug: bool):
        super().__init__()
        h, f, sp = cfg.model.hidden, cfg.model.ffn_hidden, cfg.parallel.sp
        self.fc1 = ColumnParallelLinear(h, f, ps.tp_size, ps.tp_group, sequence_parallel=sp)
        self.fc2 = RowParallelLinear(f, h, ps.tp_size, ps.tp_group, sequence_parallel=sp,
                                     bias_per_rank=row_bias_bug)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LN transformer block; the residual stream is sequence-sharded under SP."""

    def __init__(self, cfg: Config, ps: ParallelState, row_bias_bug: bool):
        super().__init__()
        self.ln1 = _layer_norm(cfg.model.hidden, cfg.parallel.sp)
        self.attn = Attention(cfg, ps, row_bias_bug)
        self.ln2 = _layer_norm(cfg.model.hidden, cfg.parallel.sp)
        self.mlp = MLP(cfg, ps, row_bias_bug)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TokenLoss(nn.Module):
    """Per-token loss [b, s] from vocab-sharded logits (a module so the tracer can hook it)."""

    def __init__(self, ps: ParallelState, vocab: int):
        super().__init__()
        self.group = ps.tp_group
        self.vocab_start = ps.tp_rank * (vocab // ps.tp_size)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Cross-entropy on FP32 logits (Megatron's default, fp16_lm_cross_entropy=False).
        return vocab_parallel_cross_entropy(logits.float(), labels, self.group, self.vocab_start)


def core_attention(core: nn.Module, selective: bool, *args: Any) -> torch.Tensor:
    """The core attention; selective: run again in backward instead of keeping its activations (the
    scores and probabilities, the largest of a layer's), as Megatron's selective recompute does it:
    reentrant, the first forward under no_grad."""
    return checkpoint(core, *args, use_reentrant=True) if selective else core(*args)


def run_layers(layers: nn.ModuleList, h: torch.Tensor, recompute: str) -> torch.Tensor:
    """The transformer layers in order. recompute="full": each layer's forward runs again in backward,
    as Megatron's full recompute (uniform, one layer a chunk) does it: reentrant, the first forward
    under no_grad keeping only the layer's input."""
    for layer in layers:
        h = checkpoint(layer, h, use_reentrant=True) if recompute == "full" else layer(h)
    return h


class GPTStage(nn.Module):
    """The layers of one pipeline stage: embedding on the first, final LN + head + loss on the last."""

    def __init__(self, cfg: Config, ps: ParallelState, *, row_bias_bug: bool = False):
        super().__init__()
        per_stage = cfg.model.layers // ps.pp_size
        self.layer_offset = ps.pp_rank * per_stage
        self.is_first, self.is_last = ps.is_first_stage, ps.is_last_stage
        if self.is_first:
            self.embedding = Embedding(cfg, ps)
        self.layers = nn.ModuleList(Block(cfg, ps, row_bias_bug) for _ in range(per_stage))
        self.recompute = cfg.parallel.recompute
        if self.is_last:
            self.final_ln = _layer_norm(cfg.model.hidden, cfg.parallel.sp)
            # LM head: column-parallel without bias; logits stay vocab-sharded for the loss.
            self.head = ColumnParallelLinear(cfg.model.hidden, cfg.model.vocab, ps.tp_size, ps.tp_group,
                                             bias=False, sequence_parallel=cfg.parallel.sp)
            self.loss = TokenLoss(ps, cfg.model.vocab)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """First stage takes token ids, others the previous stage's hidden states; the last stage
        returns the per-token loss [b, s], the others hidden states."""
        h = self.embedding(x) if self.is_first else x
        h = run_layers(self.layers, h, self.recompute)
        if not self.is_last:
            return h
        return self.loss(self.head(self.final_ln(h)), labels)
