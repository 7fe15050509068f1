"""Grad-sign replay, the rank's side (orchestrator/grad_signs.py says when and why): after a perturbed
reference or the candidate traces its param grads, every element whose sign differs from the
reference's grad (or that is zero where the reference's is not, or the reverse) takes the reference's
value, so the optimizer's first update, lr * sign(g), is the reference's wherever rounding alone decided
the sign. So does every element whose reference grad is below EPS_BAND eps: Adam's update
lr * g / (|g| + eps) is lr * sign(g) only for |g| well above eps, and below it its size follows |g|,
which rounding decides there (a clean Hugging Face bf16 check, seed 41: an embedding element with grad
3e-8 against the reference's 7e-7, both positive, moved 0.75 lr against 0.99 lr, and the next step's
embedding output failed at 1.24x its tolerance). The band is the reference's, so every run decides an
element alike: with "either grad below it", perturbed runs whose grad fell below it took the reference's
value where a candidate just above kept its own, and clean torch-native checks failed at 2.3-3.2x on
step-0 weights (seeds 83, 87). And so does every element whose own grad, of the reference's sign, would
move it by more than UPDATE_AGREE (1%) of lr away from the reference's first update (Adam's
g / (|g| + eps)): a reference grad above the band does not keep a run's own grad out of
eps's reach (an Intel Xeon, clean hf bf16 tp2 checks: seed 1234 and 4 of seeds 201-242 failed so: an
embedding element with grad -1.6e-8 against the reference's -4.5e-5 moved 0.59 lr against 1.0 lr, and
the next step's embedding output, which copies its row, failed at 1.83x). Every run keeps its
deviations under 1% of lr and gives up those above: the same cut for all, where "either grad below it"
cut each run at a different deviation. A deviation the candidate keeps (up to 1% of lr) may still
exceed what the perturbed runs kept there (or they all gave theirs up): the comparison explains it by
the candidate's own grad through the same formula (tracer/excusal.py, Adam's first update). The
traced grads are the run's own: a wrong grad is judged where it was made.

The eps is the one the reference's own first update shows (`reference_eps`, tracer.adam.fitted_eps):
grads are traced before clipping, which divides the optimizer's eps by the clip factor (hf bf16 checks
clipping at 0.1: 1.1e-7, where ADAM_EPS kept deviations of 6% of lr as 0.6%). The run records it in its
manifest's meta (`first_update_eps`), and the comparison's first-update rule uses the same
(tracer.compare_inputs.first_update_eps).

At attach (tracer/job.py) a replaying rank opens the reference run (`reference_grads`); the tracer
(`Tracer.replay_grad_signs`) hands each param grad it records, with its layout, to `GradSigns.take`,
which cuts this rank's piece of the reference's grad for the same step and parameter. A job replays
if it records its grads where the job contract says (`record_param_grads` after the reductions and
before clipping and the optimizer, or its distributed optimizer's shards, which the optimizer reads).
"""

from __future__ import annotations

from typing import Any

import torch

from tracer.adam import ADAM_EPS, FIT_ENOUGH, eps_estimates, first_update, fitted_eps
from tracer.collector import canonical_name
from tracer.errors import TraceError
from tracer.feed import ReferenceFeed, load_run
from tracer.layouts import Layout
from tracer.logical import LogicalTrace

# In eps: above it two grads of one sign give first updates (tracer/adam.py) within 1% of each other.
EPS_BAND = 100
UPDATE_AGREE = 0.01   # a run's first update may differ from the reference's by this fraction of lr


def take_reference_signs(grad: torch.Tensor, reference: torch.Tensor, *, own: torch.Tensor | None = None,
                         value: torch.Tensor | None = None, where: torch.Tensor | None = None,
                         eps: float = ADAM_EPS) -> int:
    """In place: the elements of `grad` whose sign (or that of `own`, the sum `grad` is a piece of)
    differs from `reference`'s, or where the reference's is below EPS_BAND eps in magnitude, or whose
    first Adam update (at `eps`) would differ from the reference's by more than UPDATE_AGREE of lr, take
    its value (or `value`'s, the reference's piece of that sum); only where `where` holds, if given.
    Returns how many changed."""
    own = grad if own is None else own
    take = (torch.sign(own) != torch.sign(reference)) | (reference.abs() < EPS_BAND * eps)
    take |= (first_update(own, eps) - first_update(reference, eps)).abs() > UPDATE_AGREE
    take &= own != reference
    if where is not None:
        take &= where
    grad[take] = (reference if value is None else value)[take]
    return int(take.sum())


class GradSigns:
    """The reference run's param grads, read step by step (its parts released after each step)."""

    def __init__(self, feed: ReferenceFeed):
        self.feed = feed
        self.taken = 0     # elements that took the reference's value, over the run
        self.elements = 0  # elements seen
        self.eps: float | None = None   # the reference's first update's (`reference_eps`), at the first grad

    def take(self, step: int, param: str, layout: Layout, grad: torch.Tensor,
             reduced: torch.Tensor | None = None, owned: torch.Tensor | None = None) -> None:
        """Param `param`'s grad at `step` (its logical name); `grad`: this rank's piece.

        A partial sum's piece (a DTensor grad not reduced yet: torch-native's replicated K/V weights)
        is a summand: its own signs say nothing of the sum's. Given the sum (`reduced`: this rank's
        piece with the partial axes summed), the elements where the sum's sign differs from the
        reference's are set so that the sum becomes the reference's value: the reference's value on
        coordinate 0 of the partial axes, zero elsewhere (`Layout.summand`), as the one-device runs
        replaying the same parameter take it. Without it the piece keeps its own values (the
        reference's value taken into every piece would count it once per piece). A disjoint partial
        sum's piece (a distributed optimizer's range, zeros elsewhere) holds the sum where it is
        `owned`: those elements are compared and take the reference's value, the rest stay."""
        if owned is not None:
            if not layout.disjoint:
                raise TraceError(f"grad-sign replay of '{param}': `owned` elements are a disjoint partial "
                                 f"sum's, not of layout {layout.to_json()}")
            reduced, layout = grad, Layout(layout.shard, (), layout.zigzag)
        if layout.partial and reduced is None:
            return
        name = canonical_name(step, None, param, "param_grad")
        whole = Layout(layout.shard, (), layout.zigzag) if layout.partial else layout
        ref = self.feed.local(name, whole, grad if reduced is None else reduced)
        if ref is None:
            raise TraceError(f"grad-sign replay: the reference's '{name}' does not cut to this rank's grad "
                             f"of shape {tuple(grad.shape)} by its layout {layout.to_json()}; the runs "
                             "differ in their model or layout (or set tolerance.grad_signs=own)")
        summand = ref if layout.holds_sum(self.feed.coords) else torch.zeros_like(ref)   # Layout.summand
        if self.eps is None:
            self.eps = reference_eps(self.feed.reference)
        self.taken += take_reference_signs(grad, ref, own=reduced, value=summand, where=owned, eps=self.eps)
        self.elements += grad.numel() if owned is None else int(owned.sum())

    def release(self) -> None:
        """After a step's grads: drop the reference parts they were read from."""
        self.feed.reference.release()


def reference_eps(reference: LogicalTrace) -> float:
    """The eps of the reference's first update in the units of its traced grads (tracer.adam.fitted_eps
    over its parameters' initial values, step-0 grads and step-0 values, in execution order until
    FIT_ENOUGH elements tell); ADAM_EPS where none can be fitted: a run that started from a checkpoint
    (Adam's moments not fresh) or does not say (traced before 2026-12-07), a trace starting after step
    0 or without its initial parameters, too few elements near eps, or moves unlike Adam's."""
    if reference.meta.get("from_checkpoint") is not False or reference.first_step() != 0:
        return ADAM_EPS
    got: list[torch.Tensor] = []
    have, tensors = 0, reference.tensors
    for name in reference.order:
        e = reference.info[name]
        if e["kind"] != "param" or int(e["step"]) != 0:
            continue
        path = name.split("/", 2)[2].rsplit("/", 1)[0]
        initial, grad = canonical_name(-1, None, path, "param"), canonical_name(0, None, path, "param_grad")
        if initial in tensors and grad in tensors:
            got.append(eps_estimates(tensors[initial].tensor, tensors[grad].tensor, tensors[name].tensor))
            have += got[-1].numel()
            if have >= FIT_ENOUGH:
                break
    fit = fitted_eps(torch.cat(got)) if got else None
    return ADAM_EPS if fit is None else fit


def reference_grads(url: str, coords: dict[str, int], sizes: dict[str, int]) -> GradSigns:
    """The reference run at `url` (<store>/<reference run>), read lazily, cut to this rank's layout."""
    return GradSigns(ReferenceFeed(load_run(url, lazy=True), coords, sizes, purpose="grad-sign replay"))


def attach_replays(tracer: Any, config: Any, coords: dict[str, int], sizes: dict[str, int]) -> None:
    """A perturbed or candidate run's replays of the reference (tracer.job_config.JobConfig says which):
    its routing (tracer/routing.py) and its grad signs."""
    from tracer.routing import reference_routing

    url = str(config.reference)
    if config.routing_replay:
        tracer.replay_routing(reference_routing(url, coords, sizes))
    if config.grad_sign_replay:
        tracer.replay_grad_signs(reference_grads(url, coords, sizes))
