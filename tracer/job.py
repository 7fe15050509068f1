"""The job contract, job side: what ttrace tells every rank of a job, and the one call that sets it up.

A *job* is anything that trains: the built-in trainer, megatron-core, a torchtitan-style DTensor
script, a Hugging Face model, or a user's own torchrun script. ttrace launches it once per rank with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
plus the variables below, and the job calls `tracer.session()` once:

    import tracer as ttrace
    tr = ttrace.session(tp=args.tp)      # the recipe's sizes under ttrace; these defaults outside it
    ...build and parallelize the model with tr.parallel.tp...
    tr.init_weights(model)               # optional: the same logical weights in every layout
    tr.attach(model)                     # after the weights are set
    for step in range(steps):
        with tr.step(step):
            batch = tr.token_batch(step, global_batch, seq_len, vocab)   # optional: the global batch
            for j, mb in enumerate(local_microbatches):
                with tr.microbatch(dp_rank * len(local_microbatches) + j):   # global index
                    loss = ...
                loss.backward()
            reduce_grads(); tr.record_param_grads(model)
            optimizer.step(); tr.record_params(model)

The session knows the run's *role* and applies it inside `attach`, so the job's code never branches
on it:
  reference    trains and traces as is (ttrace runs it at TP=PP=DP=1 or reference.parallel's trusted
               layout: the trusted run)
  perturbed    every parameter moved one ulp of its dtype, signs drawn per element of the logical
               tensor from (TTRACE_PERTURB, parameter name): the tolerance's noise runs
  candidate    trains and traces as is (the parallel layout under test)
  isolated     every traced module is fed the reference's tensors (tracer.isolation)
Outside ttrace (no TTRACE_ROLE and no TTRACE_SPEC in the environment) the session is disabled: every
call is a no-op and the script trains exactly as it would without it.

Environment: tracer/job_config.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from tracer.errors import ConfigError
from tracer.job_config import INITIAL_STEP, JobConfig, Parallel
from tracer.job_inputs import JobInputs
from tracer.parameters import EveryStep, mesh_axes_of, param_layout_map, perturb_parameters
from tracer.plan import Plan, Rename
from tracer.process_exit import close_at_exit, collect_garbage_at_exit, on_uncaught_exception

# A tracer built at attach time: (coords, sizes, meta) -> tracer.Tracer-like (tests record in memory).
TracerFactory = Callable[[Mapping[str, int], Mapping[str, int], Mapping[str, Any], bool], Any]


class Session(JobInputs):
    """One rank's ttrace session (module doc). Methods mirror `tracer.Tracer`; before `attach` and
    outside ttrace they are no-ops. What the job starts from (weights, optimizer state, batches) and
    the reference's final state: tracer/job_inputs.py."""

    def __init__(self, config: JobConfig, *, tracer_factory: TracerFactory | None = None):
        self.config = config
        self._factory = tracer_factory
        self._tracer: Any = None
        self._closed = False
        self._failed: str | None = None   # the uncaught exception that ended the job, if any
        self._grad_scale: float | None = None
        self._every_step: EveryStep | None = None
        self.coords: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        if config.traced:
            from tracer.store import configure

            configure((config.spec.get("trace") or {}).get("storage"))   # S3 endpoint, timeouts

    # -- what the job may read ----------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """True when this rank traces (launched by ttrace, or by hand with TTRACE_ROLE)."""
        return self.config.traced

    @property
    def role(self) -> str:
        return self.config.role

    @property
    def run(self) -> str:
        return self.config.run

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def local_rank(self) -> int:
        return self.config.local_rank

    @property
    def parallel(self) -> Parallel:
        return self.config.parallel

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def steps(self) -> int | None:
        return self.config.steps

    @property
    def perturb(self) -> int | None:
        return self.config.perturb

    @property
    def spec(self) -> Mapping[str, Any]:
        return self.config.spec

    # -- setup --------------------------------------------------------------------------------
    def attach(self, model: nn.Module, plan: Plan | None = None, *, mesh: Any = None,
               coords: Mapping[str, int] | None = None, sizes: Mapping[str, int] | None = None,
               rename: Rename | None = None, modules: Iterable[str] | None = None, local_layouts: Any = None,
               perturb: bool = True, meta: Mapping[str, Any] | None = None) -> nn.Module:
        """Trace `model` (call it after the weights are set and the model is parallelized) and apply
        the role: perturb the weights one ulp (perturbed; `perturb=False` for a job that perturbs
        otherwise) or feed the reference's tensors (isolated).

        Layouts: from `plan` (module-name patterns -> ModuleLayout, tracer.plan) when given, else from
        DTensor placements (tracer.integrations.dtensor), a plain tensor being a replica. Mesh axes: the
        given `coords`/`sizes`, else `mesh`'s (dims named after ttrace axes: dp, tp, pp, cp, ep), else
        the mesh of the first DTensor parameter, else plain data parallelism {dp: rank}. `modules`
        narrows the traced modules (DTensor layouts; default every leaf module owning parameters);
        `rename` maps local to global module names (pipeline stages)."""
        if not self.enabled:
            return model
        if self._closed:
            raise RuntimeError("tracer session already closed")
        if self._tracer is not None:
            raise RuntimeError("tr.attach(model) was already called in this session; attach once, to the "
                               "whole model (or to the pipeline stage this rank holds)")
        unused = self._inputs_unused(attaching=True)
        if unused:
            raise ConfigError(unused)
        self.coords, self.sizes = mesh_axes_of(model, coords, sizes, plan, mesh, self.rank, self.world_size)
        if self.role == "perturbed" and perturb:
            layouts, r = param_layout_map(model, plan), self.config.perturb or 0
            perturb_parameters(model, layouts, r, self.coords, self.sizes, rename=rename)
            if (self.spec.get("trace") or {}).get("perturbation_steps") == "every":
                self._every_step = EveryStep(layouts, r, self.coords, self.sizes, rename)
        self._tracer = self._new_tracer(plan is None, meta)
        self.plan = plan
        if plan is not None:
            self._tracer.attach(model, plan, rename=rename)
        else:
            self._tracer.attach(model, modules, rename=rename, local_layouts=local_layouts)
        self._tracer.set_grad_scale(self._grad_scale if self._grad_scale is not None
                                    else 1.0 / max(1, int(self.sizes.get("dp", 1))))
        # The weights every layout starts from (step -1): compared like any parameter (a wrong init or
        # load shows here), and the size of each later optimizer update is measured against them.
        with self._tracer.step(INITIAL_STEP):
            self._tracer.record_params(model)
        if self.role == "isolated":
            from tracer.feed import reference_feed

            self._tracer.isolate(reference_feed(str(self.config.reference), self.coords, self.sizes))
        elif self.config.routing_replay or self.config.grad_sign_replay:   # perturbed and candidate runs
            from tracer.grad_signs import attach_replays

            attach_replays(self._tracer, self.config, self.coords, self.sizes)
        return model

    def set_grad_scale(self, scale: float) -> None:
        """Factor from this rank's activation grads to d(global loss)/d(activation). Default 1/dp: each
        DP rank's loss is the mean over its own microbatches and grads are averaged over DP (DDP,
        FSDP, Megatron, torchtitan). A job that sums its loss over the global batch sets 1."""
        self._grad_scale = float(scale)
        if self._tracer is not None:
            self._tracer.set_grad_scale(scale)

    # -- scopes and records (no-ops until attach) ---------------------------------------------
    def step(self, step: int) -> contextlib.AbstractContextManager[None]:
        return self._tracer.step(step) if self._tracer is not None else contextlib.nullcontext()

    def microbatch(self, index: int) -> contextlib.AbstractContextManager[None]:
        """Wrap the forward of GLOBAL microbatch `index` (DP rank and local index folded together)."""
        return self._tracer.microbatch(index) if self._tracer is not None else contextlib.nullcontext()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Record nothing inside (tracer.trace_scopes: a framework's dry run of the model)."""
        return self._tracer.paused() if self._tracer is not None else contextlib.nullcontext()

    def repeated_backward(self) -> contextlib.AbstractContextManager[None]:
        """Gradients delivered again inside are not recorded again (tracer.trace_scopes)."""
        return self._tracer.repeated_backward() if self._tracer is not None else contextlib.nullcontext()

    def record(self, *args: Any, **kw: Any) -> None:
        if self._tracer is not None:
            self._tracer.record(*args, **kw)

    def record_loss(self, loss: torch.Tensor, microbatch: int) -> None:
        if self._tracer is not None:
            self._tracer.record_loss(loss, microbatch)

    def record_param_grads(self, model: nn.Module) -> None:
        """After the gradient reductions (DP, SP, ...), before clipping."""
        if self._tracer is not None:
            self._tracer.record_param_grads(model)

    def record_params(self, model: nn.Module) -> None:
        """After the optimizer step (a perturbed run's weights then move again: EveryStep)."""
        if self._tracer is not None:
            self._tracer.record_params(model)
        if self._every_step is not None:
            self._every_step.after_step(model)

    def record_param_grad_shards(self, shards: Mapping[str, Any]) -> None:
        if self._tracer is not None:
            self._tracer.record_param_grad_shards(shards)

    def close(self, failed: str | None = None) -> None:
        """Commit this rank's trace (manifest last). Also runs at interpreter exit. A job that raised
        (`failed`, or an uncaught exception seen by `session()`'s hook) commits its trace marked
        incomplete: kept to look at, never compared."""
        closed, self._closed = self._closed, True
        if closed or not self.enabled:
            return
        failed = failed or self._failed or self._inputs_unused(attaching=False)
        if self._tracer is None:   # set up but never attached: commit an empty trace ttrace reports
            self._tracer = self._new_tracer(False, {"attached": False})
        try:
            self._tracer.close(failed)
        except TypeError:          # a test's in-memory tracer
            self._tracer.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------
    def _new_tracer(self, dtensor: bool, meta: Mapping[str, Any] | None) -> Any:
        m = self.config.meta(meta)
        if self._factory is not None:
            return self._factory(self.coords, self.sizes, m, dtensor)
        cfg = self.config
        trace = cfg.spec.get("trace") or {}
        mode = cfg.mode
        kinds = trace.get("kinds")                # None: every kind
        if dtensor:
            from tracer.integrations.dtensor import DTensorTracer

            return DTensorTracer(str(cfg.store), cfg.run, cfg.rank, coords=self.coords, sizes=self.sizes,
                                 meta=m, mode=mode, kinds=kinds)
        from tracer.collector import Tracer

        return Tracer(str(cfg.store), cfg.run, cfg.rank, coords=self.coords, sizes=self.sizes, meta=m,
                      mode=mode, kinds=kinds)


_current: Session | None = None


def session(**defaults: Any) -> Session:
    """This rank's session (created on the first call, from the environment: module doc). `defaults`:
    the script's own settings (seed, steps, tp, sp, pp, ...), in effect outside ttrace; under ttrace the
    recipe's values win (read them back from `tr.parallel`, `tr.seed`, `tr.steps`)."""
    global _current
    if _current is None or _current._closed:
        _current = Session(JobConfig.from_env(**defaults))
        close_at_exit(current)
        on_uncaught_exception(_mark_failed)
        collect_garbage_at_exit()
    return _current


def _mark_failed(what: str) -> None:
    if _current is not None:
        _current._failed = what


def current() -> Session | None:
    """The session `session()` created in this process, if any (ttrace's launcher closes it)."""
    return _current


def reset() -> None:
    """Forget this process's session (a reused worker process starting its next job)."""
    global _current
    _current = None
