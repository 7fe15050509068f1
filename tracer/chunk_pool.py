"""The comparison's chunks measured on all cores (tracer/measure.py).

Each chunk is measured on a thread of its own with torch's intra-op parallelism off: torch ops
release the GIL, so N threads keep N cores busy, and no op waits at an OpenMP barrier. (With
torch's default of one OpenMP thread per core, a busy machine made every op of the comparison wait
for a descheduled peer: a demo check's comparison took 25-45 s on 2 loaded cores against 1-2 s
single-threaded.) The chunks' inputs are looked up on the calling thread, in order, since a stored
run is read as it is walked (tracer/logical.py). A chunk that shares state with an earlier one (a
parameter path's excusal mask) starts after it: the results are those of the walk in order.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")
ENV = "TTRACE_COMPARE_THREADS"   # threads measuring chunks (default: the cores this process may use)


def default_workers() -> int:
    """TTRACE_COMPARE_THREADS, else the cores this process may run on."""
    if os.environ.get(ENV):
        return max(1, int(os.environ[ENV]))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:   # not Linux
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def single_threaded_ops() -> Iterator[None]:
    """torch's intra-op threads set to 1 (threads started now inherit it), then put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ordered_map(items: Sequence[T], load: Callable[[T], Any], work: Callable[[T, Any], R],
                touches: Callable[[T], Iterable[str]], workers: int) -> Iterator[R]:
    """work(item, load(item)) for every item, results in order. `load` runs on the calling thread in
    order; `work` on `workers` threads, after every earlier item sharing a key of `touches(item)`.
    At most 2 x workers items are loaded and not yet done (memory)."""
    if workers <= 1:
        for item in items:
            yield work(item, load(item))
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="ttrace-measure")
    last: dict[str, Future] = {}
    pending: deque[Future] = deque()

    def after(deps: list[Future], item: T, data: Any) -> R:
        # FIFO pool: an item's dependencies were submitted, hence started, before it; waiting on them
        # cannot deadlock.
        for d in deps:
            d.result()
        return work(item, data)

    try:
        with single_threaded_ops():
            for item in items:
                keys = set(touches(item))
                deps = list({id(f): f for k in keys if (f := last.get(k)) is not None}.values())
                fut = pool.submit(after, deps, item, load(item))
                for k in keys:
                    last[k] = fut
                pending.append(fut)
                while len(pending) > 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
        wait(list(pending))
        pool.shutdown(wait=True)
