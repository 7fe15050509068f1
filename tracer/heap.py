"""glibc heap tuning for the comparison's chunk temporaries (tracer/measure.py)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
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
