"""Hugging Face transformers' tensor parallelism (`DistributedConfig(tp_size=...)`) for the DTensor tracer.

transformers shards parameters as DTensors (their layouts are read from the placements, as for any
DTensor model), but its TP styles replace `module.forward` and return `output.to_local()`: the
module's output reaches any hook as a plain local tensor. What that local tensor is, the style
says: it redistributes to its `output_layouts` (ColwiseParallel: `Shard(-1)`; RowwiseParallel,
EmbeddingParallel, `colwise_gather_output`: `Replicate()`) right before stripping it, and
`to_local()` declares the gradient with the same placement. `ReplicatedWithGradAllReduce` (a
replicated module whose parameter grads are partial, e.g. GQA K/V projections replicated over TP)
produces a replicated output whose gradient is a partial sum. `tp_local_layouts(model)` reads those
placements from the model's resolved TP plan (`model._tp_plan`) and the style objects; modules with
no TP style (norms) compute replicated, which the comparison checks.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tracer.integrations.dtensor import LocalLayouts, placements_to_layout
from tracer.layouts import Layout
from tracer.plan import _regex


def tp_local_layouts(model: nn.Module, axis: str = "tp") -> LocalLayouts:
    from torch.distributed.tensor import Replicate
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    from transformers.distributed.tensor_parallel import (
        ColwiseParallel,
        EmbeddingParallel,
        ReplicatedWithGradAllReduce,
        RowwiseParallel,
    )

    plan: dict[str, str] = dict(getattr(model, "_tp_plan", None) or {})
    if getattr(model, "_device_mesh", None) is None or not plan:
        return lambda name, module: None

    def style_of(name: str) -> Any:
        for pattern, style in plan.items():
            if _regex(pattern).match(name):
                return ALL_PARALLEL_STYLES[style]
        return None

    def layouts(name: str, module: nn.Module) -> tuple[Layout, Layout] | None:
        style = style_of(name)
        if isinstance(style, ReplicatedWithGradAllReduce):
            return Layout(), Layout(partial=(axis,))
        if isinstance(style, EmbeddingParallel):
            out = Replicate()   # both vocab- and hidden-sharded lookups are redistributed to Replicate
        elif isinstance(style, (ColwiseParallel, RowwiseParallel)):
            out = style.output_layouts
        else:
            return None         # no style, or one this reader does not know: plain = replicated (checked)
        if not getattr(style, "use_local_output", True):
            return None         # the output stays a DTensor: read from its placements
        lay = placements_to_layout([out], [axis])
        return lay, lay

    return layouts
