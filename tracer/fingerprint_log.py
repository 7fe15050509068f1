"""The per-step fingerprint log of `ttrace scan` (`trace.mode=scan`): per rank, every traced tensor's
statistics at every step (tracer/stats.py `local_stats`: sum of squares, max-abs, sum, xxh3 hash of
the local tensor), in blocks of `block_steps` steps. A 1000-step run costs a few MB, and the writer
holds O(traced names) in memory, never O(steps): a block is written when it is full.

A rank's directory (tracer/store.py's conventions: checksummed files, the manifest committed last):
  fp-00000.safetensors  stats F64 [K, n, 3] (sumsq, absmax, sum), hash I64 [K, n] (the xxh3_64 bits),
                        present U8 [K, n], steps I64 [K]: K steps, the n names known when it was written;
                        and `values/<k>/<i>`: the local tensor of column i at the block's k-th step,
                        for the names logged in full (below)
  manifest.json         format, mode "scan", coords, sizes, meta, files (bytes, checksum, steps) and
                        `names`: one entry per traced name WITHOUT its step ("-/layers.0.ln1.weight/
                        param_grad", "0/loss/loss"), with module, module_type, kind, microbatch, layout,
                        shape, dtype, scale (and `values: true` if logged in full): column i of every
                        block is names[i]
Partial sums (a `Partial` layout: a DTensor replica's unreduced grad, torch-native's replicated KV
weights) are logged in full, as stats mode records them (tracer/stats.py kept_in_full): the
statistics of a sum are not a function of its summands', so the reader reassembles the sum and takes
its statistics then. Their stats row is NaN (a reader that knew no values sees non-finite
statistics, never zeros). A block then also holds block_steps copies of those tensors.

`entries` is empty (read_run and the reference cache see a committed run; tracer/logical.py refuses
to reassemble it). Reading: tracer/fingerprint_read.py. No pickle.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from tracer.checksum import WRITTEN, hasher
from tracer.errors import TraceError
from tracer.stats import kept_in_full, load_kernel, local_stats
from tracer.store import FORMAT, MANIFEST, _fs, rank_dir

SCAN_MODE = "scan"
BLOCK_STEPS = 50       # steps per block file: ~4 KB per step per rank for a 100-name model
BLOCK = "fp-{:05d}.safetensors"


def values_key(k: int, column: int) -> str:
    """The block's key of a name logged in full (column) at its k-th step (module doc)."""
    return f"values/{k}/{column}"


def hash_bits(hexdigest: str) -> int:
    """An xxh3_64 hex digest as the int64 with the same bits (safetensors' I64)."""
    v = int(hexdigest, 16)
    return v - (1 << 64) if v >= 1 << 63 else v


def hash_hex(bits: int) -> str:
    return f"{bits & 0xFFFFFFFFFFFFFFFF:016x}"


class FingerprintLog:
    """A rank's fingerprint log; the Tracer's writer in scan mode (same add/flush/close as
    tracer.writer.TraceWriter). Statistics are taken at each step's end, on the training thread, from
    CPU copies made at `add` (the caller may change the tensor afterwards: clipping scales grads)."""

    def __init__(self, root: str, run: str, rank: int, header: dict[str, Any], *,
                 block_steps: int = BLOCK_STEPS, **_: Any):
        self.fs, base = _fs(root)
        self.dir = f"{base}/{run}/{rank_dir(rank)}"
        self.fs.makedirs(self.dir, exist_ok=True)
        self.header, self.block_steps, self.mode = header, int(block_steps), SCAN_MODE
        self.names: list[dict[str, Any]] = []            # column -> the name's entry
        self._column: dict[str, int] = {}
        self._step: int | None = None
        self._pending: list[tuple[int, torch.Tensor]] = []   # this step's (column, CPU copy)
        # this block's (step, stats, hashes, present, {column: values} of the names logged in full)
        self._rows: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]] = []
        self.files: list[dict[str, Any]] = []
        load_kernel()   # before the first step's statistics

    @property
    def entries(self) -> list[dict[str, Any]]:
        return []

    def add(self, fields: tuple, tensor: torch.Tensor) -> None:
        """One record (tracer.writer.FIELDS values); a record of a new step ends the previous one."""
        name, module, module_type, kind, step, microbatch, _, layout, scale = fields
        if self._step is not None and step != self._step:
            self._end_step()
        self._step = step
        key = name.split("/", 1)[1]
        col = self._column.get(key)
        shape, dtype = list(tensor.shape), str(tensor.dtype).removeprefix("torch.")
        if col is None:
            col = self._column[key] = len(self.names)
            self.names.append({"name": key, "module": module, "module_type": module_type, "kind": kind,
                               "microbatch": microbatch, "layout": layout, "shape": shape, "dtype": dtype,
                               "scale": scale})
            if kept_in_full(layout):
                self.names[col]["values"] = True
        else:
            was = self.names[col]
            if (was["shape"], was["dtype"], was["scale"], was["layout"]) != (shape, dtype, scale, layout):
                raise TraceError(f"{name}: traced as {was['dtype']} {was['shape']} (scale {was['scale']}, "
                                 f"layout {was['layout']}) before and {dtype} {shape} (scale {scale}, layout "
                                 f"{layout}) now; a scan needs one shape, dtype, scale and layout per tensor "
                                 "across steps")
        self._pending.append((col, tensor.detach().to("cpu", copy=True)))

    def flush(self) -> None:
        """The step's end (tracer.Tracer.step)."""
        self._end_step()

    def close(self, incomplete: str | None = None) -> None:
        """Write the last block, then commit the manifest (last)."""
        self._end_step()
        self._write_block()
        manifest = dict(self.header, format=FORMAT, checksum=WRITTEN, mode=SCAN_MODE, files=self.files,
                        entries=[], names=self.names, block_steps=self.block_steps)
        if incomplete:
            manifest["incomplete"] = incomplete
        with self.fs.open(f"{self.dir}/{MANIFEST}", "w") as f:
            f.write(json.dumps(manifest))

    def _end_step(self) -> None:
        if not self._pending:
            self._step = None
            return
        n = len(self.names)
        stats = torch.zeros(n, 3, dtype=torch.float64)
        hashes = torch.zeros(n, dtype=torch.int64)
        present = torch.zeros(n, dtype=torch.uint8)
        values = {c: t for c, t in self._pending if self.names[c].get("values")}
        summed = [(c, t) for c, t in self._pending if c not in values]
        if summed:
            found = local_stats([t for _, t in summed])
            index = torch.tensor([c for c, _ in summed], dtype=torch.long)
            stats[index] = torch.tensor([[s["sumsq"], s["absmax"], s["sum"]] for s in found],
                                        dtype=torch.float64)
            hashes[index] = torch.tensor([hash_bits(s["hash"]) for s in found], dtype=torch.int64)
        if values:
            stats[torch.tensor(list(values), dtype=torch.long)] = math.nan   # module doc
        present[torch.tensor([c for c, _ in self._pending], dtype=torch.long)] = 1
        assert self._step is not None
        self._rows.append((self._step, stats, hashes, present, values))
        self._pending.clear()
        self._step = None
        if len(self._rows) >= self.block_steps:
            self._write_block()

    def _write_block(self) -> None:
        if not self._rows:
            return
        from safetensors.torch import save

        n = len(self.names)
        pad = lambda t: torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, n - t.shape[0]))
        data = save({"stats": torch.stack([pad(r[1]) for r in self._rows]),
                     "hash": torch.stack([pad(r[2]) for r in self._rows]),
                     "present": torch.stack([pad(r[3]) for r in self._rows]),
                     "steps": torch.tensor([r[0] for r in self._rows], dtype=torch.int64),
                     **{values_key(k, c): t.contiguous() for k, r in enumerate(self._rows)
                        for c, t in r[4].items()}})
        name = BLOCK.format(len(self.files))
        h = hasher(WRITTEN)
        h.update(data)
        with self.fs.open(f"{self.dir}/{name}", "wb") as f:
            f.write(data)
        self.files.append({"file": name, "bytes": len(data), WRITTEN: h.hexdigest(),
                           "steps": [self._rows[0][0], self._rows[-1][0]]})
        self._rows.clear()
