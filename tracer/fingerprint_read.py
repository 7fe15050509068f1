"""Reading `ttrace scan`'s fingerprint logs (tracer/fingerprint_log.py) step by step: each step of a run
is a stats-mode LogicalTrace holding that step's tensors, so tracer/stats_compare.py judges it exactly
as it judges a `trace.mode=stats` check (one implementation of the statistics, their combination over
shards and replicas, and their tolerances). One block file per rank is held at a time."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from tracer.errors import TraceError
from tracer.fingerprint_log import SCAN_MODE, hash_hex, values_key
from tracer.heap import gc_paused
from tracer.layouts import Assembled, Layout, Piece, assemble
from tracer.logical import LogicalTrace, scaled
from tracer.store import RankTrace, read_run

Pieces = list[tuple[RankTrace, dict[str, Any]]]
_BLOCK_KEYS = {"stats", "hash", "present", "steps"}


class StepStats(Mapping[str, Any]):
    """One step's recorded statistics by canonical name: `pieces(name)` as tracer.logical's
    StoredTensors gives them for a stats-mode run. Values are assembled only for the names logged in
    full (partial sums, tracer/fingerprint_log.py), whose pieces hold them instead of statistics."""

    def __init__(self, run: str, pieces: dict[str, Pieces], info: dict[str, dict[str, Any]],
                 sizes: dict[str, int]):
        self.run, self._pieces, self._info, self._sizes = run, pieces, info, sizes

    def pieces(self, name: str) -> Pieces:
        return self._pieces[name]

    def __getitem__(self, name: str) -> Assembled:
        got = self._pieces[name]
        if not all("values" in e for _, e in got):
            raise TraceError(f"{name}: run '{self.run}' is a scan's fingerprint log (trace.mode=scan): only "
                             "statistics are stored, no values")
        pieces = [Piece(rt.manifest["coords"], scaled(e["values"], float(e.get("scale", 1.0))), rt.rank)
                  for rt, e in got]
        return assemble(name, Layout.from_json(self._info[name]["layout"]), pieces, self._sizes)

    def __iter__(self) -> Iterator[str]:
        return iter(self._pieces)

    def __len__(self) -> int:
        return len(self._pieces)

    def __contains__(self, name: object) -> bool:
        return name in self._pieces


class FingerprintRun:
    """A stored scan run's manifests (checked like any run's: every rank committed and complete)."""

    def __init__(self, root: str, run: str, world_size: int):
        self.root, self.run = root, run
        with gc_paused():
            self.ranks = read_run(root, run, world_size)
        for rt in self.ranks:
            mode = rt.manifest.get("mode", "full")
            if mode != SCAN_MODE:
                raise TraceError(f"run '{run}' rank {rt.rank} under {root} was traced with trace.mode="
                                 f"{mode}, not by a scan ({SCAN_MODE}); rerun `ttrace scan` into a fresh "
                                 "store")
        prints = {rt.manifest.get("meta", {}).get("fingerprint") for rt in self.ranks}
        if len(prints) > 1:
            raise TraceError(f"run '{run}' under {root}: its ranks were traced from different recipes "
                             f"(fingerprints {sorted(map(str, prints))}); rerun into a fresh store path")
        self.meta = dict(self.ranks[0].manifest.get("meta", {}))
        self.sizes = dict(self.ranks[0].manifest["sizes"])
        spans = {rt.rank: [f.get("steps") for f in rt.manifest["files"]] for rt in self.ranks}
        if len({json.dumps(s) for s in spans.values()}) > 1:
            raise TraceError(f"run '{run}' under {root}: its ranks logged different steps ({spans}); a rank "
                             "stopped early or the directory mixes runs; rerun the job")
        self.blocks = len(self.ranks[0].manifest["files"])

    @property
    def bytes(self) -> int:
        """Bytes of its block files (the manifests aside)."""
        return sum(int(f["bytes"]) for rt in self.ranks for f in rt.manifest["files"])

    def steps(self) -> Iterator[LogicalTrace]:
        """The run's steps in order, each as a stats-mode LogicalTrace (`step_of` gives its step)."""
        for b in range(self.blocks):
            loaded = [self._block(rt, b) for rt in self.ranks]
            steps = loaded[0]["steps"].tolist()
            for rt, blk in zip(self.ranks[1:], loaded[1:], strict=True):
                if blk["steps"].tolist() != steps:
                    raise TraceError(f"run '{self.run}' rank {rt.rank}: block {b} holds steps "
                                     f"{blk['steps'].tolist()}, rank {self.ranks[0].rank} holds {steps}")
            for k, step in enumerate(steps):
                yield self._view(int(step), k, loaded)

    def _block(self, rt: RankTrace, b: int) -> dict[str, torch.Tensor]:
        info = rt.manifest["files"][b]
        blk = rt.load_part(info)   # checksum-verified: truncation or corruption is a TraceError naming it
        names = rt.manifest["names"]
        n = len(names)
        where = f"run '{self.run}' rank {rt.rank} block {info['file']}"
        if not _BLOCK_KEYS <= set(blk):
            raise TraceError(f"{where} holds {sorted(blk)}, not a fingerprint block; rerun the job")
        k = blk["steps"].shape[0]
        if (blk["stats"].shape[0] != k or blk["stats"].shape[1] > n or blk["stats"].shape[2:] != (3,)
                or blk["hash"].shape != blk["stats"].shape[:2] or blk["present"].shape != blk["hash"].shape):
            raise TraceError(f"{where}: shapes {[list(blk[x].shape) for x in ('stats', 'hash', 'present')]} "
                             f"do not fit {k} steps of at most {n} names; the log is corrupt, rerun the job")
        for key in set(blk) - _BLOCK_KEYS:   # values of the names logged in full (fingerprint_log.py)
            _, step, col = (key.split("/") + ["", ""])[:3]
            e = names[int(col)] if key.startswith("values/") and col.isdigit() and int(col) < n else None
            if (e is None or not e.get("values") or not step.isdigit() or int(step) >= k
                    or list(blk[key].shape) != e["shape"] or str(blk[key].dtype) != f"torch.{e['dtype']}"):
                raise TraceError(f"{where} holds '{key}' {str(blk[key].dtype).removeprefix('torch.')} "
                                 f"{list(blk[key].shape)}, which no name logged in full has; the log is "
                                 "corrupt, rerun the job")
        return blk

    def _view(self, step: int, k: int, loaded: list[dict[str, torch.Tensor]]) -> LogicalTrace:
        info: dict[str, dict[str, Any]] = {}
        pieces: dict[str, Pieces] = {}
        for rt, blk in zip(self.ranks, loaded, strict=True):
            names = rt.manifest["names"]
            stats, hashes = blk["stats"][k].tolist(), blk["hash"][k].tolist()
            for col, here in enumerate(blk["present"][k].tolist()):
                if not here:
                    continue
                e = names[col]
                name = f"{step}/{e['name']}"
                if e.get("values"):   # a partial sum, logged in full
                    values = blk.get(values_key(k, col))
                    if values is None:
                        raise TraceError(f"run '{self.run}' rank {rt.rank}: step {step} of '{e['name']}' "
                                         "is logged in full but its values are missing; the log is corrupt, "
                                         "rerun the job")
                    rec: dict[str, Any] = {"values": values, "scale": e.get("scale", 1.0)}
                else:
                    sumsq, absmax, total = stats[col]
                    rec = {"stats": {"sumsq": sumsq, "absmax": absmax, "sum": total,
                                     "numel": math.prod(e["shape"]), "hash": hash_hex(hashes[col])},
                           "scale": e.get("scale", 1.0)}
                pieces.setdefault(name, []).append((rt, rec))
                if name not in info:
                    info[name] = dict(e, name=name, key=name, step=step, rank=rt.rank)
        return LogicalTrace(self.run, len(self.ranks), self.meta, list(info), info,
                            StepStats(self.run, pieces, info, self.sizes), dict(self.sizes), "stats")


def step_of(view: LogicalTrace) -> int | None:
    """The step a per-step view holds (None: it holds no tensor)."""
    return next((int(e["step"]) for e in view.info.values()), None)
