"""The recipe's schema: one dataclass per section, a docstring line on every field.

Hydra's struct mode refuses an unknown key only without `+`; `ttrace +framework._target_=x` would be
added silently and ignored, and the user would believe it took effect. `check` walks a composed
recipe against these dataclasses and names any key they do not declare (exit 2). Types are checked
where a wrong one could be silently misread (a string where a number is expected).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, get_args, get_origin, get_type_hints

from tracer.errors import ConfigError


@dataclass
class Model:
    """The built-in jobs' model (a user job defines its own and may ignore this section)."""
    name: str = "model"
    arch: str = "gpt"                # gpt | llama
    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    seq_len: int = 32
    ffn_hidden: int | None = None    # default 4 * hidden
    kv_heads: int = 0                # llama GQA: key/value heads (0 = heads)
    tie_embeddings: bool = False
    experts: int = 0                 # MoE experts per layer (0 = dense)
    top_k: int = 2
    aux_loss_coeff: float = 0.01
    attention: str = "explicit"      # llama: explicit (its own backward) | autograd


@dataclass
class Job:
    """What trains (the job contract, tracer/job.py). Neither entrypoint nor command: the built-in
    trainer (workloads.train:main)."""
    name: str | None = None          # label in reports and MLflow (default: the entrypoint or command)
    entrypoint: str | None = None    # pkg.module:function, called once per rank in a Ray worker
    command: str | None = None       # any program, launched once per rank with torchrun's environment
    workdir: str | None = None       # the ranks' working directory (default: where ttrace was started)
    env: dict[str, Any] = field(default_factory=dict)   # extra environment variables for every rank
    version: str | None = None       # your code's version (e.g. a git sha): keys the reference cache
    warm_start: bool = True          # `python SCRIPT` ranks forked from a warm interpreter (warm_python.py)


@dataclass
class Parallel:
    """Parallel sizes; dp = world_size / (tp * pp * cp), as in Megatron-LM."""
    name: str = "single"
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    zero1: bool = False
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    # Activation recomputation in the candidate: none | full (every transformer block's forward run
    # again in backward) | selective (the core attention's). The reference never recomputes: a check
    # shows recomputation changes nothing.
    recompute: str = "none"
    # The pipeline schedule of torch.distributed.pipelining by its name (job=torch_native; torchtitan's
    # pipeline_parallel_schedule): 1F1B, GPipe, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
    # ZBVZeroBubble, DualPipeV. Empty: 1F1B, or Interleaved1F1B under vpp.
    pp_schedule: str = ""


@dataclass
class Precision:
    name: str = "fp32"               # fp32 | bf16 | fp8
    scaling: str = "current"         # fp8: current | delayed
    amax_history: int = 16


@dataclass
class Bug:
    name: str = "none"               # a catalog switch of the built-in jobs (workloads/bugs.py)
    from_step: int = 100             # late bugs that read it: the step they first act at (`ttrace bugs NAME`)


@dataclass
class Store:
    url: str = "ttrace_runs"         # any fsspec URL; relative paths from where ttrace was started
    endpoint_url: str | None = None  # S3-compatible endpoint (null: AWS)
    region: str | None = None
    connect_timeout: float = 5
    read_timeout: float = 30
    max_attempts: int = 2


@dataclass
class Trace:
    mode: str = "full"               # full (every traced tensor) | stats (norm, max-abs, sum, hash per
                                     # tensor: docs/stats_mode.md); `ttrace scan` sets scan itself
    kinds: list[str] | None = None   # trace only these kinds (output, grad_output, param_grad, param,
                                     # loss); null: every kind


@dataclass
class Tracking:
    enabled: bool = True
    uri: str = "sqlite:///mlflow.db"
    artifact_root: str = "mlartifacts"
    experiment: str = "ttrace"


@dataclass
class Cluster:
    address: str | None = None       # null: start a local Ray; "auto" or host:port to join one
    num_cpus: int | None = None
    cpus_per_rank: float = 1
    compare_workers: int = 1         # the comparison's measurement in this many Ray tasks (1: in the driver)
    compare_cpus: int = 1            # CPUs of each of those tasks (its threads)


@dataclass
class Data:
    global_batch: int = 8
    micro_batch: int = 2
    path: str | None = None          # token ids, flat binary (nanoGPT, Megatron) or .npy; null: synthetic
    dtype: str = "uint16"            # the flat binary's ids: uint16 | uint32 (a .npy file carries its own)


@dataclass
class Init:
    """What every run starts from (tracer/job_inputs.py)."""
    checkpoint: str | None = None    # a directory: checkpoint.save's, Hugging Face safetensors, torch DCP


@dataclass
class Checkpoint:
    save: str | None = None          # directory the reference writes its final params + Adam state to


@dataclass
class Optim:
    lr: float = 1e-3
    clip_grad: float = 1.0
    lr_decay_from: int | None = None # step from which the LR decays linearly (null: constant LR)
    lr_decay_steps: int = 100        # steps of that decay, down to 0.1 x lr (workloads/lr_schedule.py)


@dataclass
class Reference:
    """How the reference and perturbed runs differ from the candidate. They always run the candidate's
    code (its bug switches included); a bug its layout shares is caught by a reference that differs
    in the dimension the bug lives in (workloads/bugs.py, Bug.reference; docs/reference_layouts.md)."""
    # their layout: null (one device), a parallel recipe name (tp2) or a section of sizes
    parallel: str | dict[str, Any] | None = None
    micro_batch: int | None = None   # the reference's data.micro_batch (the global batch: no accumulation)
    attention: str | None = None     # the reference's model.attention (autograd: no hand-written backward)


@dataclass
class Tolerance:
    perturbations: int = 3           # R perturbed reference runs
    perturbation: str = "auto"       # what they move: auto | weights | gemm (workloads/precision.py)
    perturbation_steps: str = "first"  # weights moved before the first step only | every: after every
                                     # optimizer step too (`ttrace scan`: a layout adds noise each step)
    k: float = 4.0
    floor_ulps: float = 16.0
    k_elem: float = 6.0
    floor_elem: float = 4.0
    k_scale: float = 1.5             # scale error (projection on r): tol = k_scale x norm-wise noise
    k_rowcol: float = 4.0            # elementwise under the row-column noise model (0: off)
    k_own: float = 1.5               # one element, GEMM rounding draws: own_err past k_own x its noise
    k_joint: float = 2.0             #   and rowcol_err past k_joint x its noise (k_own 0: off)
    k_band: float = 8.0              # scale band, GEMM rounding draws: k_band x the runs' projections'
    band_floor: float = 0.25         #   spread, at least band_floor x the norm-wise noise (0: off)
    k_stats: float = 24.0            # trace.mode=stats: every statistic's k; a scan's within its look-ahead
    local: str = "auto"              # auto (bf16/fp8 built-in) | on | off: the local verdict (isolation pass)
    k_local: float = 6.0             # its tolerance on an element, in the module's own noise
    depth_c: float = 1.03
    replicas: str = "exact"          # exact (bitwise) | tolerance (recipes with nondeterministic kernels)
    routing: str = "auto"            # auto | replay | own: MoE expert choice (orchestrator/routing.py)
    grad_signs: str = "auto"         # auto | replay | own: grad signs (orchestrator/grad_signs.py)


@dataclass
class Fault:
    kind: str = "none"               # none|raise|exit|hang|nan_grad|scale_grad_element (built-in jobs)
    rank: int = 0
    step: int = 0
    param: str = "layers.1.mlp.fc1.weight"   # scale_grad_element: the parameter whose grad it changes
    scale: float = 0.1               # scale_grad_element: its median element x (1 + scale)


@dataclass
class Scan:
    """`ttrace scan` only (orchestrator/scan.py)."""
    full_steps: int = 2              # its first steps also checked in full, as a check (0: fingerprints only)


@dataclass
class Recipe:
    model: Model = field(default_factory=Model)
    job: Job = field(default_factory=Job)
    parallel: Parallel = field(default_factory=Parallel)
    precision: Precision = field(default_factory=Precision)
    bug: Bug = field(default_factory=Bug)
    store: Store = field(default_factory=Store)
    trace: Trace = field(default_factory=Trace)
    tracking: Tracking = field(default_factory=Tracking)
    cluster: Cluster = field(default_factory=Cluster)
    data: Data = field(default_factory=Data)
    optim: Optim = field(default_factory=Optim)
    tolerance: Tolerance = field(default_factory=Tolerance)
    reference: Reference = field(default_factory=Reference)
    fault: Fault = field(default_factory=Fault)
    init: Init = field(default_factory=Init)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    scan: Scan = field(default_factory=Scan)
    steps: int = 2
    seed: int = 1234
    timeout_s: float = 300
    localize: Any = True             # true | false | always
    cache: bool = True


def check(recipe: dict[str, Any]) -> None:
    """Raise ConfigError naming the first key the schema does not declare, or a value of the wrong
    type (a string where a number is expected)."""
    _check(recipe, Recipe, "")


def check_section(d: Any, cls: type, prefix: str) -> None:
    """`check` for one section given apart from the recipe (a layout: `reference.parallel`)."""
    _check(d, cls, prefix)


RENAMED = {"tolerance.k_stats_draws": "tolerance.k_stats (2026-12-06: every precision, not GEMM draws only)"}


def _check(d: Any, cls: type, prefix: str) -> None:
    if not isinstance(d, dict):
        raise ConfigError(f"recipe key '{prefix.rstrip('.')}' must be a section (key: value pairs), "
                          f"got {d!r}")
    hints = get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    for key, value in d.items():
        where = f"{prefix}{key}"
        if key not in known and where in RENAMED:
            raise ConfigError(f"recipe key '{where}' is now {RENAMED[where]}")
        if key not in known:
            close = [k for k in known if k.startswith(str(key)[:2])]
            hint = f" (did you mean {', '.join(prefix + k for k in close)}?)" if close else ""
            top = "" if prefix else f"; {key}= options live in recipes/<group>/ (groups: {_groups()})"
            raise ConfigError(f"unknown recipe key '{where}'{hint}: ttrace would ignore it{top}. "
                              f"Known keys{' of ' + prefix.rstrip('.') if prefix else ''}: "
                              f"{', '.join(sorted(known))}")
        hint = hints[key]
        if is_dataclass(hint):
            _check(value, hint, where + ".")
        else:
            _check_value(where, value, hint)


def _check_value(where: str, value: Any, hint: Any) -> None:
    """A value of one of the hint's types (null always passes: Hydra's null, the field's default)."""
    allowed = tuple(a for a in (get_args(hint) or (hint,)) if a is not type(None))
    if value is None or Any in allowed or any(get_origin(a) is dict or a is dict for a in allowed):
        return
    if isinstance(value, list) and any(get_origin(a) is list for a in allowed):
        return
    ok = (isinstance(value, bool) and bool in allowed
          or isinstance(value, str) and str in allowed
          or not isinstance(value, bool) and (isinstance(value, int) and (int in allowed or float in allowed)
                                              or isinstance(value, float) and float in allowed))
    if not ok:
        names = " or ".join(sorted({"true/false" if a is bool else a.__name__ for a in allowed}))
        raise ConfigError(f"recipe key '{where}'={value!r} must be {names}")


def _groups() -> str:
    return ", ".join(f.name for f in fields(Recipe) if f.default_factory is not MISSING)
