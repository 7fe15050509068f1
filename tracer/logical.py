"""A stored run's traced tensors in logical (reassembled) form, read from the store as they are used.

`load_logical` reads the run's manifests only. A tensor is assembled when it is looked up: its
pieces' part files are read and checksum-verified once, and the rank's next READ_THREADS parts are
read ahead on background threads. A part is dropped once every tensor in it has been assembled, so walking a
run in execution order (as the comparison does) holds a few parts per rank, not the run; a part
looked up again later is read again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tracer.errors import TraceError
from tracer.heap import gc_paused
from tracer.layouts import Assembled, Layout, Piece, assemble, axes_known
from tracer.rank_spans import assemble_chunk, exactly_scaled, joined, plan_chunk, runs_by
from tracer.safetensors_views import PartTensors
from tracer.store import READ_THREADS, RankTrace, read_run, run_mode

_pool: ThreadPoolExecutor | None = None


def _reader() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ttrace-read")
    return _pool


@dataclass
class LogicalTrace:
    """A run's traced tensors, reassembled to logical form, in execution order."""

    run: str
    world_size: int
    meta: dict[str, Any]
    order: list[str]                    # canonical names in execution order
    info: dict[str, dict[str, Any]]     # name -> manifest entry of the lowest rank
    tensors: Mapping[str, Assembled]    # traced dtype; float64: partial sums, scales not powers of 2
    sizes: dict[str, int] = field(default_factory=dict)   # mesh axis sizes of the run
    mode: str = "full"                  # full | stats: statistics only (tracer/stats.py)
    _shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical tensor's shape, from the manifest (reads nothing): the lowest rank's local
        shape with every sharded dim times its axis size. Cached: the comparison asks for each
        tensor's shape several times per run."""
        got = self._shapes.get(name)
        if got is None:
            e = self.info[name]
            shape = [int(d) for d in e["shape"]]
            for dim, ax in e["layout"].get("shard", ()):   # Layout.from_json's reading, without the object
                shape[int(dim)] *= int(self.sizes.get(ax, 1))
            got = self._shapes[name] = tuple(shape)
        return got

    def first_step(self) -> int:
        """The first traced step (initial parameters, traced at step -1, left out; 0 if none)."""
        return min((s for e in self.info.values() if (s := int(e["step"])) >= 0), default=0)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the part files a lazily opened run has still to read (0 once read whole)."""
        return self.tensors.stored_bytes if isinstance(self.tensors, StoredTensors) else 0

    def read_whole(self) -> None:
        """Read, verify and reassemble every tensor now (a lazily opened run; a stats-mode run has no
        values to read): later lookups are dictionary lookups."""
        if isinstance(self.tensors, StoredTensors) and self.mode != "stats":
            with gc_paused():
                stored = self.tensors
                self.tensors = {n: stored[n] for n in self.order}

    def release(self) -> None:
        """Drop the parts a lazily read run holds after lookups outside a comparison's walk
        (StoredTensors.release); nothing for a run read whole."""
        if isinstance(self.tensors, StoredTensors):
            self.tensors.release()


def load_logical(root: str, run: str, world_size: int, *, lazy: bool = False) -> LogicalTrace:
    """The run's manifests, checked; with `lazy`, tensors are read as they are looked up (see the
    module doc), otherwise every part is read and verified now."""
    with gc_paused():
        ranks = read_run(root, run, world_size)
        mode = run_mode(root, run, ranks)
        stored = StoredTensors(run, ranks)
        info = stored.info
        order = sorted(info, key=lambda n: (info[n]["step"], info[n]["seq"]))   # lowest rank's record order
        trace = LogicalTrace(run, world_size, ranks[0].manifest.get("meta", {}), order, info, stored,
                             dict(stored.sizes), mode)
        if not lazy:
            trace.read_whole()
        return trace


def scaled(t: torch.Tensor, scale: float) -> torch.Tensor:
    """`t * scale` without rounding. A power of two (a DP grad scale of 1/2) only moves exponents: kept
    in `t`'s dtype, so the candidate's chunk is measured in the reference's precision against its
    prepared side (tracer/reference_side.py), unless a product lost bits (subnormal) or overflowed,
    which dividing back detects. Any other scale (an fp8 payload's, a grad scale of 1/3): float64."""
    out = exactly_scaled(t, scale)
    return out if out is not None else t.double() * scale


class StoredTensors(Mapping[str, Assembled]):
    """name -> Assembled, read on lookup (module doc). Lookups are not cached: a tensor looked up
    twice is assembled twice (from the part cache while its part is held)."""

    def __init__(self, run: str, ranks: list[RankTrace]):
        self.run = run
        self.sizes = ranks[0].manifest["sizes"]
        self.info: dict[str, dict[str, Any]] = {}
        self._pieces: dict[str, list[tuple[RankTrace, dict[str, Any]]]] = {}
        self._keys: dict[tuple[int, str], set[str]] = {}        # (rank, part file) -> keys it must hold
        self._files: dict[int, list[str]] = {}                  # rank -> its part files in order
        self._position: dict[tuple[int, str], int] = {}        # (rank, part file) -> index in its files
        info, pieces, keys = self.info, self._pieces, self._keys
        for rt in sorted(ranks, key=lambda rt: rt.rank):   # info: the lowest rank's entry, seen first
            rank = rt.rank
            files = self._files[rank] = [f["file"] for f in rt.manifest["files"]]
            self._position.update({(rank, f): i for i, f in enumerate(files)})
            listed = {f: keys.setdefault((rank, f), set()) for f in files}
            for e in rt.entries:
                name = e["name"]
                if "stats" not in e:    # stats mode: no values stored (tracer/stats.py)
                    part = listed.get(e.get("file"))
                    if part is None:
                        raise TraceError(f"run '{run}' rank {rank}: manifest lists tensor '{e['key']}' in "
                                         f"part {e.get('file')}, which it does not commit; the trace is "
                                         "incomplete, rerun the job")
                    part.add(e["key"])
                pieces.setdefault(name, []).append((rt, e))
                info.setdefault(name, e)
        self._parts: dict[tuple[int, str], Future] = {}         # parts read or being read
        self._ready: dict[tuple[int, str], PartTensors] = {}   # ... and their tensors, once read
        self._left: dict[tuple[int, str], int] = {}            # their tensors not assembled yet
        self._read: set[tuple[int, str]] = set()               # parts read at least once
        self._ahead: set[tuple[int, str]] = set()              # parts whose successors were read ahead
        self._layouts: dict[str, Layout] = {}                  # name -> parsed layout (parsed once)
        self._wanted: dict[tuple[int, str], int] | None = None  # per part, the keys a walk reads (restrict)
        self.resident_max = 0                                   # most parts held at once (bench, tests)
        self.stored_bytes = sum(int(f["bytes"]) for rt in ranks for f in rt.manifest["files"])

    def __len__(self) -> int:
        return len(self._pieces)

    def __iter__(self) -> Iterator[str]:
        return iter(self._pieces)

    def __contains__(self, name: object) -> bool:
        return name in self._pieces

    def pieces(self, name: str) -> list[tuple[RankTrace, dict[str, Any]]]:
        """Every rank's manifest entry of a tensor (with its statistics in a stats-mode run)."""
        return self._pieces[name]

    def __getitem__(self, name: str) -> Assembled:
        pieces = []
        for rt, e in self._pieces[name]:
            if "stats" in e:
                raise TraceError(f"{name}: run '{self.run}' recorded only its statistics (trace.mode=stats); "
                                 "its values are not in the store")
            rank = rt.rank
            part = (rank, e["file"])
            t = self._part(rt, part)[e["key"]]
            scale = float(e.get("scale", 1.0))
            if scale != 1.0:
                t = scaled(t, scale)
            pieces.append(Piece(rt.manifest["coords"], t, rank))
            self._consumed(part, 1)
        layout = self._layouts.get(name)
        if layout is None:
            layout = self._layouts[name] = Layout.from_json(self.info[name]["layout"])
        return assemble(name, layout, pieces, self.sizes)

    def span(self, names: Sequence[str]) -> torch.Tensor | None:
        """The tensors `names`, reassembled, as one flat tensor where every rank recorded them back to
        back in this order (the order a comparison walks): a single-rank run's is a view of its part,
        a multi-rank run's one pass over its ranks' parts (tracer/rank_spans.py), replicas bitwise
        equal. Runs of several dtypes (a bf16 run's fp32 grads) or of two parts per rank (~5% of a 16x
        comparison's chunks straddle a part boundary) are read one by one and joined, in the widest
        dtype. None otherwise (more parts: a walk holds at most two per rank and those read ahead;
        other scales or layouts, replicas that differ)."""
        pieces, held = [], []
        info, where = self.info, self._pieces
        groups = runs_by(names, lambda n: (info[n].get("dtype"), *(e.get("file") for _, e in where[n])))
        per_rank = [r for r, _ in {(rt.rank, e.get("file")) for g in groups for rt, e in where[g[0]]}]
        if any(per_rank.count(r) > 2 for r in per_rank):   # before any part is read
            return None
        for group in groups:
            parts, whole = self._view(group) if len(self._files) == 1 else self._assembled(group)
            if whole is None:
                return None
            pieces.append(whole)
            held += [(part, len(group)) for _, part in parts]
        out = joined(pieces)
        for part, n in held if out is not None else ():
            self._consumed(part, n)
        return out

    def restrict(self, names: Sequence[str] | None) -> None:
        """The walk looks up `names` only (None: every tensor again; `release` first): a part is read
        (and read ahead) only if it holds one of them, and dropped once those are assembled."""
        if names is None:
            self._wanted = None
            return
        wanted: dict[tuple[int, str], int] = {}
        for name in names:
            for rt, e in self._pieces[name]:
                if e.get("file") is not None:
                    wanted[rt.rank, e["file"]] = wanted.get((rt.rank, e["file"]), 0) + 1
        self._wanted = wanted

    def _consumed(self, part: tuple[int, str], n: int) -> None:
        """n more of the part's tensors assembled: dropped once all of them are (module doc)."""
        self._left[part] -= n
        if self._left[part] == 0:
            del self._parts[part], self._left[part]
            self._ready.pop(part, None)

    def _assembled(self, names: Sequence[str]) -> tuple[list[tuple[RankTrace, Any]], torch.Tensor | None]:
        """A multi-rank run's span of one dtype: (its ranks' parts, the chunk reassembled), or ([], None)."""
        plan = plan_chunk(names, self._pieces.__getitem__, self.sizes)
        if plan is None:
            return [], None
        parts = [(rt, (rank, file)) for rank, (rt, file) in plan.files.items()]
        spans = {p[0]: self._part(rt, p).span(plan.keys[p[0]]) for rt, p in parts}
        return parts, assemble_chunk(plan, spans, len(names))

    def _view(self, names: Sequence[str]) -> tuple[list[tuple[RankTrace, Any]], torch.Tensor | None]:
        """One rank's span of tensors in one part (`span` groups them): ([part], view) or ([], None)."""
        pieces, sizes = self._pieces, self.sizes
        first = pieces[names[0]][0]
        rt, file = first[0], first[1].get("file")
        keys = []
        for name in names:   # per tensor of every chunk of every reference run: kept lean
            (piece,) = pieces[name]
            e = piece[1]
            layout = e["layout"]
            if e.get("scale", 1.0) != 1.0 or (
                    (layout.get("shard") or layout.get("partial")) and not axes_known(layout, sizes)):
                return [], None   # the lookup raises a layout's error
            keys.append(e["key"])
        part = (rt.rank, file)
        return [(rt, part)], self._part(rt, part).span(keys)

    def release(self) -> None:
        """Drop every part held. A lookup after the walk holds its part until then (the count of a
        part's lookups is per walk); later lookups read the parts again."""
        self._parts.clear()
        self._left.clear()
        self._ready.clear()

    def _part(self, rt: RankTrace, part: tuple[int, str]) -> PartTensors:
        ready = self._ready.get(part)
        if ready is not None:   # read, verified and read ahead of already: no future to wait on
            return ready
        if part not in self._parts:
            self._fetch(rt, part)
        # Read ahead, once per part used: the walk in execution order needs the rank's next parts
        # next, and READ_THREADS of them in flight keep every reader busy while this one is used.
        if part not in self._ahead:
            self._ahead.add(part)
            files, i = self._files[part[0]], self._position[part]
            for nxt in files[i + 1:i + 1 + READ_THREADS]:
                wanted = self._wanted is None or (part[0], nxt) in self._wanted
                if (part[0], nxt) not in self._read and wanted:
                    self._fetch(rt, (part[0], nxt))
        ready = self._ready[part] = self._parts[part].result()
        return ready

    def _fetch(self, rt: RankTrace, part: tuple[int, str]) -> None:
        info = rt.manifest["files"][self._position[part]]
        self._parts[part] = _reader().submit(self._verified, rt, info)
        wanted = self._wanted
        self._left[part] = len(self._keys.get(part, ())) if wanted is None else wanted.get(part, 0)
        self._read.add(part)
        self.resident_max = max(self.resident_max, len(self._parts))

    def _verified(self, rt: RankTrace, info: dict[str, Any]) -> PartTensors:
        """One part, checksum-verified, holding exactly the keys the manifest lists for it."""
        tensors = rt.load_part(info)
        listed = self._keys.get((rt.rank, info["file"]), set())
        extra, lost = set(tensors) - listed, listed - set(tensors)
        if extra:
            raise TraceError(f"run '{self.run}' rank {rt.rank}: tensor '{min(extra)}' in {info['file']} is "
                             "not in the manifest")
        if lost:
            raise TraceError(f"run '{self.run}' rank {rt.rank}: manifest lists tensors not found in "
                             f"{info['file']} (e.g. {sorted(lost)[:3]}); the trace is incomplete, "
                             "rerun the job")
        return tensors

