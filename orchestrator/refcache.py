"""The reference cache: a check's reference and R perturbed references live under a content key in
the store (`<store>/refcache/<key>/`, key = recipe.reference_key). A check whose key has a complete
entry reuses it; checks of one sweep that share a key compute it once."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import fsspec

from orchestrator import cluster, layouts, recipe
from orchestrator.rank_logs import log_dir
from tracer.errors import TTraceError
from tracer.job_config import run_name
from tracer.store import read_run

CACHE_DIR = "refcache"
COMPLETE = "COMPLETE.json"


@dataclass
class ReferenceSet:
    """One reference + R perturbed references, either found complete in the cache or computed now."""
    key: str
    entry_url: str                # <store>/refcache/<key>
    url: str                      # root of the runs: <entry_url>/<attempt>
    runs: list[str]
    cache: str                    # hit (complete entry reused) | miss (computed) | off (cache=false)
    jobs: list[cluster.Job] = field(default_factory=list)
    computed_by: str = ""         # check_id whose plan computed it
    error: str | None = None
    why_off: str | None = None    # why a stored entry may not be reused (recipe.cacheable)
    world_size: int = 1           # ranks of each run: the reference's layout (reference.parallel)


class NeedsReference(Protocol):
    """What the cache reads of a planned check (orchestrator.outcome.PlannedCheck)."""
    rec: dict[str, Any]
    store_url: str
    check_id: str
    output_dir: Path
    refs: ReferenceSet | None


def share_references(plans: list[NeedsReference], base_dir: str) -> list[ReferenceSet]:
    """Attach a reference set to every plan: a complete cache entry, or one computation per key."""
    computing: dict[str, ReferenceSet] = {}
    for p in plans:
        key = recipe.reference_key(p.rec)
        root = p.store_url.rsplit("/", 1)[0]
        entry = f"{root}/{CACHE_DIR}/{key}"
        if key in computing and computing[key].entry_url == entry:
            p.refs = computing[key]
            continue
        not_cached = recipe.cacheable(p.rec)
        layout = layouts.reference_layout(p.rec)
        world = int(layout["world_size"])
        found = lookup(entry, world) if not_cached is None else None
        if found is not None:
            p.refs = found
            continue
        attempt = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        R = int(p.rec["tolerance"]["perturbations"])
        runs = ["reference"] + [run_name("perturbed", r) for r in range(1, R + 1)]
        rs = ReferenceSet(key, entry, f"{entry}/{attempt}", runs, "miss" if not_cached is None else "off",
                          computed_by=p.check_id, why_off=not_cached, world_size=world)
        for r, run in enumerate(runs):
            # The reference runs the candidate's code (its bug switches too) at its own layout (one
            # device unless reference.parallel), differing only where reference.* says (recipe.job_spec).
            spec = recipe.job_spec(p.rec, role="perturbed" if r else "reference", perturb=r or None,
                                   store_url=rs.url, parallel=layout,
                                   base_dir=base_dir, log=log_dir(p.output_dir, run))
            timeout = float(p.rec["timeout_s"])
            rs.jobs.append(cluster.Job(run, spec, world, label=f"ref {key[:8]}", timeout_s=timeout,
                                       error_dir=p.output_dir / "errors"))
        computing[key] = rs
        p.refs = rs
    return list(computing.values())


def lookup(entry: str, world_size: int = 1) -> ReferenceSet | None:
    """A cache entry is reused only if its COMPLETE marker exists and every run's manifests (of its
    `world_size` ranks) are committed."""
    fs, path = fsspec.core.url_to_fs(entry)
    try:
        with fs.open(f"{path}/{COMPLETE}", "r") as f:
            info = json.load(f)
        url = f"{entry}/{info['attempt']}"
        for run in info["runs"]:
            read_run(url, run, world_size)
    except (FileNotFoundError, KeyError, json.JSONDecodeError, TTraceError):
        return None
    return ReferenceSet(entry.rsplit("/", 1)[1], entry, url, list(info["runs"]), "hit",
                        computed_by=info.get("computed_by", ""), world_size=world_size)


def commit(rs: ReferenceSet) -> None:
    """Mark a freshly computed entry complete (last, after every run's manifests are committed)."""
    if rs.cache == "hit":
        return
    rs.error = next((j.error for j in rs.jobs if j.error), None)
    if rs.error is None and any(j.state != "done" for j in rs.jobs):
        rs.error = "reference jobs did not run"
    if rs.error:
        return
    try:
        for run in rs.runs:
            read_run(rs.url, run, rs.world_size)
        fs, path = fsspec.core.url_to_fs(rs.entry_url)
        info = {"attempt": rs.url.rsplit("/", 1)[1], "runs": rs.runs, "computed_by": rs.computed_by,
                "code_version": recipe.code_version(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with fs.open(f"{path}/{COMPLETE}", "w") as f:
            json.dump(info, f)
    except (TTraceError, OSError) as e:
        rs.error = f"reference cache entry {rs.entry_url} could not be committed: {e}"
