"""job=torch_native with pp > 1: torch.distributed.pipelining, as torchtitan's `pipeline_llama` runs it.

- **Split** (`stage_modules`): the model is built whole (its weights by global name, like every
  layout's), then each of this rank's stages is a copy of it with the other stages' modules deleted.
  The layers are an `nn.ModuleDict` keyed by layer id, so every stage keeps the global names
  (`layers.3.attention.wq`). Stage s of pp x vpp holds layers [s*L/S, (s+1)*L/S); the first stage
  the embedding, the last the final norm and the head. Rank r holds stages r, r + pp, ... (torchtitan's
  "loop" style, which `ScheduleInterleaved1F1B` expects).
- **Parallelism inside a stage**: the same TP(+SP) plan, activation checkpointing and FSDP2 as
  without pp (`torch_native.parallelize`), per stage module.
- **Schedule**: `parallel.pp_schedule` by torch's name for it (`get_schedule_class`), by default
  `Schedule1F1B` (vpp = 1) or `ScheduleInterleaved1F1B` (vpp > 1), over the mesh dim "pp", on this
  DP rank's local batch cut into its microbatches. The zero-bubble ones (`InterleavedZeroBubble`,
  `ZBVZeroBubble`, `DualPipeV`) split each backward into an input pass and a weight pass; V-shaped
  ones place rank r's two stages at r and 2 pp - 1 - r. Each microbatch's loss is its own
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

# torch's schedules by the names torchtitan's pipeline_parallel_schedule takes (get_schedule_class):
# one stage a rank, several looped (rank r: r, r + pp, ...), or two in a V (rank r: r, 2 pp - 1 - r)
SINGLE = ("1F1B", "GPipe")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")   # backward split: input, weight


def schedule_name(cfg: Config) -> str:
    """parallel.pp_schedule, or its default: 1F1B, Interleaved1F1B with several stages a rank."""
    return cfg.parallel.pp_schedule or ("1F1B" if cfg.parallel.vpp == 1 else "Interleaved1F1B")


def schedule_refused(cfg: Config) -> str | None:
    """Why this pp x vpp cannot run parallel.pp_schedule (None: it can)."""
    name, vpp = schedule_name(cfg), cfg.parallel.vpp
    if name not in SINGLE + LOOPED + V_SHAPED:
        return f"parallel.pp_schedule={name} is not one of {', '.join(SINGLE + LOOPED + V_SHAPED)}"
    if name in SINGLE and vpp != 1:
        return f"parallel.pp_schedule={name} runs one stage a rank: vpp must be 1, not {vpp}"
    if name in LOOPED and vpp < 2:
        return f"parallel.pp_schedule={name} runs several stages a rank: set vpp >= 2 (parallel=pp2_vpp2)"
    if name in V_SHAPED and vpp != 2:
        return f"parallel.pp_schedule={name} runs two stages a rank in a V: vpp must be 2, not {vpp}"
    if name == "DualPipeV" and cfg.micro_batches_local < 2 * cfg.parallel.pp:
        return (f"parallel.pp_schedule=DualPipeV needs at least as many microbatches per DP rank as "
                f"stages ({2 * cfg.parallel.pp}), not {cfg.micro_batches_local}: lower data.micro_batch")
    if name in ZERO_BUBBLE and cfg.parallel.recompute != "none":
        return (f"parallel.pp_schedule={name} with parallel.recompute={cfg.parallel.recompute}: its input "
                "and weight passes each recompute a block's forward, and ttrace matches one recomputation "
                "to each forward (tracer/module_calls.py); set parallel.recompute=none for the check")
    return None


def stage_ids(pp: int, vpp: int, pp_rank: int, schedule: str = "1F1B") -> list[int]:
    """The stages pipeline rank `pp_rank` holds, in order (looped, or V-shaped for `schedule`)."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
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
    for s in stage_ids(p.pp, p.vpp, pp_rank, schedule_name(cfg)):
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
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    p, name = cfg.parallel, schedule_name(cfg)
    stages = [PipelineStage(m, s, p.pp * p.vpp, device, group=pp_group) for s, m in parts]
    cls = get_schedule_class(name)
    return stages, cls(stages[0] if name in SINGLE else stages, n_microbatches=cfg.micro_batches_local,
                       loss_fn=_loss)


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
    # the ranks holding the first stage feed the tokens, the last stage's compute the losses (rank 0
    # holds both under a V-shaped schedule)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
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
