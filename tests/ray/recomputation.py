"""An assertion the third-party jobs' clean checks share (tests/ray/test_job_*.py)."""

from __future__ import annotations

from typing import Any


def assert_recomputed_and_traced_as_without(clean: Any, without: Any, ranks: int = 2) -> None:
    """`clean`, a check run with activation recomputation, traced exactly the tensors of `without`, a
    check of the same job without it (a bug's: its report lists every tensor): a recomputed forward is
    its first forward again, never a tensor of its own. And each of the candidate's `ranks` logs says
    it recomputed, so the recomputation did run."""
    names = lambda res: sorted(t["name"] for t in res.report["tensors"])
    assert names(clean) == names(without)
    logs = [(clean.report_path.parent / p).read_text() for p in clean.report["logs"]["candidate"]]
    assert len(logs) == ranks and all("activation recomputation: " in log for log in logs)
