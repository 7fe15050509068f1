"""job=torch_native with pp > 1: torch.distributed.pipelining, as torchtitan's `pipeline_llama` runs it.

- **Split** (`stage_modules`): the model is built whole (its weights by global name, like every
  layout's), then each of this rank's stages is a copy of it with the other stages' modules deleted.
  The layers are an `nn.ModuleDict` keyed by layer id, so every stage keeps the global names
  (`layers.3.attention.wq`). Stage s of pp x vpp holds layers [s*L/S, (s+1)*L/S); the first stage
  the embedding, the last the final norm and the head. Rank r holds stages r, r + pp, ... (torchtitan's
  "loop" style, which `ScheduleInterleaved1F1B` expects).
- **Parallelism inside a stage**: the same TP(+SP) plan, activation checkpointing and FSDP2 as
  without pp (`torch_native.parallelize`), per stage module.
- **Schedule**: `Schedule1F1B` (vpp = 1) or `ScheduleInterleaved1F1B` (vpp > 1) over the mesh dim
  "pp", on this DP rank's local batch cut into its microbatches. Each microbatch's loss is its own
  mean token cross-entropy; the schedule divides the stages' grads by the microbatch count after the
  backwards (`scale_grads`), and FSDP2 averages over dp: the single device's mean over the global
  batch.
- **Tracing**: the stages' forwards run in `tr.microbatch(global index)`
  (tracer.integrations.pipelining); a rank with several stages attaches them as one `nn.ModuleList`
  whose index is dropped from the names. Activation grads are those of a microbatch's own mean loss:
  the global loss's are 1/(global microbatches) of them. Losses are recorded after the schedule's step
  from the list it fills (last stage). Grad clipping adds the stages' sums of squares over pp.
- **Not supported**: tied embeddings (the embedding and the head sit on different stages, and torch's
  pipelining has no shared-parameter sync: torchtitan refuses the pair too).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tracer.integrations.pipelining import stages_renaming, trace_microbatches
from workloads import bugs, faults, harness, lr_schedule
from workloads.config import Config


def stage_ids(pp: int, vpp: int, pp_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds, in order ("loop" style)."""
    return [pp_rank + v * pp for v in range(vpp)]


def stage_modules(model: nn.Module, cfg: Config, pp_rank: int) -> list[tuple[int, nn.Module]]:
    """(stage id, the model cut down to that stage) for each stage of this rank (module doc); without
    pp, the model itself."""
    p = cfg.parallel
    stages = p.pp * p.vpp
    if stages == 1:
        return [(0, model)]
    per = cfg.model.layers // stages
    out = []
    for s in stage_ids(p.pp, p.vpp, pp_rank):
        part = copy.deepcopy(model)
        for key in list(part.layers.keys()):
            if not s * per <= int(key) < (s + 1) * per:
                del part.layers[key]
        if s > 0:
            part.tok_embeddings = None
        if s < stages - 1:
            part.norm = part.output = None
        out.append((s, part))
    return out


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A microbatch's mean token cross-entropy, on FP32 logits (torch_native.train's)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def schedule(parts: list[tuple[int, nn.Module]], cfg: Config, pp_group: Any,
             device: torch.device) -> tuple[list[Any], Any]:
    """This rank's `PipelineStage`s and their schedule (module doc)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    p = cfg.parallel
    stages = [PipelineStage(m, s, p.pp * p.vpp, device, group=pp_group) for s, m in parts]
    if p.vpp == 1:
        return stages, Schedule1F1B(stages[0], n_microbatches=cfg.micro_batches_local, loss_fn=_loss)
    return stages, ScheduleInterleaved1F1B(stages, n_microbatches=cfg.micro_batches_local, loss_fn=_loss)


def traced_model(parts: list[tuple[int, nn.Module]]) -> tuple[nn.Module, Any]:
    """What the session attaches to, and its renaming: the stage itself, or a rank's stages as one
    `nn.ModuleList` (tracer.integrations.pipelining)."""
    if len(parts) == 1:
        return parts[0][1], None
    return nn.ModuleList(m for _, m in parts), stages_renaming(len(parts))


def train(stages: list[Any], sched: Any, model: nn.Module, rename: Any, job: harness.RankJob, mesh: Any,
          clip_grad_norm: Callable[[nn.Module, float, Any], float]) -> list[float]:
    """`steps` steps of Adam on this rank's `stages` run by `sched`, traced (`model`, `rename`:
    `traced_model`'s), clipped by `clip_grad_norm(model, max_norm, pp_group)` (torch_native's); the
    global mean loss per step on the last stage's ranks (none elsewhere)."""
    cfg, tracer = job.cfg, job.session
    dp_mesh, pp_mesh = mesh["dp"], mesh["pp"]
    dp_rank, dp = dp_mesh.get_local_rank(), cfg.parallel.dp
    trace_microbatches(tracer, stages, first=dp_rank * cfg.micro_batches_local)
    tracer.set_grad_scale(1.0 / cfg.micro_batches_global)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                 weight_decay=0.0, foreach=False)
    tracer.load_optimizer_state(optimizer, model, rename=rename)   # init.checkpoint's Adam state
    first, last = pp_mesh.get_local_rank() == 0, pp_mesh.get_local_rank() == cfg.parallel.pp - 1
    # BUG tn_pp_grad_norm_stage_local: each stage clips by the norm of its own grads (torchtitan #596)
    pp_group = None if bugs.active(cfg.bug, "tn_pp_grad_norm_stage_local") else pp_mesh.get_group()

    step_losses: list[float] = []
    scheduler = lr_schedule.Scheduler(cfg)
    for step in range(cfg.steps):
        batches = job.microbatches(step, dp_rank, dp)
        ids, labels = torch.cat([mb.ids for mb in batches]), torch.cat([mb.labels for mb in batches])
        losses: list[torch.Tensor] = []
        with tracer.step(step):
            optimizer.zero_grad(set_to_none=True)
            sched.step(*((ids,) if first else ()), target=labels, losses=losses)
            for j, loss in enumerate(losses):
                tracer.record_loss(loss.detach(), microbatch=batches[j].index)
            faults.maybe_inject(job.spec, job.rank, step)
            tracer.record_param_grads(model)
            clip_grad_norm(model, cfg.clip_grad, pp_group)
            scheduler.set(optimizer)
            optimizer.step()
            scheduler.step(cfg.global_batch)
            tracer.record_params(model)
        if last:
            step_losses.append(job.mean_loss([x.item() for x in losses],
                                             dp_mesh.get_group() if dp > 1 else None))
    tracer.save_checkpoint(model, optimizer)   # checkpoint.save (the reference only: never pp)
    return step_losses
