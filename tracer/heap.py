"""Heap tuning: glibc's for the comparison's chunk temporaries (tracer/measure.py), and the cyclic
GC's around bulk allocations (trace loading, the comparison, a rank's job)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import os
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def heap_keeps_chunks() -> Iterator[None]:
    """On glibc, serve the chunk temporaries from the heap instead of fresh mmaps.

    glibc maps every allocation above M_MMAP_THRESHOLD (128 KiB until its dynamic rule raises it)
    and returns it on free, so each ~1 MB temporary of every formula page-faults anew: measured on
    a 16x trace, the comparison took 2.4 s cold and 0.8 s with the heap serving them. The thresholds
    are put back to glibc's defaults afterwards (its dynamic adjustment stays off) and the freed
    heap is returned to the system."""
    libc = _glibc()
    if libc is None:
        yield
        return
    m_trim, m_mmap = -1, -3
    libc.mallopt(m_mmap, 32 << 20)
    libc.mallopt(m_trim, 512 << 20)
    try:
        yield
    finally:
        libc.mallopt(m_mmap, 128 << 10)
        libc.mallopt(m_trim, 128 << 10)
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """libc, looked up once per process: ctypes.util.find_library runs ldconfig or a compiler in a
    subprocess (tens of ms, a fixed cost of every comparison), so the usual soname is tried first."""
    for name in ("libc.so.6", None):
        try:
            libc = ctypes.CDLL(name or ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            continue
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    return None


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while loading or comparing traces: a manifest is ~10^5 fresh dicts and
    lists (none in a cycle), and every generation-2 pass rescans all objects alive. Measured on five 16x runs:
    load 1.6-2.3 s with the GC running, 1.0 s paused.

    On leaving the outermost pause, what it allocated is moved to the oldest generation without a
    pass (`_age_young`): otherwise the first allocation after it starts a young-generation pass over
    all of it, mostly objects that live on (a run's manifests, the walk's spans) and that the pass
    cannot free. Measured on a 16x comparison loading its 5 runs one by one: 0.02-0.30 s of such
    passes in a ~1 s comparison, none after (median of 12 comparisons 1.015 -> 0.996 s; the
    comparison bench's 16x ratio 0.42-0.45 without it, 0.46-0.52 with it, interleaved)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            _age_young()
            gc.enable()


def _age_young() -> None:
    """Every object the GC tracks into its oldest generation, without traversing any: gc.freeze
    moves them all to the permanent generation and gc.unfreeze back to the oldest, list splices both.
    They are freed by reference counting as usual, and a cycle among them waits for the next full
    pass instead of a young one. Not in a process that froze objects of its own (`gc_frozen`, or its
    own gc.freeze before forking): unfreezing would undo its freeze, and freezing ours with them would
    keep any cycle among them from the GC until it unfreezes, if ever.

    Our own freeze is known without asking the GC: gc.get_freeze_count() walks every frozen object
    (24 ms in a check's driver, 6 x 10^5 of them), and asking it at every pause's end cost a demo
    check 15 such walks, +0.35 s (c93dfea). A process that froze its own heap pays that walk here."""
    with _FREEZE_LOCK:
        if _frozen_by_us or gc.get_freeze_count():
            return
        gc.freeze()
        gc.unfreeze()


_FREEZE_LOCK = threading.Lock()   # a freeze and its check are one step for the threads of a process
_frozen_by_us = False             # a gc_frozen block holds the freeze (inherited by a fork made in it)


def _fresh_lock() -> None:   # a fork made while another thread held the lock must not inherit it held
    global _FREEZE_LOCK
    _FREEZE_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):   # not on Windows
    os.register_at_fork(after_in_child=_fresh_lock)


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Every object alive now left out of the cyclic GC's passes until the block ends (gc.freeze;
    objects freed in the block are freed as usual, and cycles made in it are collected). A check's
    driver holds ~5 x 10^5 objects once Ray, torch and MLflow are imported, a warm Ray worker ~3 x
    10^5, and each generation-2 pass that a comparison's, MLflow's or a job's allocations trigger
    rescans them all. Measured: warm demo comparisons took 0.73-1.43 s with them scanned and
    0.57-0.84 s frozen; a warm built-in reference job took 0.37 s when a pass fell in it (0.16 s of
    GC) and 0.21-0.23 s otherwise. A process that froze objects of its own (gc.get_freeze_count() >
    0) is left as it is: unfreezing would undo its freeze. Nested in one of ours, nothing is asked
    of the GC (`_age_young` says why)."""
    global _frozen_by_us
    with _FREEZE_LOCK:
        ours = not _frozen_by_us and not gc.get_freeze_count()
        if ours:
            gc.freeze()
            _frozen_by_us = True
    if not ours:
        yield
        return
    try:
        yield
    finally:
        with _FREEZE_LOCK:
            _frozen_by_us = False
            gc.unfreeze()
