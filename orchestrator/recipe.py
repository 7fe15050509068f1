"""Recipe -> job specs. A check runs one reference, R perturbed references and one candidate."""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tracer.errors import ConfigError

SINGLE_DEVICE = {"name": "single", "world_size": 1, "tp": 1, "pp": 1, "sp": False}
# Recipe parts that must be identical for a reference to be valid for a candidate.
REFERENCE_KEYS = ("framework", "model", "precision", "data", "optim", "steps", "seed")


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    out.pop("hydra", None)
    return out


def resolve_url(url: str, base_dir: str) -> str:
    """A relative store path is taken from the directory ttrace was started in."""
    if "://" in url or os.path.isabs(url):
        return url
    return os.path.join(base_dir, url)


def fingerprint(recipe: dict[str, Any]) -> str:
    """Content key of everything a reference run depends on."""
    key = json.dumps({k: recipe.get(k) for k in REFERENCE_KEYS}, sort_keys=True)
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
    selection and the code version."""
    key = json.dumps({"fingerprint": fingerprint(recipe), "R": int(recipe["tolerance"]["perturbations"]),
                      "trace": recipe.get("trace"), "code": code_version()}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def job_spec(recipe: dict[str, Any], *, run: str, store_url: str, parallel: dict[str, Any] | None = None,
             bug: str | None = None, perturb_seed: int | None = None) -> dict[str, Any]:
    """The plain dict a rank receives (see workloads.train.run_rank)."""
    from orchestrator.storage import options as store_options

    return {
        "framework": recipe.get("framework") or {"name": "builtin"},
        "model": recipe["model"], "precision": recipe["precision"], "data": recipe["data"],
        "optim": recipe["optim"], "steps": recipe["steps"], "seed": recipe["seed"],
        "parallel": dict(parallel if parallel is not None else recipe["parallel"]),
        "bug": {"name": bug if bug is not None else recipe["bug"]["name"]},
        "trace": {"store_url": store_url, "run": run, "perturb_seed": perturb_seed, "enabled": True,
                  "fingerprint": fingerprint(recipe),
                  # endpoint and timeouts for S3 stores, never credentials
                  "storage": store_options(recipe.get("store") or {})},
        "timeout_s": recipe["timeout_s"],
        # Faults are injected into the candidate only: the reference must stay trustworthy.
        "fault": recipe.get("fault") if run == "candidate" else None,
    }


def validate(recipe: dict[str, Any]) -> None:
    """Raise ConfigError for any recipe the workload cannot run, before anything is scheduled."""
    from workloads.config import validate as validate_spec

    if int(recipe.get("steps", 0)) < 1:
        raise ConfigError(f"steps={recipe.get('steps')}: a check needs at least one training step")
    tol = recipe["tolerance"]
    if int(tol["perturbations"]) < 1:
        raise ConfigError("tolerance.perturbations must be >= 1: the tolerance is estimated from "
                          "perturbed reference runs")
    if recipe.get("localize", True) not in (True, False, "always"):
        raise ConfigError(f"localize={recipe.get('localize')!r}: use true (isolation pass on a failed "
                          "check), always (also on a pass) or false")
    spec = job_spec(recipe, run="validate", store_url="")
    validate_spec(spec)
    validate_spec(dict(spec, parallel=SINGLE_DEVICE, bug={"name": "none"}))


def compose(overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The recipe for `ttrace <overrides>` as a plain dict, without running Hydra's app (tests, tools)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    from orchestrator.cli import RECIPES

    try:
        with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
            return to_dict(hydra_compose("config", overrides=list(overrides)))
    except HydraException as e:
        raise ConfigError(f"recipe {list(overrides)} cannot be composed: {e}") from None
