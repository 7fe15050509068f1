"""Typed view of the spec dict the orchestrator builds from a Hydra recipe, and its validation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tracer.errors import ConfigError
from workloads import bugs, faults

SUPPORTED_PRECISIONS = ("fp32",)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab: int
    hidden: int
    heads: int
    layers: int
    seq_len: int
    ffn_hidden: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class ParallelConfig:
    name: str
    world_size: int
    tp: int
    pp: int
    sp: bool

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    parallel: ParallelConfig
    precision: str
    bug: str
    steps: int
    seed: int
    global_batch: int
    micro_batch: int
    lr: float
    clip_grad: float
    timeout_s: float
    trace_enabled: bool
    store_url: str | None
    run: str
    perturb_seed: int | None
    fingerprint: str | None = None   # content key of what a reference depends on (set by the orchestrator)

    @property
    def micro_batches_local(self) -> int:
        return self.global_batch // (self.parallel.dp * self.micro_batch)

    @property
    def micro_batches_global(self) -> int:
        return self.global_batch // self.micro_batch


def _section(spec: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    sec = spec.get(key)
    if not isinstance(sec, Mapping):
        raise ConfigError(f"spec has no '{key}' section; the recipe must define {key}=<...>")
    return sec


def _get(sec: Mapping[str, Any], where: str, key: str, cast: type) -> Any:
    if key not in sec:
        raise ConfigError(f"{where}.{key} is missing; add it to the {where} recipe")
    try:
        return cast(sec[key])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}.{key}={sec[key]!r} is not a valid {cast.__name__}") from e


def parse(spec: Mapping[str, Any]) -> Config:
    """Parse (without cross-field checks; see `validate`)."""
    m, p = _section(spec, "model"), _section(spec, "parallel")
    data, optim = _section(spec, "data"), _section(spec, "optim")
    trace = spec.get("trace") or {}
    model = ModelConfig(
        name=str(m.get("name", "model")), vocab=_get(m, "model", "vocab", int),
        hidden=_get(m, "model", "hidden", int), heads=_get(m, "model", "heads", int),
        layers=_get(m, "model", "layers", int), seq_len=_get(m, "model", "seq_len", int),
        ffn_hidden=int(m.get("ffn_hidden", 4 * _get(m, "model", "hidden", int))))
    parallel = ParallelConfig(
        name=str(p.get("name", "parallel")), world_size=_get(p, "parallel", "world_size", int),
        tp=int(p.get("tp", 1)), pp=int(p.get("pp", 1)), sp=bool(p.get("sp", False)))
    perturb = trace.get("perturb_seed")
    return Config(
        model=model, parallel=parallel,
        precision=str((spec.get("precision") or {}).get("name", "fp32")),
        bug=bugs.bug_name(spec), steps=int(spec.get("steps", 1)), seed=int(spec.get("seed", 0)),
        global_batch=_get(data, "data", "global_batch", int),
        micro_batch=_get(data, "data", "micro_batch", int),
        lr=_get(optim, "optim", "lr", float), clip_grad=float(optim.get("clip_grad", 0.0) or 0.0),
        timeout_s=float(spec.get("timeout_s", 300)),
        trace_enabled=bool(trace.get("enabled", True)), store_url=trace.get("store_url"),
        run=str(trace.get("run", "run")), perturb_seed=None if perturb is None else int(perturb),
        fingerprint=trace.get("fingerprint"))


def validate(spec: Mapping[str, Any]) -> None:
    """Raise ConfigError naming what is wrong, where, and what to do; return None if the spec can run."""
    cfg = parse(spec)
    m, p = cfg.model, cfg.parallel
    where = f"parallel={p.name}, model={m.name}"

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{where}: {msg}")

    for field, value in (("world_size", p.world_size), ("tp", p.tp), ("pp", p.pp)):
        need(value >= 1, f"parallel.{field}={value} must be >= 1")
    for field, value in (("vocab", m.vocab), ("hidden", m.hidden), ("heads", m.heads), ("layers", m.layers),
                         ("seq_len", m.seq_len), ("ffn_hidden", m.ffn_hidden)):
        need(value >= 1, f"model.{field}={value} must be >= 1")
    need(p.world_size % (p.tp * p.pp) == 0,
         f"world_size={p.world_size} is not divisible by tp*pp={p.tp * p.pp}; "
         f"set world_size to a multiple of tp*pp (dp = world_size / (tp*pp))")
    need(m.hidden % m.heads == 0,
         f"hidden={m.hidden} is not divisible by heads={m.heads}; change model.heads")
    need(m.hidden % p.tp == 0,
         f"hidden={m.hidden} is not divisible by tp={p.tp}; pick tp dividing hidden")
    need(m.heads % p.tp == 0,
         f"heads={m.heads} is not divisible by tp={p.tp}; pick tp dividing the head count")
    need(m.vocab % p.tp == 0,
         f"vocab={m.vocab} is not divisible by tp={p.tp}; pad model.vocab to a multiple of tp")
    need(m.ffn_hidden % p.tp == 0,
         f"ffn_hidden={m.ffn_hidden} is not divisible by tp={p.tp}; pick tp dividing ffn_hidden")
    need(m.layers % p.pp == 0,
         f"layers={m.layers} is not divisible by pp={p.pp}; pick pp dividing model.layers")
    if p.sp:
        need(p.tp > 1, "sequence parallelism (sp=true) requires tp > 1; set parallel.tp >= 2 or sp=false")
        need(m.seq_len % p.tp == 0,
             f"seq_len={m.seq_len} is not divisible by tp={p.tp} under sequence parallelism; "
             f"pick seq_len as a multiple of tp")
    need(cfg.micro_batch >= 1 and cfg.global_batch % (p.dp * cfg.micro_batch) == 0,
         f"data.global_batch={cfg.global_batch} is not divisible by dp*micro_batch={p.dp}*{cfg.micro_batch}; "
         f"set global_batch to a multiple of {p.dp * max(cfg.micro_batch, 1)}")
    need(cfg.precision in SUPPORTED_PRECISIONS,
         f"precision={cfg.precision} is not supported by the built-in GPT workload "
         f"(supported: {', '.join(SUPPORTED_PRECISIONS)}); use precision=fp32")
    need(cfg.bug == bugs.NONE or cfg.bug in bugs.CATALOG,
         f"unknown bug '{cfg.bug}'; known bugs: {', '.join(sorted(bugs.CATALOG))} (or 'none')")
    need(cfg.steps >= 1, f"steps={cfg.steps} must be >= 1")
    fault = spec.get("fault") or {}
    need(fault.get("kind", "none") in faults.KINDS,
         f"unknown fault.kind '{fault.get('kind')}'; known: {', '.join(faults.KINDS)}")
