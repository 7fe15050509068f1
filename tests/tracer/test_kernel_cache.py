"""The compiled kernels' cache keeps only the current sources' kernels (tracer/kernels/__init__.py)."""

from pathlib import Path

from tracer import kernels


def test_warm_up_removes_the_kernels_of_earlier_sources_and_keeps_the_current_ones():
    current = Path(kernels._cache_dir())
    kernels.warm_up()
    kept = sorted(str(p.relative_to(current)) for p in current.rglob("*"))
    assert any(name.endswith(".nbi") for name in kept), kept   # the current kernels are cached here
    stale_dir = current.parent / "ttrace-kernels-0000000000000000"
    stale_dir.mkdir(exist_ok=True)
    (stale_dir / "reference.reference_side-26.py311.nbi").write_bytes(b"old")
    stale_file = current.parent / "moments.moments-14.py311.1.nbc"   # numba's own layout, before the dirs
    stale_file.write_bytes(b"old")
    kernels.warm_up()
    assert not stale_dir.exists() and not stale_file.exists()
    assert sorted(str(p.relative_to(current)) for p in current.rglob("*")) == kept
