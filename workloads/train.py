"""Per-rank entry point: init process groups, build the stage model from the plan, train, trace.

The orchestrator calls `run_rank` inside each Ray task; worker processes are reused, so the process
group is always destroyed on the way out.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tracer import ConfigError, Tracer, full_tensor, param_layouts, perturb_ulp, token_batch
from workloads import bugs, context_parallel, faults, grad_sync, precision, zero
from workloads.config import Config, parse, validate
from workloads.parallel_state import ParallelState, initialize
from workloads.schedule import Microbatch, no_pipelining, one_f_one_b
from workloads.variants import build_stage, renaming
from workloads.vpp import interleaved_1f1b

TracerFactory = Callable[[Config, ParallelState], Any]


# -- weights -------------------------------------------------------------------------------------
def init_weights(model: nn.Module, plan: Mapping[str, Any], ps: ParallelState, cfg: Config) -> None:
    """Generate each parameter as its FULL logical tensor (global name), optionally perturb it by one
    ulp, then keep this rank's shard; the layout comes from the plan, the only sharding rules."""
    modules = dict(model.named_modules())
    layouts = param_layouts(model, plan)
    global_name = renaming(model)  # the tracer's renaming (PP offset or VPP table): one rule for both
    for name, p in model.named_parameters():
        layout = layouts[name]
        full_shape = list(p.shape)
        for dim, axis in layout.shard:
            full_shape[dim] *= ps.sizes[axis]
        owner = modules[name.rpartition(".")[0]]
        kind = name.rpartition(".")[2]
        norm = isinstance(owner, (nn.LayerNorm, nn.RMSNorm))
        init = ("ones" if kind == "weight" else "zeros") if norm else (
            "zeros" if kind == "bias" else "normal")
        gname = global_name(name)
        # Generated in FP32, cast to the parameter dtype, then perturbed by one ulp OF THAT dtype.
        full = full_tensor(gname, tuple(full_shape), cfg.seed, init=init, std=0.02).to(p.dtype)
        if cfg.perturb_seed is not None and precision.Precision(cfg.precision).perturbs_weights:
            full = perturb_ulp(full, cfg.perturb_seed, gname)
        with torch.no_grad():
            p.copy_(layout.local(full, ps.coords, ps.sizes))
        # Megatron's `param_is_not_tensor_parallel_duplicate`: sharded params count on every TP rank.
        # A KV shard shared by several TP ranks (GQA, workloads/llama.py) counts on the first of them.
        p.tensor_model_parallel = "tp" in layout.axes or ("kv" in layout.axes and ps.coords["kvr"] == 0)


# -- grad finalization, clipping -----------------------------------------------------------------
def finalize_grads(model: nn.Module, ps: ParallelState, spec: Mapping[str, Any]) -> None:
    """The grads the optimizer sees: DP average, then TP all-reduce of sequence-parallel grads
    (megatron-core finalize_model_grads order)."""
    # Expert grads (MoE) are reduced over their own group in grad_sync.reduce_experts.
    grads = [g for p in model.parameters()
             if (g := precision.grad(p)) is not None and not getattr(p, "expert", False)]
    if ps.dp_size > 1:
        grad_sync.all_reduce_coalesced(grads, ps.dp_group)
        if not bugs.active(spec, "dp_grad_not_averaged"):
            for g in grads:
                g.div_(ps.dp_size)
        # BUG dp_grad_not_averaged: the division above is skipped, grads are dp times too large.

    sp_grads = []
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if precision.grad(p) is None or not getattr(p, "sequence_parallel", False):
                continue
            if isinstance(module, nn.LayerNorm) and bugs.active(spec, "sp_layernorm_grad_unreduced"):
                continue   # BUG sp_layernorm_grad_unreduced: each TP rank keeps its partial LN grad.
            sp_grads.append(precision.grad(p))
    grad_sync.all_reduce_coalesced(sp_grads, ps.tp_group)
    # Copies of one logical tensor on several model-parallel ranks: GQA KV heads, tied embeddings.
    distopt_tie_bug = bool((spec.get("parallel") or {}).get("zero1")) and bugs.active(
        spec, "tied_embedding_grad_distopt")   # the buggy distributed optimizer syncs it too late
    grad_sync.reduce_shared(model, model.shared_groups, spec, tied=not distopt_tie_bug, ps=ps)


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
def _microbatches(cfg: Config, ps: ParallelState, step: int, device: torch.device) -> list[Microbatch]:
    """This DP rank's contiguous slice of the global batch, cut into microbatches with global indices."""
    tokens = token_batch(cfg.seed, step, cfg.global_batch, cfg.model.seq_len, cfg.model.vocab)
    per_dp = cfg.global_batch // ps.dp_size
    local = tokens[ps.coords["dp"] * per_dp:(ps.coords["dp"] + 1) * per_dp].to(device)
    m_local = cfg.micro_batches_local
    return [Microbatch(index=ps.coords["dp"] * m_local + j, ids=chunk[:, :-1], labels=chunk[:, 1:])
            for j, chunk in enumerate(local.split(cfg.micro_batch))]


def _default_tracer(cfg: Config, ps: ParallelState) -> Any:
    if not cfg.trace_enabled:
        return Tracer.disabled()
    return Tracer(cfg.store_url, cfg.run, ps.rank, coords=ps.coords, sizes=ps.sizes, meta={
        "workload": "gpt", "model": cfg.model.name, "parallel": cfg.parallel.name, "bug": cfg.bug,
        "precision": cfg.precision, "pp_stage": ps.pp_rank, "fingerprint": cfg.fingerprint})


def run_rank(spec: dict, rank: int, world_size: int, master_addr: str, master_port: int, *,
             tracer_factory: TracerFactory | None = None) -> dict:
    """Train `spec["steps"]` steps as `rank` of `world_size`; returns {"rank", "losses", "seconds"}.

    `losses` holds the global mean loss per step on last-stage ranks ([] elsewhere).
    `tracer_factory` replaces the store-backed Tracer (tests use an in-memory collector).
    """
    from workloads import frameworks

    fw = frameworks.adapter(spec)
    if fw is not None:   # megatron-core, torch-native or Hugging Face under test (workloads/frameworks)
        return fw.run_rank(spec, rank, world_size, master_addr, master_port)
    validate(spec)
    cfg = parse(spec)
    if cfg.parallel.world_size != world_size:
        raise ConfigError(f"parallel={cfg.parallel.name} declares world_size={cfg.parallel.world_size} "
                          f"but the job was launched with {world_size} ranks; fix the recipe or the launcher")
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=cfg.timeout_s))
    tracer = None
    try:
        ps = initialize(cfg.parallel, rank, world_size)
        model, plan = build_stage(cfg, ps, spec)   # gpt or llama stage, and its plan
        recipe = precision.from_spec(spec)
        model.to(recipe.param_dtype)   # BF16 parameters for bf16/fp8 recipes (no-op for fp32)
        init_weights(model, plan, ps, cfg)
        model.to(device)
        precision.apply(model, recipe, ps.tp_cp_group, ps.dp_group,
                        amax_unreduced=bugs.active(spec, "fp8_amax_unreduced"), perturb_seed=cfg.perturb_seed)
        tracer = (tracer_factory or _default_tracer)(cfg, ps)
        tracer.attach(model, plan, rename=renaming(model))
        isolate = (spec.get("trace") or {}).get("isolate")
        if isolate:   # isolation pass: every module is fed the reference's tensors (tracer/isolation.py)
            from tracer.isolation import ReferenceFeed
            from tracer.logical import load_logical

            reference = load_logical(isolate["url"], isolate["run"], 1)
            tracer.isolate(ReferenceFeed(reference, ps.coords, ps.sizes))
        tracer.set_grad_scale(cfg.micro_batches_local / cfg.micro_batches_global)
        optimizer = precision.optimizer(model, recipe, lambda params: torch.optim.Adam(
            params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False))
        if cfg.parallel.zero1:
            optimizer = zero.DistributedOptimizer(model, plan, ps, cfg, spec)
        seq_local = cfg.model.seq_len // ps.cp_size   # context parallelism: this rank's zigzag chunks
        seq_local = seq_local // ps.tp_size if cfg.parallel.sp else seq_local
        act_shape = (cfg.micro_batch, seq_local, cfg.model.hidden)

        step_losses: list[float] = []
        scale_loss = not bugs.active(spec, "grad_accum_not_scaled")
        for step in range(cfg.steps):
            with tracer.step(step):
                optimizer.zero_grad(set_to_none=True)
                mbs = context_parallel.localize(_microbatches(cfg, ps, step, device), ps)
                if ps.pp_size == 1:
                    losses = no_pipelining(model, mbs, tracer, scale_loss=scale_loss)
                elif cfg.parallel.vpp > 1:
                    losses = interleaved_1f1b(model, mbs, tracer, ps, act_shape, device,
                                              scale_loss=scale_loss)
                else:
                    losses = one_f_one_b(model, mbs, tracer, ps, act_shape, device, scale_loss=scale_loss)
                faults.maybe_inject(spec, rank, step, model)
                precision.end_step(model)
                finalize_grads(model, ps, spec)
                if cfg.parallel.zero1:   # traces its grad shards, clips, steps its shards, all-gathers
                    optimizer.step(tracer)
                else:
                    tracer.record_param_grads(model)
                    clip_grad_norm(model.parameters(), ps, cfg.clip_grad, expert_sq=lambda params: (
                        grad_sync.expert_norm_sq(params, ps, model.shared_groups, spec)))
                    optimizer.step()
                tracer.record_params(model)
            if ps.is_last_stage:
                total = torch.tensor(sum(losses), dtype=torch.float64, device=device)
                if ps.dp_size > 1:
                    dist.all_reduce(total, group=ps.dp_group)
                step_losses.append(total.item() / cfg.micro_batches_global)
        return {"rank": rank, "losses": step_losses, "seconds": time.perf_counter() - t0}
    finally:
        try:
            if tracer is not None:
                tracer.close()
        finally:
            dist.destroy_process_group()
