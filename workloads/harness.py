"""The per-rank harness of ttrace's own jobs (built-in trainer, megatron-core, torch-native, Hugging
Face), written once: the session, the recipe, the process group, this rank's data-parallel
microbatches, the step's loss, and teardown. Each job's `main()` is an entrypoint of the job contract
(tracer/job.py, orchestrator/jobs.py) like any user's; a user's torchrun script does the same work
in its own words (examples/).

    def main(session=None):
        with harness.rank_job(validate, session) as job:    # job.cfg, job.session, job.device
            ...build the model, job.session.attach(model, ...)
            for step in range(job.cfg.steps):
                mbs = job.microbatches(step, dp_rank, dp_size)
                ...
                losses.append(job.mean_loss(local_losses, dp_group))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tracer import ConfigError
from tracer.job import Session, session
from workloads.config import Config, parse
from workloads.schedule import Microbatch


@dataclass
class RankJob:
    session: Session
    spec: Mapping[str, Any]
    cfg: Config
    device: torch.device

    @property
    def rank(self) -> int:
        return self.session.rank

    @property
    def world_size(self) -> int:
        return self.session.world_size

    def global_step(self, step: int) -> int:
        """The training step `step` of this run is in the whole training: init.checkpoint's step count
        plus `step` (0 without a checkpoint). Anything keyed on the training step (a bug switch's
        `bug.from_step`, a schedule) must read this, not the loop's local step: `ttrace scan` reruns
        a late step from a checkpoint, where local step 1 is global step F."""
        return self.session.start_step + step

    def init_process_group(self) -> None:
        """The default process group from torchrun's environment (gloo on CPU, NCCL on GPUs)."""
        if dist.is_initialized():
            return
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", init_method="env://",
                                rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=self.cfg.timeout_s))

    def microbatches(self, step: int, dp_rank: int, dp_size: int) -> list[Microbatch]:
        """This DP rank's contiguous slice of the step's global batch (the session's: the consistent
        generator's tokens or data.path, from the checkpoint's step on), cut into microbatches with
        GLOBAL indices (dp_rank * local count + j)."""
        cfg = self.cfg
        tokens = self.session.token_batch(step, cfg.global_batch, cfg.model.seq_len, cfg.model.vocab)
        per_dp, m_local = cfg.global_batch // dp_size, cfg.global_batch // (dp_size * cfg.micro_batch)
        local = tokens[dp_rank * per_dp:(dp_rank + 1) * per_dp].to(self.device)
        return [Microbatch(index=dp_rank * m_local + j, ids=chunk[:, :-1], labels=chunk[:, 1:])
                for j, chunk in enumerate(local.split(cfg.micro_batch))]

    def mean_loss(self, local_losses: list[float], dp_group: Any = None) -> float:
        """The step's global mean loss from this DP rank's microbatch losses."""
        total = torch.tensor(sum(local_losses), dtype=torch.float64, device=self.device)
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(total, group=dp_group)
        return total.item() / self.cfg.micro_batches_global


@contextlib.contextmanager
def rank_job(validate: Callable[[Mapping[str, Any]], None], tr: Session | None = None, *,
             process_group: bool = True) -> Iterator[RankJob]:
    """Set up one rank of a ttrace job: validate its spec, one compute thread (ranks share the node's
    cores), the device, the process group (unless `process_group=False`: the job opens it later
    with job.init_process_group()). On the way out the trace is committed and the group destroyed,
    also when the job raises."""
    tr = tr or session()
    spec = dict(tr.spec)
    if not spec:
        raise ConfigError("this job is one of ttrace's own (workloads/): it reads its model from the recipe; "
                          "run it through `ttrace job=...`, not by hand")
    validate(spec)
    cfg = parse(spec)
    if cfg.parallel.world_size != tr.world_size:
        raise ConfigError(f"parallel={cfg.parallel.name} declares world_size={cfg.parallel.world_size} "
                          f"but the job was launched with {tr.world_size} ranks; fix the recipe or the "
                          "launcher")
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = (torch.device(f"cuda:{tr.local_rank % torch.cuda.device_count()}") if cuda
              else torch.device("cpu"))
    if cuda:
        torch.cuda.set_device(device)
    job = RankJob(tr, spec, cfg, device)
    failed = None
    try:
        if process_group:
            job.init_process_group()
        yield job
    except BaseException as e:
        failed = f"{type(e).__name__}: {e}"[:500]
        raise
    finally:
        try:
            tr.close(failed)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
