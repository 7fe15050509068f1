"""The layout of a chunk of the comparison (tracer/measure.py): consecutive tensors of a run laid out
back to back in one flat array, as tracer/kernels/ walks it (tensor i at `starts[i]`, `lens[i]`
elements)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch


class ChunkLayout:
    """Where each of a chunk's tensors lies in its flat arrays."""

    def __init__(self, lens: Sequence[int]):
        self.lens = list(lens)
        self.offsets = [0]
        for n in self.lens:
            self.offsets.append(self.offsets[-1] + n)
        self.size = self.offsets[-1]
        self.starts = np.array(self.offsets[:-1], dtype=np.int64)
        self.lengths = np.array(self.lens, dtype=np.int64)

    def flat(self, run: Mapping[str, torch.Tensor] | torch.Tensor, names: Sequence[str],
             dtype: torch.dtype) -> torch.Tensor:
        """The run's tensors of the chunk, flat, in `dtype`; `run` is a mapping of names to tensors, or
        the chunk already flat (tracer.logical.StoredTensors.span). Tensors of `dtype` lying back to
        back in memory are viewed where they lie, not copied."""
        if isinstance(run, torch.Tensor):   # flat already (a span): no view of it to make
            return run if run.dtype == dtype else run.to(dtype)
        pieces = [run[name].reshape(-1) for name in names]
        whole = adjacent(pieces)
        if whole is not None and whole.dtype == dtype:
            return whole
        return torch.cat(pieces).to(dtype)

    def slice(self, i: int) -> slice:
        """Tensor i's elements in the flat arrays."""
        return slice(self.offsets[i], self.offsets[i + 1])


def adjacent(pieces: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat view of contiguous flat pieces of one dtype that follow each other in one storage,
    else None."""
    first = pieces[0]
    dtype = first.dtype
    if not first.is_contiguous():
        return None
    storage, at, size = first.untyped_storage().data_ptr(), first.data_ptr(), dtype.itemsize
    end = at + first.numel() * size
    for p in pieces[1:]:
        if (p.data_ptr() != end or p.dtype != dtype or not p.is_contiguous()
                or p.untyped_storage().data_ptr() != storage):
            return None
        end += p.numel() * size
    return first.as_strided(((end - at) // size,), (1,))
