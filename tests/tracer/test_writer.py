"""The trace writer's fast paths (issue 16): snapshots into pooled slabs, parts written from the slab,
checksums old and new, the manifest committed last, the CUDA copy ordering (on CPU), and the
statistics of trace.mode=stats combined across shards."""

import errno
import gc
import hashlib
import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch
import xxhash

from tracer import Partial, Replicate, Shard
from tracer.errors import TraceError
from tracer.layouts import Layout
from tracer.logical import load_logical
from tracer.snapshot import DeviceCopier, Part, wait_for_copies
from tracer.stats import combine, kept_in_full, local_stats, of_tensor
from tracer.store import read_run
from tracer.writer import TraceWriter

ROOT = Path(__file__).resolve().parents[2]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 70, generator=g)
    return {
        "a": torch.randn(3, 5, generator=g),                       # odd byte counts: alignment in the slab
        "h": torch.randn(7, generator=g).to(torch.bfloat16),
        "q": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
        "d": torch.randn(2, 3, generator=g, dtype=torch.float64),
        "i": torch.arange(5, dtype=torch.int64),
        "s": torch.tensor(2.5),                                      # 0-dim
        "e": torch.empty(0, 4),                                      # empty
        "t": big.t(),                                                # not contiguous
        "o": big[3:5],                                               # contiguous, storage offset > 0
        "n": torch._neg_view(torch.randn(4, 3, generator=g)),        # lazy negation: its bytes are -x's
        "m": torch.randn(4, 3, generator=g, dtype=torch.complex64).conj().imag,   # the same, public API
        "w": _Wrapped(torch.randn(6, 2, generator=g)),               # a subclass: no bytes of its own
        "big": torch.randn(40, 40, generator=g),                     # larger than a slab
    }


class _Wrapped(torch.Tensor):
    """A wrapper tensor subclass (as DTensor is): its values live in `inner`, not at its data_ptr()."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   strides=inner.stride())

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, _Wrapped) else x
        out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})
        return _Wrapped(out) if func is torch.ops.aten.detach.default else out

    def clone(self, *args, **kwargs):
        return self.inner.clone()


def _write(root: Path, run: str, flush_bytes: int = 1024, mode: str = "full",
           extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    w = TraceWriter(str(root), run, 0, {"run": run, "rank": 0, "coords": {}, "sizes": {}, "meta": {}},
                    flush_bytes=flush_bytes, mode=mode)
    tensors = dict(_tensors(), **(extra or {}))
    for seq, (name, t) in enumerate(tensors.items()):
        w.add((name, name, "", "output", 0, None, seq, Replicate().to_json(), 1.0), t)   # writer.FIELDS
    kept = {n: t.clone().resolve_neg() for n, t in tensors.items()}
    for t in tensors.values():   # changed after the record: the snapshot must not see it
        if t.numel() and t.dtype.is_floating_point and t.dtype.itemsize > 1:
            t.add_(1)
    w.close()
    return kept


@pytest.mark.parametrize("write_bytes", [None, 40])   # 40: a part's bytes in many writes, split mid-tensor
def test_parts_written_from_slabs_read_back_bit_for_bit_in_several_parts(tmp_path, monkeypatch, write_bytes):
    if write_bytes is not None:
        monkeypatch.setattr("tracer.writer.WRITE_BYTES", write_bytes)
    want = _write(tmp_path, "r")
    manifest = json.loads((tmp_path / "r" / "rank00000" / "manifest.json").read_text())
    assert manifest["checksum"] == "xxh3_64" and len(manifest["files"]) > 2
    got = load_logical(str(tmp_path), "r", 1).tensors
    for name, t in want.items():
        assert got[name].tensor.dtype == t.dtype and got[name].tensor.shape == t.shape, name
        assert torch.equal(got[name].tensor.view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def _header_bytes(part: Path) -> int:
    return 8 + struct.unpack("<Q", part.read_bytes()[:8])[0]


def test_a_part_goes_to_a_local_directory_with_o_direct_and_safetensors_reads_it(tmp_path):
    """A part whose tensors lie back to back in its slab is written with O_DIRECT (tracer/direct_io.py):
    its header padded to whole 4 KB blocks, its data the slab's bytes, the file cut to its exact
    length. A part with an alignment hole (bf16 then float32) goes through the page cache, grouped by
    element size. Both read back bit for bit, by safetensors itself and by the comparison's reader.
    The header is formatted directly (tracer.safetensors_views.header_json), not by json.dumps: names with a
    quote, a backslash, a control character or a non-ASCII letter are escaped as json.dumps would."""
    g = torch.Generator().manual_seed(1)
    x, y, h, z = 'x"q', "y\\b", "h\nn", "z\u00e9"
    parts = [{x: torch.randn(300, generator=g), y: torch.randn(7, 5, generator=g)},
             {h: torch.randn(3, generator=g).to(torch.bfloat16), z: torch.randn(9, generator=g)}]
    w = TraceWriter(str(tmp_path), "r", 0, {"run": "r", "rank": 0, "coords": {}, "sizes": {}, "meta": {}})
    for seq, (name, t) in enumerate(kv for p in parts for kv in p.items()):
        w.add((name, name, "", "output", 0, None, seq, Replicate().to_json(), 1.0), t)
        if name == y:
            w.flush()
    w.close()
    rank = tmp_path / "r" / "rank00000"
    files = json.loads((rank / "manifest.json").read_text())["files"]
    assert len(files) == 2
    for f, want in zip(files, parts, strict=True):
        path = rank / f["file"]
        assert path.stat().st_size == f["bytes"]
        got = safetensors.torch.load_file(path)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert _header_bytes(rank / files[0]["file"]) % 4096 == 0       # O_DIRECT
    assert _header_bytes(rank / files[1]["file"]) % 4096 != 0       # the hole: the page cache
    trace = load_logical(str(tmp_path), "r", 1).tensors             # checksums verified on the way
    assert all(torch.equal(trace[k].tensor, t) for p in parts for k, t in p.items())


def test_a_store_that_fails_a_direct_write_fails_the_job_and_commits_no_manifest(tmp_path, monkeypatch):
    """A disk full (ENOSPC) under an O_DIRECT write is the store's failure, not a refusal of O_DIRECT:
    the writer does not retry it through the page cache, the job gets a TraceError naming the store,
    and no manifest is committed (a comparison reports the rank as uncommitted). Simulated: a full
    disk cannot be caused here without filling the machine's."""
    real_pwrite = os.pwrite

    def full_disk(fd, data, offset):
        if offset > 0:   # after the header: mid-part
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr("tracer.direct_io.os.pwrite", full_disk)
    with pytest.raises(TraceError, match=r"writing trace to .* failed: \[Errno 28\]"):
        _write(tmp_path, "r")
    assert not (tmp_path / "r" / "rank00000" / "manifest.json").exists()


@pytest.mark.parametrize("refusal", ["EINVAL", "EOPNOTSUPP", "no O_DIRECT"])
def test_a_filesystem_that_refuses_o_direct_gets_its_parts_through_the_page_cache(tmp_path, monkeypatch,
                                                                                 refusal):
    """EINVAL on an O_DIRECT open (tmpfs before Linux 6.6, some overlay and network filesystems), or
    EOPNOTSUPP (some FUSE filesystems), turns the writer to buffered writes for good, losing nothing;
    so does a system without O_DIRECT (macOS).
    Simulated: every filesystem on this machine's kernel (6.18) accepts O_DIRECT, so the refusal is
    the one fault here not caused for real."""
    real_open, refused = os.open, []

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(getattr(errno, refusal), os.strerror(getattr(errno, refusal)), path)
        return real_open(path, flags, *args)

    if refusal != "no O_DIRECT":
        monkeypatch.setattr("tracer.direct_io.os.open", refusing_open)
    else:
        monkeypatch.setattr("tracer.direct_io._O_DIRECT", 0)
    want = _write(tmp_path, "r")
    rank = tmp_path / "r" / "rank00000"
    files = json.loads((rank / "manifest.json").read_text())["files"]
    assert len(refused) == (refusal != "no O_DIRECT") and len(files) > 2   # refused once, then not asked
    assert all(_header_bytes(rank / f["file"]) % 4096 for f in files)
    got = load_logical(str(tmp_path), "r", 1).tensors
    assert all(torch.equal(got[n].tensor.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
               for n, t in want.items())


def test_a_record_leaves_no_object_the_cyclic_gc_tracks(tmp_path):
    """Per record the training thread keeps a manifest row and a slot in the current part, as atoms in
    flat lists (shapes interned): the GC's young-generation count, which grows by each tracked object
    that outlives its statement, does not grow with records (a tuple per row and slot made it grow by
    4 a record, one GC pass per ~440 records rescanning what the process holds). The manifest still
    carries each record's layout and shape."""
    w = TraceWriter(str(tmp_path), "r", 0, {"run": "r", "rank": 0, "coords": {}, "sizes": {}, "meta": {}})
    layout = Shard(0, "tp").to_json()
    names = [(f"0/-/m{seq}/output", f"m{seq}") for seq in range(200)]   # made before counting
    tensors = [torch.ones(4, 3) for _ in range(200)]
    record = lambda seq: w.add((*names[seq], "Linear", "output", 0, None, seq, layout, 1.0), tensors[seq])
    record(0)   # its shape's tuple, the part, the lists' first cells
    gc.disable()
    try:
        before = gc.get_count()[0]
        for seq in range(1, 200):
            record(seq)
        grown = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert grown < 10, f"{grown} GC-tracked objects kept for 199 records"
    w.close()
    entries = json.loads((tmp_path / "r" / "rank00000" / "manifest.json").read_text())["entries"]
    assert [(e["layout"], e["shape"], e["seq"]) for e in entries] == [(layout, [4, 3], i) for i in range(200)]


def test_a_record_with_fields_of_another_length_is_refused_at_commit(tmp_path):
    """A record's fields lie flat in one list: a caller passing another number of them would shift every
    later record's, so the commit refuses the trace instead of writing a manifest of shifted fields."""
    w = TraceWriter(str(tmp_path), "r", 0, {"run": "r", "rank": 0, "coords": {}, "sizes": {}, "meta": {}})
    w.add(("0/-/m/output", "m", "Linear", "output", 0, None, 0, Shard(0, "tp").to_json()), torch.ones(2))
    with pytest.raises(TraceError, match="1 records; each record's fields must be"):
        w.close()
    assert not (tmp_path / "r" / "rank00000" / "manifest.json").exists()


def test_stats_mode_records_the_statistics_of_each_snapshot_as_local_stats_computes_them(tmp_path):
    """The writer reduces whole-block runs of its slabs (padding zeroed, dtypes mixed, several parts, a
    tensor larger than a slab): the same statistics as `local_stats` of each tensor alone, within a
    few ulps of float64 ones, and finite where a float32 block's own reduction would overflow; the
    hash is python-xxhash's xxh3_64 of the tensor's bytes (the kernel links xxhash's C function)."""
    huge = torch.full((300,), 3e30)   # its squares overflow float32
    want = _write(tmp_path, "r", flush_bytes=1024, mode="stats", extra={"huge": huge})
    manifest = json.loads((tmp_path / "r" / "rank00000" / "manifest.json").read_text())
    assert manifest["files"] == []
    got = {e["name"]: e["stats"] for e in manifest["entries"]}
    for name, t in want.items():
        assert got[name] == local_stats([t])[0], name
        x = t.double().reshape(-1)
        assert got[name]["sumsq"] == pytest.approx(float(x.square().sum()), rel=1e-6, abs=1e-30), name
        assert got[name]["sum"] == pytest.approx(float(x.sum()), rel=1e-6, abs=1e-6), name
        assert got[name]["absmax"] == (float(x.abs().max()) if x.numel() else 0.0), name
        assert got[name]["hash"] == xxhash.xxh3_64_hexdigest(t.reshape(-1).view(torch.uint8).numpy()), name
    assert math.isfinite(got["huge"]["sumsq"])


def _to_legacy(rank: Path) -> None:
    """Rewrite a rank's manifest as ttrace-trace/1 wrote it: sha256 per part, no checksum field."""
    manifest = json.loads((rank / "manifest.json").read_text())
    for f in manifest["files"]:
        f.pop(manifest["checksum"])
        f["sha256"] = hashlib.sha256((rank / f["file"]).read_bytes()).hexdigest()
    del manifest["checksum"], manifest["mode"]
    manifest["format"] = "ttrace-trace/1"
    (rank / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("algorithm", ["xxh3_64", "sha256"])
def test_both_checksums_verify_and_a_corrupt_part_is_an_error_naming_it(tmp_path, algorithm):
    want = _write(tmp_path, "r")
    rank = tmp_path / "r" / "rank00000"
    if algorithm == "sha256":
        _to_legacy(rank)
    got = load_logical(str(tmp_path), "r", 1).tensors
    assert torch.equal(got["a"].tensor, want["a"])
    part = rank / json.loads((rank / "manifest.json").read_text())["files"][1]["file"]
    data = bytearray(part.read_bytes())
    data[-1] ^= 0x01
    part.write_bytes(bytes(data))
    with pytest.raises(TraceError, match=f"{part}.*{algorithm} checksum mismatch"):
        load_logical(str(tmp_path), "r", 1)


def test_a_rank_that_dies_mid_step_leaves_no_committed_manifest(tmp_path):
    """Parts already written, the process killed mid-step: the run is uncommitted, never partial data."""
    script = textwrap.dedent(f"""
        import glob, os, time, torch
        from tracer.writer import TraceWriter
        w = TraceWriter({str(tmp_path)!r}, "r", 0, {{"rank": 0, "coords": {{}}, "sizes": {{}}, "meta": {{}}}})
        w.add(("0/-/m/output", "m", "", "output", 0, None, 0, {{}}, 1.0), torch.ones(1000))
        w.flush()                     # step 0 done: its part goes to the writer thread
        w.add(("1/-/m/output", "m", "", "output", 1, None, 1, {{}}, 1.0), torch.ones(1000))
        while not glob.glob(w.dir + "/part-*.safetensors"):   # the writer thread writes step 0's part
            time.sleep(0.01)
        os._exit(9)                   # dies mid-step 1, as a killed rank does
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={"PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    rank = tmp_path / "r" / "rank00000"
    assert list(rank.glob("part-*.safetensors")) and not (rank / "manifest.json").exists()
    with pytest.raises(TraceError, match="no committed manifest for rank"):
        read_run(str(tmp_path), "r", 1)


@pytest.mark.parametrize("mode", ["stats", "scan"])
def test_a_statistics_writer_loads_its_kernel_before_the_first_step(tmp_path, mode):
    """Stats and scan writers load the compiled statistics kernel when created (a fresh process), so
    the first steps' snapshots never wait on the writer thread loading it (tracer.stats.load_kernel)."""
    script = textwrap.dedent(f"""
        from tracer.collector import Tracer
        from tracer.kernels.moments import moments
        assert not moments.signatures
        tracer = Tracer({str(tmp_path)!r}, "r", 0, {{}}, {{}}, mode={mode!r})
        print(len(moments.signatures))
        tracer.close()
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={"PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["2"], proc.stderr


class _FakeCuda:
    """Stand-in for torch.cuda recording the calls the device copier makes (CPU tensors copy at once)."""

    def __init__(self):
        self.log: list[str] = []
        cuda = self

        class Stream:
            def __init__(self, device=None, name="side"):
                self.name = name

            def wait_stream(self, other):
                cuda.log.append(f"{self.name}.wait_stream({other.name})")

            def wait_event(self, event):
                cuda.log.append(f"{self.name}.wait_event({event.name})")

        class Event:
            count = 0

            def __init__(self):
                Event.count += 1
                self.name = f"e{Event.count}"

            def record(self, stream):
                cuda.log.append(f"{self.name}.record({stream.name})")

            def synchronize(self):
                cuda.log.append(f"{self.name}.synchronize")

        self.Stream, self.Event, self._compute = Stream, Event, Stream(name="compute")

    def current_stream(self, device=None):
        return self._compute

    def stream(self, s):
        cuda = self

        class Ctx:
            def __enter__(self):
                cuda.log.append(f"enter({s.name})")

            def __exit__(self, *a):
                cuda.log.append(f"exit({s.name})")
        return Ctx()


def test_device_copies_are_ordered_after_their_producer_and_before_later_writes_and_the_writer():
    cuda = _FakeCuda()
    copier, part = DeviceCopier(cuda), Part(torch.empty(64, dtype=torch.uint8))
    src = torch.arange(4, dtype=torch.float32)
    dst = part.slab[:16].view(torch.float32)
    copier.copy(part, dst, src)
    assert cuda.log == ["side.wait_stream(compute)", "enter(side)", "e1.record(side)", "exit(side)",
                        "compute.wait_event(e1)"]
    assert torch.equal(dst, src) and part.holds == [src]   # the source is held until the copy landed
    copier.fence(part)
    assert cuda.log[-1] == "e2.record(side)" and len(part.events) == 1
    wait_for_copies(part)
    assert cuda.log[-1] == "e2.synchronize" and part.holds == [] and part.events == []


def test_statistics_combined_across_shards_equal_the_full_tensors():
    g = torch.Generator().manual_seed(3)
    full = torch.randn(6, 8, generator=g)
    sizes = {"tp": 2, "cp": 2, "dp": 2}
    want = of_tensor(full)
    for layout in (Shard(0, "tp"), Layout(shard=((1, "tp"), (0, "cp"))), Replicate()):
        pieces = []
        for rank, coords in enumerate({"tp": t, "cp": c, "dp": d} for t in range(2) for c in range(2)
                                      for d in range(2)):
            (st,) = local_stats([layout.local(full, coords, sizes).contiguous()])
            pieces.append((coords, st, rank, 1.0))
        got = combine("x", layout, pieces, sizes)
        assert got.numel == full.numel() and got.replica_differ == 0, layout
        assert got.sumsq == pytest.approx(want.sumsq, rel=1e-6)
        assert got.sum == pytest.approx(want.sum, abs=1e-5)
        assert got.absmax == want.absmax and got.norm == pytest.approx(float(full.double().norm()), rel=1e-6)
    # A replica one ulp off in one element: its hash differs, the norms hardly do.
    coords = [{"tp": t, "dp": d} for t in range(2) for d in range(2)]
    pieces = []
    for rank, c in enumerate(coords):
        t = Shard(0, "tp").local(full, c, sizes).clone()
        if rank == 3:
            t[0, 0] = torch.nextafter(t[0, 0], torch.tensor(math.inf))
        pieces.append((c, local_stats([t])[0], rank, 1.0))
    skew = combine("x", Shard(0, "tp"), pieces, {"tp": 2, "dp": 2})
    assert skew.replica_differ == 1 and skew.replica_ranks == (2, 3) and skew.replica_err < 1e-6
    with pytest.raises(TraceError, match="partial sums"):
        combine("x", Partial("tp"), pieces, sizes)


def test_disjoint_partial_sums_combine_from_statistics_and_their_values_are_not_kept():
    """A distributed optimizer's grad ranges (workloads/adapters/megatron_core.py): each dp rank's summand
    holds its range of the tp shard and zeros elsewhere, so the statistics of the sum are those the
    summands add up to; an overlap (elements on both ranks) shows in them. Other partial sums are still
    kept in full."""
    g = torch.Generator().manual_seed(4)
    full = torch.randn(6, 4, generator=g)
    sizes = {"tp": 2, "dp": 2}
    layout = Layout(shard=((0, "tp"),), partial=("dp",), disjoint=("dp",))
    assert Layout.from_json(layout.to_json()) == layout
    assert not kept_in_full(layout.to_json()) and kept_in_full(Partial("dp").to_json())

    def pieces(ranges: tuple[tuple[int, int], tuple[int, int]]) -> list:
        out = []
        for rank, c in enumerate({"tp": t, "dp": d} for t in range(2) for d in range(2)):
            shard = full.chunk(2, 0)[c["tp"]]
            own, (lo, hi) = torch.zeros_like(shard), ranges[c["dp"]]
            own.view(-1)[lo:hi] = shard.reshape(-1)[lo:hi]
            out.append((c, local_stats([own])[0], rank, 1.0))
        return out

    got, want = combine("x", layout, pieces(((0, 5), (5, 12))), sizes), of_tensor(full)
    assert got.numel == full.numel() and got.absmax == want.absmax
    assert got.sumsq == pytest.approx(want.sumsq, rel=1e-6) and got.sum == pytest.approx(want.sum, abs=1e-5)
    overlap = combine("x", layout, pieces(((0, 8), (5, 12))), sizes)   # elements 5..7 on both dp ranks
    assert overlap.sumsq > want.sumsq * (1 + 1e-3)
    with pytest.raises(TraceError, match="disjoint axes"):
        Layout(partial=("tp",), disjoint=("dp",))


def test_scaled_statistics_are_those_of_the_scaled_tensor():
    t = torch.tensor([1.0, -3.0, 2.0])
    st = of_tensor(t).scaled(-0.5)
    want = of_tensor(t * -0.5)
    assert (st.sumsq, st.absmax, st.sum) == (want.sumsq, want.absmax, want.sum)
