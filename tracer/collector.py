"""Collector: the in-process tracer a training script attaches to its model.

It records, under canonical names `step/microbatch/module/kind`:
  output       forward output of every planned module
  grad_output  gradient w.r.t. that output (tensor hook; remembers the forward's microbatch)
  param_grad   every parameter's gradient after the gradient reduction
  param        every parameter after the optimizer step
  loss         the per-microbatch loss
Each entry carries the layout that lets the comparison stage rebuild the logical tensor.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from tracer.fingerprint_log import SCAN_MODE, FingerprintLog
from tracer.forward_taps import on_grad, tap_forward
from tracer.layouts import Layout, Replicate
from tracer.module_calls import ModuleCalls
from tracer.plan import Plan, Rename, logical_names, param_layouts, traced_modules
from tracer.routing import ROUTER_TYPES, hand_on_reference
from tracer.trace_scopes import TraceScopes
from tracer.writer import TraceWriter

_PARAM_KINDS = frozenset(("param_grad", "param"))
_REPLICATE = Replicate()


@functools.lru_cache(maxsize=4096)
def _layout_json(layout: Layout) -> dict[str, Any]:
    """A layout's manifest form, built once per layout (a record is on the training thread's path).
    Shared between entries: never mutated."""
    return layout.to_json()


def canonical_name(step: int, microbatch: int | None, path: str, kind: str) -> str:
    return f"{step}/{'-' if microbatch is None else microbatch}/{path}/{kind}"


class Tracer(TraceScopes):
    """Records a rank's traced tensors to the store. `Tracer.disabled()` records nothing. Where a
    record belongs, and when none is made: tracer/trace_scopes.py."""

    def __init__(self, store_url: str, run: str, rank: int, coords: Mapping[str, int],
                 sizes: Mapping[str, int], meta: Mapping[str, Any] | None = None, *,
                 flush_bytes: int = 32 << 20, mode: str = "full", kinds: Iterable[str] | None = None):
        self.enabled = True
        self.rank = rank
        # `kinds`: the selection by kind (trace.kinds; None: every kind). A scan traces the per-step
        # kinds only: module outputs and grads per microbatch would multiply its volume.
        self._kinds = None if kinds is None else frozenset(kinds)
        header = {"run": run, "rank": rank, "coords": dict(coords), "sizes": dict(sizes),
                  "meta": dict(meta or {}, kinds=None if kinds is None else sorted(self._kinds))}
        writer = FingerprintLog if mode == SCAN_MODE else TraceWriter   # trace.mode=scan: ttrace scan's log
        self._writer = writer(store_url, run, rank, header, flush_bytes=flush_bytes, mode=mode)
        self._step: int | None = None
        self._microbatch: int | None = None
        self._seq = 0
        self._calls = ModuleCalls()   # which call of a traced module a forward is (reuse, recomputation)
        self._grad_scale = 1.0
        self._rename: Rename = lambda n: n
        self._params: dict[str, tuple[Layout, str]] = {}  # local param name -> (layout, module type)
        self._handles: list[Any] = []
        self._feed: Any = None   # tracer.isolation.ReferenceFeed: isolation pass (see `isolate`)
        self._replay: Any = None  # the reference's router outputs: routing replay (see `replay_routing`)
        self._signs: Any = None   # the reference's param grads: grad-sign replay (see `replay_grad_signs`)
        self._repeats = False     # inside `repeated_backward` (tracer/trace_scopes.py)

    @classmethod
    def disabled(cls) -> Tracer:
        self = cls.__new__(cls)
        self.enabled = False
        self._step = self._microbatch = None
        return self

    # -- setup ---------------------------------------------------------------------------------
    def attach(self, model: nn.Module, plan: Plan, rename: Rename | None = None) -> None:
        """Tap every module the plan lists (tracer.forward_taps); remember every parameter's layout."""
        if not self.enabled:
            return
        self._rename = logical_names(rename)
        types = {name: type(m).__name__ for name, m in model.named_modules()}
        for pname, layout in param_layouts(model, plan).items():
            self._params[pname] = (layout, types.get(pname.rpartition(".")[0], ""))
        for name, module, entry in traced_modules(model, plan):
            if entry.trace and self.traces("output", "grad_output"):
                self._handles.append(tap_forward(module, self._forward_hook(
                    self._rename(name), type(module).__name__, entry.output, entry.grad_layout)))

    def traces(self, *kinds: str) -> bool:
        """Does the selection (trace.kinds) hold any of `kinds`?"""
        return self._kinds is None or any(k in self._kinds for k in kinds)

    def isolate(self, feed: Any) -> None:
        """Isolation pass: after recording each traced module's output (and, in backward, its
        grad_output), hand the REFERENCE's tensor on downstream instead (`tracer.isolation`), so every
        recorded tensor carries only the error of the code between it and the previous traced one."""
        self._feed = feed

    def replay_routing(self, feed: Any) -> None:
        """Routing replay (tracer/routing.py): hand each router's caller the reference's output for the
        same call (`feed`: tracer.routing.reference_routing) beside the router's own."""
        self._replay = feed

    def replay_grad_signs(self, signs: Any) -> None:
        """Grad-sign replay (tracer/grad_signs.py): after recording each param grad, its elements whose
        sign differs from the reference's take the reference's value (tracer.grad_signs.GradSigns)."""
        self._signs = signs

    def set_grad_scale(self, scale: float) -> None:
        """Factor turning this rank's activation grads into d(global loss)/d(activation).

        Megatron divides each microbatch loss by the local microbatch count and averages over DP,
        so local activation grads are (global microbatches / local microbatches) times too large.
        """
        self._grad_scale = float(scale)

    # -- records -------------------------------------------------------------------------------
    def record(self, path: str, kind: str, tensor: torch.Tensor, layout: Layout | None = None, *,
               microbatch: int | None = None, module_type: str = "", scale: float = 1.0,
               at: str | None = None) -> None:
        """`at`: the path the name holds when it is not `path` (a module's later call: module_calls)."""
        if not self.enabled or (self._kinds is not None and kind not in self._kinds):
            return
        if self._step is None:
            raise RuntimeError("Tracer.record called outside `with tracer.step(i)`")
        step = self._step
        name = f"{step}/{'-' if microbatch is None else microbatch}/{at or path}/{kind}"   # canonical_name
        # tracer.writer.FIELDS; the tensor is snapshotted now (the caller may change it afterwards)
        self._writer.add((name, path.rpartition(".")[0] if kind in _PARAM_KINDS else path, module_type, kind,
                          step, microbatch, self._seq, _layout_json(layout or _REPLICATE), scale), tensor)
        self._seq += 1

    def record_loss(self, loss: torch.Tensor, microbatch: int) -> None:
        self.record("loss", "loss", loss, Replicate(), microbatch=microbatch, module_type="loss")

    def record_param_grads(self, model: nn.Module) -> None:
        """Call after the gradient reductions (DP, SP, ...) and before clipping."""
        self._record_params(model, "param_grad")

    def record_params(self, model: nn.Module) -> None:
        """Call after the optimizer step."""
        self._record_params(model, "param")

    def record_param_grad_shards(self, shards: Mapping[str, tuple[torch.Tensor, Layout]
                                                       | tuple[torch.Tensor, Layout, torch.Tensor]]) -> None:
        """Param grads as a distributed optimizer holds them: `shards[local name] = (this rank's
        shard, layout of that shard)` (e.g. the plan's layout with a DP shard nested inside), or
        (piece, layout, owned) for a disjoint partial sum: `owned` marks the elements whose reduced value
        this rank's piece holds (megatron's distributed optimizer: the range it steps), which grad-sign
        replay edits (tracer.grad_signs.GradSigns.take)."""
        if not self.enabled:
            return
        for pname, (t, layout, *owned) in shards.items():
            name, mtype = self._rename(pname), self._params.get(pname, (Replicate(), ""))[1]
            self.record(name, "param_grad", t, layout, module_type=mtype)
            if self._signs is not None:
                self._signs.take(self._step, name, layout, t, owned=owned[0] if owned else None)
        if self._signs is not None:
            self._signs.release()

    def close(self, incomplete: str | None = None) -> None:
        """Commit this rank's trace (manifest last). Call on every rank after training; `incomplete`
        says why a job that stopped early (it raised) commits a partial trace, never compared."""
        if not self.enabled:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._calls.recomputed_forwards:
            print(f"ttrace: activation recomputation: {self._calls.recomputed_forwards} forwards of traced "
                  "modules ran again in backward, each matched to its first forward", file=sys.stderr)
        if self._signs is not None:   # into the rank's log: how much of the update was replayed
            print(f"ttrace: grad-sign replay: {self._signs.taken} of {self._signs.elements} grad elements "
                  f"took the reference's value (Adam's eps {self._signs.eps})", file=sys.stderr)
            if self._signs.eps is not None:   # the comparison's first-update rule uses the same
                self._writer.header["meta"]["first_update_eps"] = self._signs.eps
        self._writer.close(incomplete)

    # -- internals -----------------------------------------------------------------------------
    def _record_params(self, model: nn.Module, kind: str) -> None:
        if not self.enabled:
            return
        want = self._kinds is None or kind in self._kinds
        step = self._step
        if want and step is None:
            raise RuntimeError("Tracer.record called outside `with tracer.step(i)`")
        # What `record` does, with each parameter's constant fields made once: a step records every
        # parameter twice, on the training thread's path.
        known = self.__dict__.setdefault("_renamed", {})   # local name -> (name, layout, json, module, type)
        signs = self._signs if kind == "param_grad" else None
        add, grads = self._writer.add, kind == "param_grad"
        for pname, p in model.named_parameters():
            t = p
            if grads:
                t = getattr(p, "main_grad", None)
                if t is None:
                    t = p.grad
                    if t is None:
                        continue
            rec = known.get(pname)
            if rec is None:   # renaming (a regex per name) once, not at every record
                name = self._rename(pname)
                layout, mtype = self._params.get(pname, (_REPLICATE, ""))
                rec = known[pname] = (name, layout, _layout_json(layout), name.rpartition(".")[0], mtype)
            name, layout, lay, module, mtype = rec
            if want:   # canonical_name, tracer.writer.FIELDS
                add((f"{step}/-/{name}/{kind}", module, mtype, kind, step, None, self._seq, lay, 1.0), t)
                self._seq += 1
            if signs is not None:   # after the record: the traced grad is the run's own
                signs.take(self._step, name, layout, t)
        if signs is not None:
            signs.release()

    def _forward_hook(self, path: str, module_type: str, layout: Layout, grad_layout: Layout | None = None):
        grad_layout = layout if grad_layout is None else grad_layout
        # Run per module call and per gradient: the record's constant fields bound once here, and the
        # writer called directly (what `record` does, without its per-call lookups).
        lay, grad_lay = _layout_json(layout), _layout_json(grad_layout)
        want_out, want_grad = self.traces("output"), self.traces("grad_output")
        add = self._writer.add
        router = module_type in ROUTER_TYPES
        calls = self._calls

        def grad_hook_for(step: int, mb: int | None, at: str) -> Any:
            mb_key = "-" if mb is None else mb
            recorded = False

            def grad_hook(grad: torch.Tensor) -> torch.Tensor | None:
                nonlocal recorded
                if want_grad and not (recorded and self._repeats):
                    add((f"{step}/{mb_key}/{at}/grad_output", path, module_type, "grad_output", step,
                         mb, self._seq, grad_lay, self._grad_scale), grad)
                    self._seq += 1
                    recorded = True
                feed = self._feed
                if feed is None:
                    return None
                return feed.local(canonical_name(step, mb, at, "grad_output"), grad_layout, grad,
                                  scale=1.0 / self._grad_scale)
            return grad_hook

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            is_seq = isinstance(output, (tuple, list))
            out = output[0] if is_seq else output
            step = self._step
            if step is None or not isinstance(out, torch.Tensor):
                return None
            feed = self._feed
            # A recomputation (`again`: its first forward) is that forward's tensor again: not recorded.
            # A module called again in this microbatch is named path#k (tracer.module_calls).
            again, mb, at = calls.forward(path, step, self._microbatch, out.shape)
            if again is None and want_out:   # canonical_name, tracer.writer.FIELDS
                add((f"{step}/{'-' if mb is None else mb}/{at}/output", path, module_type, "output", step,
                     mb, self._seq, lay, 1.0), out)
                self._seq += 1
            if router and self._replay is not None:
                hand_on_reference(self._replay, canonical_name(step, mb, at, "output"), layout, out)
            if feed is not None:   # isolation pass: downstream sees the reference's output (rebuilt too)
                out = feed.substitute(out, canonical_name(step, mb, at, "output"), layout)
            grads = out.requires_grad and (want_grad or feed is not None)
            if grads:   # a recomputation's too: it fires on the output backward runs through (module_calls)
                on_grad(out, grad_hook_for(step, mb, at))
            if again is None:
                calls.ran(path, mb, at, out.shape)   # tracer.module_calls.Call
            if feed is None:
                return None
            return (out, *output[1:]) if is_seq else out
        return hook

