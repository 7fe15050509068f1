"""The reference set read while the candidate still runs.

A check's reference and perturbed runs usually finish before its candidate (one device against a
gang of ranks), and a cached set is complete before any job starts. Their traces are then read,
checksum-verified and reassembled on a background thread in that time, so once the candidate is
done the comparison reads only the candidate. Measured on warm demo checks on 2 cores (medians of 6,
interleaved with the read-ahead off): the comparison after the last job took 0.48 s against 0.62 s
(fresh store) and 0.50 s against 0.65 s (cache hit), but the thread takes its CPU from the
candidate's ranks, which ran 7-9% longer: the check's wall time fell 2% (2.21 -> 2.15 s) and 5%
(1.60 -> 1.52 s). With cores to spare on the driver's node the whole read is off the critical path.

A set is read whole into memory only while every set read ahead stays under BUDGET_BYTES (stored
bytes); a larger one is read as the comparison walks it, a few parts at a time (tracer/logical.py),
as before. Reading ahead changes when the bytes are read, never what is compared: a corrupt or
missing part raises the same error at the same check, from `traces`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

from orchestrator.refcache import ReferenceSet
from tracer.logical import LogicalTrace, load_logical

BUDGET_BYTES = 1 << 30   # stored bytes of all sets read ahead at once (their tensors stay in memory)


class ReferencePrefetch:
    """Reads each reference set ahead once its jobs are done (`poll`, called on every job change)."""

    def __init__(self, refsets: list[ReferenceSet], budget_bytes: int = BUDGET_BYTES):
        self.budget = budget_bytes
        self._sets = refsets
        self._reads: dict[int, Future] = {}       # id(refset) -> future of (reference, perturbed)
        self._lock = threading.Lock()
        self.seconds: dict[int, float] = {}       # id(refset) -> how long reading it ahead took

    def poll(self, _jobs: Any = None) -> None:
        """Start reading every set whose jobs are all done (a cache hit has none)."""
        for rs in self._sets:
            if id(rs) in self._reads or any(j.state != "done" for j in rs.jobs):
                continue
            fut: Future = Future()
            self._reads[id(rs)] = fut
            threading.Thread(target=self._read, args=(rs, fut), name="ttrace-prefetch", daemon=True).start()

    def traces(self, rs: ReferenceSet) -> tuple[LogicalTrace, list[LogicalTrace]]:
        """The set's reference and perturbed runs, as read ahead (waiting for the read to end) or opened
        to be read as the comparison walks them. Raises what reading them raises."""
        fut = self._reads.get(id(rs))
        return fut.result() if fut is not None else _open(rs)

    def seconds_of(self, rs: ReferenceSet) -> float | None:
        """How long reading the set ahead took (None: it was not read ahead)."""
        return self.seconds.get(id(rs))

    def _read(self, rs: ReferenceSet, fut: Future) -> None:
        try:
            t0 = time.perf_counter()
            runs = _open(rs)   # the manifests: what the runs hold, and their size
            size = sum(t.stored_bytes for t in (runs[0], *runs[1]))
            with self._lock:
                fits = size <= self.budget
                self.budget -= size if fits else 0
            if fits:
                for t in (runs[0], *runs[1]):
                    t.read_whole()
                self.seconds[id(rs)] = time.perf_counter() - t0
            fut.set_result(runs)
        except BaseException as e:   # surfaced by `traces`, in the checks that read the set
            fut.set_exception(e)


def _open(rs: ReferenceSet) -> tuple[LogicalTrace, list[LogicalTrace]]:
    reference = load_logical(rs.url, rs.runs[0], rs.world_size, lazy=True)
    return reference, [load_logical(rs.url, run, rs.world_size, lazy=True) for run in rs.runs[1:]]

