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
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tracer.integrations.pipelining import stages_renaming, trace_microbatches
from workloads import bugs
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
    return None


def fsdp_per_block(cfg: Config) -> bool:
    """Whether FSDP2 wraps each block of a stage besides the stage (torchtitan's way), or the stage alone.
    Alone under a zero-bubble schedule: in torch 2.13 its weight passes and per-block FSDP2 leave every
    stage but the first with wrong grads (50-94% off) and the last with none, silently
    (scripts/repro_zb_fsdp_grads.py; bug `tn_pp_zero_bubble_fsdp2_grads` keeps torchtitan's wrapping)."""
    if cfg.parallel.pp == 1 or schedule_name(cfg) not in ZERO_BUBBLE:
        return True
    return bugs.active(cfg.bug, "tn_pp_zero_bubble_fsdp2_grads")


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


class Pipeline:
    """This rank's stages under their schedule, traced (module doc): what `torch_native.train` runs
    in place of its microbatch loop."""

    def __init__(self, parts: list[tuple[int, nn.Module]], cfg: Config, mesh: Any, tracer: Any,
                 device: torch.device):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        p, name = cfg.parallel, schedule_name(cfg)
        pp_group = mesh["pp"].get_group()
        self.stages = [PipelineStage(m, s, p.pp * p.vpp, device, group=pp_group) for s, m in parts]
        self.schedule = get_schedule_class(name)(self.stages[0] if name in SINGLE else self.stages,
                                                 n_microbatches=cfg.micro_batches_local, loss_fn=_loss)
        trace_microbatches(tracer, self.stages, first=mesh["dp"].get_local_rank() * cfg.micro_batches_local)
        # the ranks holding the first stage feed the tokens, the last stage's compute the losses (rank 0
        # holds both under a V-shaped schedule)
        self.first, self.last = any(s.is_first for s in self.stages), any(s.is_last for s in self.stages)
        # BUG tn_pp_grad_norm_stage_local: each stage clips by the norm of its own grads (torchtitan #596)
        self.clip_group = None if bugs.active(cfg.bug, "tn_pp_grad_norm_stage_local") else pp_group
        self._tracer = tracer

    def step(self, batches: list[Any]) -> list[float]:
        """One step's forwards and backwards of this DP rank's microbatches; their losses recorded and
        returned (last stage; none elsewhere)."""
        ids, labels = torch.cat([mb.ids for mb in batches]), torch.cat([mb.labels for mb in batches])
        losses: list[torch.Tensor] = []
        self.schedule.step(*((ids,) if self.first else ()), target=labels, losses=losses)
        for mb, loss in zip(batches, losses, strict=False):   # no losses off the last stage
            self._tracer.record_loss(loss.detach(), microbatch=mb.index)
        return [x.item() for x in losses]


def traced_model(parts: list[tuple[int, nn.Module]]) -> tuple[nn.Module, Any]:
    """What the session attaches to, and its renaming: the stage itself, or a rank's stages as one
    `nn.ModuleList` (tracer.integrations.pipelining)."""
    if len(parts) == 1:
        return parts[0][1], None
    return nn.ModuleList(m for _, m in parts), stages_renaming(len(parts))
