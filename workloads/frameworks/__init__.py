"""Third-party frameworks under test. Each adapter module exposes

    validate(spec) -> None                                   raise ConfigError for a spec it cannot run
    run_rank(spec, rank, world_size, master_addr, master_port) -> {"rank", "losses", "seconds"}
    SUPPORTS_ISOLATION: bool                                 optional; True if run_rank honours
                                                             spec["trace"]["isolate"] (tracer/isolation.py)

with the same contract as `workloads.train.run_rank` (the built-in trainer). Modules are imported
lazily: a framework's library is an optional extra and only its own recipes need it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from tracer.errors import ConfigError

BUILTIN = "builtin"
ADAPTERS = {
    "megatron_core": "workloads.frameworks.megatron_core",
    "torch_native": "workloads.frameworks.torch_native",
    "hf": "workloads.frameworks.hf",
}


def name(spec: Mapping[str, Any]) -> str:
    return str((spec.get("framework") or {}).get("name", BUILTIN) or BUILTIN)


def adapter(spec: Mapping[str, Any]) -> ModuleType | None:
    """The adapter module for the spec's framework, or None for the built-in trainer."""
    fw = name(spec)
    if fw == BUILTIN:
        return None
    if fw not in ADAPTERS:
        raise ConfigError(f"framework={fw} is unknown; choose one of {[BUILTIN, *ADAPTERS]}")
    try:
        return importlib.import_module(ADAPTERS[fw])
    except ImportError as e:
        raise ConfigError(f"framework={fw} needs a library that is not installed ({e}); "
                          "run `make setup` (it installs the framework extras)") from None


def supports_isolation(spec: Mapping[str, Any]) -> bool:
    """Can this spec's trainer run the isolation pass (feed every module the reference's tensors)?"""
    fw = adapter(spec)
    return fw is None or bool(getattr(fw, "SUPPORTS_ISOLATION", False))


def refuse_isolation(spec: Mapping[str, Any]) -> None:
    """For adapters without SUPPORTS_ISOLATION: an isolated job must never run as a plain one (its
    trace would be taken for local errors). The orchestrator does not schedule one (`supports_isolation`)."""
    if (spec.get("trace") or {}).get("isolate"):
        raise ConfigError(f"framework={name(spec)}: the isolation pass (localize) is not wired for this "
                          "framework yet; the first divergence stands (localize=false skips it)")


def start_rank(spec: Mapping[str, Any], world_size: int,
               validate: Callable[[Mapping[str, Any]], None]) -> Any:
    """The opening every adapter's `run_rank` shares: validate the recipe, refuse an isolated job
    (for adapters without SUPPORTS_ISOLATION), check the job's world size, one compute thread per
    rank (ranks share the node's cores). Returns the parsed workloads.config.Config."""
    import torch

    from workloads.config import parse

    validate(spec)
    refuse_isolation(spec)
    cfg = parse(spec)
    p = cfg.parallel
    if p.world_size != world_size:
        raise ConfigError(f"parallel={p.name} declares world_size={p.world_size} "
                          f"but the job has {world_size} ranks")
    torch.set_num_threads(1)
    return cfg

