"""Which call of a traced module a forward is, so that every call has a name of its own.

A module can run more than once for one microbatch:
  reuse          called twice in one forward (a shared block, `fc(fc(x))`): each call is a tensor of
                 its own. The first keeps the module's path; call k > 0 is named `path#k`, the same in
                 every run that makes the same calls.
  recomputation  activation checkpointing (torch.utils.checkpoint, Megatron's recompute) runs the
                 forward again during backward to rebuild what it freed. That is the same tensor as the
                 first forward's, not a new one: it is not recorded again. It is matched to its first
                 forward, whose name its gradient and the isolation pass's substitution (which must
                 rebuild the activations the first forward handed on) use. Its output gets a gradient
                 hook as the first forward's did: under reentrant checkpointing (torch's, Megatron's)
                 backward runs through the recomputed output only, the first forward's graph having
                 been made under no_grad, or dropped (Megatron runs its bias-dropout-add under
                 enable_grad even there); under non-reentrant checkpointing the recomputed graph only
                 rebuilds saved tensors and is never run backward, so that hook never fires.

A recomputation is matched to the oldest forward of the same module in this step that has not been
recomputed yet: every pipeline schedule runs the microbatches' backwards in the order of their
forwards, per model chunk. A zero-bubble schedule's weight pass of one microbatch (`repeating`:
Tracer.repeated_backward) recomputes what its input pass did, once per parameter group it
backpropagates to: the first time it is matched to the oldest forward recomputed once (or not yet,
where the input pass computed nothing, as the first stage's), every later time in that pass to the
same. A job that runs one backward over several microbatches' losses leaves that order to autograd;
a mismatch seen (no forward left, or another shape) is an error, never a guess."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

from tracer.errors import TraceError
from tracer.snapshot import INTERNED, interned

in_backward = torch._C._current_graph_task_id   # -1 outside autograd's backward (a plain C call)


class Call(NamedTuple):
    """One forward of a traced module: its microbatch, the path its records are named by, the output's
    shape."""
    microbatch: int | None
    at: str
    shape: tuple[int, ...]


class ModuleCalls:
    """The traced modules' forwards of one step (`reset` at each step's start)."""

    def __init__(self) -> None:
        self.recomputed_forwards = 0   # over the run: said in the rank's log (a job's AC seen working)
        self._pass: dict[str, Call] | None = None   # inside a weight pass: path -> the call it repeats
        self.reset()

    def reset(self) -> None:
        self._count: dict[int | None, dict[str, int]] = {}   # microbatch -> path -> its forwards so far
        # path -> its forwards not recomputed yet, Call's fields flat (3 cells a call: a tuple per
        # call would be an object the cyclic GC tracks, tracer/writer.py says what those cost)
        self._open: dict[str, deque] = {}
        self._again: dict[str, deque] = {}   # path -> its forwards recomputed once, Call's fields flat

    def repeating(self, on: bool) -> None:
        """A zero-bubble weight pass of one microbatch starts (True) or ends (module doc)."""
        self._pass = {} if on else None

    def forward(self, path: str, step: int, microbatch: int | None,
                shape: torch.Size) -> tuple[Call | None, int | None, str]:
        """A traced module's forward hook starts here: (the forward this one repeats when it is a
        recomputation, else None; the microbatch and the path its records are named by)."""
        if in_backward() != -1:   # a forward inside autograd's backward: activation recomputation
            call = self.recomputed(path, step, shape)
            return call, call.microbatch, call.at
        return None, microbatch, self.name(path, microbatch)

    def name(self, path: str, microbatch: int | None) -> str:
        """The path this forward of `path` in `microbatch` is recorded under (module doc)."""
        count = self._count.get(microbatch)   # by microbatch, then path: no key tuple a call (ran says why)
        if count is None:
            count = self._count[microbatch] = {}
        k = count.get(path, 0)
        count[path] = k + 1
        return path if k == 0 else f"{path}#{k}"

    def ran(self, path: str, microbatch: int | None, at: str, shape: torch.Size) -> None:
        """A forward of `path` ran (not a recomputation): Call's fields, kept with the shape interned
        (tracer.snapshot.interned). Per traced module call, on the training thread's path."""
        calls = self._open.get(path)
        if calls is None:
            calls = self._open[path] = deque()
        calls += (microbatch, at, INTERNED.get(shape) or interned(shape))

    def recomputed(self, path: str, step: int, shape: torch.Size) -> Call:
        """The forward that this recomputation of `path` in backward repeats (module doc)."""
        if self._pass is not None:   # a weight pass (module doc)
            call = self._pass.get(path)
            if call is None:
                again = self._again.get(path)
                call = self._pass[path] = (Call(again.popleft(), again.popleft(), again.popleft()) if again
                                           else self._first_recomputation(path, step, shape))
            return self._same_shape(call, path, step, shape)
        call = self._first_recomputation(path, step, shape)
        self._again.setdefault(path, deque()).extend(call)   # a weight pass may recompute it again
        return call

    def _first_recomputation(self, path: str, step: int, shape: torch.Size) -> Call:
        calls = self._open.get(path)
        if not calls:
            raise TraceError(f"traced module '{path}' ran its forward during step {step}'s backward "
                             "(activation recomputation) with no forward of it in that step left to repeat: "
                             "ttrace cannot tell which call this is. Run the microbatches' backwards in "
                             "their forwards' order, or turn recomputation off for the check")
        call = Call(calls.popleft(), calls.popleft(), calls.popleft())
        self.recomputed_forwards += 1
        return self._same_shape(call, path, step, shape)

    def _same_shape(self, call: Call, path: str, step: int, shape: torch.Size) -> Call:
        """`call`, which this recomputation was matched to, if its output has the same shape."""
        if call.shape != shape:
            which = ("the forward its weight pass repeats" if self._pass is not None
                     else "its oldest forward not yet recomputed")
            raise TraceError(f"traced module '{path}' was recomputed in step {step}'s backward with output "
                             f"shape {tuple(shape)}, but {which} ('{call.at}', microbatch {call.microbatch}) "
                             f"had {tuple(call.shape)}: the recomputations run in another order than the "
                             "forwards. Run the microbatches' backwards in their forwards' order, or turn "
                             "recomputation off for the check")
        return call
