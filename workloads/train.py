"""The built-in trainer as a job (`workloads.train:main`, the job with neither entrypoint nor command):
build the stage model from the plan, train, trace. Per-rank setup and teardown: workloads/harness.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tracer.job import Session
from workloads import bugs, context_parallel, faults, grad_sync, harness, lr_schedule, precision, zero
from workloads.config import Config, validate
from workloads.parallel_state import ParallelState, initialize
from workloads.schedule import no_pipelining, one_f_one_b
from workloads.stages import build_stage, renaming
from workloads.vpp import interleaved_1f1b


# -- grad finalization, clipping -----------------------------------------------------------------
def finalize_grads(model: nn.Module, ps: ParallelState, cfg: Config, dp_buckets: grad_sync.DPGradBuckets,
                   step: int) -> None:
    """The grads the optimizer sees: DP average (all-reduced in buckets), then TP all-reduce of
    sequence-parallel grads (megatron-core finalize_model_grads order)."""
    # Expert grads (MoE) are reduced over their own group in grad_sync.reduce_experts.
    grads = [g for p in model.parameters()
             if (g := precision.grad(p)) is not None and not getattr(p, "expert", False)]
    if ps.dp_size > 1:
        dp_buckets.all_reduce(grads, ps.dp_group, step)
        if not bugs.active(cfg.bug, "dp_grad_not_averaged"):
            for g in grads:
                g.div_(ps.dp_size)
        # BUG dp_grad_not_averaged: the division above is skipped, grads are dp times too large.

    sp_grads = []
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if precision.grad(p) is None or not getattr(p, "sequence_parallel", False):
                continue
            if isinstance(module, nn.LayerNorm) and bugs.active(cfg.bug, "sp_layernorm_grad_unreduced"):
                continue   # BUG sp_layernorm_grad_unreduced: each TP rank keeps its partial LN grad.
            sp_grads.append(precision.grad(p))
    grad_sync.all_reduce_coalesced(sp_grads, ps.tp_group)
    # Copies of one logical tensor on several model-parallel ranks: GQA KV heads, tied embeddings.
    distopt_tie_bug = cfg.parallel.zero1 and bugs.active(
        cfg.bug, "tied_embedding_grad_distopt")   # the buggy distributed optimizer syncs it too late
    grad_sync.reduce_shared(model, model.shared_groups, cfg.bug, tied=not distopt_tie_bug, ps=ps)


def clip_grad_norm(params: Iterable[nn.Parameter], ps: ParallelState, max_norm: float, *,
                   expert_sq: Callable[[list[nn.Parameter]], torch.Tensor] | None = None) -> float:
    """Global-norm clipping over the whole model: TP-sharded params count on every TP rank,
    replicated ones once (tp rank 0); summed over the model-parallel group (all TP and PP ranks)."""
    params = [p for p in params if precision.grad(p) is not None]
    counted = [precision.grad(p) for p in params
               if (getattr(p, "tensor_model_parallel", False) or ps.tp_rank == 0)
               and not getattr(p, "norm_duplicate", False)   # tied embedding: counted on the first stage
               and not getattr(p, "expert", False)]           # MoE experts: `expert_sq` (summed over EP)
    device = precision.grad(params[0]).device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in counted:
        sq = sq + g.float().pow(2).sum()
    if expert_sq is not None:
        sq = sq + expert_sq(params).to(device)
    if ps.mp_group is not None and dist.get_world_size(ps.mp_group) > 1:
        dist.all_reduce(sq, group=ps.mp_group)
    total = math.sqrt(sq.item())
    coef = max_norm / (total + 1e-6)
    if max_norm > 0 and coef < 1.0:
        for p in params:
            precision.grad(p).mul_(coef)
    return total


# -- entry point ---------------------------------------------------------------------------------
def main(session: Session | None = None) -> dict[str, Any]:
    """Train `steps` steps as this rank (torchrun's environment); returns {"losses"}: the global mean
    loss per step on last-stage ranks ([] elsewhere). `session` replaces the environment's (tests)."""
    with harness.rank_job(validate, session) as job:
        return {"losses": train(job)}


def train(job: harness.RankJob) -> list[float]:
    cfg, spec, tr, device = job.cfg, job.spec, job.session, job.device
    ps = initialize(cfg.parallel, job.rank, job.world_size)
    model, plan = build_stage(cfg, ps)   # gpt or llama stage, and its plan
    recipe = precision.from_spec(spec)
    model.to(recipe.param_dtype)   # BF16 parameters for bf16/fp8 recipes (no-op for fp32)
    rename = renaming(model)       # the tracer's renaming (PP offset or VPP table): one rule for both
    tr.init_weights(model, plan, rename=rename, coords=ps.coords, sizes=ps.sizes)
    mark_tensor_parallel(model, plan, ps)
    model.to(device)
    # Perturbed references: one ulp of every weight (tr.attach), or rounding draws on every GEMM result.
    moves = precision.perturbation_of(spec)
    precision.apply(model, recipe, ps.tp_cp_group, ps.dp_group,
                    amax_unreduced=bugs.active(cfg.bug, "fp8_amax_unreduced"),
                    gemm_draws=tr.perturb if tr.role == "perturbed" and moves == "gemm" else None,
                    draw_stream=ps.coords["dp"] * ps.sizes.get("cp", 1) + ps.coords.get("cp", 0))
    tr.attach(model, plan, rename=rename, coords=ps.coords, sizes=ps.sizes, perturb=moves == "weights",
              meta={"pp_stage": ps.pp_rank, "perturbation": moves})   # tracer.compare: what moved
    tr.set_grad_scale(cfg.micro_batches_local / cfg.micro_batches_global)
    optimizer = precision.optimizer(model, recipe, lambda params: torch.optim.Adam(
        params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False))
    if cfg.parallel.zero1:
        optimizer = zero.DistributedOptimizer(model, plan, ps, cfg)
    adam, masters, shard = adam_of(optimizer)
    tr.load_optimizer_state(adam, model, plan, params=masters, shard=shard, rename=rename, coords=ps.coords,
                            sizes=ps.sizes)   # init.checkpoint's Adam state, when it holds one
    seq_local = cfg.model.seq_len // ps.cp_size   # context parallelism: this rank's zigzag chunks
    seq_local = seq_local // ps.tp_size if cfg.parallel.sp else seq_local
    act_shape = (cfg.micro_batch, seq_local, cfg.model.hidden)

    step_losses: list[float] = []
    scale_loss = not bugs.active(cfg.bug, "grad_accum_not_scaled")
    dp_buckets = grad_sync.DPGradBuckets(cfg.bug, cfg.bug_from_step)
    # Runs started from a checkpoint (init.checkpoint, a scan's rerun) continue its step count: late
    # bugs act, and the LR schedule stands, where the run that wrote it would have been.
    start = job.global_step(0)
    scheduler = lr_schedule.Scheduler(cfg)
    # The samples one optimizer step consumed: the global batch. BUG lr_schedule_local_samples: this
    # rank's samples only (the data-parallel size left out), so the decay runs dp times late.
    local_samples = bugs.active(cfg.bug, "lr_schedule_local_samples")
    increment = cfg.micro_batch * cfg.micro_batches_local if local_samples else cfg.global_batch
    scheduler.step(start * increment)
    for step in range(cfg.steps):   # local step: a switch keyed on the step reads job.global_step(step)
        with tr.step(step):
            optimizer.zero_grad(set_to_none=True)
            mbs = context_parallel.local_chunks(job.microbatches(step, ps.coords["dp"], ps.dp_size), ps)
            if ps.pp_size == 1:
                losses = no_pipelining(model, mbs, tr, scale_loss=scale_loss)
            elif cfg.parallel.vpp > 1:
                losses = interleaved_1f1b(model, mbs, tr, ps, act_shape, device, scale_loss=scale_loss)
            else:
                losses = one_f_one_b(model, mbs, tr, ps, act_shape, device, scale_loss=scale_loss)
            faults.maybe_inject(spec, job.rank, step, model)
            precision.end_step(model)
            finalize_grads(model, ps, cfg, dp_buckets, job.global_step(step))
            scheduler.set(optimizer)
            if cfg.parallel.zero1:   # traces its grad shards, clips, steps its shards, all-gathers
                optimizer.step(tr)
            else:
                tr.record_param_grads(model)
                clip_grad_norm(model.parameters(), ps, cfg.clip_grad, expert_sq=lambda params: (
                    grad_sync.expert_norm_sq(params, ps, model.shared_groups, cfg.bug)))
                optimizer.step()
            scheduler.step(increment)
            tr.record_params(model)
        if ps.is_last_stage:
            step_losses.append(job.mean_loss(losses, ps.dp_group))
    tr.save_checkpoint(model, adam, params=masters, rename=rename)   # checkpoint.save (reference only)
    return step_losses


def adam_of(optimizer: Any) -> tuple[torch.optim.Optimizer, list[torch.Tensor] | None, Any]:
    """The torch Adam inside the trainer's optimizer, the tensors it steps (FP32 masters; None: the
    parameters) and the further cut of a parameter's slice it holds (ZeRO-1: this DP rank's chunk)."""
    if isinstance(optimizer, zero.DistributedOptimizer):
        return optimizer.adam, optimizer.master, optimizer.mine
    if isinstance(optimizer, precision.MasterWeightOptimizer):
        return optimizer.inner, optimizer.master, None
    return optimizer, None, None


def mark_tensor_parallel(model: nn.Module, plan: Mapping[str, Any], ps: Any) -> None:
    """Megatron's `param_is_not_tensor_parallel_duplicate`: sharded params count on every TP rank (grad
    norm); a KV shard shared by several TP ranks (GQA, workloads/llama.py) counts on the first of them."""
    from tracer import param_layouts

    for name, layout in param_layouts(model, plan).items():
        model.get_parameter(name).tensor_model_parallel = (
            "tp" in layout.axes or ("kv" in layout.axes and ps.coords["kvr"] == 0))
