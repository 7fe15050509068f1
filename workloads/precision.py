"""Precision recipes of the built-in workload, the way Megatron-LM / TransformerEngine train.

fp32  everything in FP32; the modules are left untouched (bit-identical to the plain model).
bf16  BF16 parameters and activations, FP32 main grads (each BF16 weight grad is accumulated into
      `p.main_grad`), FP32 master weights and Adam in FP32, copied back (rounded) to the BF16
      parameters after the step. GEMMs as GPUs run them: BF16 inputs, FP32 accumulation, output
      rounded to BF16 — emulated here by upcasting, an FP32 matmul and rounding (BF16 matmul is
      ~130x slower on CPU). Attention runs in FP32 inside and returns BF16 (flash-attention style),
      the cross-entropy sees FP32 logits (Megatron's default), LayerNorm keeps FP32 statistics.
fp8   bf16 plus FP8 GEMMs in the transformer layers (TE Linear: qkv, proj, fc1, fc2): inputs and
      weights quantized per tensor to E4M3, output grads to E5M2, FP32 accumulation, output rounded
      to BF16. The scale is fp8_max / amax with the amax reduced (MAX) over the TP group, so every
      shard of a logical tensor uses the logical tensor's scale, exactly as the one-rank reference.
      `scaling: current` uses this tensor's amax; `scaling: delayed` uses the max of an amax
      history of previous steps (TE DelayedScaling, amax_compute_algo="max"), updated once per
      step with the step's amax reduced over TP and DP (the first step, with an empty history,
      falls back to current scaling). The LM head stays BF16 (Megatron keeps the output layer
      out of FP8). Bug switch `fp8_amax_unreduced` skips the TP reduction.

Perturbed references (tolerance estimation, docs/tolerance.md), `tolerance.perturbation`:
weights  every initial weight moved one ulp of its dtype (the default for fp32, and the only kind a
         user job gets: the session perturbs what it attaches).
gemm     the default for bf16 and fp8: every GEMM result (forward output and input grad) is drawn
         again at its final rounding. An honest layout changes the order in which FP32 partial sums
         are added before the one rounding to BF16 (or rounds partial sums before a reduction); a
         value re-rounded from a randomly moved accumulator lands one ulp away with probability
         ~1/4, so that is the bf16 draw: one BF16 ulp, random sign, on a random quarter of the
         elements (`ROUNDING_FLIP`). A one-ulp move of every BF16 weight disturbs far more (2^-8 on
         every weight of every layer: 2.5x the honest TP error on the weight grads). fp8 moves every
         GEMM result one BF16 ulp (flip 1), the FP8 quantization step then applied where it applies:
         with 1/4 a clean fp8 tp2 check failed at a bias whose honest grad error was 5x the
         perturbed runs' (docs/tolerance.md). A one-ulp weight change would re-quantize ~5% of every
         FP8 weight tensor from layer 0 on, which no honest layout does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tracer.errors import ConfigError
from workloads.rounding_draws import perturbed_linear, rounding_draw

PRECISIONS = ("fp32", "bf16", "fp8")
PERTURBATIONS = ("weights", "gemm")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
Group = dist.ProcessGroup | None


@dataclass(frozen=True)
class Precision:
    name: str = "fp32"
    scaling: str = "current"      # fp8: current | delayed
    amax_history: int = 16        # fp8 delayed scaling: steps of amax history
    fp8_modules: tuple[str, ...] = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.float32 if self.name == "fp32" else torch.bfloat16

    @property
    def mixed(self) -> bool:
        return self.name != "fp32"

    def perturbation(self, setting: str = "auto") -> str:
        """What this recipe's perturbed references move: "weights" or "gemm" (module doc)."""
        if setting == "auto":
            return "weights" if self.name == "fp32" else "gemm"
        if setting not in PERTURBATIONS:
            raise ConfigError(f"tolerance.perturbation={setting}: use auto, weights or gemm")
        return setting


def perturbation_of(spec: Mapping[str, Any]) -> str:
    """What the spec's perturbed references move (Precision.perturbation of tolerance.perturbation)."""
    return from_spec(spec).perturbation((spec.get("trace") or {}).get("perturbation") or "auto")


def weights_refused(spec: Mapping[str, Any]) -> str | None:
    """Why a job whose BF16 compute casts FP32 weights (torch-native, Hugging Face) refuses weight moves
    for its perturbed references, or None."""
    if perturbation_of(spec) == "gemm" or from_spec(spec).name == "fp32":
        return None
    return ("tolerance.perturbation=weights: a one-ulp move of an FP32 weight mostly vanishes in its BF16 "
            "cast, so bf16 perturbed references draw GEMM roundings (tolerance.perturbation=auto or gemm)")


def from_spec(spec: Mapping[str, Any]) -> Precision:
    sec = spec.get("precision") or {}
    p = Precision(name=str(sec.get("name", "fp32")), scaling=str(sec.get("scaling", "current")),
                  amax_history=int(sec.get("amax_history", 16)))
    if p.name not in PRECISIONS:
        raise ConfigError(f"precision={p.name} is not supported (supported: {', '.join(PRECISIONS)})")
    if p.scaling not in ("current", "delayed"):
        raise ConfigError(f"precision.scaling={p.scaling} must be 'current' or 'delayed'")
    if p.amax_history < 1:
        raise ConfigError(f"precision.amax_history={p.amax_history} must be >= 1")
    return p


# -- GEMMs -----------------------------------------------------------------------------------------
def bf16_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """BF16 GEMM as a GPU runs it: FP32 accumulation of BF16 inputs, output rounded to BF16.

    Autograd of the casts gives the same for both backward GEMMs (dgrad, wgrad): FP32 products of
    the BF16 operands, rounded to BF16 where they meet the BF16 tensors again."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)


def _all_reduce_max(t: torch.Tensor, group: Group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def quantize(t: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaled cast: q = saturate(t * scale) in `dtype`, scale = fp8_max / amax (FP32)."""
    amax = amax.float()
    scale = torch.where(amax > 0, FP8_MAX[dtype] / amax, torch.ones_like(amax))
    q = (t.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() / scale


class FP8Scaling:
    """Scales of one FP8 module's three operands: input x, weight w (E4M3), output grad g (E5M2)."""

    def __init__(self, recipe: Precision, amax_group: Group, dp_group: Group, reduce_tp: bool = True):
        self.delayed = recipe.scaling == "delayed"
        # The group holding pieces of one logical tensor: TP shards and, under CP, sequence chunks.
        self.amax_group = amax_group if reduce_tp else None   # None: BUG fp8_amax_unreduced
        self.dp_group = dp_group
        self.history = {r: deque(maxlen=recipe.amax_history) for r in "xwg"}
        self.step_amax: dict[str, torch.Tensor] = {}

    def quantize(self, role: str, t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        amax = t.detach().abs().max().float()
        if self.delayed:
            seen = self.step_amax.get(role)
            self.step_amax[role] = amax if seen is None else torch.maximum(seen, amax)
            if self.history[role]:
                return quantize(t, dtype, max(self.history[role]))
        # Current scaling: every shard of a logical tensor must use the logical tensor's amax.
        return quantize(t, dtype, _all_reduce_max(amax.clone(), self.amax_group))

    def end_step(self) -> None:
        """Delayed scaling: push this step's amax, reduced over TP and DP, into the history."""
        if not self.delayed:
            return
        for role, amax in sorted(self.step_amax.items()):
            amax = _all_reduce_max(_all_reduce_max(amax.clone(), self.amax_group), self.dp_group)
            self.history[role].append(amax)
        self.step_amax.clear()


class _FP8Linear(torch.autograd.Function):
    """y = x W^T + b with FP8 operands (E4M3 forward, E5M2 output grad), FP32 accumulation, BF16
    output; dgrad and wgrad reuse the forward's quantized x and W, as TE does. The bias grad comes
    from the unquantized BF16 output grad."""

    @staticmethod
    def forward(ctx, x, w, b, scaling: FP8Scaling):
        xq, sx = scaling.quantize("x", x, E4M3)
        wq, sw = scaling.quantize("w", w, E4M3)
        y = F.linear(dequantize(xq, sx), dequantize(wq, sw), None if b is None else b.float())
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.scaling, ctx.dtypes, ctx.has_bias = scaling, (x.dtype, w.dtype), b is not None
        return y.to(torch.bfloat16)

    @staticmethod
    def backward(ctx, g):
        xq, sx, wq, sw = ctx.saved_tensors
        gq, sg = ctx.scaling.quantize("g", g, E5M2)
        gd, xd, wd = dequantize(gq, sg), dequantize(xq, sx), dequantize(wq, sw)
        dx = (gd @ wd).to(ctx.dtypes[0])
        dw = (gd.reshape(-1, gd.shape[-1]).t() @ xd.reshape(-1, xd.shape[-1])).to(ctx.dtypes[1])
        db = g.float().reshape(-1, g.shape[-1]).sum(0).to(ctx.dtypes[1]) if ctx.has_bias else None
        return dx, dw, db, None


def fp8_linear(scaling: FP8Scaling) -> Callable[..., torch.Tensor]:
    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return _FP8Linear.apply(x, w, b, scaling)
    return linear


# -- model, grads, optimizer -------------------------------------------------------------------------
def _accumulate_main_grad(p: torch.Tensor) -> None:
    p.main_grad.add_(p.grad.float())
    p.grad = None


def apply(model: nn.Module, recipe: Precision, amax_group: Group, dp_group: Group, *,
          amax_unreduced: bool = False, gemm_draws: int | None = None, draw_stream: int = 0) -> None:
    """Give every linear its GEMM and every parameter an FP32 main grad (no-op for fp32 unless
    `gemm_draws`, the perturbed run's seed for rounding draws on GEMM results). `draw_stream`: the
    rank's data coordinate (dp, cp) in a parallel reference layout, so each rank's microbatches or
    sequence chunks get their own draws as one device's do; TP ranks share a stream, so a GEMM
    replicated over TP (KV heads, the router) stays bitwise one replica.

    Call after the weights are initialized in `recipe.param_dtype`."""
    if not recipe.mixed and gemm_draws is None:
        return
    for name, m in model.named_modules():
        if not hasattr(m, "linear"):
            continue
        if recipe.name == "fp8" and name.startswith("layers.") and name.endswith(recipe.fp8_modules):
            m.fp8_scaling = FP8Scaling(recipe, amax_group, dp_group, reduce_tp=not amax_unreduced)
            m.linear = fp8_linear(m.fp8_scaling)
        elif recipe.mixed:
            m.linear = bf16_linear
        if gemm_draws is not None:   # a perturbed reference with perturbation=gemm: its run's seed
            draw = rounding_draw(gemm_draws, len(name), draw_stream, recipe.name)
            m.linear = perturbed_linear(m.linear, draw)
    if not recipe.mixed:
        return
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.register_post_accumulate_grad_hook(_accumulate_main_grad)


def end_step(model: nn.Module) -> None:
    """Once per step, after the last backward: update delayed FP8 scaling histories."""
    for m in model.modules():
        s = getattr(m, "fp8_scaling", None)
        if s is not None:
            s.end_step()


def grad(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer sees: the FP32 main grad if there is one."""
    g = getattr(p, "main_grad", None)
    return p.grad if g is None else g


class MasterWeightOptimizer:
    """Megatron's mixed-precision optimizer: FP32 master copies of the BF16 parameters take the
    FP32 main grads; after the step the masters are rounded back into the model's parameters."""

    def __init__(self, params: Iterable[nn.Parameter], make: Callable[[list[torch.Tensor]], Any]):
        self.params = list(params)
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.inner = make(self.master)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups   # the LR schedule sets the inner optimizer's LR

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
            p.main_grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for m, p in zip(self.master, self.params, strict=True):
            m.grad = p.main_grad
        self.inner.step()
        for m, p in zip(self.master, self.params, strict=True):
            p.copy_(m)


def optimizer(model: nn.Module, recipe: Precision, make: Callable[[list[Any]], Any]) -> Any:
    params = list(model.parameters())
    return MasterWeightOptimizer(params, make) if recipe.mixed else make(params)
