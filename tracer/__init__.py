"""ttrace tracer: the in-process library every job imports (README, "Your own training code").

    import tracer as ttrace
    tr = ttrace.session()      # the job contract: role, store, run, seed, parallel sizes (tracer/job.py)
    tr.attach(model)           # layouts from DTensor placements, or from a plan
"""

from tracer.collector import Tracer, canonical_name
from tracer.errors import ConfigError, JobError, TraceError, TTraceError
from tracer.generator import full_tensor, perturb_ulp, token_batch
from tracer.job import Parallel, Session, session
from tracer.layouts import Layout, Partial, Replicate, Shard
from tracer.plan import LayerRenaming, ModuleLayout, PipelineRenaming, param_layouts

__all__ = [
    "ConfigError", "JobError", "LayerRenaming", "Layout", "ModuleLayout", "Parallel", "Partial",
    "PipelineRenaming", "Replicate", "Session", "Shard", "TTraceError", "TraceError", "Tracer",
    "canonical_name", "full_tensor", "param_layouts", "perturb_ulp", "session", "token_batch",
]
