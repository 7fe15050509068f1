"""ttrace tracer: the in-process library every job imports (README, "Your own training code").

    import tracer as ttrace
    tr = ttrace.session()      # the job contract: role, store, run, seed, parallel sizes (tracer/job.py)
    tr.attach(model)           # layouts from DTensor placements, or from a plan

The names below are imported on first use (PEP 562), so `from tracer.errors import JobError` costs
no torch import: a rank host reports a failed rank with it, and torch there cost 2-3 s, enough for
the scheduler's grace period to pass before the rank's own error arrived.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "tracer.collector": ("Tracer", "canonical_name"),
    "tracer.errors": ("ConfigError", "JobError", "TraceError", "TTraceError"),
    "tracer.generator": ("full_tensor", "perturb_ulp", "token_batch"),
    "tracer.job": ("Parallel", "Session", "session"),
    "tracer.layouts": ("Layout", "Partial", "Replicate", "Shard"),
    "tracer.plan": ("LayerRenaming", "ModuleLayout", "PipelineRenaming", "param_layouts"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [   # the same names, spelled out for linters and `from tracer import *`
    "ConfigError", "JobError", "LayerRenaming", "Layout", "ModuleLayout", "Parallel", "Partial",
    "PipelineRenaming", "Replicate", "Session", "Shard", "TTraceError", "TraceError", "Tracer",
    "canonical_name", "full_tensor", "param_layouts", "perturb_ulp", "session", "token_batch",
]

if TYPE_CHECKING:   # what type checkers and IDEs see
    from tracer.collector import Tracer, canonical_name
    from tracer.errors import ConfigError, JobError, TraceError, TTraceError
    from tracer.generator import full_tensor, perturb_ulp, token_batch
    from tracer.job import Parallel, Session, session
    from tracer.layouts import Layout, Partial, Replicate, Shard
    from tracer.plan import LayerRenaming, ModuleLayout, PipelineRenaming, param_layouts


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'tracer' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module), name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
