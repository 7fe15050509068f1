"""A lazily read run's part files (tracer/logical.py), read as a walk in execution order needs them:
each part read and checksum-verified once, on a reader thread, with the rank's next READ_THREADS
parts read ahead, and dropped once every tensor the walk wants from it has been assembled. Walking a
run in execution order (as the comparison does) holds a few parts per rank, not the run; a part
looked up again later is read again."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tracer.errors import TraceError
from tracer.safetensors_views import PartTensors
from tracer.store import READ_THREADS, RankTrace

Part = tuple[int, str]   # (rank, part file)

_pool: ThreadPoolExecutor | None = None


def _reader() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ttrace-read")
    return _pool


class PartCache:
    """The parts of one run's ranks: read, held while a walk uses them, dropped (module doc)."""

    def __init__(self, run: str, ranks: list[RankTrace], keys: Mapping[Part, set[str]]):
        self.run = run
        self._keys = keys                                      # part -> the keys it must hold
        self._ranks = {rt.rank: rt for rt in ranks}
        self._files = {rt.rank: [f["file"] for f in rt.manifest["files"]] for rt in ranks}   # in order
        self._position = {(rank, f): i for rank, files in self._files.items() for i, f in enumerate(files)}
        self.held: dict[Part, Future] = {}                     # parts read or being read
        self._ready: dict[Part, PartTensors] = {}              # ... and their tensors, once read
        self._left: dict[Part, int] = {}                       # their tensors not assembled yet
        self._read: set[Part] = set()                          # parts read at least once
        self._ahead: set[Part] = set()                         # parts whose successors were read ahead
        self._wanted: dict[Part, int] | None = None            # per part, the keys a walk reads (restrict)
        self.resident_max = 0                                  # most parts held at once (bench, tests)

    def get(self, part: Part) -> PartTensors:
        """The part's tensors, read (and its successors read ahead) if not held already."""
        ready = self._ready.get(part)
        if ready is not None:   # read, verified and read ahead of already: no future to wait on
            return ready
        if part not in self.held:
            self._fetch(part)
        # Read ahead, once per part used: the walk in execution order needs the rank's next parts
        # next, and READ_THREADS of them in flight keep every reader busy while this one is used.
        if part not in self._ahead:
            self._ahead.add(part)
            rank, i = part[0], self._position[part]
            for nxt in self._files[rank][i + 1:i + 1 + READ_THREADS]:
                if (rank, nxt) not in self._read and (self._wanted is None or (rank, nxt) in self._wanted):
                    self._fetch((rank, nxt))
        ready = self._ready[part] = self.held[part].result()
        return ready

    def consumed(self, part: Part, n: int) -> None:
        """n more of the part's tensors assembled: dropped once all of them are (module doc)."""
        self._left[part] -= n
        if self._left[part] == 0:
            del self.held[part], self._left[part]
            self._ready.pop(part, None)

    def read_first(self) -> None:
        """Start reading each rank's first part: a walk in execution order starts there, and the reads
        overlap what comes before it (the other runs' manifests, the comparison's checks)."""
        for rank, files in self._files.items():
            if files and self._keys.get((rank, files[0])) and (rank, files[0]) not in self.held:
                self._fetch((rank, files[0]))

    def restrict(self, wanted: dict[Part, int] | None) -> None:
        """A walk reads `wanted[part]` keys of each part (None: all): other parts are not read (nor
        read ahead), and a part is dropped once those are assembled. Parts read already (read_first)
        are kept for the wanted keys only."""
        self._wanted = wanted
        for part in list(self.held) if wanted is not None else ():
            if part in wanted:
                self._left[part] = wanted[part]
            else:
                del self.held[part], self._left[part]
                self._ready.pop(part, None)

    def release(self) -> None:
        """Drop every part held. A lookup after the walk holds its part until then (the count of a
        part's lookups is per walk); later lookups read the parts again."""
        self.held.clear()
        self._left.clear()
        self._ready.clear()

    def _fetch(self, part: Part) -> None:
        rt = self._ranks[part[0]]
        self.held[part] = _reader().submit(self._verified, rt, rt.manifest["files"][self._position[part]])
        wanted = self._wanted
        self._left[part] = len(self._keys.get(part, ())) if wanted is None else wanted.get(part, 0)
        self._read.add(part)
        self.resident_max = max(self.resident_max, len(self.held))

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
