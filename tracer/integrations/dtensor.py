"""Layouts read from DTensor placements: tracing torch-native (DTensor) parallelism with no plan.

A DTensor knows how its local tensor relates to the logical one: one placement per mesh dim,
`Shard(d)` (dim d split over that mesh dim), `Replicate()` or `Partial()` (a partial sum). With the
mesh dims named after ttrace's axes ("dp", "tp", ...), that is exactly a ttrace `Layout`:

    DTensor(placements=(Shard(0), Shard(1)), mesh dims ("dp", "tp"))  ->  Layout(shard=((0, "dp"), (1, "tp")))
    DTensor(placements=(Replicate(), Partial()), ...)                   ->  Layout(partial=("tp",))

FSDP2 on top of TP shards an already TP-sharded dim again and says so with `_StridedShard(d,
split_factor)` on the dp mesh dim: the dp split is nested *inside* the tp split (ttrace lists it
after, outermost first).

`DTensorTracer` is a `Tracer` whose layouts come from the tensors themselves, never from a plan:

- params and their grads: the parameter's own placements (TP from `parallelize_module`, dp shards
  from `fully_shard`, Replicate for a plain tensor) at the moment they are recorded;
- module outputs: the module's *own* output, read by a forward hook that runs before the
  ParallelStyle's output hook (`prepend=True`). torch's styles default to `use_local_output=True`:
  their output hook redistributes the DTensor to `output_layouts` and strips it to a plain local
  tensor, which loses the placement. Read before that hook, the output is still a DTensor (e.g. a
  RowwiseParallel output is `Partial`: the traced logical tensor is the sum, as the math says);
- grad_output: the gradient DTensor autograd delivers to that output, with its own placements
  (e.g. `Partial` where every TP rank contributes part of the gradient).

A plain (non-DTensor) tensor is taken as replicated over every mesh axis; the comparison checks that
claim (replicas must agree). So a module left out of the placement plan while it computes on
sharded data (a norm without `SequenceParallel` under SP) shows up at that module as replicas that
disagree. Which modules are traced is the only choice left to the user: by default every leaf
module that owns parameters (embeddings, linears, norms), optionally filtered by name patterns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard

from tracer.collector import Tracer, canonical_name
from tracer.forward_taps import on_grad
from tracer.layouts import Layout
from tracer.plan import Rename, _regex, logical_names, unwrapped

# (module name, module) -> (output layout, grad_output layout) of a plain local output, or None.
LocalLayouts = Callable[[str, nn.Module], "tuple[Layout, Layout] | None"]


def mesh_axes(mesh: DeviceMesh | None) -> tuple[dict[str, int], dict[str, int]]:
    """(coords, sizes) of this rank over the mesh's named dims (a Tracer's `coords` and `sizes`)."""
    if mesh is None:
        return {}, {}
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError("the DeviceMesh has no dim names; name them after ttrace axes, e.g. "
                         "init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))")
    coords = {n: int(mesh.get_local_rank(n)) for n in names}
    sizes = {n: int(mesh.size(i)) for i, n in enumerate(names)}
    return coords, sizes


def placements_to_layout(placements: Iterable[Any], dim_names: Iterable[str],
                         ndim: int | None = None) -> Layout:
    """The ttrace Layout of a DTensor with `placements` over mesh dims `dim_names` (same order).
    Negative shard dims stay negative without `ndim` (resolved when a tensor is at hand)."""
    plain: list[tuple[int, str]] = []
    strided: list[tuple[int, str]] = []
    partial: list[str] = []
    for pl, axis in zip(placements, dim_names, strict=True):
        if isinstance(pl, _StridedShard):   # nested inside the other shards of the same dim (FSDP2 + TP)
            strided.append((_dim(pl.dim, ndim), axis))
        elif isinstance(pl, Shard):
            plain.append((_dim(pl.dim, ndim), axis))
        elif isinstance(pl, Partial):       # also _MaskPartial (vocab-parallel embedding)
            if getattr(pl, "reduce_op", "sum") != "sum":
                raise ValueError(f"placement {pl} over '{axis}': only sum partials reassemble")
            partial.append(axis)
        elif not isinstance(pl, Replicate):
            raise ValueError(f"placement {pl!r} over '{axis}' has no ttrace layout")
    # Outermost first: plain shards in mesh order, then the strided (inner) ones.
    return Layout(shard=tuple(plain + strided), partial=tuple(partial))


def _dim(d: int, ndim: int | None) -> int:
    return d if d >= 0 or ndim is None else d + ndim


def layout_of(t: torch.Tensor) -> Layout:
    """Layout of a tensor: from its placements if it is a DTensor, replicated otherwise."""
    if isinstance(t, DTensor):
        return placements_to_layout(t.placements, t.device_mesh.mesh_dim_names or (), t.ndim)
    return Layout()


def _summed(t: DTensor) -> torch.Tensor | None:
    """A partial-sum grad's local piece with its `Partial("sum")` axes summed (grad-sign replay reads the
    sum's signs, tracer.grad_signs.GradSigns.take); None for another reduction. A collective: every
    rank records its param grads at the same point of the step (the job contract), in the same order."""
    if any(p.is_partial() and getattr(p, "reduce_op", "sum") != "sum" for p in t.placements):
        return None
    summed = [Replicate() if p.is_partial() else p for p in t.placements]
    return t.redistribute(t.device_mesh, summed).to_local()


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local tensor; a masked partial (vocab-parallel embedding lookup) gets its pending mask
    applied to a copy: until its reduction, rows of token ids outside this rank's vocab shard hold
    the lookup of a clamped index, which the reduction zeroes first."""
    if not isinstance(t, DTensor):
        return t
    local = t.to_local()
    for pl in t.placements:
        if isinstance(pl, _MaskPartial) and pl.mask_buffer.data is not None:
            local = local.detach().clone()
            pl.mask_buffer.apply_mask(local)
    return local


def _module_type(m: nn.Module) -> str:
    return type(m).__name__


def default_selection(model: nn.Module) -> list[str]:
    """Every leaf module that owns parameters (embeddings, linears, norms), in module order."""
    return [name for name, m in model.named_modules()
            if name and not list(m.children()) and list(m.parameters(recurse=False))]


class DTensorTracer(Tracer):
    """A Tracer for torch-native parallelism: layouts come from DTensor placements (module doc).

        tr = DTensorTracer(store_url, run, rank, mesh=mesh)     # mesh dims named "dp", "tp", ...
        tr.attach(model)                                          # after parallelize_module / fully_shard
    """

    def __init__(self, store_url: str, run: str, rank: int, mesh: DeviceMesh | None = None,
                 meta: Mapping[str, Any] | None = None, *, coords: Mapping[str, int] | None = None,
                 sizes: Mapping[str, int] | None = None, **kw: Any):
        mc, ms = mesh_axes(mesh)
        self.coords, self.sizes = {**mc, **(coords or {})}, {**ms, **(sizes or {})}
        super().__init__(store_url, run, rank, coords=self.coords, sizes=self.sizes, meta=meta, **kw)

    def attach(self, model: nn.Module, modules: Iterable[str] | None = None,  # type: ignore[override]
               rename: Rename | None = None, local_layouts: LocalLayouts | None = None) -> None:
        """Trace the output and grad_output of the named modules (fnmatch-like patterns, `*` = one
        path component; default: `default_selection(model)`). Param layouts are read when recorded.

        `local_layouts(module name, module)` may give (output, grad_output) layouts for modules whose
        framework hands out plain local tensors after stripping the DTensor (e.g. Hugging Face's TP
        styles, `tracer.integrations.hf`); other plain tensors are taken as replicated."""
        if not self.enabled:
            return
        self._local_layouts = local_layouts or (lambda name, module: None)
        self._rename = logical_names(rename)
        names = default_selection(model)
        if modules is not None:
            pats = [_regex(p) for p in modules]
            names = [n for n, _ in model.named_modules() if n and any(p.match(unwrapped(n)) for p in pats)]
        mods = dict(model.named_modules())
        for name in names if self.traces("output", "grad_output") else ():
            m = mods[name]
            # prepend: before a ParallelStyle's output hook turns the DTensor into a local tensor.
            self._handles.append(m.register_forward_hook(
                self._dtensor_hook(self._rename(name), _module_type(m), self._local_layouts(name, m)),
                prepend=True))
        self._types = {n: _module_type(m) for n, m in mods.items()}

    def _record_params(self, model: nn.Module, kind: str) -> None:
        if not self.enabled:
            return
        types = getattr(self, "_types", {})
        signs = self._signs if kind == "param_grad" else None   # grad-sign replay (Tracer.replay_grad_signs)
        for pname, p in model.named_parameters():
            t = p if kind == "param" else p.grad
            if t is None:
                continue
            name, local, layout = self._rename(pname), local_of(t), layout_of(t)
            self.record(name, kind, local, layout, module_type=types.get(pname.rpartition(".")[0], ""))
            if signs is not None:   # after the record: the traced grad is the run's own
                signs.take(self._step, name, layout, local, _summed(t) if layout.partial else None)
        if signs is not None:
            signs.release()

    def _dtensor_hook(self, path: str, module_type: str,
                      declared: tuple[Layout, Layout] | None) -> Callable[..., None]:
        def layouts(t: torch.Tensor, grad: bool) -> Layout:
            if isinstance(t, DTensor) or declared is None:
                return layout_of(t)
            return _resolve(declared[1 if grad else 0], t.ndim)

        calls = self._calls

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            is_seq = isinstance(output, (tuple, list))
            out = output[0] if is_seq else output
            if not isinstance(out, torch.Tensor) or self._step is None:
                return None
            step, feed = self._step, self._feed
            layout = layouts(out, False)
            again, mb, at = calls.forward(path, step, self._microbatch, out.shape)   # as Tracer's hook
            if again is None:
                self.record(path, "output", local_of(out), layout, microbatch=mb, module_type=module_type,
                            at=at)
            if feed is not None:   # isolation pass: downstream sees the reference's output
                out = _substitute(feed, out, canonical_name(step, mb, at, "output"), layout)
            if out.requires_grad:   # a recomputation's too (tracer.module_calls)
                recorded = False

                def grad_hook(grad: torch.Tensor) -> torch.Tensor | None:
                    nonlocal recorded
                    glayout = layouts(grad, True)
                    if not (recorded and self._repeats):   # Tracer.repeated_backward
                        prev, self._step = self._step, step
                        try:
                            self.record(path, "grad_output", local_of(grad), glayout, microbatch=mb,
                                        module_type=module_type, scale=self._grad_scale, at=at)
                        finally:
                            self._step = prev
                        recorded = True
                    if feed is None:
                        return None
                    ref = feed.local(canonical_name(step, mb, at, "grad_output"), glayout, local_of(grad),
                                     scale=1.0 / self._grad_scale)
                    return None if ref is None else _like(ref, grad)
                on_grad(out, grad_hook)
            if again is None:
                calls.ran(path, mb, at, out.shape)   # tracer.module_calls.Call
            if feed is None:
                return None
            return (out, *output[1:]) if is_seq else out
        return hook


def _like(local: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`local` in the form of `t`: a DTensor with t's placements (a masked partial as a plain partial:
    the reference's summand is already masked) or the plain tensor."""
    if not isinstance(t, DTensor):
        return local
    placements = tuple(Partial() if isinstance(p, _MaskPartial) else p for p in t.placements)
    return DTensor.from_local(local, t.device_mesh, placements, run_check=False, shape=t.shape,
                              stride=t.stride())


def _substitute(feed: Any, out: torch.Tensor, name: str, layout: Layout) -> torch.Tensor:
    """Isolation pass: the reference's value of `out` (this rank's summand), gradients passing
    through to the computed `out`; `out` itself where its layout does not fit the reference."""
    from tracer.feed import _Substitute

    local = feed.local(name, layout, local_of(out))
    if local is None:
        return out
    ref = _like(local, out)
    if isinstance(out, DTensor):   # the replaced masked partial is never reduced: release its mask
        for pl in out.placements:
            if isinstance(pl, _MaskPartial) and pl.mask_buffer.data is not None:
                pl.mask_buffer.release_mask()
    # A copy without grad: the reference's own tensor handed on could be changed in place or made the
    # output of an autograd Function (tracer.feed.ReferenceFeed.substitute).
    return _Substitute.apply(out, ref) if out.requires_grad else _like(local.clone(), out)


def _resolve(layout: Layout, ndim: int) -> Layout:
    """Negative shard dims (placements like Shard(-1)) made absolute for a tensor of `ndim` dims."""
    return Layout(shard=tuple((_dim(d, ndim), a) for d, a in layout.shard), partial=layout.partial,
                  zigzag=layout.zigzag)
