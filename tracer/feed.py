"""The isolation pass's feed (TTrace's input rewriting): after each traced module's output is
recorded, the reference's output (this rank's shard of it) is what the rest of the network sees; in
backward, after a module's grad_output is recorded, the reference's grad_output is what flows into
the module. Every recorded tensor of that run then carries only the error made between it and the
previous traced tensor: the module's own (local) error (tracer/isolation.py names the culprit)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tracer.errors import TraceError
from tracer.layouts import Layout
from tracer.logical import LogicalTrace, load_logical
from tracer.store import world_size_of


class _Substitute(torch.autograd.Function):
    """Forward: the reference value (exact bits). Backward: identity into the computed tensor, so the
    module's parameters still receive their gradients."""

    @staticmethod
    def forward(ctx: Any, computed: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        return reference.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ReferenceFeed:
    """The reference run's logical tensors, sliced to one rank's layout on demand."""

    def __init__(self, reference: LogicalTrace, coords: Mapping[str, int], sizes: Mapping[str, int], *,
                 purpose: str = "isolation pass"):
        self.reference, self.coords, self.sizes = reference, dict(coords), dict(sizes)
        self.purpose = purpose

    def local(self, name: str, layout: Layout, like: torch.Tensor, *,
              scale: float = 1.0) -> torch.Tensor | None:
        """This rank's piece of the reference's `name`, or None when the layout does not cut the
        reference to `like`'s shape: the module's layout is wrong (the comparison reports it as a
        shape verdict), and the module hands on its own tensor."""
        got = self.reference.tensors.get(name)
        if got is None:
            raise TraceError(f"{self.purpose}: the reference has no tensor '{name}' (the runs' recipes or "
                             "tracing plans differ)")
        full = got.tensor * scale if scale != 1.0 else got.tensor
        try:
            local = layout.summand(full, self.coords, self.sizes)
        except (TraceError, ValueError, RuntimeError):
            return None
        if local.shape != like.shape:
            return None
        return local.to(dtype=like.dtype, device=like.device)

    def substitute(self, computed: torch.Tensor, name: str, layout: Layout) -> torch.Tensor:
        ref = self.local(name, layout, computed)
        if ref is None:
            return computed
        # A copy either way: the reference's own tensor, handed on, could be changed in place or made
        # the output of an autograd Function (reentrant checkpointing's first forward runs under no_grad).
        return _Substitute.apply(computed, ref) if computed.requires_grad else ref.clone()


def load_run(url: str, *, lazy: bool = False) -> LogicalTrace:
    """A stored run by its URL (<store>/<run>), all its ranks."""
    root, _, run = url.rstrip("/").rpartition("/")
    return load_logical(root, run, world_size_of(root, run), lazy=lazy)


def reference_feed(url: str, coords: Mapping[str, int], sizes: Mapping[str, int]) -> ReferenceFeed:
    """The isolation pass's feed: every tensor of the reference run at `url` (<store>/<run>)."""
    return ReferenceFeed(load_run(url), coords, sizes)
