"""torch.distributed.pipelining under ttrace: each stage's forward named after its microbatch.

A pipeline schedule (`Schedule1F1B`, `ScheduleGPipe`, `ScheduleInterleaved1F1B`, ...) is handed a
rank's whole batch, cuts it into `n_microbatches` chunks and runs each stage's forward once per chunk
(`PipelineStage.forward_one_chunk(fwd_chunk_id, ...)`). The training loop never sees a microbatch
boundary to wrap in `tr.microbatch(i)`, so `trace_microbatches` wraps each stage's forward in it:
chunk j of DP rank d is global microbatch `first + j` (`first` = d x the local microbatch count).
Backward needs nothing: a traced output's gradient hook remembers the microbatch of its forward,
whichever order the schedule runs the backwards in.

Zero-bubble schedules split a microbatch's backward into an input pass (`backward_one_chunk(...,
full_backward=False)`: the gradients a stage sends back) and a weight pass later
(`backward_weight_one_chunk`), which backpropagates once more from gradients the input pass saved: a
traced output's gradient can reach its hook twice, the same gradient. The weight pass runs in
`session.repeated_backward()`, where a hook that already recorded does not record again (the first
stage, whose input pass computes nothing, records its gradients there).

A stage's first step also runs it once outside any microbatch: the metadata inference that learns
the shapes it sends and receives (a forward, and a backward, on placeholder inputs). That dry run is
recorded by nobody (`session.paused()`); were a torch version to run it elsewhere, its records would
be extra tensors with no microbatch, and the comparison refuses runs that traced different tensors.

A rank holding several stages (interleaved schedules) attaches them as one `nn.ModuleList`;
`stages_renaming` drops the list's index from the traced names, which are then the model's own
(torchtitan keeps global layer names in every stage: its layers are an `nn.ModuleDict` keyed by layer
id, and a stage is the model with the other stages' modules deleted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tracer.plan import Rename


def trace_microbatches(session: Any, stages: Sequence[Any], first: int = 0) -> None:
    """Run every forward of each of `stages` (this rank's `PipelineStage`s) inside
    `session.microbatch(first + chunk)` (a `tracer.Session` or `Tracer`; module doc), its dry runs in
    `session.paused()` and its weight passes in `session.repeated_backward()`. Call it once, before the
    schedule's first step: it wraps the stages' own methods."""
    for stage in stages:
        forward = stage.forward_one_chunk

        def traced(fwd_chunk_id: int, *args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            with session.microbatch(first + fwd_chunk_id):
                return _forward(fwd_chunk_id, *args, **kwargs)

        stage.forward_one_chunk = traced
        for dry_run in _DRY_RUNS:
            if hasattr(stage, dry_run):
                setattr(stage, dry_run, _inside(session.paused, getattr(stage, dry_run)))
        stage.backward_weight_one_chunk = _inside(session.repeated_backward, stage.backward_weight_one_chunk)


# PipelineStage's metadata inference (torch 2.4 on): the forward's, and the backward's
_DRY_RUNS = ("_prepare_forward_infra", "_prepare_backward_infra")


def _inside(scope: Callable[[], Any], method: Callable[..., Any]) -> Callable[..., Any]:
    def scoped(*args: Any, **kwargs: Any) -> Any:
        with scope():
            return method(*args, **kwargs)
    return scoped


def stages_renaming(count: int) -> Rename:
    """Names in an `nn.ModuleList` of `count` stage modules (`<index>.<name>`) as the model's own."""
    def rename(name: str) -> str:
        head, _, rest = name.partition(".")
        return rest if head.isdigit() and int(head) < count else name
    return rename
