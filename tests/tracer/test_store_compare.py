"""Store round-trip, integrity checks, and the comparison stage on hand-built traces (no Ray)."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from tracer import ModuleLayout, Shard, Tracer
from tracer.checksum import hasher
from tracer.compare import compare
from tracer.errors import TraceError
from tracer.logical import load_logical, scaled
from tracer.stats_compare import over_tolerance
from tracer.store import READ_THREADS
from tracer.tolerance import TolerancePolicy, cosine, max_err, rel_err

PLAN = {"fc": ModuleLayout(output=Shard(-1, "tp"), params={"weight": Shard(0, "tp")}), "out": ModuleLayout()}


class Tiny(nn.Module):
    def __init__(self, w_fc: torch.Tensor, w_out: torch.Tensor):
        super().__init__()
        self.fc = nn.Linear(w_fc.shape[1], w_fc.shape[0], bias=False)
        self.out = nn.Linear(w_out.shape[1], w_out.shape[0], bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(w_fc)
            self.out.weight.copy_(w_out)


FULL_FC = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
FULL_OUT = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
X = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))


def write_run(root: Path, run: str, tp: int = 1, fc_scale: float = 1.0, nan: bool = False,
              replica_skew: float = 0.0, microbatch: int = 0, fingerprint: str = "recipe-a",
              flush_bytes: int = 32 << 20, replica_ulp: bool = False, mode: str = "full",
              lost_grad: bool = False) -> None:
    """A 'tensor-parallel' run of Tiny, emulated rank by rank in one process.

    fc is column-parallel (weight rows and output columns sharded); `out` consumes the gathered
    activation, so its output and the loss are replicated, as a real TP run traces them.
    """
    for r in range(tp):
        m = Tiny(FULL_FC.chunk(tp, 0)[r] * fc_scale, FULL_OUT)
        tr = Tracer(str(root), run, r, coords={"tp": r}, sizes={"tp": tp}, meta={"fingerprint": fingerprint},
                    flush_bytes=flush_bytes, mode=mode)
        tr.attach(m, PLAN)
        with tr.step(0):
            with tr.microbatch(microbatch):
                m.fc(X)  # traced shard; the gathered activation below is what a TP all-gather returns
                gathered = X @ FULL_FC.t() * fc_scale
                if nan:
                    gathered[0, 0] = float("nan")
                y = m.out(gathered.requires_grad_(True))
                loss = y.square().mean() * (1 + replica_skew * r)
            tr.record_loss(loss, microbatch=microbatch)
            # A replicated tensor every rank holds whole; with replica_ulp, rank 1's copy is one ulp off
            # in one element (a nondeterministic kernel, or a reduction applied on one rank only).
            probe = X.clone()
            if replica_ulp and r == 1:
                probe[2, 1] = torch.nextafter(probe[2, 1], torch.tensor(float("inf")))
            tr.record("probe", "output", probe, microbatch=microbatch)
            loss.backward()
            if lost_grad:   # a gradient a parallel wrapper never delivered
                m.out.weight.grad = None
            tr.record_param_grads(m)
            tr.record_params(m)
        tr.close()


def load(root, run, tp=1):
    return load_logical(str(root), run, tp)


@pytest.fixture
def traces(tmp_path):
    write_run(tmp_path, "reference")
    write_run(tmp_path, "perturbed-0", fc_scale=1 + 2**-22)
    return tmp_path


def test_round_trip_reassembles_sharded_tensors(tmp_path):
    write_run(tmp_path, "reference")
    write_run(tmp_path, "candidate", tp=2)
    ref, cand = load(tmp_path, "reference"), load(tmp_path, "candidate", tp=2)
    assert ref.order[:3] == ["0/0/fc/output", "0/0/out/output", "0/0/loss/loss"]  # execution order
    for name in ref.order:
        assert cand.tensors[name].tensor.shape == ref.tensors[name].tensor.shape, name
    assert torch.equal(cand.tensors["0/-/fc.weight/param"].tensor, FULL_FC.double())
    assert torch.allclose(cand.tensors["0/-/out.weight/param_grad"].tensor,
                          ref.tensors["0/-/out.weight/param_grad"].tensor)
    # The output columns reassemble exactly from the ranks' shards (what each rank computed: the
    # BLAS kernel of a narrower GEMM may round differently from the full one, e.g. on AVX-512 Xeons).
    shards = [torch.nn.functional.linear(X, w) for w in FULL_FC.chunk(2, 0)]
    assert torch.equal(cand.tensors["0/0/fc/output"].tensor, torch.cat(shards, -1).double())
    assert torch.allclose(cand.tensors["0/0/fc/output"].tensor, ref.tensors["0/0/fc/output"].tensor)


def test_clean_candidate_passes_and_scaled_one_diverges(traces):
    write_run(traces, "candidate", tp=2)
    write_run(traces, "buggy", tp=2, fc_scale=1.01)
    policy = TolerancePolicy()
    ref, pert = load(traces, "reference"), [load(traces, "perturbed-0")]
    clean = compare(ref, load(traces, "candidate", 2), pert, policy)
    assert clean.verdict == "pass", [r.reason for r in clean.results if not r.ok]
    bad = compare(ref, load(traces, "buggy", 2), pert, policy)
    assert bad.verdict == "fail"
    assert bad.first_divergence.name == "0/0/fc/output"
    assert bad.first_divergence.rel_err == pytest.approx(0.01, rel=1e-3)


def test_nan_in_candidate_fails_even_where_norms_agree(traces):
    write_run(traces, "candidate", tp=2, nan=True)
    res = compare(load(traces, "reference"), load(traces, "candidate", 2), [load(traces, "perturbed-0")],
                  TolerancePolicy())
    assert res.verdict == "fail"
    assert res.first_divergence.module == "out" and "non-finite" in res.first_divergence.reason


def test_replicas_that_disagree_fail(traces):
    write_run(traces, "candidate", tp=2, replica_skew=0.5)
    res = compare(load(traces, "reference"), load(traces, "candidate", 2), [load(traces, "perturbed-0")],
                  TolerancePolicy())
    assert res.verdict == "fail"
    assert res.first_divergence.kind == "loss"
    assert "replicas" in res.first_divergence.reason


def test_tolerance_follows_perturbation_noise(traces):
    ref, pert = load(traces, "reference"), load(traces, "perturbed-0")
    write_run(traces, "candidate", tp=2)
    res = compare(ref, load(traces, "candidate", 2), [pert], TolerancePolicy(k=4.0, floor_ulps=0.0))
    by = {r.name: r for r in res.results}
    noise = rel_err(pert.tensors["0/0/fc/output"].tensor, ref.tensors["0/0/fc/output"].tensor)
    assert noise > 0
    assert by["0/0/fc/output"].tolerance == pytest.approx(4.0 * noise)


def test_truncated_part_is_an_error(traces):
    part = next((traces / "reference" / "rank00000").glob("part-*.safetensors"))
    part.write_bytes(part.read_bytes()[:-10])
    with pytest.raises(TraceError, match="truncated or corrupt"):
        load(traces, "reference")


def test_corrupted_part_is_an_error(traces):
    part = next((traces / "reference" / "rank00000").glob("part-*.safetensors"))
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(TraceError, match="checksum"):
        load(traces, "reference")


def test_a_part_with_a_matching_checksum_but_a_broken_header_is_an_error(traces):
    """Written by something other than ttrace (the manifest was rewritten to match): still an error."""
    rank = traces / "reference" / "rank00000"
    part = next(rank.glob("part-*.safetensors"))
    data = bytearray(part.read_bytes())
    data[8:12] = b'{"x"'   # the JSON header no longer parses
    part.write_bytes(bytes(data))
    manifest = json.loads((rank / "manifest.json").read_text())
    entry = next(f for f in manifest["files"] if f["file"] == part.name)
    h = hasher(manifest["checksum"])
    h.update(data)
    entry[manifest["checksum"]] = h.hexdigest()
    (rank / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="not a valid safetensors file"):
        load(traces, "reference")


def test_missing_rank_manifest_is_an_error(tmp_path):
    write_run(tmp_path, "candidate", tp=2)
    (tmp_path / "candidate" / "rank00001" / "manifest.json").unlink()
    with pytest.raises(TraceError, match=r"rank\(s\) \[1\]"):
        load(tmp_path, "candidate", 2)


def test_mismatched_runs_are_an_error(traces):
    write_run(traces, "other", microbatch=1)  # e.g. a different data split
    with pytest.raises(TraceError, match="traced different tensors"):
        compare(load(traces, "reference"), load(traces, "other"), [], TolerancePolicy())


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_a_candidate_parameter_left_without_its_gradient_fails_there_as_untrained(tmp_path, mode):
    """A param grad the candidate lacks (and nothing else) is a FAIL at its place in execution order,
    naming its module; every other tensor is judged as usual (and passes here)."""
    for run, kw in (("reference", {}), ("perturbed-0", {"fc_scale": 1 + 2**-22}),
                    ("candidate", {"tp": 2, "lost_grad": True})):
        write_run(tmp_path, run, mode=mode, **kw)
    ref = load(tmp_path, "reference")
    got = compare(ref, load(tmp_path, "candidate", tp=2), [load(tmp_path, "perturbed-0")], TolerancePolicy())
    assert got.verdict == "fail"
    fd, lost = got.first_divergence, "0/-/out.weight/param_grad"
    assert (fd.name, fd.module, fd.kind, fd.rel_err) == (lost, "out", "param_grad", math.inf)
    assert fd.reason.startswith("no gradient") and "never trained" in fd.reason
    assert [r.name for r in got.results] == ref.order
    assert [r.index for r in got.results] == list(range(len(ref.order)))
    assert [r.name for r in got.results if not r.ok] == [lost]
    assert fd.index == ref.order.index(lost) and fd.index > 0   # the tensors before it were judged, and pass
    # An isolated rerun lacks the grad too: the culprit is that parameter, alone in its window.
    from tracer.isolation import name_culprit

    named = name_culprit(got, got)
    assert named["culprit"]["module"] == "out" and named["culprit"]["resolved"], named
    assert named["origin"] == "local" and named["blame_window"]["size"] == 1, named


def test_a_candidate_lacking_other_tensors_than_param_grads_is_an_error(traces):
    write_run(traces, "candidate", lost_grad=True, microbatch=1)   # its activations named otherwise too
    with pytest.raises(TraceError, match=r"traced different tensors.*the runs do not match"):
        compare(load(traces, "reference"), load(traces, "candidate"), [], TolerancePolicy())


def test_metrics():
    r = torch.tensor([3.0, 4.0, 0.0], dtype=torch.float64)
    c = torch.tensor([3.0, 4.0, 0.5], dtype=torch.float64)
    assert rel_err(c, r) == pytest.approx(0.1)
    assert max_err(c, r) == pytest.approx(0.5 / 4.0)
    assert cosine(r, r) == pytest.approx(1.0)
    assert cosine(-r, r) == pytest.approx(-1.0)
    assert rel_err(r, r) == 0.0
    assert math.isinf(rel_err(c, torch.zeros(3, dtype=torch.float64)))


def test_a_record_scaled_by_a_power_of_two_keeps_its_dtype_unless_that_would_round():
    """A DP grad scale of 1/2 keeps the candidate in the reference's precision (its chunk is then
    measured against the prepared reference side); every scaled value is exact either way."""
    t = torch.randn(64, generator=torch.Generator().manual_seed(3))
    for dtype in (torch.float32, torch.bfloat16):
        half = scaled(t.to(dtype), 0.5)
        assert half.dtype == dtype and torch.equal(half.double(), t.to(dtype).double() * 0.5)
    assert scaled(t, 4.0).dtype == torch.float32 and scaled(t, -0.25).dtype == torch.float32
    third = scaled(t, 1 / 3)   # would round in float32
    assert third.dtype == torch.float64 and torch.equal(third, t.double() * (1 / 3))
    tiny = torch.tensor([math.ldexp(3, -149), 1.0])   # a float32 subnormal: halving loses its last bit
    assert scaled(tiny, 0.5).dtype == torch.float64 and scaled(tiny, 0.5)[0].item() == math.ldexp(3, -150)
    huge = torch.tensor([3e38, 1.0])   # doubling overflows float32
    assert scaled(huge, 2.0).dtype == torch.float64 and math.isfinite(scaled(huge, 2.0)[0].item())
    fp8 = t.to(torch.float8_e4m3fn)   # an fp8 payload always widens
    assert scaled(fp8, 0.5).dtype == torch.float64


def test_runs_of_different_recipes_are_an_error(traces):
    write_run(traces, "candidate", tp=2, fingerprint="recipe-b")
    with pytest.raises(TraceError, match="different recipe"):
        compare(load(traces, "reference"), load(traces, "candidate", 2), [], TolerancePolicy())


def test_a_rank_manifest_from_another_recipe_is_an_error(traces):
    """Rank 1's manifest comes from a different recipe than rank 0's: the run itself is refused."""
    write_run(traces, "candidate", tp=2)
    m = traces / "candidate" / "rank00001" / "manifest.json"
    doc = json.loads(m.read_text())
    doc["meta"]["fingerprint"] = "recipe-b"
    m.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=r"rank\(s\) \[1\] were traced from a different recipe"):
        load(traces, "candidate", 2)


def test_runs_of_different_dtypes_are_an_error(traces):
    """Same shapes, different dtype (e.g. a bf16 candidate against an fp32 reference): an error."""
    write_run(traces, "candidate", tp=2)
    ref, cand = load(traces, "reference"), load(traces, "candidate", 2)
    name = "0/0/fc/output"
    cand.info[name] = dict(cand.info[name], dtype="bfloat16")
    with pytest.raises(TraceError, match="bfloat16 but the reference as float32"):
        compare(ref, cand, [], TolerancePolicy())


def test_a_candidate_tensor_of_another_shape_is_a_verdict_at_its_module(traces):
    """The candidate reassembles one tensor to another shape (a layout declared wrong, e.g. a module
    left out of the parallel plan): a FAIL at that tensor with reason "shape", never an error and
    never a figure computed on misaligned elements; the tensors before it are judged as usual."""
    write_run(traces, "candidate", tp=2)
    ref, cand = load(traces, "reference"), load(traces, "candidate", 2)
    name = "0/0/out/output"
    cand.tensors[name].tensor = cand.tensors[name].tensor[:, :-1]
    res = compare(ref, cand, [load(traces, "perturbed-0")], TolerancePolicy())
    assert res.verdict == "fail"
    fd = res.first_divergence
    assert fd.name == name and fd.module == "out" and fd.reason.startswith("shape: "), fd
    assert "(5, 2) but the reference has (5, 3)" in fd.reason and fd.rel_err == math.inf
    assert res.results[0].name == "0/0/fc/output" and res.results[0].ok


def test_replicas_of_different_shapes_are_a_shape_verdict(traces):
    """A plain local tensor taken as replicated whose ranks hold different sizes: the candidate's pieces
    do not reassemble at all, which is again the module's layout, judged as a verdict."""
    write_run(traces, "candidate", tp=2)
    ref, cand = load(traces, "reference"), load(traces, "candidate", 2)
    name = "0/0/out/output"
    from tracer.errors import LayoutMismatch
    from tracer.layouts import Assembled, Layout, Piece, assemble

    with pytest.raises(LayoutMismatch):   # what assemble raises for such pieces
        assemble(name, Layout(), [Piece({"tp": 0}, torch.zeros(5, 3), 0),
                                   Piece({"tp": 1}, torch.zeros(5, 2), 1)], {"tp": 2})

    class Broken(dict):
        def __getitem__(self, key: str) -> Assembled:
            if key == name:
                raise LayoutMismatch(f"{name}: replicas on ranks 0 and 1 have shapes (5, 3) and (5, 2)")
            return dict.__getitem__(self, key)

    cand.tensors = Broken(cand.tensors)
    res = compare(ref, cand, [load(traces, "perturbed-0")], TolerancePolicy())
    fd = res.first_divergence
    assert res.verdict == "fail" and fd.name == name and "replicas on ranks 0 and 1" in fd.reason, fd


def test_perturbed_runs_identical_to_the_reference_are_an_error_not_a_wall_of_fails(traces):
    """A perturbed run whose perturbation never applied (bit-identical to the reference) would make
    every tolerance the floor: exit 2 saying so, never hundreds of false FAILs."""
    write_run(traces, "perturbed-1")            # same weights as the reference: nothing moved
    write_run(traces, "candidate", tp=2)
    with pytest.raises(TraceError, match=r"\['perturbed-1'\] are bit-identical to reference"):
        compare(load(traces, "reference"), load(traces, "candidate", 2),
                [load(traces, "perturbed-0"), load(traces, "perturbed-1")], TolerancePolicy())


def test_an_inf_in_the_candidate_fails_at_that_tensor(traces):
    write_run(traces, "candidate", tp=2)
    ref, cand = load(traces, "reference"), load(traces, "candidate", 2)
    cand.tensors["0/0/out/output"].tensor[1, 1] = float("-inf")
    res = compare(ref, cand, [load(traces, "perturbed-0")], TolerancePolicy())
    assert res.verdict == "fail"
    fd = res.first_divergence
    assert fd.name == "0/0/out/output" and fd.reason == "1 non-finite values"


def test_a_non_finite_perturbed_reference_is_an_error_not_a_loose_tolerance(traces):
    """A NaN in a perturbed run would make every tolerance NaN, and NaN comparisons never fail."""
    write_run(traces, "candidate", tp=2)
    pert = load(traces, "perturbed-0")
    pert.tensors["0/0/fc/output"].tensor[0, 0] = float("nan")
    with pytest.raises(TraceError, match="0/0/fc/output: a perturbed reference run has non-finite values"):
        compare(load(traces, "reference"), load(traces, "candidate", 2), [pert], TolerancePolicy())


def test_a_run_read_as_the_comparison_walks_it_gives_the_same_figures_holding_few_parts(tmp_path):
    """lazy=True (how a check reads runs): the same report as reading everything first, while at
    most the two parts a chunk straddles and the READ_THREADS read ahead are held per rank."""
    runs = {"reference": {}, "perturbed-0": {"fc_scale": 1 + 2**-22}, "candidate": {"tp": 2},
            "buggy": {"tp": 2, "fc_scale": 1.01}}
    for run, kw in runs.items():
        write_run(tmp_path, run, flush_bytes=1, **kw)   # one part per tensor
    parts = len(json.loads((tmp_path / "reference" / "rank00000" / "manifest.json").read_text())["files"])
    policy = TolerancePolicy()
    for cand in ("candidate", "buggy"):
        eager = compare(load(tmp_path, "reference"), load(tmp_path, cand, 2), [load(tmp_path, "perturbed-0")],
                        policy)
        ref, c, pert = (load_logical(str(tmp_path), run, n, lazy=True)
                        for run, n in (("reference", 1), (cand, 2), ("perturbed-0", 1)))
        lazy = compare(ref, c, [pert], policy)
        assert lazy.to_json() == eager.to_json()
        held = 2 + READ_THREADS   # a chunk's parts (at most two per rank) and those read ahead
        assert parts >= 2 * held and ref.tensors.resident_max <= held and c.tensors.resident_max <= 2 * held
    assert lazy.verdict == "fail" and eager.verdict == "fail"


def test_a_lazily_opened_run_starts_reading_each_ranks_first_part_which_a_restricted_walk_drops(tmp_path):
    """The first parts are read while the other runs' manifests load (tracer.part_cache.read_first);
    a walk of other tensors (per step, a share) drops them unread by it, and a run opened with
    read_first=False reads nothing until a lookup."""
    write_run(tmp_path, "candidate", flush_bytes=1, tp=2)   # one part per tensor
    c = load_logical(str(tmp_path), "candidate", 2, lazy=True)
    first = {(rank, f"part-{0:05d}.safetensors") for rank in (0, 1)}
    assert set(c.tensors.parts.held) == first
    assert {p.result() is not None for p in c.tensors.parts.held.values()} == {True}   # read and verified
    c.tensors.restrict([c.order[-1]])
    assert not set(c.tensors.parts.held) & first
    assert not load_logical(str(tmp_path), "candidate", 2, lazy=True, read_first=False).tensors.parts.held


def test_a_corrupt_part_of_a_lazily_read_run_is_an_error_of_the_comparison(traces):
    write_run(traces, "candidate", tp=2)
    part = next((traces / "candidate" / "rank00001").glob("part-*.safetensors"))
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    cand = load_logical(str(traces), "candidate", 2, lazy=True)   # manifests only: nothing read yet
    with pytest.raises(TraceError, match="checksum"):
        compare(load(traces, "reference"), cand, [load(traces, "perturbed-0")], TolerancePolicy())


def test_a_part_that_cannot_be_read_is_an_error_naming_the_store(traces):
    """An I/O error other than a missing file (here the part is a directory; on S3, the endpoint
    going away) is a TraceError saying what to check, not a crash of the comparison."""
    part = next((traces / "reference" / "rank00000").glob("part-*.safetensors"))
    part.unlink()
    part.mkdir()
    with pytest.raises(TraceError, match=r"reading trace part .* failed \(IsADirectoryError"):
        load(traces, "reference")


def test_replicas_one_ulp_apart_fail_unless_the_recipe_declares_nondeterministic_kernels(traces):
    """Honest replicas are bit-identical (45,022 tensors of clean checks: replica_err 0 every time), so
    they are judged bitwise: one element one ulp apart fails. With tolerance.replicas=tolerance (a
    recipe with nondeterministic kernels) the same difference is within the norm-wise tolerance."""
    write_run(traces, "candidate", tp=2, replica_ulp=True)
    ref, cand, pert = load(traces, "reference"), load(traces, "candidate", 2), load(traces, "perturbed-0")
    res = compare(ref, cand, [pert], TolerancePolicy())
    fd = res.first_divergence
    assert res.verdict == "fail" and fd.name == "0/0/probe/output", fd
    assert fd.reason.startswith("replicas on ranks (0, 1) differ in 1 element(s)"), fd.reason
    assert fd.rel_err == 0.0   # the copy that is compared is right: only the replicas disagree
    loose = compare(ref, load(traces, "candidate", 2), [pert], TolerancePolicy(replicas="tolerance"))
    assert loose.verdict == "pass", loose.first_divergence
    write_run(traces, "honest", tp=2)
    assert compare(ref, load(traces, "honest", 2), [pert], TolerancePolicy()).verdict == "pass"


# -- trace.mode=stats (tracer/stats.py, tracer/stats_compare.py) -------------------------------------

def test_stats_mode_passes_a_clean_candidate_and_flags_a_scaled_or_skewed_one(tmp_path):
    write_run(tmp_path, "reference", mode="stats")
    write_run(tmp_path, "perturbed-0", fc_scale=1 + 2**-22, mode="stats")
    write_run(tmp_path, "candidate", tp=2, mode="stats")
    write_run(tmp_path, "buggy", tp=2, fc_scale=1.01, mode="stats")
    write_run(tmp_path, "skewed", tp=2, replica_skew=0.5, mode="stats")
    manifest = json.loads((tmp_path / "candidate" / "rank00000" / "manifest.json").read_text())
    assert manifest["mode"] == "stats" and manifest["files"] == []   # no tensor values stored
    ref, pert = load(tmp_path, "reference"), [load(tmp_path, "perturbed-0")]
    clean = compare(ref, load(tmp_path, "candidate", 2), pert, TolerancePolicy())
    assert clean.verdict == "pass", [r.reason for r in clean.results if not r.ok]
    bad = compare(ref, load(tmp_path, "buggy", 2), pert, TolerancePolicy())
    assert bad.verdict == "fail" and bad.first_divergence.name == "0/0/fc/output"
    assert bad.first_divergence.rel_err == pytest.approx(0.01, rel=1e-3)   # the norm's relative error
    skewed = compare(ref, load(tmp_path, "skewed", 2), pert, TolerancePolicy())
    assert skewed.first_divergence.kind == "loss" and "replicas" in skewed.first_divergence.reason
    # over_tolerance (what the benches report): below 1 on every clean tensor, the norm's 0.01 on fc
    assert max(over_tolerance(vars(r))[0] for r in clean.results) < 1
    fd = bad.first_divergence
    fc = over_tolerance(vars(fd))
    assert fc[1] in ("norm", "sum") and fc[0] >= fd.rel_err / fd.tolerance > 1
    assert over_tolerance({**vars(fd), "max_tolerance": 0.0}) == (math.inf, "absmax")


def test_a_manifest_holding_non_finite_statistics_is_read_and_fails_at_that_tensor(tmp_path):
    """json.dumps writes a diverged tensor's statistics as NaN, which orjson refuses: the manifest is
    still read (tracer.store.parse_manifest), and the comparison fails there, not on reading."""
    write_run(tmp_path, "reference", mode="stats")
    write_run(tmp_path, "perturbed-0", fc_scale=1 + 2**-22, mode="stats")
    write_run(tmp_path, "candidate", tp=2, nan=True, mode="stats")
    assert "NaN" in (tmp_path / "candidate" / "rank00000" / "manifest.json").read_text()
    ref, pert = load(tmp_path, "reference"), [load(tmp_path, "perturbed-0")]
    got = compare(ref, load(tmp_path, "candidate", 2), pert, TolerancePolicy())
    assert got.verdict == "fail" and got.first_divergence.name == "0/0/out/output"
    assert not math.isfinite(got.first_divergence.rel_err) or "non-finite" in got.first_divergence.reason


def test_a_manifest_that_is_not_json_is_an_error_naming_it(traces):
    (traces / "perturbed-0" / "rank00000" / "manifest.json").write_text('{"format": "ttrace-trace/2", "entr')
    with pytest.raises(TraceError, match=r"perturbed-0/rank00000/manifest.json is not valid JSON"):
        load(traces, "perturbed-0")


def test_a_stats_candidate_is_judged_against_a_full_reference(traces):
    """A full-mode run contributes its reassembled tensors' statistics (stats of the same tensors)."""
    write_run(traces, "candidate", tp=2, mode="stats")
    write_run(traces, "buggy", tp=2, fc_scale=1.01, mode="stats")
    ref, pert = load(traces, "reference"), [load(traces, "perturbed-0")]
    assert compare(ref, load(traces, "candidate", 2), pert, TolerancePolicy()).verdict == "pass"
    assert compare(ref, load(traces, "buggy", 2), pert, TolerancePolicy()).verdict == "fail"


def test_stats_mode_judges_a_sum_where_the_full_mode_judges_a_projection(tmp_path):
    """The sum is a projection (on the all-ones direction): judged on a matrix's grad, not on a grad of
    one dimension (a norm weight's, a bias's) nor on a post-step parameter, where honest errors lie
    along the tensor (tracer.tolerance.TolerancePolicy.scale_tolerance). Here the perturbed run moves
    no sum (its deviation alternates in sign) and the candidate moves every element by the same 1e-3:
    the sum is ~1,800x its tolerance (the floor), the norm and the largest magnitude within theirs."""
    v = (torch.arange(64, dtype=torch.float32) - 31.5) / 32   # sums to zero
    alternating = 1e-3 * (1 - 2 * (torch.arange(64) % 2)).float()
    for run, t in (("reference", v), ("perturbed-0", v + alternating), ("candidate", v + 1e-3)):
        tr = Tracer(str(tmp_path), run, 0, coords={}, sizes={}, mode="stats")
        with tr.step(0):
            tr.record("norm.weight", "param_grad", t)
            tr.record("proj.weight", "param_grad", t.view(8, 8))
            tr.record("proj.weight", "param", t.view(8, 8))
        tr.close()
    got = compare(load(tmp_path, "reference"), load(tmp_path, "candidate"), [load(tmp_path, "perturbed-0")],
                  TolerancePolicy())
    verdicts = {r.name: (r.ok, r.reason) for r in got.results}
    assert verdicts["0/-/norm.weight/param_grad"] == (True, "")
    assert verdicts["0/-/proj.weight/param"] == (True, "")
    ok, reason = verdicts["0/-/proj.weight/param_grad"]
    assert not ok and reason.startswith("sum: relative error"), reason
    bad = next(r for r in got.results if r.name == "0/-/proj.weight/param_grad")
    assert bad.rel_err < bad.tolerance and bad.max_err < bad.max_tolerance   # only its sum is off


def one_grad_in_stats_mode(tmp_path, reference, perturbed, candidate, perturbation=None):
    """One param grad traced in stats mode by a reference, one perturbed run (moved by `perturbation`,
    as its meta says) and a candidate; their comparison."""
    for run, t in (("reference", reference), ("perturbed-1", perturbed), ("candidate", candidate)):
        meta = {"perturbation": perturbation} if perturbation and run == "perturbed-1" else {}
        tr = Tracer(str(tmp_path), run, 0, coords={}, sizes={}, meta=meta, mode="stats")
        with tr.step(0):
            tr.record("proj.weight", "param_grad", t)
        tr.close()
    return compare(load(tmp_path, "reference"), load(tmp_path, "candidate"), [load(tmp_path, "perturbed-1")],
                   TolerancePolicy())


@pytest.mark.parametrize(("perturbation", "scale", "verdict"), [
    ("weights", 1e-3, "pass"), ("weights", 3e-3, "fail"), ("gemm", 1e-3, "pass"), ("gemm", 3e-3, "fail")])
def test_stats_mode_judges_each_statistic_at_k_stats_in_any_precision(tmp_path, perturbation, scale, verdict):
    """A statistic is one number per tensor that each perturbed run samples once; honest layouts moved
    them up to 15.6x their noise under GEMM rounding draws, 9x in fp32 (docs/stats_mode.md), so stats
    mode judges them at k_stats (24), not k (4), whatever moved the perturbed runs: a grad scaled 10x
    its noise passes, 30x fails."""
    v = ((torch.arange(64, dtype=torch.float32) - 31.5) / 32).view(8, 8)
    got = one_grad_in_stats_mode(tmp_path, v, v * (1 + 1e-4), v * (1 + scale), perturbation)
    (res,) = got.results
    assert res.tolerance == pytest.approx(24 * res.noise)
    assert res.max_tolerance == pytest.approx(24 * res.max_noise)
    assert got.verdict == verdict, (res.rel_err, res.tolerance)


def test_the_largest_magnitudes_noise_is_at_least_the_norms(tmp_path):
    """Perturbed runs that move every element but the largest (bf16 rounding of a grad's largest
    element absorbed every GEMM draw, a clean bf16 check with reference.micro_batch) give the largest
    magnitude no noise of its own: it is judged at the norm's, not at the floor, where the candidate's
    honest 1e-3 on that element failed at 1000x."""
    v = ((torch.arange(64, dtype=torch.float32) + 1) / 64).view(8, 8)
    v[7, 7] = 2.0   # the argmax, alone
    top = (torch.tensor([7]), torch.tensor([7]))
    others = (v * (1 + 1e-3)).index_put_(top, v[top])
    got = one_grad_in_stats_mode(tmp_path, v, others, v.clone().index_put_(top, v[top] * (1 + 1e-3)))
    (res,) = got.results
    assert res.noise > 5e-4 and res.max_noise == res.noise and res.max_err == pytest.approx(1e-3, rel=1e-3)
    assert got.verdict == "pass", res.reason


def test_stats_perturbed_runs_identical_to_the_reference_are_an_error(tmp_path):
    write_run(tmp_path, "reference", mode="stats")
    write_run(tmp_path, "perturbed-0", mode="stats")
    write_run(tmp_path, "candidate", tp=2, mode="stats")
    with pytest.raises(TraceError, match="bit-identical"):
        compare(load(tmp_path, "reference"), load(tmp_path, "candidate", 2), [load(tmp_path, "perturbed-0")],
                TolerancePolicy())


def test_gc_frozen_keeps_old_objects_out_of_gc_passes_and_leaves_a_users_freeze_alone():
    import gc

    from tracer.heap import gc_frozen

    before = gc.get_freeze_count()
    assert before == 0
    with gc_frozen():
        assert gc.get_freeze_count() > 0   # the heap alive at entry is frozen
        fresh = [[]]
        fresh[0].append(fresh)   # a cycle made inside the block is still collected
        del fresh
        assert gc.collect() > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()   # a process that froze its own heap keeps it frozen
    try:
        frozen = gc.get_freeze_count()
        with gc_frozen():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_what_a_gc_pause_allocated_skips_the_young_passes_and_its_garbage_is_still_collected():
    """tracer.heap.gc_paused moves what it allocated to the oldest generation when it ends (a young
    pass over a run's manifests would free nothing); a cycle made in it and dropped is still collected
    by a full pass; a process that froze its own heap keeps it frozen, and nothing of ours joins it."""
    import gc

    from tracer.heap import gc_paused

    gc.collect()
    with gc_paused():
        kept = [{"shape": [i]} for i in range(20_000)]
        cycle = [[]]
        cycle[0].append(cycle)
    assert gc.isenabled() and gc.get_count()[0] < 100
    assert not any(o is kept for o in gc.get_objects(generation=0))
    assert kept in gc.get_objects(generation=2)
    del cycle
    assert gc.collect() > 0
    gc.freeze()   # a process's own freeze: left alone, and nothing of ours joins it
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            young = [{"k": i} for i in range(1_000)]
        assert gc.get_freeze_count() == frozen and any(o is young for o in gc.get_objects())   # not frozen
    finally:
        gc.unfreeze()


def test_inside_our_own_freeze_no_pause_or_nested_freeze_walks_the_frozen_heap(monkeypatch):
    """gc.get_freeze_count() walks every frozen object (24 ms in a check's driver): inside a gc_frozen
    block, a pause's end and a nested gc_frozen never call it, and still leave the freeze as it is."""
    import gc

    from tracer import heap

    with heap.gc_frozen():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        calls = []
        real = gc.get_freeze_count
        monkeypatch.setattr(gc, "get_freeze_count", lambda: calls.append(1) or real())
        with heap.gc_paused():
            young = [{"k": i} for i in range(1_000)]
        with heap.gc_frozen():
            pass
        monkeypatch.undo()
        assert calls == [] and gc.get_freeze_count() == frozen
        assert not any(o is young for o in gc.get_objects(generation=2))   # not aged into the frozen heap
    assert gc.get_freeze_count() == 0


def test_a_fork_made_while_another_thread_holds_the_freeze_lock_can_still_pause_the_gc():
    """A process that forks from one thread while others run (a user's job may; ttrace's fork server
    has no other thread): a child that inherited the freeze lock held would hang at its first GC
    pause's end. The lock is renewed in the child."""
    import os
    import threading
    import time

    from tracer import heap

    held, release = threading.Event(), threading.Event()

    def hold():
        with heap._FREEZE_LOCK:
            held.set()
            release.wait(30)

    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:   # the child: exit 0 once a pause ended
        with heap.gc_paused():
            pass
        os._exit(0)
    try:
        deadline = time.monotonic() + 20
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0, done
    finally:
        release.set()


def _reference_set(root: Path, jobs: list | None = None):
    from orchestrator.refcache import ReferenceSet

    return ReferenceSet("key", str(root), str(root), ["reference", "perturbed-0"], "hit", jobs=jobs or [])


def test_a_reference_set_read_ahead_is_compared_as_if_read_while_walked(traces):
    """orchestrator/prefetch.py: a set whose jobs are done is read whole on a background thread, within
    the budget; over it, or while a job still runs, it is read as the comparison walks it. The
    figures are the same either way."""
    from types import SimpleNamespace

    from orchestrator.prefetch import ReferencePrefetch
    from tracer.logical import StoredTensors

    write_run(traces, "candidate", tp=2, fc_scale=1.01)
    policy = TolerancePolicy()
    walk = lambda run, ranks=1: load_logical(str(traces), run, ranks, lazy=True)
    walked = compare(walk("reference"), walk("candidate", 2), [walk("perturbed-0")], policy)
    assert walked.verdict == "fail"
    running = SimpleNamespace(state="running")
    for budget, jobs, read_ahead in ((1 << 30, [], True), (100, [], False), (1 << 30, [running], False)):
        rs = _reference_set(traces, jobs)
        prefetch = ReferencePrefetch([rs], budget_bytes=budget)
        prefetch.poll()
        reference, perturbed = prefetch.traces(rs)
        assert isinstance(reference.tensors, StoredTensors) != read_ahead, (budget, jobs)
        assert (prefetch.seconds_of(rs) is not None) == read_ahead
        assert (prefetch.prepared(rs) is not None) == read_ahead   # its side of the measurement too
        got = compare(reference, walk("candidate", 2), perturbed, policy, prepared=prefetch.prepared(rs))
        assert got.to_json() == walked.to_json()
    running.state = "done"   # the job ended: the next poll reads the set
    prefetch.poll()
    assert not isinstance(prefetch.traces(rs)[0].tensors, StoredTensors)


def test_a_corrupt_part_of_a_reference_set_read_ahead_is_the_same_error(traces):
    from orchestrator.prefetch import ReferencePrefetch

    part = next((traces / "perturbed-0" / "rank00000").glob("part-*.safetensors"))
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    rs = _reference_set(traces)
    prefetch = ReferencePrefetch([rs])
    prefetch.poll()
    with pytest.raises(TraceError, match=r"perturbed-0/rank00000/part-.* is truncated or corrupt.*checksum"):
        prefetch.traces(rs)


def test_the_read_ahead_limit_comes_from_the_environment(traces, monkeypatch):
    from orchestrator.prefetch import ENV, ReferencePrefetch
    from tracer.logical import StoredTensors

    monkeypatch.setenv(ENV, "0")   # 0: never read ahead
    rs = _reference_set(traces)
    prefetch = ReferencePrefetch([rs])
    prefetch.poll()
    assert isinstance(prefetch.traces(rs)[0].tensors, StoredTensors) and prefetch.prepared(rs) is None
