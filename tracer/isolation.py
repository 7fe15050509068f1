"""Isolation pass (TTrace's input rewriting), its analysis: name the culprit.

An error born in one module cascades into every tensor computed after it, so "which tensors diverge"
overstates where the bug is. The isolation pass reruns the candidate fed the reference's tensors
(tracer/feed.py): every recorded tensor of that run then carries only the module's own (local) error.

`name_culprit` compares the normal and the isolated comparisons: the culprit is the first tensor whose
local error is beyond tolerance, and the blame window is every module the isolation pass could not
rule out as the origin of the first divergence.
"""

from __future__ import annotations

from typing import Any

from tracer.verdicts import Comparison, TensorResult


def _entry(r: TensorResult) -> dict[str, Any]:
    return {"name": r.name, "module": r.module, "module_type": r.module_type, "kind": r.kind,
            "step": r.step, "microbatch": r.microbatch, "rel_err": r.rel_err, "tolerance": r.tolerance,
            "elem_err": r.elem_err, "elem_tolerance": r.elem_tolerance, "reason": r.reason}


def name_culprit(normal: Comparison, isolated: Comparison) -> dict[str, Any]:
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
        raise ValueError("name_culprit needs a failed comparison")
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
