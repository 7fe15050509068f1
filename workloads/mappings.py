"""TP/SP communication as tiny autograd Functions, named by the region change they make
(megatron-core tensor_parallel/mappings.py). Each backward is the dual collective of its forward.

Activations are [batch, seq, hidden]: the sequence-parallel dim is 1, the tensor-parallel dim is -1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SEQ_DIM = 1


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    # all-reduce + local slice: same sums as a reduce-scatter, and gloo has no reduce_scatter on CPU.
    return _split(_all_reduce(x, group), dim, group)


class _CopyToTP(torch.autograd.Function):
    """Enter a TP region with a replicated input: identity forward, all-reduce of the input grad."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Leave a TP region by summing partial outputs; grads are already replicated."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToSP(torch.autograd.Function):
    """Replicated -> sequence-sharded: keep this rank's sequence chunk; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, SEQ_DIM, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    """Sequence-sharded -> full sequence. Entering a column-parallel linear the consumers are
    TP-parallel, so each rank's grad is a partial sum: backward reduce-scatters. Consumers that
    compute the same thing on every rank (MoE experts' inputs and gates) pass
    `tensor_parallel_output_grad=False`: backward keeps this rank's chunk (megatron-core's flag)."""

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.partial = group, tensor_parallel_output_grad
        return _gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.partial:
            return _reduce_scatter(g, SEQ_DIM, ctx.group), None, None
        return _split(g, SEQ_DIM, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Partial sums over TP -> summed and sequence-sharded (leaving a row-parallel linear)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, SEQ_DIM, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def scatter_to_sp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _ScatterToSP.apply(x, group)


def gather_from_sp_region(x: torch.Tensor, group: dist.ProcessGroup | None,
                          tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    return _GatherFromSP.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _ReduceScatterToSP.apply(x, group)
