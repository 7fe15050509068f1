"""BF16 kernels computed as a GPU computes them, under code ttrace does not own (megatron-core's BF16
layers, job=megatron_core): a TorchDispatchMode, since that code calls torch itself.

What the mode changes, each for BF16 operands only, every output rounded once to its BF16 dtype:
- GEMMs (aten mm, bmm, addmm, baddbmm): FP32 accumulation of the BF16 operands, as cuBLAS computes
  them (workloads/precision.py's bf16_linear, for code that calls torch's GEMMs directly). BF16 GEMMs
  on a CPU without BF16 instructions run ~130x slower than FP32 ones; where it has them (AVX512-BF16)
  they accumulate in FP32 too and agree with these on 99.99% of outputs.
- LayerNorm, forward and backward, and the embedding's weight grad: CPU's BF16 kernels keep LayerNorm's
  mean and 1/std in BF16 for the backward (GPU kernels keep them in FP32) and accumulate its weight and
  bias grads and an embedding's grad over repeated tokens in BF16 (LayerNorm's: 22-27% correctly
  rounded against FP64, and their value depends on the thread count, so a dp2 rank differed from the
  single device by ~1e-2 with nothing wrong; the embedding's: 52%). Computed in FP32 here, the outputs
  rounded once and the statistics kept in FP32, as a GPU computes them, and the same on any thread
  count.

A dispatch mode, not a function mode: a TorchFunctionMode is not active inside an autograd.Function's
backward (megatron's linear layers compute their dgrad and wgrad GEMMs there) nor under the backward
formulas autograd runs in C++ (attention's bmm). Measured on megatron-core's tiny GPT (2026-12-07): every
GEMM of a step, forward and backward (117 mm, 42 bmm, 10 baddbmm over 2 steps), and a step 22 ms against
13 ms with the CPU's own BF16 kernels. Communication is untouched: its dtypes are the code's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

BF16 = torch.bfloat16
aten = torch.ops.aten
GEMMS = (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default)


def _up(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype == BF16 else x


class GpuBF16(TorchDispatchMode):
    """BF16 GEMMs, LayerNorm backward and embedding backward as a GPU computes them (module doc). Wrap
    the forward and backward in it (`with GpuBF16(): ...`); on a CUDA device it changes nothing."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or tensors[0].is_cuda or not any(t.dtype == BF16 for t in tensors):
            return func(*args, **kwargs)
        if func in GEMMS and all(t.dtype == BF16 for t in tensors):
            return func(*map(_up, args), **kwargs).to(BF16)
        if func is aten.embedding_dense_backward.default:   # (grad, indices, num_weights, padding, by_freq)
            return func(_up(args[0]), *args[1:], **kwargs).to(args[0].dtype)
        if func is aten.native_layer_norm.default:   # (input, shape, weight, bias, eps) -> (out, mean, rstd)
            out, mean, rstd = func(*map(_up, args), **kwargs)
            return out.to(args[0].dtype), mean, rstd
        if func is aten.native_layer_norm_backward.default:
            # (grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask) -> (dx, dw, db)
            like = (args[1], args[5], args[6])
            outs = func(*map(_up, args), **kwargs)
            return tuple(o if o is None or t is None else o.to(t.dtype)
                         for o, t in zip(outs, like, strict=True))
        return func(*args, **kwargs)
