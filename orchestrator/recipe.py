"""Recipe -> job specs. A check runs one reference, R perturbed references and one candidate, all of
them one job (`job.entrypoint` or `job.command`, orchestrator/jobs.py) in different roles."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import sys
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from orchestrator import grad_signs, layouts, routing
from orchestrator.jobs import BUILTIN_ENTRYPOINT
from orchestrator.layouts import (  # noqa: F401  (recipe.RECIPES, ...)
    RECIPES,
    SINGLE_DEVICE,
    microbatches_differ,
)
from tracer.errors import ConfigError
from workloads import faults

# Recipe parts that must be identical for a reference to be valid for a candidate.
REFERENCE_KEYS = ("job", "model", "precision", "data", "optim", "steps", "seed", "bug", "reference", "init")
KINDS = ("output", "grad_output", "param_grad", "param", "loss")   # what a tracer records (trace.kinds)


def job_of(recipe: dict[str, Any], base_dir: str | None = None) -> dict[str, Any]:
    """The recipe's job section, complete: the built-in trainer when it sets neither an entrypoint nor
    a command, `label` for reports, `own` for the jobs shipped with ttrace, and `workdir` resolved
    from the directory ttrace was started in."""
    from orchestrator.schema import Job

    job = {**asdict(Job()), **(recipe.get("job") or {})}
    if job["entrypoint"] and job["command"]:
        raise ConfigError(f"job.entrypoint={job['entrypoint']} and job.command={job['command']!r} are both "
                          "set (a job=<option> sets an entrypoint); set one of them")
    if not job["entrypoint"] and not job["command"]:
        job["entrypoint"], job["name"] = BUILTIN_ENTRYPOINT, job["name"] or "builtin"
    job["label"] = str(job["name"] or job["command"] or job["entrypoint"])
    job["own"] = routing.own(recipe)
    if base_dir is not None:
        job["workdir"] = resolve_url(str(job["workdir"] or "."), base_dir) if not job["own"] else None
    job["env"] = {str(k): str(v) for k, v in (job["env"] or {}).items()}
    return job


def to_dict(cfg: DictConfig, search_dirs: list[str] | None = None) -> dict[str, Any]:
    """The composed recipe as a plain dict. A `reference.parallel` name is resolved here, like a
    `parallel=<name>` option, from `search_dirs` (default: the running Hydra app's config folders);
    a name found nowhere stays a name, and `validate` refuses it."""
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    out.pop("hydra", None)
    ref = out.get("reference")
    if isinstance(ref, dict) and isinstance(ref.get("parallel"), str):
        found = layouts.find(ref["parallel"], layouts.hydra_dirs() if search_dirs is None else search_dirs)
        ref["parallel"] = found or ref["parallel"]
    return out


def resolve_url(url: str, base_dir: str) -> str:
    """A relative store path is taken from the directory ttrace was started in."""
    if "://" in url or os.path.isabs(url):
        return url
    return os.path.join(base_dir, url)


def fingerprint(recipe: dict[str, Any]) -> str:
    """Content key of everything a reference run depends on; its input files by content
    (orchestrator/inputs.py), not by path."""
    from orchestrator import inputs

    parts = {k: recipe.get(k) for k in REFERENCE_KEYS}
    if (recipe.get("reference") or {}).get("parallel") is not None:   # its sizes, not its name
        layout = {k: v for k, v in layouts.reference_layout(recipe).items() if k != "name"}
        parts["reference"] = {**recipe["reference"], "parallel": layout if layouts.sizes(layout) else None}
    parts["data"] = {k: v for k, v in (recipe.get("data") or {}).items() if k != "path"}
    parts["init"] = {k: v for k, v in (recipe.get("init") or {}).items() if k != "checkpoint"}
    parts["inputs"] = inputs.identity(recipe)
    parts["job"] = {k: v for k, v in job_of(recipe).items()
                    if k in ("entrypoint", "command", "env", "version")}
    key = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def code_version() -> str:
    """Hash of the sources that produce a trace (tracer/ and workloads/): a code change invalidates
    every cached reference. TTRACE_CODE_VERSION (e.g. a release tag or git sha) overrides it."""
    return os.environ.get("TTRACE_CODE_VERSION") or _source_hash()


@lru_cache(maxsize=1)
def _source_hash() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for pkg in ("tracer", "workloads"):
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def reference_key(recipe: dict[str, Any]) -> str:
    """Content key of a check's reference and perturbed references (the reference cache's key):
    the recipe parts a reference depends on, the number R of perturbed references, the traced
    selection and the code version (ttrace's own jobs: the hash of tracer/ and workloads/; a user
    job: `job.version`, see `cacheable`)."""
    job = job_of(recipe)
    code = code_version() if job["own"] else f"{code_version()}/{job['version']}"
    tol = recipe["tolerance"]
    key = json.dumps({"fingerprint": fingerprint(recipe), "R": int(tol["perturbations"]),
                      "perturbation": tol.get("perturbation", "auto"), "trace": recipe.get("trace"),
                      "perturbation_steps": tol.get("perturbation_steps", "first"),
                      "routing_replay": routing.replay(recipe), "code": code,
                      "grad_sign_replay": grad_signs.replay(recipe),
                      # checks of a sweep saving to different directories are different computations
                      "save": (recipe.get("checkpoint") or {}).get("save")}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def cacheable(recipe: dict[str, Any]) -> str | None:
    """Why a stored reference may NOT be reused across ttrace runs (None: it may). ttrace cannot hash a
    user's code (a script imports whatever it likes), so a user job's reference is stored for reuse
    only under the code version it declares (`job.version`, e.g. a git sha); checks of one sweep
    still share one computation."""
    job = job_of(recipe)
    if not recipe.get("cache", True):
        return "cache=false"
    if (recipe.get("checkpoint") or {}).get("save"):
        return "checkpoint.save: the reference runs to write its final state"
    if not job["own"] and not job["version"]:
        return "a user job without job.version (set it, e.g. to a git sha, to reuse references across runs)"
    return None


def job_spec(recipe: dict[str, Any], *, role: str, store_url: str, run: str | None = None,
             parallel: dict[str, Any] | None = None, bug: str | None = None, perturb: int | None = None,
             reference: str | None = None, base_dir: str | None = None,
             log: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plain dict a rank receives (as TTRACE_SPEC, tracer/job.py)."""
    from orchestrator.inputs import resolved
    from orchestrator.storage import options as store_options
    from tracer.job_config import run_name

    recipe = resolved(recipe, base_dir or os.getcwd())

    model, data = dict(recipe["model"]), dict(recipe["data"])
    if role in ("reference", "perturbed"):   # the candidate's code; only these differ (recipe reference.*)
        ref = recipe.get("reference") or {}
        if ref.get("micro_batch") is not None:
            data["micro_batch"] = int(ref["micro_batch"])
        if ref.get("attention") is not None:
            model["attention"] = str(ref["attention"])
    return {
        "job": job_of(recipe, base_dir),
        "model": model, "precision": recipe["precision"], "data": data,
        "optim": recipe["optim"], "steps": recipe["steps"], "seed": recipe["seed"],
        "init": dict(recipe.get("init") or {}),
        # Only the reference writes its final state (tracer/job_inputs.py save_checkpoint).
        "checkpoint": dict(recipe.get("checkpoint") or {}) if role == "reference" else {},
        "parallel": dict(parallel if parallel is not None else recipe["parallel"]),
        "bug": {**recipe["bug"], "name": bug if bug is not None else recipe["bug"]["name"]},
        "trace": {"store_url": store_url, "run": run or run_name(role, perturb), "role": role,
                  "perturb": perturb, "reference": reference, "enabled": True,
                  "mode": (recipe.get("trace") or {}).get("mode") or "full",
                  "kinds": (recipe.get("trace") or {}).get("kinds"),   # None: every kind
                  "perturbation": recipe["tolerance"].get("perturbation", "auto"),
                  "perturbation_steps": recipe["tolerance"].get("perturbation_steps", "first"),
                  # the reference run's URL is set when jobs are ordered (orchestrator/routing.py)
                  "routing_replay": role in ("perturbed", "candidate") and routing.replay(recipe),
                  "grad_sign_replay": role in ("perturbed", "candidate") and grad_signs.replay(recipe),
                  "fingerprint": fingerprint(recipe),
                  # endpoint and timeouts for S3 stores, never credentials
                  "storage": store_options(recipe.get("store") or {})},
        "timeout_s": recipe["timeout_s"],
        "fault": faults.for_role(recipe.get("fault"), role),   # the candidate's only (workloads/faults.py)
        "log": log or {},
    }


def validate(recipe: dict[str, Any], base_dir: str | None = None) -> None:
    """Raise ConfigError for any recipe that cannot run, before anything is scheduled: an unknown key,
    a job that cannot be found, a spec its job refuses (ttrace's own jobs validate theirs)."""
    from orchestrator import schema

    schema.check(recipe)
    if int(recipe.get("steps", 0)) < 1:
        raise ConfigError(f"steps={recipe.get('steps')}: a check needs at least one training step")
    tol = recipe["tolerance"]
    if int(tol["perturbations"]) < 2:
        raise ConfigError(f"tolerance.perturbations={tol['perturbations']}: at least 2 perturbed reference "
                          "runs are needed; the elementwise tolerance scores each run against the others' "
                          "noise (leave-one-out), which one run cannot do, and clean checks then fail")
    from tracer.local_verdict import check_local  # here: composing a recipe needs no torch
    from tracer.tolerance import TolerancePolicy

    TolerancePolicy.from_config(tol)
    check_local(recipe, microbatches_differ(recipe), routing.builtin(recipe))
    from tracer.stats import MODES

    mode = (recipe.get("trace") or {}).get("mode") or "full"
    if mode not in MODES:
        raise ConfigError(f"trace.mode={mode!r}: use full (every traced tensor) or stats (norm, max-abs, sum "
                          "and hash per tensor; docs/stats_mode.md)")
    kinds = (recipe.get("trace") or {}).get("kinds")
    if kinds is not None and (not kinds or set(kinds) - set(KINDS)):
        raise ConfigError(f"trace.kinds={kinds}: a non-empty list of {', '.join(KINDS)} (null: every kind)")
    if recipe.get("localize", True) not in (True, False, "always"):
        raise ConfigError(f"localize={recipe.get('localize')!r}: use true (isolation pass on a failed "
                          "check), always (also on a pass) or false")
    job = job_of(recipe, base_dir or os.getcwd())
    layout = layouts.reference_layout(recipe)   # an unknown name or key: exit 2 before anything runs
    from orchestrator import inputs

    inputs.validate(inputs.resolved(recipe, base_dir or os.getcwd()), job["own"])
    if tol.get("perturbation", "auto") not in ("auto", "weights", "gemm"):
        raise ConfigError(f"tolerance.perturbation={tol['perturbation']}: use auto, weights or gemm")
    if tol.get("perturbation_steps", "first") not in ("first", "every"):
        raise ConfigError(f"tolerance.perturbation_steps={tol['perturbation_steps']}: use first (the initial "
                          "weights) or every (after every optimizer step too)")
    routing.validate(recipe)
    grad_signs.validate(recipe)
    if tol.get("perturbation") == "gemm" and job["entrypoint"] != BUILTIN_ENTRYPOINT:
        raise ConfigError(f"tolerance.perturbation=gemm draws the rounding of GEMM results inside ttrace's "
                          f"built-in trainer only; job {job['label']!r} is perturbed by its weights "
                          "(tolerance.perturbation=weights or auto)")
    if not job["own"]:
        _validate_user_job(recipe, job)
        return
    from orchestrator.jobs import resolve_entrypoint

    check_spec = getattr(importlib.import_module(job["entrypoint"].partition(":")[0]), "validate", None)
    resolve_entrypoint(job["entrypoint"])
    if check_spec is not None:
        check_spec(job_spec(recipe, role="candidate", store_url=""))
        try:
            check_spec(job_spec(recipe, role="reference", store_url="", parallel=layout))
        except ConfigError as e:
            if (recipe.get("reference") or {}).get("parallel") is None:
                raise
            raise ConfigError(f"reference.parallel={layout['name']} (the reference's layout): {e}") from None


def _validate_user_job(recipe: dict[str, Any], job: dict[str, Any]) -> None:
    """A user job: it must exist where it will run, and the built-in jobs' switches must be off (a user
    job never reads them: set, they would be silently unused)."""
    from orchestrator.jobs import command_argv, resolve_entrypoint

    workdir = job["workdir"]
    if not os.path.isdir(workdir):
        raise ConfigError(f"job.workdir={workdir} is not a directory")
    if recipe["bug"]["name"] != "none":
        raise ConfigError(f"bug={recipe['bug']['name']} is a switch of ttrace's built-in jobs, unused by "
                          f"job {job['label']!r}; a bug of your own code is your job's flag "
                          "(job.command='python train.py --bug ...')")
    if (recipe.get("fault") or {}).get("kind", "none") != "none":
        raise ConfigError("fault.kind is injected by ttrace's built-in jobs only; it would be unused by "
                          f"job {job['label']!r}")
    if job["command"]:
        argv = command_argv(job["command"], {**os.environ, **job["env"]})
        exe = argv[0]
        found = shutil.which(exe) or (os.sep in exe and os.path.exists(os.path.join(workdir, exe)))
        if exe in ("python", "python3") or exe == sys.executable:
            found = True
        if not found:
            raise ConfigError(f"job.command: '{exe}' is neither on PATH nor a file in {workdir}")
        if exe in ("python", "python3") or exe == sys.executable:
            script = next((a for a in argv[1:] if not a.startswith("-")), None)
            if script and script.endswith(".py") and not os.path.exists(os.path.join(workdir, script)):
                raise ConfigError(f"job.command: script {script} not found in {workdir} (job.workdir, "
                                  "default: the directory ttrace was started in)")
    else:
        resolve_entrypoint(job["entrypoint"], workdir)


def compose(overrides: list[str] | tuple[str, ...] = (), config_dirs: list[str] | tuple[str, ...] = ()
            ) -> dict[str, Any]:
    """The recipe for `ttrace <overrides>` as a plain dict, without running Hydra's app (tests, tools).
    `config_dirs` are further recipe folders searched after ttrace's own (like `--config-dir`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    overrides = list(overrides)
    if config_dirs:
        dirs = ",".join(f"file://{os.path.abspath(d)}" for d in config_dirs)
        overrides.append(f"hydra.searchpath=[{dirs}]")
    try:
        with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
            return to_dict(hydra_compose("config", overrides=overrides), [RECIPES, *config_dirs])
    except HydraException as e:
        raise ConfigError(f"recipe {list(overrides)} cannot be composed: {e}") from None
