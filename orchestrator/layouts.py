"""Parallel layouts by name, and the reference's layout (`reference.parallel`, docs/reference_layouts.md).

The reference and its perturbed runs run on one device unless `reference.parallel` names a trusted
layout: a `parallel=<name>` option (recipes/parallel/<name>.yaml in ttrace's recipes or the user's
config dirs) or a section of parallel sizes. The name is resolved when the recipe is composed
(`recipe.to_dict`), so the reference cache key covers the layout's sizes, not only its name.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from tracer.errors import ConfigError

RECIPES = str(Path(__file__).resolve().parents[1] / "recipes")
SINGLE_DEVICE = {"name": "single", "world_size": 1, "tp": 1, "pp": 1, "sp": False}
WHERE = "reference.parallel"


def options(dirs: Iterable[str] = (RECIPES,)) -> list[str]:
    """The parallel recipe names found in `dirs` (each holding a parallel/ folder)."""
    return sorted({p.stem for d in dirs for p in Path(d, "parallel").glob("*.yaml")})


def hydra_dirs() -> list[str]:
    """The running Hydra app's config folders (ttrace's recipes, --config-dir, hydra.searchpath);
    ttrace's own recipes alone outside an app."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return [RECIPES]
    sources = HydraConfig.get().runtime.config_sources
    return [str(s.path) for s in sources if s.schema == "file" and os.path.isdir(str(s.path))] or [RECIPES]


def find(name: str, dirs: Iterable[str]) -> dict[str, Any] | None:
    """The layout `parallel=<name>` would select (the first folder that has it), or None."""
    for d in dirs:
        path = Path(d, "parallel", f"{name}.yaml")
        if path.is_file():
            section = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
            if not isinstance(section, dict):
                raise ConfigError(f"{path}: a parallel recipe is a section of sizes (world_size, tp...)")
            section.pop("defaults", None)
            return normalize(section, str(path))
    return None


def normalize(section: Mapping[str, Any], where: str = WHERE) -> dict[str, Any]:
    """Every size of a layout section (schema.Parallel's defaults filled in); unknown keys refused."""
    from orchestrator import schema

    schema.check_section(dict(section), schema.Parallel, f"{where}.")
    layout = {**asdict(schema.Parallel()), **section}
    if not section.get("name"):
        layout["name"] = "_".join(k if v is True else f"{k}{v}" for k, v in sizes(layout).items()) or "single"
    return layout


def resolve(value: Any, dirs: Iterable[str] = (RECIPES,)) -> dict[str, Any]:
    """A `reference.parallel` value as a layout: null is one device, a name is looked up like a
    `parallel=<name>` option, a section is taken as the sizes."""
    dirs = list(dirs)
    if value is None:
        return normalize(SINGLE_DEVICE)
    if isinstance(value, Mapping):
        return normalize(value)
    if isinstance(value, str):
        found = find(value, dirs)
        if found is None:
            raise ConfigError(f"{WHERE}={value}: no parallel recipe of that name (looked for "
                              f"parallel/{value}.yaml in {', '.join(dirs)}); options: "
                              f"{', '.join(options(dirs))}, or null (one device)")
        return found
    raise ConfigError(f"{WHERE}={value!r}: name a parallel recipe (e.g. tp2) or give a section of sizes")


def reference_layout(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The layout the reference and the perturbed runs of a composed recipe run at (a name left
    unresolved by `recipe.to_dict` is looked up again, to name the options where it was sought)."""
    value = (rec.get("reference") or {}).get("parallel")
    return resolve(value, hydra_dirs() if isinstance(value, str) else (RECIPES,))


def sizes(layout: Mapping[str, Any]) -> dict[str, Any]:
    """The dimensions a layout uses beyond one device: tp, pp, dp, cp, ep, vpp > 1; sp, zero1 on."""
    tp, pp, cp, ep, vpp = (int(layout.get(k, 1) or 1) for k in ("tp", "pp", "cp", "ep", "vpp"))
    dp = int(layout.get("world_size", 1)) // (tp * pp * cp)
    out: dict[str, Any] = {k: v for k, v in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp), ("ep", ep),
                                             ("vpp", vpp)) if v > 1}
    out.update({k: True for k in ("sp", "zero1") if layout.get(k)})
    return out


def _listed(dims: Mapping[str, Any]) -> str:
    return ", ".join(k if v is True else f"{k}={v}" for k, v in dims.items())


def describe_sizes(layout: Mapping[str, Any]) -> str:
    return _listed(sizes(layout))


def describe(layout: Mapping[str, Any]) -> str:
    """`tp2 (tp=2)`; `single (one device)`."""
    return f"{layout.get('name')} ({describe_sizes(layout) or 'one device'})"


def trusted(candidate: Mapping[str, Any], reference: Mapping[str, Any]) -> str:
    """One sentence: what the check trusts (the reference's layout) and what it tests."""
    c, r = sizes(candidate), sizes(reference)
    added = _listed({k: v for k, v in c.items() if r.get(k) != v})
    extra = _listed({k: v for k, v in r.items() if c.get(k) != v})
    shared = _listed({k: v for k, v in r.items() if c.get(k) == v})
    if not r:
        if not c:
            return "one device is trusted; the candidate runs on one device too"
        return (f"one device is trusted; everything the candidate {candidate.get('name')} does in parallel "
                f"({added}) is under test")
    if not extra and not added:
        return (f"the reference layout {describe(reference)} is the candidate's own: a bug of this layout is "
                "in both runs and cannot show; only what reference.* changes besides it is under test")
    if not extra:
        return (f"the reference layout {describe(reference)} is trusted; only what the candidate "
                f"{candidate.get('name')} adds ({added}) is under test")
    return (f"the reference layout {describe(reference)} is trusted but is not a subset of the candidate "
            f"{describe(candidate)}: it has {extra}, which the candidate lacks, so a divergence can come "
            "from either layout; " + (f"what both share ({shared}) is not under test" if shared
                                      else "they share no parallel dimension"))


def report(candidate: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, Any]:
    """report.json `reference.parallel` and `reference.trusted`."""
    return {"parallel": {"name": reference.get("name"), "world_size": int(reference.get("world_size", 1)),
                         "sizes": sizes(reference)},
            "trusted": trusted(candidate, reference)}


def microbatches_differ(recipe: dict[str, Any]) -> bool:
    """Does the reference cut the global batch into other microbatches than the candidate? Then only
    the per-step tensors (param_grad, param) have counterparts to compare."""
    mb = (recipe.get("reference") or {}).get("micro_batch")
    return mb is not None and int(mb) != int(recipe["data"]["micro_batch"])
