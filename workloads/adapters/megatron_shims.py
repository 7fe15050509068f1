"""CPU shims that let megatron-core's real code run without a GPU (gloo process groups).

megatron-core assumes CUDA in four places the tiny GPT touches: tensors allocated on
`torch.cuda.current_device()`, the CUDA RNG tracker's `fork()` around weight init and dropout, the
CUDA RNG state that activation recomputation (its CheckpointFunction) saves and restores, and CUDA
synchronization in its pipeline p2p code (plus one literal `device="cuda"` in its schedules).
On a machine without CUDA, `install()` points the first at the CPU, makes the second a null context
(dropout is off and weights come from ttrace's consistent generator, so no RNG stream is needed), the
third a state of nothing (the CPU generator's state is saved and restored beside it, as on a GPU) and
the fourth a no-op. Two more stand-ins: megatron's unfused softmax needs an explicit boolean causal
mask (`causal_mask`), and its torch LayerNorm wrapper refuses sequence parallelism (`TorchNorm`).
Nothing here changes numerics. With CUDA present, `install()` does nothing.
"""

from __future__ import annotations

import contextlib
import types

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
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _CpuTorch()   # its token counter is allocated with a literal device="cuda"
    _installed = True


class _CpuTorch(types.ModuleType):
    """`torch` as seen by one megatron module: literal `device="cuda"` allocations land on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: object, device: object = None, **kwargs: object) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


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
