"""Isolation pass (TTrace's input rewriting): measure each module's OWN error, then name the culprit.

An error born in one module cascades into every tensor computed after it, so "which tensors diverge"
overstates where the bug is. The isolation pass reruns the candidate with a `ReferenceFeed`: after
each traced module's output is recorded, the reference's output (this rank's shard of it) is what the
rest of the network sees; in backward, after a module's grad_output is recorded, the reference's
grad_output is what flows into the module. Every recorded tensor of that run then carries only the
error made between it and the previous traced tensor: the module's own (local) error.

`localize` compares the normal and the isolated comparisons: the culprit is the first tensor whose
local error is beyond tolerance, and the blame window is every module the isolation pass could not
rule out as the origin of the first divergence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tracer.compare import Comparison, TensorResult
from tracer.errors import TraceError
from tracer.layouts import Layout
from tracer.logical import LogicalTrace


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

    def __init__(self, reference: LogicalTrace, coords: Mapping[str, int], sizes: Mapping[str, int]):
        self.reference, self.coords, self.sizes = reference, dict(coords), dict(sizes)

    def local(self, name: str, layout: Layout, like: torch.Tensor, *,
              scale: float = 1.0) -> torch.Tensor | None:
        """This rank's piece of the reference's `name`, or None when the layout does not cut the
        reference to `like`'s shape: the module's layout is wrong (the comparison reports it as a
        shape verdict), and the module hands on its own tensor."""
        got = self.reference.tensors.get(name)
        if got is None:
            raise TraceError(f"isolation pass: the reference has no tensor '{name}' (the runs' recipes or "
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
        return _Substitute.apply(computed, ref) if computed.requires_grad else ref


def _entry(r: TensorResult) -> dict[str, Any]:
    return {"name": r.name, "module": r.module, "module_type": r.module_type, "kind": r.kind,
            "step": r.step, "microbatch": r.microbatch, "rel_err": r.rel_err, "tolerance": r.tolerance,
            "elem_err": r.elem_err, "elem_tolerance": r.elem_tolerance, "reason": r.reason}


def localize(normal: Comparison, isolated: Comparison) -> dict[str, Any]:
    """Culprit and blame window of a failed check from its isolation pass.

    flagged      tensors whose local error (isolated run) is beyond tolerance
    culprit      the first flagged tensor at or before the first divergence, in execution order
    blame_window the distinct modules flagged at or before the first divergence: the origins the tool
                 could not rule out. When none is flagged there (every module is within tolerance once
                 fed the reference's tensors: the error accumulates, or lives in untraced glue), the
                 culprit is left unresolved and the window is every module executed in the first
                 divergence's step up to it.
    origin       of the first divergence: "local" if its own module is flagged, else "inherited".
    """
    fd = normal.first_divergence
    if fd is None:
        raise ValueError("localize needs a failed comparison")
    local = {r.name: r for r in isolated.results}
    flagged = [r for r in isolated.results if not r.ok]
    before = [r for r in flagged if r.index <= fd.index]
    fd_local = local.get(fd.name)
    out: dict[str, Any] = {
        "origin": "local" if fd_local is not None and not fd_local.ok else "inherited",
        "flagged": len(flagged),
        "flagged_modules": list(dict.fromkeys(f"{r.module}/{r.kind}" for r in flagged))[:50],
    }
    if before:
        window = list(dict.fromkeys(r.module for r in before))
        out["culprit"] = dict(_entry(before[0]), resolved=True)
    else:
        window = list(dict.fromkeys(r.module for r in normal.results
                                    if r.step == fd.step and r.index <= fd.index))
        out["culprit"] = dict(_entry(fd), resolved=False,
                              note="no module is beyond tolerance on its own: the error accumulates over "
                                   "modules or arises in untraced code; showing the first divergence")
    out["blame_window"] = {"size": len(window), "modules": window[:50]}
    return out


def describe(report: Mapping[str, Any]) -> str:
    """One line on the culprit of a report (empty if the isolation pass did not run)."""
    c, w = report.get("culprit"), report.get("blame_window")
    if not c or not w:
        return ""
    if not c.get("resolved"):
        return f"culprit unresolved (no module beyond tolerance on its own); blame window {w['size']} modules"
    why = c.get("reason") or f"rel_err {c['rel_err']:.3g} > tolerance {c['tolerance']:.3g}"
    return (f"culprit {c['module']} ({c['module_type'] or c['kind']}, {c['kind']} at step {c['step']}): "
            f"on its own, {why}; the first divergence's error is "
            f"{report.get('origin', '?')}; blame window {w['size']} module{'s' if w['size'] != 1 else ''}")
