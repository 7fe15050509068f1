"""Layouts: slicing a full tensor and reassembling it from every rank's shard are inverses."""

import pytest
import torch

from tracer.errors import TraceError
from tracer.layouts import Layout, Partial, Piece, Replicate, Shard, assemble


def _mesh(sizes):
    coords = [{}]
    for axis, n in sizes.items():
        coords = [dict(c, **{axis: i}) for c in coords for i in range(n)]
    return coords


@pytest.mark.parametrize("layout", [Replicate(), Shard(0, "tp"), Shard(-1, "tp"), Shard(1, "tp"),
                                    Layout(shard=((1, "dp"), (1, "tp")))])
def test_slice_then_assemble_is_identity(layout):
    sizes = {"tp": 2, "dp": 2, "pp": 1}
    full = torch.randn(4, 8, 6)
    pieces = [Piece(c, layout.local(full, c, sizes).clone(), rank=i) for i, c in enumerate(_mesh(sizes))]
    out = assemble("x", layout, pieces, sizes)
    assert torch.equal(out.tensor, full)
    assert out.replica_err == 0.0


def test_nested_shard_order_is_outermost_first():
    # Sequence split over dp first, then each dp chunk over tp: rank (dp=0, tp=1) holds rows 2..3 of 8.
    sizes = {"tp": 2, "dp": 2}
    full = torch.arange(8.0)
    layout = Layout(shard=((0, "dp"), (0, "tp")))
    assert layout.local(full, {"dp": 0, "tp": 1}, sizes).tolist() == [2.0, 3.0]
    assert layout.local(full, {"dp": 1, "tp": 0}, sizes).tolist() == [4.0, 5.0]


def test_partial_sums_are_added():
    sizes = {"tp": 2}
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    out = assemble("x", Partial("tp"), [Piece({"tp": 0}, a, 0), Piece({"tp": 1}, b, 1)], sizes)
    assert out.tensor.dtype == torch.float64   # summed and kept in float64: no rounding of its own
    assert torch.equal(out.tensor, a.double() + b.double())


def test_replica_disagreement_is_measured_and_names_the_ranks():
    sizes = {"tp": 2}
    a = torch.ones(4)
    out = assemble("x", Replicate(), [Piece({"tp": 0}, a, 0), Piece({"tp": 1}, a * 1.5, 1)], sizes)
    assert out.replica_err == pytest.approx(0.5)
    assert out.replica_ranks == (0, 1)
    assert torch.equal(out.tensor, a)


def test_missing_shard_is_an_error_not_a_smaller_tensor():
    sizes = {"tp": 2}
    with pytest.raises(TraceError, match="missing"):
        assemble("x", Shard(0, "tp"), [Piece({"tp": 0}, torch.ones(2), 0)], sizes)
