"""Typed view of the spec dict the orchestrator builds from a Hydra recipe, and its validation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tracer.errors import ConfigError
from workloads import bugs, faults

SUPPORTED_PRECISIONS = ("fp32", "bf16", "fp8")   # see workloads/precision.py
# parallel.recompute, activation recomputation in backward: of every transformer block (full), or of
# the core attention only (selective: Megatron's default `--recompute-activations`)
RECOMPUTE = ("none", "full", "selective")


def recompute_refused(mode: str, *, selective: bool) -> str | None:
    """Why a job refuses parallel.recompute=`mode` (None: it takes it). `selective`: the job can rerun
    the core attention alone (torchtitan's and transformers' recomputation is per block; torchtitan's
    selective AC is per op)."""
    if mode not in RECOMPUTE:
        return f"parallel.recompute={mode} must be one of {', '.join(RECOMPUTE)}"
    if mode == "selective" and not selective:
        return ("parallel.recompute=selective (the core attention alone, Megatron's way) is offered by "
                "job=builtin and job=megatron_core; this job recomputes whole blocks: use full")
    return None


def pp_schedule_refused(schedule: str) -> str | None:
    """Why a job other than job=torch_native refuses parallel.pp_schedule=`schedule` (None: unset)."""
    if not schedule:
        return None
    return (f"parallel.pp_schedule={schedule} picks a schedule of torch.distributed.pipelining, which "
            "job=torch_native runs; this job runs its own pipeline schedule: unset it")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab: int
    hidden: int
    heads: int
    layers: int
    seq_len: int
    ffn_hidden: int
    arch: str = "gpt"               # gpt (LayerNorm, GELU, learned positions) | llama (workloads/llama.py)
    kv_heads: int = 0               # llama GQA: key/value heads (0 = heads); may be fewer than tp
    tie_embeddings: bool = False    # LM head reuses the word embedding (summed across first/last PP stage)
    experts: int = 0                # MoE (workloads/moe.py): experts per MoE layer (0 = dense MLP)
    top_k: int = 2
    aux_loss_coeff: float = 0.01    # load-balancing auxiliary loss
    attention: str = "explicit"     # llama core attention: explicit (its own backward) | autograd

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads


@dataclass(frozen=True)
class ParallelConfig:
    name: str
    world_size: int
    tp: int
    pp: int
    sp: bool
    zero1: bool = False   # distributed optimizer: grads reduce-scattered over DP, Adam state sharded
    vpp: int = 1          # virtual pipeline: model chunks per PP rank (interleaved 1F1B)
    cp: int = 1           # context parallelism: ring attention over zigzag sequence chunks
    ep: int = 1           # expert parallelism (carved out of DP): experts sharded over ep DP ranks
    recompute: str = "none"   # activation recomputation: none | full | selective (RECOMPUTE)
    pp_schedule: str = ""     # torch.distributed.pipelining's schedule by name (job=torch_native)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)


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
    bug_from_step: int = bugs.DEFAULT_FROM_STEP   # the step a late bug reading bug.from_step first acts at
    lr_decay_from: int | None = None   # LR schedule (workloads/lr_schedule.py): None = constant LR
    lr_decay_steps: int = 100

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
    model = ModelConfig(
        name=str(m.get("name", "model")), vocab=_get(m, "model", "vocab", int),
        hidden=_get(m, "model", "hidden", int), heads=_get(m, "model", "heads", int),
        layers=_get(m, "model", "layers", int), seq_len=_get(m, "model", "seq_len", int),
        ffn_hidden=int(m.get("ffn_hidden", 4 * _get(m, "model", "hidden", int))),
        arch=str(m.get("arch", "gpt")), kv_heads=int(m.get("kv_heads", 0) or 0),
        tie_embeddings=bool(m.get("tie_embeddings", False)), experts=int(m.get("experts", 0) or 0),
        top_k=int(m.get("top_k", 2)), aux_loss_coeff=float(m.get("aux_loss_coeff", 0.01)),
        attention=str(m.get("attention", "explicit")))
    parallel = ParallelConfig(
        name=str(p.get("name", "parallel")), world_size=_get(p, "parallel", "world_size", int),
        tp=int(p.get("tp", 1)), pp=int(p.get("pp", 1)), sp=bool(p.get("sp", False)),
        zero1=bool(p.get("zero1", False)), vpp=int(p.get("vpp", 1) or 1),
        cp=int(p.get("cp", 1) or 1), ep=int(p.get("ep", 1) or 1),
        recompute=str(p.get("recompute") or "none"), pp_schedule=str(p.get("pp_schedule") or ""))
    return Config(
        model=model, parallel=parallel,
        precision=str((spec.get("precision") or {}).get("name", "fp32")),
        bug=bugs.bug_name(spec), steps=int(spec.get("steps", 1)), seed=int(spec.get("seed", 0)),
        global_batch=_get(data, "data", "global_batch", int),
        micro_batch=_get(data, "data", "micro_batch", int),
        lr=_get(optim, "optim", "lr", float), clip_grad=float(optim.get("clip_grad", 0.0) or 0.0),
        timeout_s=float(spec.get("timeout_s", 300)), bug_from_step=bugs.from_step(spec),
        lr_decay_from=None if optim.get("lr_decay_from") is None else _get(optim, "optim", "lr_decay_from",
                                                                            int),
        lr_decay_steps=int(optim.get("lr_decay_steps", 100)))


def validate(spec: Mapping[str, Any]) -> None:
    """The built-in trainer's check of its spec: raise ConfigError naming what is wrong, where, and what
    to do; return None if the spec can run."""
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
    builtin = sorted(n for n, b in bugs.CATALOG.items() if b.job == "builtin")
    need(cfg.bug == bugs.NONE or cfg.bug in builtin,
         f"unknown bug '{cfg.bug}' for the built-in trainer; known bugs: {', '.join(builtin)} (or 'none'); "
         "a bug of another job needs its job= option (ttrace bugs NAME)")
    need(cfg.steps >= 1, f"steps={cfg.steps} must be >= 1")
    need((why := recompute_refused(p.recompute, selective=True)) is None, str(why))
    need((why := pp_schedule_refused(p.pp_schedule)) is None, str(why))
    need(cfg.bug_from_step >= 1, f"bug.from_step={cfg.bug_from_step} must be >= 1 (the stale state is the "
                                 "previous step's)")
    need(cfg.bug_from_step == bugs.DEFAULT_FROM_STEP or cfg.bug == bugs.NONE or bugs.reads_from_step(cfg.bug),
         f"bug.from_step={cfg.bug_from_step} is read by late bugs only ("
         f"{', '.join(n for n in bugs.CATALOG if bugs.reads_from_step(n))}); bug={cfg.bug} would ignore it")
    need(cfg.lr_decay_from is None or cfg.lr_decay_from >= 0,
         f"optim.lr_decay_from={cfg.lr_decay_from} must be a step >= 0 (or null: constant LR)")
    need(cfg.lr_decay_steps >= 1, f"optim.lr_decay_steps={cfg.lr_decay_steps} must be >= 1")
    _validate_variants(cfg, need)
    fault = spec.get("fault") or {}
    need(fault.get("kind", "none") in faults.KINDS,
         f"unknown fault.kind '{fault.get('kind')}'; known: {', '.join(faults.KINDS)}")
    need(fault.get("kind") != "scale_grad_element" or -1 < float(fault.get("scale", 0.1)) < math.inf,
         f"fault.scale={fault.get('scale')}: the element becomes x (1 + scale), a finite scale > -1")


MODEL_ARCHS = ("gpt", "llama")


def _validate_variants(cfg: Config, need: Any) -> None:
    """Model variants (llama GQA, tied embeddings) and the distributed optimizer."""
    m, p = cfg.model, cfg.parallel
    need(m.arch in MODEL_ARCHS, f"model.arch={m.arch} is unknown (known: {', '.join(MODEL_ARCHS)})")
    need(m.attention in ("explicit", "autograd"),
         f"model.attention={m.attention}: use explicit (the llama attention's own backward) or autograd")
    need(m.attention == "explicit" or p.cp == 1,
         "model.attention=autograd is the single-sequence path; context parallelism runs ring attention")
    kv = m.num_kv_heads
    need(m.kv_heads == 0 or m.arch == "llama",
         f"model.kv_heads={m.kv_heads} (grouped-query attention) needs model.arch=llama")
    need(kv >= 1 and m.heads % kv == 0,
         f"heads={m.heads} is not divisible by kv_heads={kv}; pick kv_heads dividing the head count")
    need(kv % p.tp == 0 or p.tp % kv == 0,
         f"kv_heads={kv} and tp={p.tp}: one must divide the other (KV heads are sharded over TP, or "
         f"replicated across the tp/kv_heads ranks that share one)")
    need(not m.tie_embeddings or m.arch == "llama",
         "model.tie_embeddings=true is implemented for model.arch=llama (model=llama_tiny)")
    need(p.vpp >= 1, f"parallel.vpp={p.vpp} must be >= 1")
    need(p.cp >= 1, f"parallel.cp={p.cp} must be >= 1")
    if p.cp > 1:
        need(p.world_size % (p.tp * p.pp * p.cp) == 0,
             f"world_size={p.world_size} is not divisible by tp*pp*cp={p.tp * p.pp * p.cp}")
        need(m.seq_len % (2 * p.cp) == 0,
             f"seq_len={m.seq_len} is not divisible by 2*cp={2 * p.cp} (zigzag: two chunks per CP rank)")
        need(not p.sp, "sequence parallelism together with context parallelism is not supported yet; "
                       "use sp=false with cp > 1")
        need(p.vpp == 1, "virtual pipelining together with context parallelism is not supported yet")
    if p.vpp > 1:
        need(p.pp > 1, f"vpp={p.vpp} (interleaved pipeline) needs pp > 1")
        need(m.layers % (p.pp * p.vpp) == 0,
             f"layers={m.layers} is not divisible by pp*vpp={p.pp * p.vpp}; each chunk needs whole layers")
        need(cfg.micro_batches_local % p.pp == 0,
             f"interleaved 1F1B needs the local microbatch count ({cfg.micro_batches_local}) to be a "
             f"multiple of pp={p.pp}; adjust data.global_batch / data.micro_batch")
    need(p.ep == 1 or m.experts > 0,
         f"parallel.ep={p.ep} (expert parallelism) needs a mixture-of-experts model (model=moe_tiny); "
         f"model={m.name} is dense")
    if m.experts > 0:
        need(m.arch == "llama", "model.experts > 0 (MoE) is implemented for model.arch=llama")
        need(1 <= m.top_k <= m.experts, f"model.top_k={m.top_k} must be in 1..experts={m.experts}")
        need(p.dp % p.ep == 0, f"ep={p.ep} must divide dp={p.dp} (EP is carved out of data parallelism)")
        need(m.experts % p.ep == 0, f"experts={m.experts} is not divisible by ep={p.ep}")
        need(p.pp == 1 and p.cp == 1 and not p.zero1,
             "MoE is implemented without pp, cp and zero1 so far; use tp/sp/dp/ep recipes (ep2, ep2_tp2)")
    if p.zero1:
        need(p.dp > 1 or p.world_size == 1,
             f"zero1=true shards the optimizer over DP but dp={p.dp}; use a recipe with dp >= 2")
