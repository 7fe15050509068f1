"""Parameters as logical tensors: every parameter's layout, its initialization from the consistent
generator (the same logical weights in every layout), and the perturbed runs' one-ulp move."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from tracer.errors import ConfigError
from tracer.generator import full_tensor, perturb_signs, step_ulp
from tracer.layouts import Layout, Replicate
from tracer.plan import Plan, Rename, logical_names, param_layouts


def param_layout_map(model: nn.Module, plan: Plan | None) -> dict[str, Layout]:
    """Every parameter's layout: from the plan, else its DTensor placements (plain: replicated)."""
    if plan is not None:
        return param_layouts(model, plan)
    from tracer.integrations.dtensor import layout_of

    return {n: layout_of(p) for n, p in model.named_parameters()}


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p._local_tensor if isinstance(p, DTensor) else p.data


def _logical_shape(p: torch.Tensor, layout: Layout, sizes: Mapping[str, int]) -> tuple[int, ...]:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return tuple(p.shape)
    shape = list(p.shape)
    for dim, axis in layout.shard:
        shape[dim] *= int(sizes.get(axis, 1))
    return tuple(shape)


def _each_param(model: nn.Module, layouts: Mapping[str, Layout], sizes: Mapping[str, int],
                rename: Rename | None) -> Iterator[tuple[str, str, torch.Tensor, Layout, tuple[int, ...]]]:
    """(local name, global name, local tensor, layout, logical shape) of every parameter."""
    rename = logical_names(rename)
    for name, p in model.named_parameters():
        layout = layouts.get(name, Replicate())
        if layout.partial:
            raise ConfigError(f"parameter {name} is declared a partial sum; a parameter is sharded or "
                              "replicated")
        yield name, rename(name), _local(p), layout, _logical_shape(p, layout, sizes)


@torch.no_grad()
def perturb_parameters(model: nn.Module, layouts: Mapping[str, Layout], perturb: int,
                       coords: Mapping[str, int], sizes: Mapping[str, int], *,
                       rename: Rename | None = None) -> None:
    """Move every parameter element one ulp of its dtype, with signs drawn per element of the logical
    tensor (seed: perturbed run r and the global name) and sliced by the layout: every layout of the
    same run moves the same logical weights the same way."""
    for _, gname, local, layout, shape in _each_param(model, layouts, sizes, rename):
        up = layout.local(perturb_signs(shape, perturb, gname), coords, sizes)
        local.copy_(step_ulp(local, up))


class EveryStep:
    """`tolerance.perturbation_steps=every`: a perturbed run's weights moved one ulp again after every
    optimizer step, with fresh signs per step. A parallel layout rounds differently at every step, not
    only at the first; over hundreds of steps (`ttrace scan`) runs moved once at the start drift apart
    far less than an honest layout does from its reference (a clean 1000-step tp2_dp2 scan left its
    band from step 212 on, up to 31x, with the initial move alone)."""

    STRIDE = 1009   # seeds r + STRIDE * (k + 1): per run r and step k, never the initial move's r

    def __init__(self, layouts: Mapping[str, Layout], perturb: int, coords: Mapping[str, int],
                 sizes: Mapping[str, int], rename: Rename | None):
        self.layouts, self.perturb, self.rename = layouts, perturb, rename
        self.coords, self.sizes = coords, sizes
        self.steps = 0

    @torch.no_grad()
    def after_step(self, model: nn.Module) -> None:
        self.steps += 1
        perturb_parameters(model, self.layouts, self.perturb + self.STRIDE * self.steps, self.coords,
                           self.sizes, rename=self.rename)


def default_init(name: str, module: nn.Module) -> str:
    """norm weights ones, norm and other biases zeros, everything else normal."""
    kind = name.rpartition(".")[2]
    norm = isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()
    if norm:
        return "ones" if kind == "weight" else "zeros"
    return "zeros" if kind == "bias" else "normal"


# The full logical tensor of a parameter from its global name and logical shape (a checkpoint).
Source = Callable[[str, tuple[int, ...]], torch.Tensor]


@torch.no_grad()
def init_parameters(model: nn.Module, layouts: Mapping[str, Layout], seed: int, coords: Mapping[str, int],
                    sizes: Mapping[str, int], *, rename: Rename | None = None,
                    init: Callable[[str, nn.Module], str] | None = None, std: float = 0.02,
                    source: Source | None = None) -> None:
    """Every parameter generated as its full logical tensor by global name (tracer.full_tensor, in
    FP32; or read from `source`, a checkpoint), cast to the parameter's dtype and sliced to this
    rank's shard by its layout."""
    init = init or default_init
    modules = dict(model.named_modules())
    for name, gname, local, layout, shape in _each_param(model, layouts, sizes, rename):
        if source is not None:
            full = source(gname, shape).to(local.dtype)
        else:
            kind = init(name, modules[name.rpartition(".")[0]])
            full = full_tensor(gname, shape, seed, init=kind, std=std).to(local.dtype)
        local.copy_(layout.local(full, coords, sizes))


LogicalParam = tuple[str, torch.Tensor, Layout, tuple[int, ...]]


def logical_params(model: nn.Module, layouts: Mapping[str, Layout], sizes: Mapping[str, int],
                   rename: Rename | None = None) -> dict[str, LogicalParam]:
    """Local name -> (global name, the parameter, its layout, its logical shape)."""
    params = dict(model.named_parameters())
    return {name: (gname, params[name], layout, shape)
            for name, gname, _, layout, shape in _each_param(model, layouts, sizes, rename)}


def mesh_axes_of(model: nn.Module, coords: Mapping[str, int] | None, sizes: Mapping[str, int] | None,
                 plan: Plan | None, mesh: Any, rank: int,
                 world_size: int) -> tuple[dict[str, int], dict[str, int]]:
    """This rank's coordinates and the mesh sizes (Session.attach documents the order they are
    looked for in)."""
    if coords is not None or sizes is not None:
        if coords is None or sizes is None:
            raise ConfigError("attach(model, coords=..., sizes=...): give both, or neither")
        return dict(coords), dict(sizes)
    if plan is not None:
        raise ConfigError("attach(model, plan): a plan's layouts name mesh axes, so pass this rank's "
                          "coords and sizes too (e.g. coords={'tp': tp_rank, 'dp': dp_rank}, "
                          "sizes={'tp': tp, 'dp': dp})")
    if mesh is None:
        from torch.distributed.tensor import DTensor

        mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if mesh is not None:
        from tracer.integrations.dtensor import mesh_axes

        return mesh_axes(mesh)
    return {"dp": rank}, {"dp": world_size}
