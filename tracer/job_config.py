"""The job contract's environment: the variables ttrace sets for every rank, and the configuration a
session reads from them (`JobConfig.from_env`).

Environment (ttrace's launcher sets all of them; by hand, with plain torchrun, set the first four):
  TTRACE_STORE      where the trace goes (any fsspec URL)
  TTRACE_ROLE       reference | perturbed | candidate | isolated
  TTRACE_PERTURB    the perturbed run's index r = 1, 2, ... (role perturbed)
  TTRACE_REFERENCE  URL of the reference run, <store>/reference (role isolated; routing replay)
  TTRACE_RUN        run name in the store (default: the role; perturbed-<r> for perturbed runs)
  TTRACE_SEED       seed of the consistent generator (`init_weights`)
  TTRACE_MODE       full (default) | stats: what the tracer stores per tensor (docs/stats_mode.md);
                    a scan's per-step log is `ttrace scan`'s own
  TTRACE_SPEC       JSON: the whole job spec from the recipe (parallel sizes, steps, seed, data,
                    model, ...); ttrace's own jobs read their model from it
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from tracer.errors import ConfigError

ENV_SPEC = "TTRACE_SPEC"
ENV_STORE = "TTRACE_STORE"
ENV_ROLE = "TTRACE_ROLE"
ENV_PERTURB = "TTRACE_PERTURB"
ENV_REFERENCE = "TTRACE_REFERENCE"
ENV_RUN = "TTRACE_RUN"
ENV_SEED = "TTRACE_SEED"
ENV_MODE = "TTRACE_MODE"
MODES_BY_HAND = ("full", "stats")   # TTRACE_MODE's values; "scan": set by `ttrace scan` in the spec
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
    mode: str = "full"   # full | stats (tracer/stats.py) | scan (tracer/fingerprint_log.py)

    @property
    def routing_replay(self) -> bool:
        """Take the reference's top-k experts (tracer/routing.py): set by ttrace on perturbed and
        candidate runs of a check that replays routing."""
        return bool(self.spec.get("trace", {}).get("routing_replay"))

    @property
    def grad_sign_replay(self) -> bool:
        """Take the reference's grad where this run's disagrees in sign (tracer/grad_signs.py): set by
        ttrace on perturbed and candidate runs of a check that replays grad signs."""
        return bool(self.spec.get("trace", {}).get("grad_sign_replay"))

    def meta(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What a trace's manifest says of the run that wrote it (`extra`: the job's own keys)."""
        spec = self.spec
        job = spec.get("job") or {}
        return {"role": self.role, "job": job.get("label") or job.get("name") or "script",
                "parallel": self.parallel.name, "world_size": self.world_size,
                "precision": (spec.get("precision") or {}).get("name"),
                "model": (spec.get("model") or {}).get("name"), "bug": (spec.get("bug") or {}).get("name"),
                "perturb": self.perturb, "fingerprint": self.fingerprint,
                # whether step 0 is Adam's first update from a fresh state (tracer/excusal.py): not so
                # from a checkpoint, which may hold the optimizer's state
                "from_checkpoint": bool((spec.get("init") or {}).get("checkpoint")), **dict(extra or {})}

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
        mode = env.get(ENV_MODE) or trace.get("mode") or "full"
        if env.get(ENV_MODE) and mode not in MODES_BY_HAND and mode != trace.get("mode"):
            raise ConfigError(f"{ENV_MODE}={mode!r}: use {' or '.join(MODES_BY_HAND)} (a scan's per-step log "
                              "is made by `ttrace scan`)")
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
        if trace.get("routing_replay") and not reference:
            raise ConfigError(f"routing replay needs {ENV_REFERENCE}, the URL of the reference run whose "
                              "router outputs this run takes its experts from")
        if trace.get("grad_sign_replay") and not reference:
            raise ConfigError(f"grad-sign replay needs {ENV_REFERENCE}, the URL of the reference run whose "
                              "param grads this run takes its grad signs from")
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
                   fingerprint=trace.get("fingerprint"), spec=spec, mode=str(mode))

    def env(self) -> dict[str, str]:
        """The TTRACE_* variables that give a rank this config (ttrace's launcher)."""
        out = {ENV_SPEC: json.dumps(self.spec, default=str), ENV_ROLE: self.role, ENV_RUN: self.run,
               ENV_SEED: str(self.seed), ENV_MODE: self.mode}   # the mode set: never a shell's TTRACE_MODE
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

