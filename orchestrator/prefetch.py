"""The reference set read, and its side of the measurement prepared, while the candidate still runs.

A check's reference and perturbed runs usually finish before its candidate (one device against a
gang of ranks), and a cached set is complete before any job starts. In that time a background
thread reads, checksum-verifies and reassembles their traces, then computes everything of the
measurement that needs no candidate (tracer/reference_side.py: with 3 perturbed runs, most of
it); once the candidate is done the comparison reads the candidate and measures it against that.
Checks of a sweep that share the set share both. Measured on warm demo checks on 2 cores (medians of
6, interleaved with this off): the comparison after the last job took 0.32 s against 0.61 s (fresh
store) and 0.35 s against 0.62 s (cache hit); the check's wall time 1.99 against 2.35 s and 1.43
against 1.55 s. The thread takes its CPU from the candidate's ranks on so few cores (the cache-hit
candidate ran 0.83 s against 0.68 s); with cores to spare on the driver's node it is off the
critical path altogether.

A set is read whole and prepared only while every set read ahead stays under BUDGET_BYTES (stored
bytes, TTRACE_READ_AHEAD_BYTES overrides it; its prepared side holds about 3x the reference's bytes
again); a larger one is read as the comparison walks it, a few parts at a time (tracer/logical.py),
as before. Reading ahead changes when the work is done, never what is compared (the figures are
the same bit for bit): a corrupt or missing part raises the same error at the same check, from
`traces`, and a set the measurement rejects is left to the comparison, which says why.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import Any

from orchestrator.refcache import ReferenceSet
from tracer import kernels
from tracer.compare_inputs import prepare_reference_side
from tracer.errors import TTraceError
from tracer.logical import LogicalTrace, load_logical
from tracer.reference_side import ReferenceSide

BUDGET_BYTES = 1 << 30   # stored bytes of all sets read ahead at once (their tensors stay in memory)
ENV = "TTRACE_READ_AHEAD_BYTES"   # overrides BUDGET_BYTES (0: never read ahead)


class ReferencePrefetch:
    """Reads each reference set ahead once its jobs are done (`poll`, called on every job change)."""

    def __init__(self, refsets: list[ReferenceSet], budget_bytes: int | None = None):
        # The comparison's compiled kernels loaded while the jobs run (~0.5 s in a fresh process).
        threading.Thread(target=kernels.warm_up, name="ttrace-kernels", daemon=True).start()
        self.budget = int(os.environ.get(ENV, BUDGET_BYTES)) if budget_bytes is None else budget_bytes
        self._sets = refsets
        self._reads: dict[int, Future] = {}       # id(refset) -> future of (reference, perturbed, prepared)
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
        return fut.result()[:2] if fut is not None else _open(rs)

    def prepared(self, rs: ReferenceSet) -> dict[str, ReferenceSide] | None:
        """The set's side of the measurement, prepared ahead with it (None: not read ahead)."""
        fut = self._reads.get(id(rs))
        return fut.result()[2] if fut is not None else None

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
            prepared = None
            if fits:
                for t in (runs[0], *runs[1]):
                    t.read_whole()
                try:   # a set the comparison cannot measure fails there, with its own error, in order
                    prepared = prepare_reference_side(*runs)
                except TTraceError:
                    prepared = None
                self.seconds[id(rs)] = time.perf_counter() - t0
            fut.set_result((*runs, prepared))
        except BaseException as e:   # surfaced by `traces`, in the checks that read the set
            fut.set_exception(e)


def _open(rs: ReferenceSet) -> tuple[LogicalTrace, list[LogicalTrace]]:
    reference = load_logical(rs.url, rs.runs[0], rs.world_size, lazy=True)
    return reference, [load_logical(rs.url, run, rs.world_size, lazy=True) for run in rs.runs[1:]]

