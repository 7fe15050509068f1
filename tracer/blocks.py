"""Dense per-tensor reductions over flat chunks of many tensors (tracer/measure.py): each tensor
zero-padded to whole blocks of BLOCK elements, so a reduction is one dense (blocks, BLOCK) reduction
and a small per-tensor one."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

BLOCK = 128             # reduction block; a tensor pads to a whole number of blocks


class Blocks:
    """A chunk's tensors laid out flat, each zero-padded to whole blocks of BLOCK elements, so every
    reduction is a dense (blocks, BLOCK) reduction followed by a small per-tensor one over its blocks
    (torch's segment reductions over elements are 10-80x slower than dense ones). Zero padding is
    neutral for every reduction here: sums of squares, and maxima of non-negative values."""

    def __init__(self, lens: Sequence[int]):
        self.lens = list(lens)
        nblocks = [-(-n // BLOCK) for n in self.lens]
        self.block_lengths = torch.tensor(nblocks, dtype=torch.int64)
        self.offsets = [0]
        for b in nblocks:
            self.offsets.append(self.offsets[-1] + b * BLOCK)

    def flat(self, run: Mapping[str, torch.Tensor], names: Sequence[str], dtype: torch.dtype) -> torch.Tensor:
        """(blocks, BLOCK) array of the tensors, padded; one cat for the whole chunk."""
        pad = torch.zeros(BLOCK, dtype=dtype)
        pieces = []
        for name, n in zip(names, self.lens, strict=True):
            pieces.append(run[name].reshape(-1))
            if n % BLOCK:
                pieces.append(pad[:BLOCK - n % BLOCK])
        return torch.cat(pieces).to(dtype).view(-1, BLOCK)

    def slice(self, i: int) -> slice:
        """Tensor i's elements in the flattened chunk (padding excluded)."""
        return slice(self.offsets[i], self.offsets[i] + self.lens[i])

    def per_block(self, per_tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A per-tensor value broadcast to (blocks, 1)."""
        return per_tensor.to(dtype).repeat_interleave(self.block_lengths)[:, None]

    def sumsq(self, x: torch.Tensor) -> torch.Tensor:
        """Per tensor sum of squares, squared and accumulated in float64."""
        return self._sum(torch.linalg.vector_norm(x, dim=1, dtype=torch.float64).square())

    def dot(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per tensor dot product, in float64 (x may be passed already in float64: no copy)."""
        return self._sum((x.double() * y.double()).sum(1))

    def count(self, x: torch.Tensor) -> torch.Tensor:
        return self._sum(x.sum(1, dtype=torch.float64))

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """Per tensor max of a non-negative array (0 for an empty tensor; NaN propagates)."""
        return torch.segment_reduce(x.amax(1).double(), "max", lengths=self.block_lengths, initial=0)

    def _sum(self, per_block: torch.Tensor) -> torch.Tensor:
        return torch.segment_reduce(per_block, "sum", lengths=self.block_lengths)


def ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den with 0/x = 0 and x/0 = inf (x > 0): the per-tensor definitions' conventions."""
    return torch.where(num == 0, 0.0, torch.where(den > 0, num / den, math.inf))


def no_nan(x: torch.Tensor) -> torch.Tensor:
    """Elementwise error ratios: 0/0 (an element nothing moved) counts as 0 (tracer.tolerance.elem_err)."""
    return x.nan_to_num(nan=0.0, posinf=math.inf)


def max_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    out = rows[0]
    for x in rows[1:]:
        out = torch.maximum(out, x)
    return out


def leave_one_out(rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """For each i, the elementwise max of all rows but row i (zeros when there is no other row)."""
    n = len(rows)
    prefix, suffix = [None] * n, [None] * n
    for i in range(1, n):
        prefix[i] = rows[i - 1] if prefix[i - 1] is None else torch.maximum(prefix[i - 1], rows[i - 1])
    for i in range(n - 2, -1, -1):
        suffix[i] = rows[i + 1] if suffix[i + 1] is None else torch.maximum(suffix[i + 1], rows[i + 1])
    out = []
    for a, b in zip(prefix, suffix, strict=True):
        out.append(torch.zeros_like(rows[0]) if a is None and b is None else
                   a if b is None else b if a is None else torch.maximum(a, b))
    return out
