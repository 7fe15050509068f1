"""Errors that carry a user-facing message: what is wrong, where, and what to do."""


class TTraceError(Exception):
    """Any failure that must end a check with exit code 2 (never a verdict)."""


class TraceError(TTraceError):
    """A trace is missing, truncated, corrupt, or cannot be reassembled."""


class LayoutMismatch(TraceError):
    """A run's pieces of one tensor do not fit the layout they declare (replicas of different shapes,
    shards that do not concatenate): in a candidate, a wrong layout, judged as a verdict at that
    tensor's module (reason "shape"), not an error."""


class ConfigError(TTraceError):
    """A recipe or parallel configuration that cannot run (bad sizes, unknown option)."""


class JobError(TTraceError):
    """A traced job failed: a rank raised, died, or timed out."""
