"""Rounding draws on GEMM results: the built-in trainer's perturbed references under
`tolerance.perturbation=gemm` (workloads/precision.py says why, docs/tolerance.md what it measured).
Every GEMM's forward output and input grad is drawn again at its final rounding."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from tracer.generator import step_ulp

# P(a GEMM result moves one ulp) in a gemm draw; bf16: P(a value re-rounded from a moved FP32
# accumulator lands one ulp away).
ROUNDING_FLIP = {"fp32": 0.25, "bf16": 0.25, "fp8": 1.0}


class RoundingDraw:
    """Moves each element one ulp of its dtype with probability `flip`, up or down (seeded)."""

    def __init__(self, seed: int, flip: float):
        self.gen = torch.Generator().manual_seed(seed)
        self.flip = flip

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        moved = step_ulp(t, torch.randint(0, 2, t.shape, generator=self.gen).bool())
        if self.flip >= 1:   # every element (no second draw: the fp8 draws of before 2026-11-24)
            return moved
        return torch.where(torch.rand(t.shape, generator=self.gen) < self.flip, moved, t)


def module_draw(run: int, module: str, stream: int, precision: str) -> RoundingDraw:
    """`rounding_draw` of the GEMM of the module named `module`, keyed by its name (a job whose GEMMs
    are modules: torch-native's, Hugging Face's Linear layers)."""
    return rounding_draw(run, zlib.crc32(module.encode()) % 1_000_003, stream, precision)


def rounding_draw(run: int, key: int, stream: int, precision: str) -> RoundingDraw:
    """The draws of one GEMM in perturbed run `run` (its TTRACE_PERTURB): `key` tells the GEMM apart,
    `stream` the rank's data coordinate (its own microbatches' draws)."""
    return RoundingDraw(run * 1_000_003 + key + stream * 7_919, ROUNDING_FLIP[precision])


class _PerturbGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, noise):
        ctx.noise = noise
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.noise(g), None


def grad_drawn(x: torch.Tensor, noise: RoundingDraw) -> torch.Tensor:
    """x, whose grad is drawn again on its way back (a GEMM's input: its input grad)."""
    return _PerturbGrad.apply(x, noise)


def drawn(y: torch.Tensor, noise: RoundingDraw) -> torch.Tensor:
    """y drawn again (a GEMM's output), its grad passed through unchanged."""
    return y + (noise(y.detach()) - y.detach())


def perturbed_linear(linear: Callable[..., torch.Tensor], noise: RoundingDraw) -> Callable[..., torch.Tensor]:
    """`linear` whose output (forward) and input grad (backward) are each drawn again (RoundingDraw)."""
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return drawn(linear(grad_drawn(x, noise), w, b), noise)
    return f
