"""Builds the configured model architecture's pipeline stage (or interleaved virtual stages) and its
tracing plan."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from tracer import ModuleLayout, PipelineRenaming
from workloads import bugs, context_parallel, grad_sync, moe
from workloads.config import Config
from workloads.llama import LlamaStage, add_kv_axes
from workloads.model import GPTStage
from workloads.parallel_state import ParallelState
from workloads.plan import plan_for
from workloads.vpp import VirtualStage


def build_stage(cfg: Config, ps: ParallelState) -> tuple[nn.Module, dict[str, ModuleLayout]]:
    """This rank's stage and the plan; `stage.shared_groups` holds the groups of grad_sync."""
    experts = None
    if cfg.model.arch == "llama":
        add_kv_axes(ps, cfg.model.num_kv_heads)
        dq_bug = bugs.active(cfg.bug, "attention_dq_scale_wrong")
        if cfg.model.experts:
            moe.add_ep_axes(ps, cfg.parallel.ep)
            experts = moe.build_groups(ps, cfg.parallel.ep)
        router_bug = bugs.active(cfg.bug, "moe_router_grad_unreduced")
        make: Callable[[ParallelState], nn.Module] = lambda s: LlamaStage(
            cfg, s, dq_scale_bug=dq_bug, expert_groups=experts, router_bug=router_bug)
    else:
        row_bug = bugs.active(cfg.bug, "row_parallel_bias_per_rank")
        make = lambda s: GPTStage(cfg, s, row_bias_bug=row_bug)
    if cfg.parallel.vpp > 1:
        model: nn.Module = VirtualStage(make, ps, cfg.parallel.vpp, cfg.model.layers,
                                        offset_bug=bugs.active(cfg.bug, "vpp_layer_offset_wrong"))
    else:
        model = make(ps)
    model.shared_groups = grad_sync.build_groups(ps, cfg.model.tie_embeddings)
    model.shared_groups.experts = experts
    plan = plan_for(cfg.model, cfg.parallel.sp)
    if cfg.parallel.cp > 1:
        context_parallel.apply(model, ps, cfg)
        plan = context_parallel.with_cp(plan)
    return model, plan


def renaming(model: nn.Module) -> Callable[[str], str]:
    """Local -> global module names (PP offset, or the VPP table): one rule for init and tracing."""
    return getattr(model, "renaming", None) or PipelineRenaming(model.layer_offset)
