"""CPU shims that let megatron-core's real code run without a GPU (gloo process groups).

megatron-core assumes CUDA in four places the tiny GPT touches: tensors allocated on
`torch.cuda.current_device()`, the CUDA RNG tracker's `fork()` around weight init and dropout, the
CUDA RNG state that activation recomputation (its CheckpointFunction) saves and restores, and CUDA
synchronization in its pipeline p2p code; besides, literal `device="cuda"` allocations in its
schedules, optimizers, grad clipping and multi-tensor fallbacks, and type checks that want
`torch.cuda.FloatTensor` in its optimizers and grad clipping.
On a machine without CUDA, `install()` points the first at the CPU, makes the second a null context
(dropout is off and weights come from ttrace's consistent generator, so no RNG stream is needed), the
third a state of nothing (the CPU generator's state is saved and restored beside it, as on a GPU) and
the fourth a no-op; the literal allocations land on the CPU (`_CpuTorch`), and `cpu_tensors_as_cuda()`
names a CPU tensor's type as its CUDA twin, and keeps it where it is when moved to the GPU, while
megatron's model and optimizer are built and the optimizer stepped. Two more
stand-ins: megatron's unfused softmax needs an explicit boolean causal mask (`causal_mask`), and its
torch LayerNorm wrapper refuses sequence parallelism (`TorchNorm`). Nothing here changes numerics.
With CUDA present, `install()` does nothing and `cpu_tensors_as_cuda()` changes nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterator

import torch

_installed = False


def install() -> None:
    """Idempotent; call before building any megatron-core module."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"   # device= arguments of megatron's allocations
    torch.cuda.synchronize = lambda *a, **k: None   # pipeline p2p "race" guard
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    mrandom.CudaRNGStatesTracker.add = lambda self, name, seed: None
    mrandom._get_cuda_rng_state = lambda *a, **k: None   # recomputation's CUDA generator state
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    # Modules that allocate with a literal device="cuda": the schedules' token counter, the optimizers'
    # scale and found-inf flags, grad clipping's norm, and the multi-tensor fallbacks' l2 norm.
    for name in _LITERAL_CUDA:
        importlib.import_module(name).torch = _CpuTorch()
    _installed = True


_LITERAL_CUDA = ("megatron.core.pipeline_parallel.schedules", "megatron.core.optimizer.optimizer",
                 "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.clip_grads",
                 "megatron.core.utils")


@contextlib.contextmanager
def cpu_tensors_as_cuda() -> Iterator[None]:
    """While megatron's model and optimizer are built, and the optimizer stepped: a CPU tensor's
    `type()` names its CUDA twin ('torch.cuda.FloatTensor', which its param-group builder and grad
    clipping require of every parameter and grad) and its `cuda()` is the tensor itself (a tied output
    layer's weight is moved to the GPU before the embedding group's all-reduce). Scoped, since the
    whole process shares `torch.Tensor`. No-op with CUDA."""
    if torch.cuda.is_available():
        yield
        return
    real_type, real_cuda = torch.Tensor.type, torch.Tensor.cuda

    def cuda_named(self: torch.Tensor, dtype: object = None, non_blocking: bool = False,
                   **kw: object) -> object:
        if dtype is None and not kw and self.device.type == "cpu":
            return "torch.cuda." + real_type(self).removeprefix("torch.")
        return real_type(self) if dtype is None else real_type(self, dtype, non_blocking, **kw)

    def stays(self: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        return self if self.device.type == "cpu" and not args and not kw else real_cuda(self, *args, **kw)

    torch.Tensor.type, torch.Tensor.cuda = cuda_named, stays   # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = real_type, real_cuda   # type: ignore[method-assign]


class _CpuTorch(types.ModuleType):
    """`torch` as seen by one megatron module: literal `device="cuda"` allocations land on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: object, device: object = None, **kwargs: object) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    @staticmethod
    def tensor(*args: object, device: object = None, **kwargs: object) -> torch.Tensor:
        return torch.tensor(*args, device="cpu" if device == "cuda" else device, **kwargs)


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """megatron's convention: True where attention is masked out, shape [1, 1, s, s]."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


class TorchNorm:
    """megatron's `WrappedTorchNorm` without its `not config.sequence_parallel` assertion (the local
    spec's LayerNorm when apex is absent). Under SP the norm simply runs on the rank's sequence chunk;
    like megatron's fused LayerNorm, its params are tagged `sequence_parallel` so that
    `finalize_model_grads` all-reduces their grads over TP."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_: object) -> torch.nn.Module:  # noqa: ANN001
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm
