"""ttrace tracer: the in-process library a training script imports (see README, "Integration")."""

from tracer.collector import Tracer, canonical_name
from tracer.errors import ConfigError, JobError, TraceError, TTraceError
from tracer.generator import full_tensor, perturb_ulp, token_batch
from tracer.layouts import Layout, Partial, Replicate, Shard
from tracer.plan import LayerRenaming, ModuleLayout, PipelineRenaming, param_layouts

__all__ = [
    "ConfigError", "JobError", "LayerRenaming", "Layout", "ModuleLayout", "Partial", "PipelineRenaming",
    "Replicate",
    "Shard", "TTraceError", "TraceError", "Tracer", "canonical_name", "full_tensor", "param_layouts",
    "perturb_ulp", "token_batch",
]
