"""The trace writer: the training thread snapshots tensors into pooled buffers (tracer/snapshot.py);
a background thread serializes, checksums and writes them; the manifest is committed last.

Per tensor the training thread does one copy into the current part's slab and appends one manifest
entry. At each step's end (or when the slab is full) the part goes on a bounded queue; the writer
thread writes it as a safetensors file straight from the slab's bytes, no intermediate serialization,
checksums it on the way (xxh3_64, tracer/checksum.py; the hashing and file writes release the GIL)
and gives the slab back to the pool. To a local directory a part goes with O_DIRECT, the slab's bytes
as they lie after a header padded to the device's block (tracer/direct_io.py); elsewhere, or where
the slab has alignment holes between tensors (safetensors wants none), through the page cache with
the tensors grouped by element size.

Back-pressure: at most `max_pending` parts wait for the writer. When storage is slower than the
trace is produced, `flush` blocks the training thread until a part is written: memory stays bounded
(about (max_pending + 2) x flush_bytes) and no data is dropped. A step never otherwise waits on a file.

Crash safety: the manifest is written by `close` only, after every part it lists has been written;
a rank that dies mid-step leaves part files but no manifest, which the comparison reports as an
uncommitted rank (tracer.store.read_run). A job that raises commits its manifest marked incomplete.
"""

from __future__ import annotations

import json
import queue
import threading
from collections import Counter
from typing import Any

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from tracer.checksum import WRITTEN, hasher
from tracer.direct_io import header_block, write_direct
from tracer.errors import TraceError
from tracer.heap import gc_paused
from tracer.safetensors_views import header_json
from tracer.snapshot import (
    INTERNED,
    DeviceCopier,
    Part,
    SlabPool,
    Slot,
    interned,
    slot_columns,
    slot_tuples,
    snapshot,
    wait_for_copies,
)
from tracer.stats import MODES, entry, kept_in_full, load_kernel, slab_figures
from tracer.store import FORMAT, MANIFEST, _fs, rank_dir

# A record's fields, in the order `add` takes them; the manifest entry adds key, shape, dtype, file
# (full) or stats (trace.mode=stats).
FIELDS = ("name", "module", "module_type", "kind", "step", "microbatch", "seq", "layout", "scale")
ROW_CELLS = len(FIELDS) + 3   # a record's cells in TraceWriter._cells: FIELDS, shape, dtype, part file

# A part's bytes go to the file in writes of at most this size. Measured on the 2-core EPYC VM (ext4):
# a 9 MB part written in one call cost the writer thread 17-25 ms of CPU, in 256 KB-1 MB writes 3.5-5
# ms (CPU a training process's other ranks and threads can use).
WRITE_BYTES = 1 << 20


class TraceWriter:
    """Snapshots recorded tensors and writes them as safetensors parts from a background thread."""

    def __init__(self, root: str, run: str, rank: int, header: dict[str, Any], flush_bytes: int = 32 << 20,
                 *, mode: str = "full", max_pending: int = 4, copier: DeviceCopier | None = None):
        if mode not in MODES:
            raise ValueError(f"trace mode {mode!r}: use one of {MODES}")
        self.fs, base = _fs(root)
        self.dir = f"{base}/{run}/{rank_dir(rank)}"
        self.fs.makedirs(self.dir, exist_ok=True)
        self._direct = isinstance(self.fs, LocalFileSystem)   # False once the filesystem refuses O_DIRECT
        self.header, self.mode = header, mode
        self._full = mode == "full"
        if not self._full:
            load_kernel()   # before the first step, not on the writer thread during it
        # Per record, ROW_CELLS cells appended to one flat list: its FIELDS values, shape (one tuple
        # per distinct shape: tracer.snapshot.interned), dtype, part file or None; manifest entries
        # are built at close, off the training thread's path. A record leaves no object the cyclic GC
        # tracks. With a tuple per record and slot (until 2026-12-07), gpt_tiny's training made 184
        # young-generation passes per 100 steps (16.5 of the next), 0.8 ms of GC a step; now 4 (0.5),
        # as many as untraced, 0.45 ms (docs/stats_mode.md, Cost).
        self._cells: list[Any] = []
        self._records = 0
        # Stats mode, per dtype of a part (writer thread): (element size, rows, bytes, and the figures of
        # tracer.stats.slab_figures), made manifest entries at close.
        self._figures: list[tuple[int, np.ndarray, np.ndarray, tuple[np.ndarray, ...]]] = []
        self.files: list[dict[str, Any]] = []
        self._pool = SlabPool(flush_bytes, keep=max_pending + 2)
        if copier is None and torch.cuda.is_available():
            copier = DeviceCopier()
        self._copier = copier
        self._part: Part | None = None
        self._parts = 0
        self._queue: queue.Queue[tuple[str, Part] | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="ttrace-writer", daemon=True)
        self._thread.start()

    def add(self, fields: tuple, tensor: torch.Tensor) -> None:
        """Snapshot one tensor with its record's FIELDS values (the caller may change the tensor
        afterwards). On the training thread's path for every traced tensor: kept lean."""
        if self._error is not None:
            self._raise_if_failed()
        keep = self._full or kept_in_full(fields[7])
        row = self._records
        self._records = row + 1
        part = self._part
        dtype, size = tensor.dtype, tensor.shape   # read once: each torch call ~0.1-0.2 us
        shape = INTERNED.get(size) or interned(size)
        if part is None or not snapshot(part, row, tensor, dtype, shape, self._copier, keep):
            if part is not None:
                self.flush()
            pinned = tensor.is_cuda and self._copier is not None
            part = self._part = Part(self._pool.take(tensor.nbytes, pinned))
            snapshot(part, row, tensor, dtype, shape, self._copier, keep)
        cells = self._cells
        cells += fields
        cells += (shape, dtype, _NAMES[self._parts] if keep else None)

    @property
    def entries(self) -> list[dict[str, Any]]:
        """The manifest entries of every record so far (complete once `close` joined the thread)."""
        stats = {row: entry(*f, n // size) for size, rows, nbytes, figures in self._figures
                 for row, *f, n in zip(rows.tolist(), *(a.tolist() for a in figures), nbytes.tolist(),
                                       strict=True)}
        out, cells = [], self._cells
        if len(cells) != ROW_CELLS * self._records:   # a caller's fields of another length
            raise TraceError(f"trace writer {self.dir}: {len(cells)} cells for {self._records} records; each "
                             f"record's fields must be FIELDS' {len(FIELDS)} values (tracer.writer.FIELDS)")
        for i, at in enumerate(range(0, len(cells), ROW_CELLS)):
            *head, shape, dtype, file = cells[at:at + ROW_CELLS]
            e = dict(zip(FIELDS, head, strict=True), key=head[0], shape=list(shape),
                     dtype=str(dtype).removeprefix("torch."))
            if file is not None:
                e["file"] = file
            if i in stats:
                e["stats"] = stats[i]
            out.append(e)
        return out

    def flush(self) -> None:
        """Hand the current part to the writer thread (blocks only when max_pending parts wait)."""
        part, self._part = self._part, None
        if part is None or not part.cells:
            if part is not None:
                self._pool.give(part.slab)
            return
        if self._copier is not None and part.holds:
            self._copier.fence(part)
        self._queue.put((_NAMES[self._parts], part))
        self._parts += 1

    def close(self, incomplete: str | None = None) -> None:
        """Flush, wait for every part, then commit the manifest (last). `incomplete`: why the job
        stopped early (it raised); such a trace is kept for inspection but never compared."""
        self.flush()
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        # A dict per record, none in a cycle: 80,000 records beside a 4 x 10^5-object heap took
        # 0.81-1.03 s to commit with the GC's 229 passes, 0.55-0.59 s with it paused (tracer.heap).
        with gc_paused():
            entries = self.entries
            incomplete = incomplete or _named_twice(entries)
            manifest = dict(self.header, format=FORMAT, checksum=WRITTEN, mode=self.mode, files=self.files,
                            entries=entries)
            if incomplete:
                manifest["incomplete"] = incomplete
            text = json.dumps(manifest)   # one write: json.dump issues one per token (~10^5, 0.3 s)
        with self.fs.open(f"{self.dir}/{MANIFEST}", "w") as f:
            f.write(text)

    def _drain(self) -> None:
        # This thread's torch work (statistics, pre-faulting) on one core: intra-op threads are
        # per calling thread, so the training thread keeps its own. One slab fills while earlier
        # steps' are written (pinned slabs are allocated on first use, when the device is known).
        torch.set_num_threads(1)
        self._pool.warm(3)
        while (item := self._queue.get()) is not None:
            name, part = item
            if self._error is not None:
                continue
            try:
                wait_for_copies(part)
                # Per-slot Python here holds the GIL the training thread keeps asking for: in full
                # mode (every slot kept) the slots go to the file as the snapshot left them, read from
                # the part's cells (tuples of them held were GC survivors: TraceWriter._cells).
                kept = part.cells
                if not self._full:
                    slots = part.slots()
                    self._record_stats(part, slots)
                    kept = [x for slot in slots if slot[5] for x in slot]
                    del slots
                if kept and not (self._direct and self._write_direct(name, part, kept)):
                    self._write(name, part, [Slot._make(s) for s in slot_tuples(kept)])
                del kept
            except BaseException as e:  # surfaced to the training thread on the next add/close
                self._error = e
            finally:
                self._pool.give(part.slab)

    def _record_stats(self, part: Part, slots: list[tuple]) -> None:
        """Stats mode: the summarized slots' statistics, one compiled pass over the slab per dtype
        (tracer.stats.slab_figures). The training thread waits for the GIL this thread holds: per
        slot, one tuple appended here, the entries made at close."""
        groups: dict[torch.dtype, list[tuple[int, int, int]]] = {}
        for row, dtype, _, offset, nbytes, keep in slots:
            if not keep:
                groups.setdefault(dtype, []).append((row, offset, nbytes))
        for dtype, slots in groups.items():
            rows, at, nbytes = np.array(slots, dtype=np.int64).T.copy()   # each row contiguous
            self._figures.append((dtype.itemsize, rows, nbytes, slab_figures(part.slab, at, nbytes, dtype)))

    def _write_direct(self, name: str, part: Part, slots: list[Any]) -> bool:
        """The part as its slab holds it, with O_DIRECT (tracer/direct_io.py): True if written. False
        when its tensors do not lie back to back from the slab's start (an alignment hole between
        dtypes, or summarized slots among them), or the filesystem refuses O_DIRECT (then for good).
        `slots`: Slot fields, flat (SLOT_CELLS each), in slab order."""
        rows, dtypes, shapes, offsets, sizes, _ = slot_columns(slots)
        end = 0
        for offset, nbytes in zip(offsets, sizes, strict=True):
            if offset != end:
                return False
            end += nbytes
        cells = self._cells
        head = header_block(header_json((cells[row * ROW_CELLS], dtype, shape, offset, offset + nbytes)
                                         for row, dtype, shape, offset, nbytes
                                         in zip(rows, dtypes, shapes, offsets, sizes, strict=True)))
        if not write_direct(f"{self.dir}/{name}", head, part.slab, end):
            self._direct = False
            return False
        h = hasher(WRITTEN)
        h.update(head)
        h.update(part.slab.numpy()[:end])
        self.files.append({"file": name, "bytes": len(head) + end, WRITTEN: h.hexdigest()})
        return True

    def _write(self, name: str, part: Part, slots: list[Slot]) -> None:
        """One safetensors file from the slab: tensors grouped by element size (each stays aligned,
        and the data has no holes), contiguous slab ranges written in pieces of at most WRITE_BYTES."""
        order = sorted(slots, key=lambda s: (-s.dtype.itemsize, s.offset))
        entries: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
        ranges: list[list[int]] = []
        pos = 0
        for s in order:
            entries.append((self._cells[s.row * ROW_CELLS], s.dtype, s.shape, pos, pos + s.nbytes))
            pos += s.nbytes
            if ranges and ranges[-1][1] == s.offset:
                ranges[-1][1] += s.nbytes
            else:
                ranges.append([s.offset, s.offset + s.nbytes])
        head = header_block(header_json(entries), 8)
        raw = part.slab.numpy()
        h = hasher(WRITTEN)
        h.update(head)
        with self.fs.open(f"{self.dir}/{name}", "wb") as f:
            f.write(head)
            for a, b in ranges:
                for at in range(a, b, WRITE_BYTES):
                    view = memoryview(raw[at:min(at + WRITE_BYTES, b)])
                    h.update(view)
                    f.write(view)
        self.files.append({"file": name, "bytes": len(head) + pos, WRITTEN: h.hexdigest()})

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TraceError(f"writing trace to {self.dir} failed: {self._error}") from self._error


class _PartNames(dict):
    """Part file names by index, each formatted once."""

    def __missing__(self, i: int) -> str:
        name = self[i] = f"part-{i:05d}.safetensors"
        return name


_NAMES = _PartNames()


def _named_twice(entries: list[dict[str, Any]]) -> str | None:
    """Why a trace holding two records of one name is incomplete: a comparison would see one of them
    (the collector names each call of a module apart: tracer.module_calls; a caller's own `record`
    repeated for one step and microbatch is not)."""
    twice = sorted(name for name, n in Counter(e["name"] for e in entries).items() if n > 1)
    if not twice:
        return None
    return (f"{len(twice)} name(s) recorded twice in one trace, e.g. {twice[:3]}: a comparison would see "
            "only one of each; every record needs a name of its own (a record call repeated for the same "
            "step, microbatch, path and kind?)")
