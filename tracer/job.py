"""The job contract, job side: what ttrace tells every rank of a job, and the one call that sets it up.

A *job* is anything that trains: the built-in trainer, megatron-core, a torchtitan-style DTensor
script, a Hugging Face model, or a user's own torchrun script. ttrace launches it once per rank with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
plus the variables below, and the job calls `tracer.session()` once:

    import tracer as ttrace
    tr = ttrace.session(tp=args.tp)      # the recipe's sizes under ttrace; these defaults outside it
    ...build and parallelize the model with tr.parallel.tp...
    tr.attach(model)                     # after the weights are set
    for step in range(steps):
        with tr.step(step):
            for j, mb in enumerate(local_microbatches):
                with tr.microbatch(dp_rank * len(local_microbatches) + j):   # global index
                    loss = ...
                loss.backward()
            reduce_grads(); tr.record_param_grads(model)
            optimizer.step(); tr.record_params(model)

The session knows the run's *role* and applies it inside `attach`, so the job's code never branches
on it:
  reference    trains and traces as is (ttrace runs it at TP=PP=DP=1: the trusted run)
  perturbed    every parameter moved one ulp of its dtype, signs drawn per element of the logical
               tensor from (TTRACE_PERTURB, parameter name): the tolerance's noise runs
  candidate    trains and traces as is (the parallel layout under test)
  isolated     every traced module is fed the reference's tensors (tracer.isolation)
Outside ttrace (no TTRACE_ROLE and no TTRACE_SPEC in the environment) the session is disabled: every
call is a no-op and the script trains exactly as it would without it.

Environment (ttrace's launcher sets all of them; by hand, with plain torchrun, set the first four):
  TTRACE_STORE      where the trace goes (any fsspec URL)
  TTRACE_ROLE       reference | perturbed | candidate | isolated
  TTRACE_PERTURB    the perturbed run's index r = 1, 2, ... (role perturbed)
  TTRACE_REFERENCE  URL of the reference run, <store>/reference (role isolated)
  TTRACE_RUN        run name in the store (default: the role; perturbed-<r> for perturbed runs)
  TTRACE_SEED       seed of the consistent generator (`init_weights`)
  TTRACE_SPEC       JSON: the whole job spec from the recipe (parallel sizes, steps, seed, data,
                    model, ...); ttrace's own jobs read their model from it
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from tracer.errors import ConfigError
from tracer.generator import full_tensor, perturb_signs, step_ulp
from tracer.layouts import Layout, Replicate
from tracer.plan import Plan, Rename, param_layouts

ENV_SPEC = "TTRACE_SPEC"
ENV_STORE = "TTRACE_STORE"
ENV_ROLE = "TTRACE_ROLE"
ENV_PERTURB = "TTRACE_PERTURB"
ENV_REFERENCE = "TTRACE_REFERENCE"
ENV_RUN = "TTRACE_RUN"
ENV_SEED = "TTRACE_SEED"
ROLES = ("reference", "perturbed", "candidate", "isolated")
UNTRACED = "untraced"
DEFAULT_SEED = 1234
INITIAL_STEP = -1   # the canonical step of the parameters as attached, before any optimizer step


def run_name(role: str, perturb: int | None = None) -> str:
    """The store's name of a run: the role, or perturbed-<r>."""
    return f"perturbed-{perturb}" if role == "perturbed" else role


@dataclass(frozen=True)
class Parallel:
    """The parallel sizes of this job (the recipe's `parallel` section under ttrace)."""

    world_size: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    sp: bool = False
    zero1: bool = False
    name: str = ""

    @property
    def dp(self) -> int:
        return max(1, self.world_size // (self.tp * self.pp * self.cp))

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], world_size: int) -> Parallel:
        known = {f.name: f.type for f in fields(cls)}
        kw: dict[str, Any] = {}
        for k, v in d.items():
            if k in known and v is not None:
                kw[k] = bool(v) if k in ("sp", "zero1") else (str(v) if k == "name" else int(v))
        kw.setdefault("world_size", world_size)
        return cls(**kw)


@dataclass(frozen=True)
class JobConfig:
    """Everything ttrace tells one rank of a job (from its environment: see the module doc)."""

    role: str = UNTRACED
    run: str = ""
    store: str | None = None
    perturb: int | None = None
    reference: str | None = None
    seed: int = DEFAULT_SEED
    steps: int | None = None
    parallel: Parallel = field(default_factory=Parallel)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    fingerprint: str | None = None
    spec: Mapping[str, Any] = field(default_factory=dict)

    @property
    def traced(self) -> bool:
        return self.role != UNTRACED and bool(self.spec.get("trace", {}).get("enabled", True))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **defaults: Any) -> JobConfig:
        """The config of this rank. `defaults` (seed, steps, tp, sp, ...) are the script's own values,
        used outside ttrace; under ttrace the recipe's win."""
        env = os.environ if env is None else env
        try:
            spec = json.loads(env[ENV_SPEC]) if env.get(ENV_SPEC) else {}
        except json.JSONDecodeError as e:
            raise ConfigError(f"{ENV_SPEC} is not valid JSON ({e}); it is written by ttrace's launcher") \
                from None
        return cls.from_spec(spec, env=env, **defaults)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], *, env: Mapping[str, str] | None = None,
                  **defaults: Any) -> JobConfig:
        env = {} if env is None else env
        trace = dict(spec.get("trace") or {})
        rank, world = _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1)
        role = env.get(ENV_ROLE) or trace.get("role") or UNTRACED
        store = env.get(ENV_STORE) or trace.get("store_url")
        if role == UNTRACED and store and not spec:
            raise ConfigError(f"{ENV_STORE} is set but {ENV_ROLE} is not: set {ENV_ROLE} to one of "
                              f"{', '.join(ROLES)}")
        if role not in (*ROLES, UNTRACED):
            raise ConfigError(f"{ENV_ROLE}={role!r} is not a role; use one of {', '.join(ROLES)}")
        perturb = env.get(ENV_PERTURB) or trace.get("perturb")
        perturb = None if perturb in (None, "") else int(perturb)
        reference = env.get(ENV_REFERENCE) or trace.get("reference")
        if role != UNTRACED and not store:
            raise ConfigError(f"{ENV_ROLE}={role} needs {ENV_STORE}, the URL the trace is written to")
        if role == "perturbed" and (perturb is None or perturb < 1):
            raise ConfigError(f"{ENV_ROLE}=perturbed needs {ENV_PERTURB}=r with r = 1, 2, ... (one value per "
                              "perturbed reference run)")
        if role != "perturbed" and perturb is not None:
            raise ConfigError(f"{ENV_PERTURB}={perturb} is set but {ENV_ROLE}={role}: only perturbed "
                              "reference runs are perturbed")
        if role == "isolated" and not reference:
            raise ConfigError(f"{ENV_ROLE}=isolated needs {ENV_REFERENCE}, the URL of the reference run "
                              "(<store>/reference)")
        sizes = dict(defaults)
        seed = _first(env.get(ENV_SEED), spec.get("seed"), sizes.pop("seed", None), DEFAULT_SEED)
        steps = _first(spec.get("steps"), sizes.pop("steps", None))
        parallel = Parallel.from_mapping(spec.get("parallel") or sizes, world)
        if spec and parallel.world_size != world:
            raise ConfigError(f"parallel={parallel.name or '?'} declares world_size={parallel.world_size} "
                              f"but the job was launched with WORLD_SIZE={world}; fix the recipe or the "
                              "launcher")
        return cls(role=role, run=env.get(ENV_RUN) or trace.get("run") or run_name(role, perturb),
                   store=store, perturb=perturb, reference=reference, seed=int(seed),
                   steps=None if steps is None else int(steps), parallel=parallel, rank=rank,
                   world_size=world, local_rank=_int(env, "LOCAL_RANK", rank),
                   fingerprint=trace.get("fingerprint"), spec=spec)

    def env(self) -> dict[str, str]:
        """The TTRACE_* variables that give a rank this config (ttrace's launcher)."""
        out = {ENV_SPEC: json.dumps(self.spec, default=str), ENV_ROLE: self.role, ENV_RUN: self.run,
               ENV_SEED: str(self.seed)}
        if self.store:
            out[ENV_STORE] = self.store
        if self.perturb is not None:
            out[ENV_PERTURB] = str(self.perturb)
        if self.reference:
            out[ENV_REFERENCE] = self.reference
        return out


def _first(*values: Any) -> Any:
    """The first value that is set (0 counts as set)."""
    return next((v for v in values if v not in (None, "")), None)


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    try:
        return int(env.get(key, default))
    except ValueError:
        raise ConfigError(f"{key}={env.get(key)!r} is not an integer") from None


# A tracer built at attach time: (coords, sizes, meta) -> tracer.Tracer-like (tests record in memory).
TracerFactory = Callable[[Mapping[str, int], Mapping[str, int], Mapping[str, Any], bool], Any]


class Session:
    """One rank's ttrace session (module doc). Methods mirror `tracer.Tracer`; before `attach` and
    outside ttrace they are no-ops."""

    def __init__(self, config: JobConfig, *, tracer_factory: TracerFactory | None = None):
        self.config = config
        self._factory = tracer_factory
        self._tracer: Any = None
        self._closed = False
        self._failed: str | None = None   # the uncaught exception that ended the job, if any
        self._grad_scale: float | None = None
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
    def init_weights(self, model: nn.Module, plan: Plan | None = None, *, rename: Rename | None = None,
                     coords: Mapping[str, int] | None = None, sizes: Mapping[str, int] | None = None,
                     init: Callable[[str, nn.Module], str] | None = None, std: float = 0.02) -> None:
        """Optional: fill every parameter from the consistent generator (`tracer.full_tensor`: the full
        logical tensor by global name and `seed`, sliced by its layout), so every layout starts from
        the same weights whatever order it builds its modules in. `init(name, module)` returns
        "normal", "ones" or "zeros" (default: norms ones/zeros, biases zeros, the rest normal(0, std))."""
        coords, sizes = self._axes(model, coords, sizes, plan)
        init_parameters(model, _layouts(model, plan), self.seed, coords, sizes, rename=rename, init=init,
                        std=std)

    def attach(self, model: nn.Module, plan: Plan | None = None, *, mesh: Any = None,
               coords: Mapping[str, int] | None = None, sizes: Mapping[str, int] | None = None,
               rename: Rename | None = None, modules: Iterable[str] | None = None,
               local_layouts: Any = None, perturb: bool = True,
               meta: Mapping[str, Any] | None = None) -> nn.Module:
        """Trace `model` (call it after the weights are set and the model is parallelized) and apply
        the role: perturb the weights one ulp (perturbed; `perturb=False` for a job that perturbs
        otherwise) or feed the reference's tensors (isolated).

        Layouts: from `plan` (module-name patterns -> ModuleLayout, tracer.plan) when given, else from
        DTensor placements (tracer.frameworks.dtensor), a plain tensor being a replica. Mesh axes: the
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
        self.coords, self.sizes = self._axes(model, coords, sizes, plan, mesh)
        if self.role == "perturbed" and perturb:
            perturb_parameters(model, _layouts(model, plan), self.config.perturb or 0, self.coords,
                               self.sizes, rename=rename)
        self._tracer = self._new_tracer(plan is None, meta)
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
            from tracer.isolation import ReferenceFeed
            from tracer.logical import load_logical
            from tracer.store import world_size_of

            root, _, run = str(self.config.reference).rstrip("/").rpartition("/")
            reference = load_logical(root, run, world_size_of(root, run))
            self._tracer.isolate(ReferenceFeed(reference, self.coords, self.sizes))
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
        """After the optimizer step."""
        if self._tracer is not None:
            self._tracer.record_params(model)

    def record_param_grad_shards(self, shards: Mapping[str, Any]) -> None:
        if self._tracer is not None:
            self._tracer.record_param_grad_shards(shards)

    def close(self, failed: str | None = None) -> None:
        """Commit this rank's trace (manifest last). Also runs at interpreter exit. A job that raised
        (`failed`, or an uncaught exception seen by `session()`'s hook) commits its trace marked
        incomplete: kept to look at, never compared."""
        if self._closed or not self.enabled:
            self._closed = True
            return
        self._closed = True
        failed = failed or self._failed
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
    def _meta(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        spec = self.config.spec
        job = spec.get("job") or {}
        return {"role": self.role, "job": job.get("label") or job.get("name") or "script",
                "parallel": self.parallel.name, "world_size": self.world_size,
                "precision": (spec.get("precision") or {}).get("name"),
                "model": (spec.get("model") or {}).get("name"), "bug": (spec.get("bug") or {}).get("name"),
                "perturb": self.config.perturb, "fingerprint": self.config.fingerprint, **dict(extra or {})}

    def _new_tracer(self, dtensor: bool, meta: Mapping[str, Any] | None) -> Any:
        m = self._meta(meta)
        if self._factory is not None:
            return self._factory(self.coords, self.sizes, m, dtensor)
        cfg = self.config
        if dtensor:
            from tracer.frameworks.dtensor import DTensorTracer

            return DTensorTracer(str(cfg.store), cfg.run, cfg.rank, coords=self.coords, sizes=self.sizes,
                                 meta=m)
        from tracer.collector import Tracer

        return Tracer(str(cfg.store), cfg.run, cfg.rank, coords=self.coords, sizes=self.sizes, meta=m)

    def _axes(self, model: nn.Module, coords: Mapping[str, int] | None, sizes: Mapping[str, int] | None,
              plan: Plan | None, mesh: Any = None) -> tuple[dict[str, int], dict[str, int]]:
        if coords is not None or sizes is not None:
            if coords is None or sizes is None:
                raise ConfigError("attach(model, coords=..., sizes=...): give both, or neither")
            return dict(coords), dict(sizes)
        if plan is not None:
            raise ConfigError("attach(model, plan): a plan's layouts name mesh axes, so pass this rank's "
                              "coords and sizes too (e.g. coords={'tp': tp_rank, 'dp': dp_rank}, "
                              "sizes={'tp': tp, 'dp': dp})")
        if mesh is None:
            mesh = _first_mesh(model)
        if mesh is not None:
            from tracer.frameworks.dtensor import mesh_axes

            return mesh_axes(mesh)
        return {"dp": self.rank}, {"dp": self.world_size}


def _first_mesh(model: nn.Module) -> Any:
    from torch.distributed.tensor import DTensor

    return next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)


def _layouts(model: nn.Module, plan: Plan | None) -> dict[str, Layout]:
    """Every parameter's layout: from the plan, else its DTensor placements (plain: replicated)."""
    if plan is not None:
        return param_layouts(model, plan)
    from tracer.frameworks.dtensor import layout_of

    return {n: layout_of(p) for n, p in model.named_parameters()}


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p._local_tensor if isinstance(p, DTensor) else p.data


def _logical_shape(p: torch.Tensor, layout: Layout, sizes: Mapping[str, int]) -> tuple[int, ...]:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return tuple(p.shape)
    shape = list(p.shape)
    for dim, axis in layout.shard:
        shape[dim] *= int(sizes.get(axis, 1))
    return tuple(shape)


def _each_param(model: nn.Module, layouts: Mapping[str, Layout], sizes: Mapping[str, int],
                rename: Rename | None) -> Iterator[tuple[str, str, torch.Tensor, Layout, tuple[int, ...]]]:
    """(local name, global name, local tensor, layout, logical shape) of every parameter."""
    rename = rename or (lambda n: n)
    for name, p in model.named_parameters():
        layout = layouts.get(name, Replicate())
        if layout.partial:
            raise ConfigError(f"parameter {name} is declared a partial sum; a parameter is sharded or "
                              "replicated")
        yield name, rename(name), _local(p), layout, _logical_shape(p, layout, sizes)


@torch.no_grad()
def perturb_parameters(model: nn.Module, layouts: Mapping[str, Layout], perturb: int,
                       coords: Mapping[str, int], sizes: Mapping[str, int], *,
                       rename: Rename | None = None) -> None:
    """Move every parameter element one ulp of its dtype, with signs drawn per element of the logical
    tensor (seed: perturbed run r and the global name) and sliced by the layout: every layout of the
    same run moves the same logical weights the same way."""
    for _, gname, local, layout, shape in _each_param(model, layouts, sizes, rename):
        up = layout.local(perturb_signs(shape, perturb, gname), coords, sizes)
        local.copy_(step_ulp(local, up))


def default_init(name: str, module: nn.Module) -> str:
    """norm weights ones, norm and other biases zeros, everything else normal."""
    kind = name.rpartition(".")[2]
    norm = isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()
    if norm:
        return "ones" if kind == "weight" else "zeros"
    return "zeros" if kind == "bias" else "normal"


@torch.no_grad()
def init_parameters(model: nn.Module, layouts: Mapping[str, Layout], seed: int, coords: Mapping[str, int],
                    sizes: Mapping[str, int], *, rename: Rename | None = None,
                    init: Callable[[str, nn.Module], str] | None = None, std: float = 0.02) -> None:
    """Every parameter generated as its full logical tensor by global name (tracer.full_tensor, in
    FP32, then cast to the parameter's dtype) and sliced to this rank's shard by its layout."""
    init = init or default_init
    modules = dict(model.named_modules())
    for name, gname, local, layout, shape in _each_param(model, layouts, sizes, rename):
        kind = init(name, modules[name.rpartition(".")[0]])
        full = full_tensor(gname, shape, seed, init=kind, std=std).to(local.dtype)
        local.copy_(layout.local(full, coords, sizes))


_current: Session | None = None


def session(**defaults: Any) -> Session:
    """This rank's session (created on the first call, from the environment: module doc).

    `defaults` are the script's own settings (seed, steps, tp, sp, pp, ...), in effect outside
    ttrace; under ttrace the recipe's values win, so read them back from `tr.parallel`, `tr.seed`,
    `tr.steps`."""
    global _current
    if _current is None or _current._closed:
        _current = Session(JobConfig.from_env(**defaults))
        atexit.register(_current.close)
        _watch_uncaught_exceptions()
        _collect_at_exit()
    return _current


def _collect_at_exit() -> None:
    """Collect cyclic garbage at exit, while the interpreter is whole. torch's gloo backend otherwise
    aborts in about 1 of 10 two-rank runs here ("terminate called without an active exception",
    SIGABRT): objects of finished collectives die during interpreter finalization (pytorch PR
    #179291). Measured on a 2-rank gloo script: 3-5 aborts in 30 runs without, 0 in 90 with a
    collection after destroy_process_group. It changes nothing in training, traced or not."""
    global _collecting
    if not _collecting:
        atexit.register(gc.collect)   # atexit is last-in first-out: runs before the session's close
        _collecting = True


_collecting = False


def _watch_uncaught_exceptions() -> None:
    """Python calls sys.excepthook for an uncaught exception before the atexit handlers: the session
    then commits its trace marked incomplete instead of passing a partial run off as a whole one."""
    previous = sys.excepthook
    if getattr(previous, "_ttrace", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if _current is not None:
            _current._failed = f"{kind.__name__}: {value}"[:500]
        previous(kind, value, tb)

    hook._ttrace = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def current() -> Session | None:
    """The session `session()` created in this process, if any (ttrace's launcher closes it)."""
    return _current


def reset() -> None:
    """Forget this process's session (a reused worker process starting its next job)."""
    global _current
    _current = None
