"""Routing flips of an MoE check: for every traced router output (expert logits, [..., experts]),
the tokens whose top-k experts differ from the reference's, in the candidate and in each perturbed
reference, and how close to a tie the reference's routing was there.

Top-k routing is a discrete decision. In BF16 an honest layout flips tokens whose k-th and
(k+1)-th routing probabilities nearly tie, and each flip moves a whole token's contribution from one
expert to another: the experts' tensors then differ by far more than rounding noise, and no
tolerance estimated from R perturbed runs covers it (docs/tolerance.md, "Held-out results ... seeds
11, 12"). A check does not judge the flips; it reports them beside a FAIL, so the user can tell a
flip from a bug.

Routing replay (tolerance.routing, orchestrator/routing.py) removes the flips: the perturbed
references and the candidate take the reference's top-k experts. At attach (tracer/job.py) a rank
reads the reference's router outputs (`reference_routing`); the tracer's hook on each router hands
this rank's piece of the reference's output for the same (step, microbatch, router) to the model on
the router's own output (`replayed`), and the model takes its top-k from it, its gates from its own
probabilities (workloads/moe.py). The router's logits and grads are still the candidate's own and
judged as before; what replay cannot see is a bug in the top-k choice itself (docs/tolerance.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tracer.errors import TraceError
from tracer.feed import ReferenceFeed, load_run
from tracer.layouts import Layout
from tracer.logical import LogicalTrace

ROUTER_TYPES = frozenset({"Router"})   # module types whose output is the routing logits (workloads/moe.py)
_REPLAYED = "_ttrace_replayed_routing"  # attribute of a router output: the reference's, this rank's piece


def replayed(logits: torch.Tensor) -> torch.Tensor | None:
    """Under routing replay, the reference's router output for this call (this rank's piece): take the
    top-k experts from it. None otherwise: route on your own."""
    return getattr(logits, _REPLAYED, None)


def hand_on(logits: torch.Tensor, reference: torch.Tensor) -> None:
    """The tracer's router hook: attach the reference's output to the router's own (see `replayed`)."""
    setattr(logits, _REPLAYED, reference)


def reference_routing(url: str, coords: dict[str, int], sizes: dict[str, int]) -> ReferenceFeed:
    """The reference run's router outputs (and only those: the rest of its parts are not kept), cut to
    this rank's layout on demand. `url`: <store>/<reference run>."""
    trace = load_run(url, lazy=True)
    names = _router_outputs(trace)
    if not names:
        raise TraceError(f"routing replay: the reference run {url} traced no router output (a module of type "
                         f"{', '.join(sorted(ROUTER_TYPES))}); set tolerance.routing=own")
    kept = {n: trace.tensors[n] for n in names}
    trace.release()
    trace.tensors = kept
    return ReferenceFeed(trace, coords, sizes, purpose="routing replay")


@dataclass
class RoutingFlips:
    top_k: int
    routers: int                 # router outputs compared (microbatches x layers x steps)
    tokens: int                  # tokens routed over all of them
    candidate: int               # tokens whose top-k experts differ from the reference's
    perturbed: list[int]         # the same count for each perturbed reference
    largest_flip_margin: float   # the largest reference top-k margin among the candidate's flips
    median_margin: float         # the median token's margin (k-th - (k+1)-th probability)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def warning(self) -> str:
        return (f"routing: the candidate's top-{self.top_k} experts differ from the reference's for "
                f"{self.candidate} of {self.tokens} routed tokens, where the reference's top-{self.top_k} "
                f"probability margin is at most {self.largest_flip_margin:.2g} (the median token's: "
                f"{self.median_margin:.2g}); the perturbed references flip {self.perturbed}. A flip moves a "
                "whole token between experts: a FAIL on an expert's tensors after one can be a routing "
                "flip rather than a bug (tolerance.routing=replay takes the reference's experts; "
                "docs/tolerance.md)")


def _router_outputs(trace: LogicalTrace) -> list[str]:
    """The router outputs a run traced, in execution order."""
    return [n for n in trace.order
            if trace.info[n]["kind"] == "output" and trace.info[n].get("module_type") in ROUTER_TYPES]


def _experts(logits: torch.Tensor, k: int) -> torch.Tensor:
    return logits.double().topk(k, -1).indices.sort(-1).values


def routing_flips(reference: LogicalTrace, candidate: LogicalTrace, perturbed: Sequence[LogicalTrace],
                  top_k: int) -> RoutingFlips | None:
    """The flips of every router output the runs traced (LogicalTraces); None if they traced none. A
    diagnosis beside a verdict, never part of it: a router output the runs disagree on in shape (the
    verdict names it) or cannot reassemble is left out."""
    routers = tokens = cand = 0
    pert = [0] * len(perturbed)
    flip_margins: list[torch.Tensor] = []
    margins: list[torch.Tensor] = []
    for name in _router_outputs(reference):
        try:
            r, c, *ps = (run.tensors[name].tensor for run in (reference, candidate, *perturbed))
        except (TraceError, KeyError):
            continue
        if any(x.shape != r.shape for x in (c, *ps)):
            continue
        want = _experts(r, top_k)
        flipped = (_experts(c, top_k) != want).any(-1)
        for i, p in enumerate(ps):
            pert[i] += int((_experts(p, top_k) != want).any(-1).sum())
        probs = r.double().softmax(-1).sort(-1, descending=True).values
        # no (k+1)-th expert: nothing to flip to, an infinite margin
        margin = (probs[..., top_k - 1] - probs[..., top_k] if probs.shape[-1] > top_k
                  else torch.full_like(probs[..., 0], float("inf")))
        margins.append(margin.reshape(-1))
        flip_margins.append(margin[flipped].reshape(-1))
        routers += 1
        tokens += flipped.numel()
        cand += int(flipped.sum())
    for run in (reference, candidate, *perturbed):   # the parts these lookups read: not kept
        run.release()
    if not routers:
        return None
    flips = torch.cat(flip_margins)
    return RoutingFlips(top_k, routers, tokens, cand, pert,
                        float(flips.max()) if flips.numel() else 0.0, float(torch.cat(margins).median()))


def hand_on_reference(feed: Any, name: str, layout: Layout, out: torch.Tensor) -> None:
    """Routing replay on a rank: `hand_on` the reference's router output `name` (this rank's piece)."""
    ref = feed.local(name, layout, out)
    if ref is None:
        raise TraceError(f"routing replay: the reference's '{name}' does not cut to this rank's router "
                         f"output of shape {tuple(out.shape)} by its layout {layout.to_json()}; the runs "
                         "differ in their data or layout (or set tolerance.routing=own)")
    hand_on(out, ref)
