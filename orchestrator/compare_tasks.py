"""A check's measurement on several Ray workers (recipe `cluster.compare_workers` > 1).

The tensors are cut into shares (tracer/compare_shares.py); each share is a Ray task that opens the
runs from the store itself, reads the parts holding its tensors and measures them on its own cores
(`cluster.compare_cpus` each); the driver judges all figures together (tracer.compare), as it
judges one process's. Tasks are spread over the cluster's nodes: with a shared store (S3, or a
directory every node mounts) a share reads its parts where it runs. What a task sends back is its
figures, not tensors.

A share that fails ends the check with its error (a corrupt part names its file, as in one process);
a share whose worker died is an error too: no verdict is given on the figures of the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import fsspec
import ray
from fsspec.implementations.local import LocalFileSystem

from orchestrator import cluster, storage
from orchestrator.refcache import ReferenceSet
from tracer.compare_shares import Measured, RunAt, measure_share, merge, partition
from tracer.errors import ConfigError, TraceError, TTraceError
from tracer.measure import TensorKey
from tracer.store import configure


def _share(store_opts: dict[str, Any], reference: RunAt, candidate: RunAt, perturbed: list[RunAt],
           keys: list[TensorKey], k_elem: float, threads: int) -> dict[str, Any]:
    configure(store_opts)   # the store's endpoint and timeouts in this worker, as in the ranks
    for run in (reference, candidate, *perturbed):
        _visible(run.root)
    return measure_share(reference, candidate, perturbed, keys, k_elem, workers=threads).to_json()


def _visible(root: str) -> None:
    """A local store must be a directory this worker's node sees too (the driver saw it): else the
    share would report the runs as never traced, which the driver knows to be false."""
    fs, path = fsspec.core.url_to_fs(root)
    if isinstance(fs, LocalFileSystem) and not fs.isdir(path):
        node = ray.util.get_node_ip_address()
        raise TraceError(f"a comparison share on node {node} cannot see the store {root}: with "
                         "cluster.compare_workers > 1 each share reads the store where it runs, so every "
                         "node must reach it (S3, or a directory mounted at that path on every node); or "
                         "set cluster.compare_workers=1 to measure in the driver")


_share_task = ray.remote(max_retries=0)(_share)


def measurer(store_opts: dict[str, Any], reference: RunAt, candidate: RunAt, perturbed: Sequence[RunAt],
             workers: int, k_elem: float, cpus: int = 1) -> Callable[[Sequence[TensorKey]], Measured]:
    """tracer.compare's `measurer`: the keys in `workers` shares, each a Ray task of `cpus` CPUs."""

    def run(keys: Sequence[TensorKey]) -> Measured:
        shares = partition(keys, workers)
        task = _share_task.options(num_cpus=cpus, scheduling_strategy="SPREAD")
        refs = [task.remote(store_opts, reference, candidate, list(perturbed), share, k_elem, cpus)
                for share in shares]
        got = []
        for i, ref in enumerate(refs):
            which = (f"comparison share {i + 1} of {len(refs)} ({len(shares[i])} tensors from "
                     f"{shares[i][0].name})")
            try:
                got.append(Measured.from_json(ray.get(ref)))
            except ray.exceptions.RayTaskError as e:
                cause = e.cause
                if isinstance(cause, TTraceError):   # what one process would have raised, as it said it
                    raise type(cause)(str(cause)) from None
                raise TTraceError(f"{which} failed: {type(cause).__name__}: {cause}") from None
            except ray.exceptions.RayError as e:   # the worker died (OOM, killed) or its node was lost
                lost = f"{type(e).__name__}: {str(e)[:300]}"
                raise TraceError(f"{which}: its worker was lost ({lost}); no verdict on the other shares "
                                 "alone. Rerun the check (or lower cluster.compare_workers)") from None
        return merge(got)

    return run


def workers_of(rec: dict[str, Any]) -> int:
    """`cluster.compare_workers`: the Ray tasks a check's measurement runs in (1: its own process)."""
    return int(rec["cluster"].get("compare_workers") or 1)


def from_recipe(rec: dict[str, Any], reference: RunAt, candidate: RunAt, perturbed: Sequence[RunAt],
                k_elem: float) -> Callable[[Sequence[TensorKey]], Measured] | None:
    """The recipe's measurer: in `cluster.compare_workers` Ray tasks (Ray started or joined as
    `cluster` says) when that is > 1; None (the caller's own process) otherwise."""
    workers = workers_of(rec)
    if workers <= 1:
        return None
    cpus = int(rec["cluster"].get("compare_cpus") or 1)
    cluster.ensure_ray(rec["cluster"])
    biggest = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]), default=0)
    if not 1 <= cpus <= biggest:   # a task no node can hold would wait forever
        raise ConfigError(f"cluster.compare_cpus={cpus}: each comparison task needs 1 to {biggest:g} CPUs "
                          "(the largest node of the Ray cluster); set it within that")
    return measurer(storage.options(rec["store"]), reference, candidate, perturbed, workers, k_elem, cpus)


def against_references(rec: dict[str, Any], rs: ReferenceSet, store_url: str, run: str, world_size: int,
                       k_elem: float) -> Callable[[Sequence[TensorKey]], Measured] | None:
    """`from_recipe` for a check's run (its candidate, its isolation pass's run) against its
    reference set."""
    at = lambda name: RunAt(rs.url, name, rs.world_size)
    return from_recipe(rec, at(rs.runs[0]), RunAt(store_url, run, world_size), [at(r) for r in rs.runs[1:]],
                       k_elem)
