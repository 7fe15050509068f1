"""A Tracer's scopes: which step and microbatch a record belongs to, and when hooks hold records back.

`step(i)` and `microbatch(i)` name what is recorded inside; `paused()` and `repeated_backward()` keep
a framework's own extra passes over the model out of the trace (tracer/integrations/pipelining.py:
a pipeline stage's metadata inference, a zero-bubble schedule's weight pass). The hooks that read
them: tracer/collector.py and tracer/integrations/dtensor.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class TraceScopes:
    """Mixed into tracer.collector.Tracer, whose state it sets (`_step`, `_microbatch`, `_repeats`)."""

    enabled: bool
    _step: int | None
    _microbatch: int | None
    _repeats: bool
    _calls: Any
    _writer: Any

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        self._step = step
        if self.enabled:
            self._calls.reset()
        try:
            yield
        finally:
            if self.enabled:
                self._writer.flush()
            self._step = None

    @contextlib.contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """Wrap the forward of global microbatch `index`; its backward hooks remember it."""
        prev, self._microbatch = self._microbatch, index
        try:
            yield
        finally:
            self._microbatch = prev

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside, in a step: a framework's dry run of the model (a pipeline stage's
        metadata inference runs its forward and backward on placeholder inputs)."""
        step, self._step = self._step, None
        try:
            yield
        finally:
            self._step = step

    @contextlib.contextmanager
    def repeated_backward(self) -> Iterator[None]:
        """Inside, a traced output's gradient hook that already recorded does not record again: a
        zero-bubble pipeline schedule's weight pass backpropagates once more from the gradients its
        input pass delivered (and recorded). Outside, a second delivery is recorded, a name twice: an
        error at commit, never one of them kept silently."""
        self._repeats = True
        self._calls.repeating(True)   # and its recomputations repeat (tracer/module_calls.py)
        try:
            yield
        finally:
            self._repeats = False
            self._calls.repeating(False)
