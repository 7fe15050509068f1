"""Virtual pipeline parallelism (parallel.vpp > 1): several model chunks per PP rank, interleaved 1F1B.

With pp ranks and vpp chunks each, virtual stage v = chunk * pp + rank holds layers
[v * L/(pp*vpp), (v+1) * L/(pp*vpp)) (Megatron's interleaving): pp=2, vpp=2, L=4 puts layers 0 and 2
on rank 0, layers 1 and 3 on rank 1. A rank's chunks are built as ordinary stages of a pp*vpp-deep
pipeline and flattened into one module whose `layers` lists all of its layers in local order; the
`renaming` (tracer.LayerRenaming) maps local layer numbers to global ones, for the tracer and for
the consistent initialization alike.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tracer import LayerRenaming
from workloads.parallel_state import ParallelState
from workloads.schedule import Microbatch, _forward

FORWARD_TAG, BACKWARD_TAG = 1, 2


def chunk_offsets(layers: int, pp: int, vpp: int, rank: int, *, offset_bug: bool = False) -> list[int]:
    """Global index of the first layer of each of `rank`'s chunks."""
    per_chunk = layers // (pp * vpp)
    if offset_bug:
        # BUG vpp_layer_offset_wrong: the non-interleaved formula (rank's contiguous block of layers).
        return [rank * (layers // pp) + c * per_chunk for c in range(vpp)]
    return [(c * pp + rank) * per_chunk for c in range(vpp)]


class VirtualStage(nn.Module):
    """This rank's chunks flattened: `embedding` (rank 0, chunk 0), `layers`, `final_*`/`head`/`loss`
    (last rank, last chunk); `forward_chunk(c, x, labels)` runs chunk c."""

    def __init__(self, make_stage: Callable[[ParallelState], nn.Module], ps: ParallelState, vpp: int,
                 layers: int, *, offset_bug: bool = False):
        super().__init__()
        pp, r = ps.pp_size, ps.pp_rank
        self.vpp = vpp
        self.chunks: list[nn.Module] = []   # not registered: their modules are registered below
        flat: list[nn.Module] = []
        for c in range(vpp):
            virtual = dataclasses.replace(ps, sizes={**ps.sizes, "pp": pp * vpp},
                                          coords={**ps.coords, "pp": c * pp + r})
            stage = make_stage(virtual)
            self.chunks.append(stage)
            flat.extend(stage.layers)
            for name, child in stage.named_children():
                if name != "layers":
                    self.add_module(name, child)
        self.layers = nn.ModuleList(flat)
        per_chunk = layers // (pp * vpp)
        offsets = chunk_offsets(layers, pp, vpp, r, offset_bug=offset_bug)
        self.renaming = LayerRenaming(tuple(o + j for o in offsets for j in range(per_chunk)))
        self.layer_offset = offsets[0]
        self.is_first, self.is_last = ps.is_first_stage, ps.is_last_stage

    def forward_chunk(self, chunk: int, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.chunks[chunk](x, labels)


def interleaved_1f1b(model: VirtualStage, microbatches: Sequence[Microbatch], tracer: Any,
                     ps: ParallelState, act_shape: tuple[int, ...], device: torch.device, *,
                     scale_loss: bool = True) -> list[float]:
    """Megatron's interleaved schedule: virtual microbatch k runs chunk (k // pp) % vpp on microbatch
    (k // (pp*vpp)) * pp + k % pp; warmup (pp - rank - 1) * 2 + (vpp - 1) * pp forwards, then 1F1B,
    then cooldown backwards (chunks in reverse). Sends are non-blocking, receives blocking in schedule
    order; forward and backward streams use distinct tags (with pp=2 both peers are the same rank)."""
    pp, r, vpp = ps.pp_size, ps.pp_rank, model.vpp
    n = len(microbatches)
    total = n * vpp
    warmup = min((pp - r - 1) * 2 + (vpp - 1) * pp, total)
    prev_rank, next_rank = ps.stage_rank((r - 1) % pp), ps.stage_rank((r + 1) % pp)
    dtype = next(model.parameters()).dtype
    pending: list[tuple[Any, torch.Tensor]] = []
    losses: list[float] = []
    queues: list[list[tuple[torch.Tensor | None, torch.Tensor]]] = [[] for _ in range(vpp)]

    def recv(src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(act_shape, device=device, dtype=dtype)
        dist.irecv(buf, src=src, tag=tag).wait()
        return buf

    def send(t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.detach().contiguous()
        pending.append((dist.isend(t, dst=dst, tag=tag), t))

    def first_virtual(c: int) -> bool:
        return c == 0 and r == 0

    def last_virtual(c: int) -> bool:
        return c == vpp - 1 and r == pp - 1

    def forward(k: int) -> None:
        c = (k // pp) % vpp
        mb = microbatches[(k // (pp * vpp)) * pp + k % pp]
        x = mb.ids if first_virtual(c) else recv(prev_rank, FORWARD_TAG).requires_grad_()
        y = _forward(functools.partial(model.forward_chunk, c), x, mb, tracer, n, losses,
                     is_last=last_virtual(c), scale_loss=scale_loss)
        if not last_virtual(c):
            send(y, next_rank, FORWARD_TAG)
        queues[c].append((None if first_virtual(c) else x, y))

    def backward(k: int) -> None:
        c = vpp - 1 - (k // pp) % vpp
        x, y = queues[c].pop(0)
        if last_virtual(c):
            torch.autograd.backward(y)
        else:
            torch.autograd.backward(y, grad_tensors=recv(next_rank, BACKWARD_TAG))
        if not first_virtual(c):
            send(x.grad, prev_rank, BACKWARD_TAG)

    for k in range(warmup):
        forward(k)
    for k in range(total - warmup):
        forward(warmup + k)
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    for work, _ in pending:
        work.wait()
    return losses
