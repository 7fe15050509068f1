"""A stored run's traced tensors in logical (reassembled) form, read from the store as they are used.

`load_logical` reads the run's manifests only. A tensor is assembled when it is looked up, from its
pieces' part files, read as tracer/part_cache.py says: verified once, read ahead, dropped once every
tensor in them has been assembled.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import torch

from tracer.errors import TraceError
from tracer.heap import gc_paused
from tracer.layouts import Assembled, Layout, Piece, assemble, axes_known
from tracer.part_cache import PartCache
from tracer.rank_spans import assemble_chunk, exactly_scaled, joined, plan_chunk, runs_by
from tracer.store import RankTrace, read_run, run_mode


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

    def restricted(self, keep: list[str]) -> LogicalTrace:
        """The run with its tensors `keep` only (in its order), read as the run reads them."""
        return LogicalTrace(self.run, self.world_size, self.meta, keep, {n: self.info[n] for n in keep},
                            Subset(self.tensors, set(keep)), self.sizes, self.mode)

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


def load_logical(root: str, run: str, world_size: int, *, lazy: bool = False,
                 read_first: bool = True) -> LogicalTrace:
    """The run's manifests, checked; with `lazy`, tensors are read as they are looked up (see the
    module doc) and each rank's first part starts being read now (PartCache.read_first; not with
    `read_first` False: a walk of some tensors only, e.g. a share of them), otherwise every part is
    read and verified now."""
    with gc_paused():
        ranks = read_run(root, run, world_size)
        mode = run_mode(root, run, ranks)
        stored = StoredTensors(run, ranks)
        info = stored.info
        # The lowest rank's record order.
        order = [e["name"] for e in sorted(info.values(), key=itemgetter("step", "seq"))]
        trace = LogicalTrace(run, world_size, ranks[0].manifest.get("meta", {}), order, info, stored,
                             dict(stored.sizes), mode)
        if not lazy:
            trace.read_whole()
        elif read_first:
            stored.parts.read_first()
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
        keys: dict[tuple[int, str], set[str]] = {}        # (rank, part file) -> keys it must hold
        self._single_rank = len(ranks) == 1               # its spans are views of its parts
        info, pieces = self.info, self._pieces
        for rt in sorted(ranks, key=lambda rt: rt.rank):   # info: the lowest rank's entry, seen first
            rank = rt.rank
            listed = {f["file"]: keys.setdefault((rank, f["file"]), set()) for f in rt.manifest["files"]}
            for e in rt.entries:
                name = e["name"]
                if "stats" not in e:    # stats mode: no values stored (tracer/stats.py)
                    part = listed.get(e.get("file"))
                    if part is None:
                        raise TraceError(f"run '{run}' rank {rank}: manifest lists tensor '{e['key']}' in "
                                         f"part {e.get('file')}, which it does not commit; the trace is "
                                         "incomplete, rerun the job")
                    part.add(e["key"])
                got = pieces.get(name)
                if got is None:
                    pieces[name], info[name] = [(rt, e)], e
                elif got[-1][0] is rt:   # a writer before tracer.writer._named_twice
                    raise TraceError(f"run '{run}' rank {rank} holds two tensors named '{name}': a "
                                     "comparison would see one of them; retrace the run with this ttrace (it "
                                     "names each call of a module apart)")
                else:
                    got.append((rt, e))
        self.parts = PartCache(run, ranks, keys)
        self._layouts: dict[str, Layout] = {}                  # name -> parsed layout (parsed once)
        self.stored_bytes = sum(int(f["bytes"]) for rt in ranks for f in rt.manifest["files"])

    @property
    def resident_max(self) -> int:
        """The most parts held at once (bench, tests)."""
        return self.parts.resident_max

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
            t = self.parts.get(part)[e["key"]]
            scale = float(e.get("scale", 1.0))
            if scale != 1.0:
                t = scaled(t, scale)
            pieces.append(Piece(rt.manifest["coords"], t, rank))
            self.parts.consumed(part, 1)
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
        if self._single_rank:
            return self._single(names)
        pieces, held = [], []
        info, where = self.info, self._pieces
        groups = runs_by(names, lambda n: (info[n].get("dtype"), [e.get("file") for _, e in where[n]]))
        per_rank = [r for r, _ in {(rt.rank, e.get("file")) for g in groups for rt, e in where[g[0]]}]
        if any(per_rank.count(r) > 2 for r in per_rank):   # before any part is read
            return None
        for group in groups:
            parts, whole = self._assembled(group)
            if whole is None:
                return None
            pieces.append(whole)
            held += [(part, len(group)) for part in parts]
        return self._joined(pieces, held)

    def _joined(self, pieces: list[torch.Tensor | None], held: list[tuple[tuple[int, str], int]]
                ) -> torch.Tensor | None:
        """A span's pieces joined (rank_spans.joined), and its parts' tensors counted as assembled
        (`held`: (part, tensors)); None, counting nothing, if a piece or the join failed."""
        whole = None if any(p is None for p in pieces) else joined(pieces)
        for part, n in held if whole is not None else ():
            self.parts.consumed(part, n)
        return whole

    def restrict(self, names: Sequence[str] | None) -> None:
        """The walk looks up `names` only (None: every tensor again; `release` first): a part is read
        (and read ahead) only if it holds one of them, and dropped once those are assembled."""
        wanted: dict[tuple[int, str], int] | None = None if names is None else {}
        for name in names or ():
            for rt, e in self._pieces[name]:
                if e.get("file") is not None:
                    wanted[rt.rank, e["file"]] = wanted.get((rt.rank, e["file"]), 0) + 1
        self.parts.restrict(wanted)

    def _assembled(self, names: Sequence[str]) -> tuple[list[tuple[int, str]], torch.Tensor | None]:
        """A multi-rank run's span of one dtype: (its ranks' parts, the chunk reassembled), or ([], None)."""
        plan = plan_chunk(names, self._pieces.__getitem__, self.sizes)
        if plan is None:
            return [], None
        parts = [(rank, file) for rank, (_, file) in plan.files.items()]
        spans = {rank: self.parts.get((rank, file)).span(plan.keys[rank]) for rank, file in parts}
        return parts, assemble_chunk(plan, spans, len(names))

    def _single(self, names: Sequence[str]) -> torch.Tensor | None:
        """`span` of a single-rank run: each run of the names' pieces of one dtype in one part one view
        of it. One pass over the names: it runs for every chunk of every reference run, on the thread
        that feeds every measuring thread."""
        pieces, sizes = self._pieces, self.sizes
        groups: list[tuple[tuple[int, str], list[str]]] = []   # (part, keys) per run of pieces
        keys: list[str] = []
        last: tuple[Any, Any] | None = None
        for name in names:
            ((rt, e),) = pieces[name]
            layout = e["layout"]
            if e.get("scale", 1.0) != 1.0 or (
                    (layout.get("shard") or layout.get("partial")) and not axes_known(layout, sizes)):
                return None   # the lookup scales it (float64) or raises the layout's error
            at = (e.get("file"), e.get("dtype"))
            if at != last:
                last, keys = at, []
                groups.append(((rt.rank, at[0]), keys))
            keys.append(e["key"])
        if len({part for part, _ in groups}) > 2:   # before any part is read
            return None
        return self._joined([self.parts.get(part).span(keys) for part, keys in groups],
                            [(part, len(keys)) for part, keys in groups])

    def release(self) -> None:
        """Drop every part held (PartCache.release)."""
        self.parts.release()


class Subset(Mapping[str, Assembled]):
    """A run's tensors restricted to some names (read lazily as the run's own mapping does)."""

    def __init__(self, tensors: Mapping[str, Assembled], names: set[str]):
        self.stored, self._names = tensors, names   # `stored`: what a walk restricts (compare_shares)

    def __getitem__(self, name: str) -> Assembled:
        if name not in self._names:
            raise KeyError(name)
        return self.stored[name]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def pieces(self, name: str) -> Any:
        """The ranks' entries of a tensor (tracer.logical.StoredTensors.pieces; stats mode)."""
        return self.stored.pieces(name)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
