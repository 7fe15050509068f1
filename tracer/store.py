"""Trace store: safetensors shards plus one JSON manifest per rank, on any fsspec filesystem.

Layout of a run:  <root>/<run>/rank00003/part-00000.safetensors ... manifest.json
A rank's trace is complete only once its manifest exists; the manifest is written last, after
every part file it lists, and carries a sha256 per part so truncation and corruption are caught.
Writes happen on a background thread so a training step never waits on storage.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tracer.errors import TraceError

FORMAT = "ttrace-trace/1"
MANIFEST = "manifest.json"


def _fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/")


def rank_dir(rank: int) -> str:
    return f"rank{rank:05d}"


class TraceWriter:
    """Buffers recorded tensors and writes them as safetensors parts from a background thread."""

    def __init__(self, root: str, run: str, rank: int, header: dict[str, Any], flush_bytes: int = 32 << 20):
        self.fs, base = _fs(root)
        self.dir = f"{base}/{run}/{rank_dir(rank)}"
        self.fs.makedirs(self.dir, exist_ok=True)
        self.header = header
        self.flush_bytes = flush_bytes
        self.entries: list[dict[str, Any]] = []
        self.files: list[dict[str, Any]] = []
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._parts = 0
        self._queue: queue.Queue[tuple[str, dict[str, torch.Tensor]] | None] = queue.Queue(maxsize=4)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="ttrace-writer", daemon=True)
        self._thread.start()

    def add(self, entry: dict[str, Any], tensor: torch.Tensor) -> None:
        """Queue one tensor (already detached and copied) under entry['name']."""
        self._raise_if_failed()
        key = entry["name"]
        entry = dict(entry, key=key, file=self._part_name(self._parts),
                     shape=list(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."))
        self.entries.append(entry)
        self._buf[key] = tensor.contiguous()
        self._buf_bytes += tensor.numel() * tensor.element_size()
        if self._buf_bytes >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._buf:
            return
        self._queue.put((self._part_name(self._parts), self._buf))
        self._parts += 1
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> None:
        """Flush, wait for every part, then commit the manifest (last)."""
        self.flush()
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        manifest = dict(self.header, format=FORMAT, files=self.files, entries=self.entries)
        with self.fs.open(f"{self.dir}/{MANIFEST}", "w") as f:
            json.dump(manifest, f)

    def _part_name(self, i: int) -> str:
        return f"part-{i:05d}.safetensors"

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue
            name, tensors = item
            try:
                data = st_save(tensors)
                with self.fs.open(f"{self.dir}/{name}", "wb") as f:
                    f.write(data)
                self.files.append({"file": name, "bytes": len(data),
                                   "sha256": hashlib.sha256(data).hexdigest()})
            except BaseException as e:  # surfaced to the training thread on the next add/close
                self._error = e

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TraceError(f"writing trace to {self.dir} failed: {self._error}") from self._error


@dataclass
class RankTrace:
    """One rank's committed manifest, with lazy, checksum-verified access to its tensors."""

    root: str
    run: str
    manifest: dict[str, Any]

    @property
    def rank(self) -> int:
        return int(self.manifest["rank"])

    @property
    def entries(self) -> list[dict[str, Any]]:
        return self.manifest["entries"]

    def load_parts(self) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        fs, base = _fs(self.root)
        for info in self.manifest["files"]:
            path = f"{base}/{self.run}/{rank_dir(self.rank)}/{info['file']}"
            try:
                with fs.open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                raise TraceError(f"trace part {path} listed in the manifest is missing; rerun the job "
                                 f"'{self.run}'") from None
            if len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
                raise TraceError(f"trace part {path} is truncated or corrupt ({len(data)} bytes, expected "
                                 f"{info['bytes']}; checksum mismatch); rerun the job '{self.run}'")
            yield info["file"], st_load(data)


def read_run(root: str, run: str, world_size: int) -> list[RankTrace]:
    """Every rank's manifest of a run; a run with any rank uncommitted is an error, not partial data."""
    fs, base = _fs(root)
    traces, missing = [], []
    for rank in range(world_size):
        path = f"{base}/{run}/{rank_dir(rank)}/{MANIFEST}"
        try:
            with fs.open(path, "r") as f:
                manifest = json.load(f)
        except FileNotFoundError:
            missing.append(rank)
            continue
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TraceError(f"manifest {path} is not valid JSON ({e}); the rank's trace is corrupt, "
                             f"rerun the job '{run}'") from None
        if manifest.get("format") != FORMAT:
            raise TraceError(f"manifest {path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
        traces.append(RankTrace(root, run, manifest))
    if missing:
        raise TraceError(f"run '{run}' under {root} has no committed manifest for rank(s) {missing} of "
                         f"{world_size}: those ranks did not finish writing their trace; rerun the job")
    return traces
