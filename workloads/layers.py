"""Tensor-parallel building blocks (Megatron semantics). Parameters are created empty with their
LOCAL shapes; `train.init_weights` fills them from full logical tensors sliced by the plan."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workloads.mappings import (
    copy_to_tp_region,
    gather_from_sp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
)

Group = dist.ProcessGroup | None


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape))


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) sharded; the output stays sharded on the last dim.

    Input is replicated (copy_to_tp: grads all-reduced) or, under SP, sequence-sharded (all-gathered).
    """

    def __init__(self, in_features: int, out_features: int, tp_size: int, group: Group, *, bias: bool = True,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.linear = F.linear   # the GEMM; precision recipes swap in BF16/FP8 (workloads/precision.py)
        self.weight = _param(out_features // tp_size, in_features)
        self.bias = _param(out_features // tp_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sp_region(x, self.group)
        else:
            x = copy_to_tp_region(x, self.group)
        return self.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (input features) sharded; input already TP-parallel.

    Partial outputs are summed (reduce_from_tp) or, under SP, summed and sequence-sharded
    (reduce_scatter_to_sp); the replicated bias is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, tp_size: int, group: Group, *,
                 sequence_parallel: bool = False, bias_per_rank: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.linear = F.linear   # the GEMM; precision recipes swap in BF16/FP8 (workloads/precision.py)
        self.bias_per_rank = bias_per_rank   # bug switch row_parallel_bias_per_rank
        self.weight = _param(out_features, in_features // tp_size)
        self.bias = _param(out_features)
        # Under SP the bias meets only this rank's sequence chunk: its grad is partial over TP.
        self.bias.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias_per_rank:
            # BUG row_parallel_bias_per_rank: bias joins the partial sum, so it is counted tp times.
            y = self.linear(x, self.weight, self.bias)
        else:
            y = self.linear(x, self.weight)
        y = reduce_scatter_to_sp_region(y, self.group) if self.sequence_parallel else reduce_from_tp_region(
            y, self.group)
        return y if self.bias_per_rank else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with vocab rows sharded: look up local rows, zero the others, sum over TP."""

    def __init__(self, vocab: int, hidden: int, tp_size: int, tp_rank: int, group: Group):
        super().__init__()
        self.group = group
        self.per_rank = vocab // tp_size
        self.start = tp_rank * self.per_rank
        self.weight = _param(self.per_rank, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.per_rank)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-sharded logits [b, s, v/tp] without gathering the vocab.

    Three all-reduces over TP: the max (stability), the target logit (owned by one rank), the sum
    of exps. Backward is softmax - onehot, computed locally on the shard.
    """

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        multi = group is not None and dist.get_world_size(group) > 1
        logits_max = logits.max(dim=-1)[0]
        if multi:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)   # not in place: `head` output may be traced

        per_rank = logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_start + per_rank)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        if multi:
            dist.all_reduce(predicted, group=group)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if multi:
            dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - predicted

        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, local_target.unsqueeze(-1),
                                                   (~outside).to(softmax.dtype).unsqueeze(-1))
        return (softmax - onehot) * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group,
                                 vocab_start: int) -> torch.Tensor:
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)
