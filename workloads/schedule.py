"""Forward/backward over a step's microbatches: plain gradient accumulation, or 1F1B pipelining.

Each microbatch loss is the mean over its tokens divided by the number of LOCAL microbatches before
backward (Megatron's convention); DP averaging happens later, in grad finalization.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workloads.parallel_state import ParallelState


@dataclass
class Microbatch:
    index: int               # global microbatch index (dp rank and local index folded together)
    ids: torch.Tensor        # [micro_batch, seq]
    labels: torch.Tensor     # [micro_batch, seq]


def _forward(model: nn.Module, x: torch.Tensor, mb: Microbatch, tracer: Any, num_local: int,
             losses: list[float], is_last: bool, scale_loss: bool = True) -> torch.Tensor:
    """Run one stage forward; on the last stage return the scaled loss to backpropagate."""
    with tracer.microbatch(mb.index):
        out = model(x, mb.labels if is_last else None)
    if not is_last:
        return out
    loss = out.mean()
    tracer.record_loss(loss.detach(), microbatch=mb.index)
    losses.append(loss.item())
    # BUG grad_accum_not_scaled (scale_loss=False): accumulated grads are num_local times too large.
    return loss / num_local if scale_loss else loss


def no_pipelining(model: nn.Module, microbatches: Sequence[Microbatch], tracer: Any, *,
                  scale_loss: bool = True) -> list[float]:
    """pp == 1: forward and backward each microbatch in turn, accumulating grads."""
    losses: list[float] = []
    for mb in microbatches:
        _forward(model, mb.ids, mb, tracer, len(microbatches), losses, is_last=True,
                 scale_loss=scale_loss).backward()
    return losses


@dataclass
class _P2P:
    """Point-to-point with the same (tp, dp) coordinates on the adjacent stages. Sends are
    non-blocking (kept alive until the step ends); receives are waited in schedule order, which
    every stage agrees on, so nothing deadlocks on gloo."""

    ps: ParallelState
    shape: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype = torch.float32   # activation dtype (BF16 under mixed precision)
    pending: list[tuple[Any, torch.Tensor]] = field(default_factory=list)

    def _recv(self, src: int) -> torch.Tensor:
        buf = torch.empty(self.shape, device=self.device, dtype=self.dtype)
        dist.irecv(buf, src=src).wait()
        return buf

    def _send(self, t: torch.Tensor, dst: int) -> None:
        t = t.detach().contiguous()
        self.pending.append((dist.isend(t, dst=dst), t))

    def recv_forward(self) -> torch.Tensor:
        return self._recv(self.ps.stage_rank(self.ps.pp_rank - 1)).requires_grad_()

    def send_forward(self, y: torch.Tensor) -> None:
        self._send(y, self.ps.stage_rank(self.ps.pp_rank + 1))

    def recv_backward(self) -> torch.Tensor:
        return self._recv(self.ps.stage_rank(self.ps.pp_rank + 1))

    def send_backward(self, g: torch.Tensor) -> None:
        self._send(g, self.ps.stage_rank(self.ps.pp_rank - 1))

    def finish(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def one_f_one_b(model: nn.Module, microbatches: Sequence[Microbatch], tracer: Any, ps: ParallelState,
                act_shape: tuple[int, ...], device: torch.device, *, scale_loss: bool = True) -> list[float]:
    """1F1B: warmup (pp - stage - 1 forwards), steady one-forward-one-backward, cooldown backwards."""
    first, last = ps.is_first_stage, ps.is_last_stage
    p2p = _P2P(ps, act_shape, device, dtype=next(model.parameters()).dtype)
    n = len(microbatches)
    warmup = min(ps.pp_size - ps.pp_rank - 1, n)
    losses: list[float] = []
    in_flight: list[tuple[torch.Tensor | None, torch.Tensor]] = []   # (stage input, stage output)

    def forward(i: int) -> None:
        mb = microbatches[i]
        x = mb.ids if first else p2p.recv_forward()
        y = _forward(model, x, mb, tracer, n, losses, is_last=last, scale_loss=scale_loss)
        if not last:
            p2p.send_forward(y)
        in_flight.append((None if first else x, y))

    def backward() -> None:
        x, y = in_flight.pop(0)
        if last:
            torch.autograd.backward(y)
        else:
            torch.autograd.backward(y, grad_tensors=p2p.recv_backward())
        if not first:
            p2p.send_backward(x.grad)

    for i in range(warmup):
        forward(i)
    for i in range(warmup, n):
        forward(i)
        backward()
    for _ in range(warmup):
        backward()
    p2p.finish()
    return losses
