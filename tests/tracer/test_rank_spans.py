"""A multi-rank run's chunk reassembled in one pass (tracer/rank_spans.py) is exactly what looking its
tensors up one by one gives, and it leaves every case it does not cover to those lookups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tracer import Shard, Tracer
from tracer.compare import compare
from tracer.layouts import Layout, Partial, Replicate
from tracer.logical import load_logical
from tracer.tolerance import TolerancePolicy

G = torch.Generator().manual_seed(3)
FULL = {   # path -> (logical tensor, layout): every case the one-pass plan takes, in record order
    "a": (torch.randn(6, 4, generator=G), Replicate()),
    "b": (torch.randn(8, 3, generator=G), Shard(0, "tp")),
    "c": (torch.randn(5, 6, generator=G), Shard(1, "tp")),
    "d": (torch.randn(3, 4, 10, generator=G), Shard(1, "tp")),
    "e": (torch.randn(2, 5, 4, generator=G).to(torch.bfloat16).float(), Shard(2, "tp")),
    "f": (torch.randn(6, generator=G), Shard(0, "dp")),
}
SIZES = {"tp": 2, "dp": 2}


def _write(root: Path, run: str, ulp_on_rank: int | None = None, partial: bool = False,
           dtype: torch.dtype = torch.float32, scales: dict[str, float] | None = None,
           tiny: bool = False, dtypes: dict[str, torch.dtype] | None = None) -> None:
    """A tp2 x dp2 run (4 ranks) recording FULL's tensors as each rank holds them; with `ulp_on_rank`
    that rank's copy of the replicated 'a' is one ulp off in one element; with `partial` one more
    tensor is a partial sum over tp (which the one-pass plan leaves to lookups); `scales`: path ->
    its records' scale; with `tiny`, one element of 'c' is the smallest float32 subnormal; `dtypes`:
    path -> the dtype its records are stored in (default `dtype`)."""
    for rank in range(4):
        coords = {"tp": rank % 2, "dp": rank // 2}
        tr = Tracer(str(root), run, rank, coords=coords, sizes=SIZES, meta={"fingerprint": "spans"})
        with tr.step(0):
            for path, (full, layout) in FULL.items():
                if tiny and path == "c":
                    full = full.clone()
                    full[0, 0] = 2.0**-149
                stored = (dtypes or {}).get(path, dtype)
                local = layout.local(full, coords, SIZES).to(stored).contiguous().clone()
                if path == "a" and rank == ulp_on_rank:
                    local[1, 2] = torch.nextafter(local[1, 2], torch.tensor(float("inf")))
                tr.record(path, "output", local, layout, scale=(scales or {}).get(path, 1.0))
            if partial:
                tr.record("g", "output", torch.full((3,), float(coords["tp"] + 1)), Partial("tp"))
        tr.close()


def _lazy(root: Path, run: str, world: int = 4):
    return load_logical(str(root), run, world, lazy=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_chunk_of_every_layout_the_plan_takes_is_reassembled_exactly_in_one_pass(tmp_path, dtype):
    _write(tmp_path, "candidate", dtype=dtype)
    names = _lazy(tmp_path, "candidate").order
    assert len(names) == len(FULL)
    whole = _lazy(tmp_path, "candidate").tensors.span(names)
    assert whole is not None, "the chunk was not reassembled in one pass"
    one_by_one = _lazy(tmp_path, "candidate").tensors
    expected = torch.cat([one_by_one[n].tensor.reshape(-1) for n in names])
    assert whole.dtype == expected.dtype == dtype and torch.equal(_bits(whole), _bits(expected))
    # ... and it is the logical tensors themselves, in order.
    logical = torch.cat([full.reshape(-1) for full, _ in FULL.values()]).to(dtype)
    assert torch.equal(_bits(whole), _bits(logical))
    # Any run of consecutive tensors too (a chunk starts and ends anywhere).
    for lo, hi in ((1, 3), (2, 6), (4, 5)):
        got = _lazy(tmp_path, "candidate").tensors.span(names[lo:hi])
        want = torch.cat([one_by_one[n].tensor.reshape(-1) for n in names[lo:hi]])
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("world", [4, 1])
def test_a_chunk_of_several_dtypes_is_joined_in_float32_or_float64(tmp_path, world):
    """A bf16 run records fp32 grads and losses among its bf16 tensors, and a part stores each dtype
    as a run of its own: the chunk is each dtype's span, joined in float32 (float64 where a record
    is), as the lookups give it; a single-rank run (a reference) the same way."""
    dtypes = {"b": torch.bfloat16, "c": torch.bfloat16, "e": torch.float64}
    if world == 4:
        _write(tmp_path, "mixed", dtypes=dtypes)
    else:
        tr = Tracer(str(tmp_path), "mixed", 0, coords={}, sizes={}, meta={"fingerprint": "spans"})
        with tr.step(0):
            for path, (full, _) in FULL.items():
                tr.record(path, "output", full.to(dtypes.get(path, torch.float32)), Layout())
        tr.close()
    names = _lazy(tmp_path, "mixed", world).order
    one_by_one = _lazy(tmp_path, "mixed", world).tensors
    for chunk, dtype in ((names[:4], torch.float32), (names, torch.float64)):
        got = _lazy(tmp_path, "mixed", world).tensors.span(chunk)
        assert got is not None and got.dtype == dtype
        assert torch.equal(got, torch.cat([one_by_one[n].tensor.reshape(-1).to(dtype) for n in chunk]))
        logical = [full.to(dtypes.get(path, torch.float32)).to(dtype).reshape(-1)
                   for path, (full, _) in FULL.items()]
        assert torch.equal(got, torch.cat(logical[:len(chunk)]))


def test_a_chunk_is_read_whole_from_up_to_two_parts_per_rank(tmp_path):
    """A chunk that straddles a part boundary (here one part per record) is read part by part and
    joined; one spread over more parts is looked up one by one (a walk holds at most two parts per
    rank, tracer.logical). Both give the tensors' values, and a part is dropped once read."""
    tr = Tracer(str(tmp_path), "parts", 0, coords={}, sizes={}, meta={"fingerprint": "spans"}, flush_bytes=1)
    with tr.step(0):
        tr.record("a", "output", FULL["a"][0], Layout())
        tr.record("b", "output", FULL["b"][0].to(torch.bfloat16), Layout())
        tr.record("c", "output", FULL["c"][0], Layout())
    tr.close()
    names = _lazy(tmp_path, "parts", 1).order
    want = [FULL[p][0].reshape(-1).float() for p in "abc"]
    want[1] = FULL["b"][0].to(torch.bfloat16).reshape(-1).float()
    assert _lazy(tmp_path, "parts", 1).tensors.span(names) is None   # three parts
    two = _lazy(tmp_path, "parts", 1).tensors
    got = two.span(names[:2])
    assert got is not None and got.dtype == torch.float32 and torch.equal(got, torch.cat(want[:2]))
    read = {(0, two.pieces(n)[0][1]["file"]) for n in names[:2]}
    assert len(read) == 2 and not read & set(two.parts.held)   # both dropped once their tensors were read


def test_records_scaled_by_powers_of_two_are_scaled_exactly_in_the_pass_or_left_to_lookups(tmp_path):
    """A DP run's grad_output records carry a power-of-two scale: applied in the pass exactly as a
    lookup applies it (in the stored dtype); a product that would round (a subnormal) or a scale that
    is not a power of two leaves the chunk to lookups, which widen those tensors to float64."""
    scales = {"b": 0.5, "c": 0.5, "e": 0.25}
    _write(tmp_path, "scaled", scales=scales)
    names = _lazy(tmp_path, "scaled").order
    whole = _lazy(tmp_path, "scaled").tensors.span(names)
    assert whole is not None and whole.dtype == torch.float32
    logical = torch.cat([full.reshape(-1) * scales.get(path, 1.0) for path, (full, _) in FULL.items()])
    assert torch.equal(whole, logical)
    one_by_one = _lazy(tmp_path, "scaled").tensors
    assert torch.equal(whole, torch.cat([one_by_one[n].tensor.reshape(-1) for n in names]))
    for run, kw in (("third", {"scales": {"c": 1.0 / 3}}), ("tiny", {"scales": {"c": 0.5}, "tiny": True})):
        _write(tmp_path, run, **kw)
        names = _lazy(tmp_path, run).order
        assert _lazy(tmp_path, run).tensors.span(names) is None, run
        assert _lazy(tmp_path, run).tensors[names[2]].tensor.dtype == torch.float64   # 'c', widened
    assert _lazy(tmp_path, "tiny").tensors[names[2]].tensor[0, 0].item() == 2.0**-150


def test_replicas_one_bit_apart_or_a_partial_sum_are_left_to_the_lookup_that_measures_them(tmp_path):
    _write(tmp_path, "candidate", ulp_on_rank=3)
    names = _lazy(tmp_path, "candidate").order
    assert _lazy(tmp_path, "candidate").tensors.span(names) is None
    assert _lazy(tmp_path, "candidate").tensors.span(names[1:]) is not None   # without 'a'
    looked_up = _lazy(tmp_path, "candidate").tensors[names[0]]
    assert looked_up.replica_differ == 1 and looked_up.replica_ranks == (0, 3)
    _write(tmp_path, "partial", partial=True)
    names = _lazy(tmp_path, "partial").order
    assert _lazy(tmp_path, "partial").tensors.span(names) is None
    assert torch.equal(_lazy(tmp_path, "partial").tensors[names[-1]].tensor, torch.full((3,), 3.0).double())


def test_a_lazily_compared_candidate_is_judged_as_one_read_whole(tmp_path):
    """The comparison walks a lazily read candidate in chunks (the one-pass path); the report is the
    one of a candidate read whole and looked up tensor by tensor, for a clean candidate and for one
    whose replicas differ by one bit (the replica verdict must survive the fast path)."""
    for rank_run in ("reference", "perturbed-1"):
        tr = Tracer(str(tmp_path), rank_run, 0, coords={}, sizes={}, meta={"fingerprint": "spans"})
        with tr.step(0):
            for path, (full, _) in FULL.items():
                moved = full * (1 + 2**-20) if rank_run == "perturbed-1" else full
                tr.record(path, "output", moved, Layout())
        tr.close()
    _write(tmp_path, "candidate")
    _write(tmp_path, "skewed", ulp_on_rank=1)
    policy = TolerancePolicy()
    for run, verdict in (("candidate", "pass"), ("skewed", "fail")):
        eager = compare(load_logical(str(tmp_path), "reference", 1), load_logical(str(tmp_path), run, 4),
                        [load_logical(str(tmp_path), "perturbed-1", 1)], policy)
        lazy = compare(_lazy(tmp_path, "reference", 1), _lazy(tmp_path, run),
                       [_lazy(tmp_path, "perturbed-1", 1)], policy)
        assert lazy.to_json() == eager.to_json() and lazy.verdict == verdict
    assert "replicas on ranks (0, 1) differ in 1 element" in lazy.first_divergence.reason
