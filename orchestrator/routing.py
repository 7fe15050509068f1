"""Routing replay, the orchestrator's side: which checks replay the reference's expert choice, and the
job order that makes it possible (the rank's side: tracer/routing.py).

Top-k routing is a discrete decision. In bf16 and fp8, GEMM rounding moves the router logits of
near-tied tokens across the top-k boundary: a perturbed reference or an honest candidate then sends
those tokens to other experts, and every expert's grads move by far more than rounding explains (the
MoE false alarms of docs/tolerance.md). Under replay the perturbed references and the candidate take
the reference's top-k experts for every (step, microbatch, layer) and keep every numeric difference;
the router's logits and grads are judged as before. So they start once the reference has finished;
grad-sign replay (orchestrator/grad_signs.py) reads the reference the same way and shares this order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from orchestrator.jobs import BUILTIN_ENTRYPOINT, OWN_JOBS
from orchestrator.layouts import microbatches_differ
from tracer.errors import ConfigError

MODES = ("auto", "replay", "own")


def replay(recipe: dict[str, Any]) -> bool:
    """Does the check replay the reference's routing (tolerance.routing)? `auto`: for the built-in
    trainer's MoE models in bf16 and fp8 traced in full, whose reference cuts the same microbatches.
    In fp32 nothing flips (measured on seeds 8-12), and a check keeps judging the candidate's own
    choice of experts."""
    mode = recipe["tolerance"].get("routing", "auto")
    if mode != "auto":
        return mode == "replay"
    if microbatches_differ(recipe):
        return False
    moe = int(recipe["model"].get("experts") or 0) > 0
    low = recipe["precision"].get("name") in ("bf16", "fp8")
    return builtin(recipe) and moe and low and traces(recipe.get("trace") or {}, "output")


def builtin(recipe: dict[str, Any]) -> bool:
    """Is the check's job the built-in trainer (recipe.job_of: neither job.command nor another
    job.entrypoint set)?"""
    job = recipe.get("job") or {}
    return not job.get("command") and (job.get("entrypoint") or BUILTIN_ENTRYPOINT) == BUILTIN_ENTRYPOINT


def own(recipe: dict[str, Any]) -> bool:
    """Is the check's job one of ttrace's own (recipe.job_of's `own`: the built-in trainer or another
    entrypoint shipped in workloads/, not job.command)?"""
    job = recipe.get("job") or {}
    return not job.get("command") and str(job.get("entrypoint") or BUILTIN_ENTRYPOINT).startswith(OWN_JOBS)


def validate(recipe: dict[str, Any]) -> None:
    mode = recipe["tolerance"].get("routing", "auto")
    if mode not in MODES:
        raise ConfigError(f"tolerance.routing={mode!r}: use auto, replay (the perturbed references and the "
                          "candidate take the reference's top-k experts) or own")
    if mode == "replay" and not traces(recipe.get("trace") or {}, "output"):
        raise ConfigError("tolerance.routing=replay reads the router outputs of the reference's trace, which "
                          "trace.mode=stats or a trace.kinds without 'output' does not keep; trace in full "
                          "or set tolerance.routing=own")
    if mode == "replay" and microbatches_differ(recipe):
        raise ConfigError("tolerance.routing=replay takes each microbatch's experts from the reference's "
                          "same microbatch, but reference.micro_batch cuts the batch differently; leave "
                          "reference.micro_batch unset or set tolerance.routing=own")


def traces(trace: dict[str, Any], kind: str) -> bool:
    """Does a recipe's `trace` section keep the values of `kind` (full mode, the kind selected)? A
    replay reads them from the reference's trace."""
    kinds = trace.get("kinds")
    return (trace.get("mode") or "full") == "full" and (kinds is None or kind in kinds)


def reads_reference(spec: dict[str, Any]) -> bool:
    """Does a job replay the reference while it trains (its routing, or its grad signs:
    orchestrator/grad_signs.py)?"""
    return bool(spec["trace"].get("routing_replay") or spec["trace"].get("grad_sign_replay"))


def order_jobs(checks: Iterable[Any]) -> None:
    """For every check that replays (`reads_reference`): its perturbed references and candidate read the
    reference run (trace.reference) and start after it. `checks`: planned checks
    (orchestrator.outcome.PlannedCheck) with their reference sets attached. A cached reference is
    already complete: nothing waits."""
    for p in checks:
        rs = p.refs
        if rs is None or p.candidate is None or not reads_reference(p.candidate.spec):
            continue
        computing = rs.jobs[0] if rs.cache != "hit" else None
        for job in [*rs.jobs[1:], p.candidate]:
            wait_for_reference(job, f"{rs.url}/reference", computing)


def wait_for_reference(job: Any, url: str, reference: Any | None) -> None:
    """A replaying job (cluster.Job whose spec `reads_reference`) reads the reference run at
    `url` and starts after `reference`, its job (None: that run is complete already)."""
    job.spec["trace"]["reference"] = url
    job.after = reference
