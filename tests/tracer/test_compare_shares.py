"""The comparison in shares (tracer/compare_shares.py): the tensors cut so that each share can be read
and measured apart, the figures judged together, the verdicts those of one walk."""

import json
import math

import pytest
from test_store_compare import write_run

import tracer.store
from tracer.compare import compare
from tracer.compare_shares import Measured, RunAt, measure_share, merge, partition
from tracer.errors import TraceError
from tracer.logical import load_logical
from tracer.measure import TensorKey
from tracer.tolerance import TolerancePolicy

K_ELEM = TolerancePolicy().k_elem
RUNS = {"reference": {}, "perturbed-0": {"fc_scale": 1 + 2**-22}, "candidate": {"tp": 2},
        "buggy": {"tp": 2, "fc_scale": 1.01}}


def _keys() -> list[TensorKey]:
    """Two steps of a model of six modules and four parameters, in execution order."""
    keys = []
    for step in range(2):
        for mb in range(2):
            for kind, mods in (("output", range(6)), ("grad_output", reversed(range(6)))):
                keys += [TensorKey(f"{step}/{mb}/m{m}/{kind}", kind, f"m{m}", 2**-24, 100 * (m + 1))
                         for m in mods]
        for kind in ("param_grad", "param"):
            keys += [TensorKey(f"{step}/-/m{p}.weight/{kind}", kind, f"m{p}.weight", 2**-24, 50 * (p + 1))
                     for p in range(4)]
    return keys


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_shares_keep_each_parameter_path_whole_in_execution_order_and_balanced(n):
    keys = _keys()
    shares = partition(keys, n)
    index = {k.name: i for i, k in enumerate(keys)}
    assert len(shares) == n and all(shares)
    assert sorted(index[k.name] for s in shares for k in s) == list(range(len(keys)))   # each key once
    for s in shares:
        assert [index[k.name] for k in s] == sorted(index[k.name] for k in s)   # execution order
    owner = {}
    for i, s in enumerate(shares):
        for k in s:
            if k.kind in ("param_grad", "param"):
                assert owner.setdefault(k.path, i) == i, k   # a parameter's chain in one share
    share_of = {k.name: i for i, s in enumerate(shares) for k in s}
    acts = [k for k in keys if k.kind not in ("param_grad", "param")]
    assert [share_of[k.name] for k in acts] == sorted(share_of[k.name] for k in acts)   # contiguous runs
    paths = list(dict.fromkeys(k.path for k in keys if k.kind in ("param_grad", "param")))
    assert [owner[p] for p in paths] == sorted(owner[p] for p in paths)
    units = [k.numel for k in acts] + [sum(k.numel for k in keys if k.path == p and k.kind != "output"
                                           and k.kind != "grad_output") for p in paths]
    total, biggest = sum(units), max(units)
    for s in shares:   # each share within one unit (an activation, a parameter's path) of an equal share
        assert abs(sum(k.numel for k in s) - total / n) <= biggest, ([len(x) for x in shares], total / n)
    with pytest.raises(ValueError):
        partition(keys, 0)


def _in_shares(root, cand, n):
    """tracer.compare's measurer: `n` shares, each measured by `measure_share` from the store (as a
    worker would) and sent back as `Measured.to_json` (what a Ray task returns)."""
    at = lambda run, size=1: RunAt(str(root), run, size)

    def measurer(keys):
        return merge(Measured.from_json(json.loads(json.dumps(
            measure_share(at("reference"), at(cand, 2), [at("perturbed-0")], share, K_ELEM).to_json())))
            for share in partition(keys, n))
    return measurer


def _lazy(root, cand):
    return (load_logical(str(root), "reference", 1, lazy=True), load_logical(str(root), cand, 2, lazy=True),
            [load_logical(str(root), "perturbed-0", 1, lazy=True)])


def test_a_comparison_measured_in_shares_has_the_verdicts_and_figures_of_one_walk(tmp_path):
    for run, kw in RUNS.items():
        write_run(tmp_path, run, flush_bytes=1, **kw)   # one part per tensor
    policy = TolerancePolicy()
    for cand in ("candidate", "buggy"):
        whole = compare(*_lazy(tmp_path, cand), policy)
        split = compare(*_lazy(tmp_path, cand), policy,
                        measurer=_in_shares(tmp_path, cand, 3))
        a, b = whole.to_json(), split.to_json()
        assert a["verdict"] == b["verdict"] and a["first_divergence"] == b["first_divergence"]
        assert len(a["tensors"]) == len(b["tensors"]) == 8
        for x, y in zip(a["tensors"], b["tensors"], strict=True):
            assert x.keys() == y.keys()
            for f, v in x.items():   # every figure and tolerance, to a float64 rounding; the rest equal
                if isinstance(v, float) and math.isfinite(v):
                    assert math.isclose(v, y[f], rel_tol=1e-12), (x["name"], f, v, y[f])
                else:
                    assert v == y[f] or (v != v and y[f] != y[f]), (x["name"], f, v, y[f])
    assert whole.verdict == "fail" and whole.first_divergence.name == "0/0/fc/output"
    clean = compare(*_lazy(tmp_path, "candidate"), policy,
                    measurer=_in_shares(tmp_path, "candidate", 2))
    assert clean.verdict == "pass", [r.reason for r in clean.results if not r.ok]


def test_a_share_reads_only_the_parts_holding_its_tensors(tmp_path, monkeypatch):
    for run, kw in RUNS.items():
        write_run(tmp_path, run, flush_bytes=1, **kw)   # one part per tensor
    read = []
    load_part = tracer.store.RankTrace.load_part

    def counted(self, info):
        read.append((self.run, self.rank, info["file"]))
        return load_part(self, info)
    monkeypatch.setattr(tracer.store.RankTrace, "load_part", counted)
    from tracer.compare_inputs import tensor_keys
    manifests = lambda run, n=1: load_logical(str(tmp_path), run, n, lazy=True, read_first=False)
    keys = tensor_keys(manifests("reference"))
    runs = {r: manifests(r, n) for r, n in (("reference", 1), ("candidate", 2), ("perturbed-0", 1))}
    parts = lambda names: {(r, rt.rank, e["file"]) for r, t in runs.items() for n in names
                           for rt, e in t.tensors.pieces(n)}
    at = lambda run, size=1: RunAt(str(tmp_path), run, size)
    for share in partition(keys, 2):   # the second holds none of the runs' first parts
        read.clear()
        got = measure_share(at("reference"), at("candidate", 2), [at("perturbed-0")], share, K_ELEM)
        assert set(got.stats) == {k.name for k in share} and set(got.replicas) == set(got.stats)
        needed = parts([k.name for k in share])
        assert sorted(read) == sorted(needed)   # each needed part once, no other
        assert len(needed) < len(parts(runs["reference"].order))


def test_figures_missing_from_the_shares_are_an_error_not_a_verdict_on_the_rest(tmp_path):
    for run, kw in RUNS.items():
        write_run(tmp_path, run, **kw)
    whole = _in_shares(tmp_path, "candidate", 2)
    fields = ("stats", "replicas", "mismatch")
    lost_one = lambda keys: Measured(**{f: {n: v for n, v in getattr(whole(keys), f).items()
                                            if n != keys[-1].name} for f in fields})
    with pytest.raises(TraceError, match="returned no figures for 1 of"):
        compare(*_lazy(tmp_path, "candidate"), TolerancePolicy(),
                measurer=lost_one)


def test_shares_measured_by_ray_tasks_judge_as_one_walk_and_a_corrupt_part_is_their_error(ray_cluster,
                                                                                           tmp_path):
    """orchestrator/compare_tasks.py: each share a Ray task reading the store itself (as on another
    node), its figures sent back; a share's error is the check's, as one walk would raise it."""
    from orchestrator.compare_tasks import measurer

    for run, kw in RUNS.items():
        write_run(tmp_path, run, flush_bytes=1, **kw)
    policy = TolerancePolicy()
    at = lambda run, size=1: RunAt(str(tmp_path), run, size)
    tasks = lambda cand: measurer({}, at("reference"), at(cand, 2), [at("perturbed-0")], 2, policy.k_elem)
    for cand in ("candidate", "buggy"):
        whole = compare(*_lazy(tmp_path, cand), policy).to_json()
        split = compare(*_lazy(tmp_path, cand), policy,
                        measurer=tasks(cand)).to_json()
        oks = lambda report: [(t["name"], t["ok"]) for t in report["tensors"]]
        assert oks(split) == oks(whole)
        assert split["first_divergence"] == whole["first_divergence"]
        assert split["verdict"] == ("pass" if cand == "candidate" else "fail"), split["first_divergence"]
    part = sorted((tmp_path / "candidate" / "rank00001").glob("part-*.safetensors"))[-1]
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(TraceError, match=f"checksum.*{part.name}|{part.name}.*checksum"):
        compare(*_lazy(tmp_path, "candidate"), policy,
                measurer=tasks("candidate"))


def test_a_share_whose_worker_dies_is_an_error_naming_it_not_a_verdict(ray_cluster, tmp_path):
    """A comparison worker killed mid-share (here: SIGKILL, as the OOM killer does, while its read of a
    part stalls on storage that never answers: a FIFO in the part's place) ends the comparison with an
    error naming the share, never a verdict on the other shares' figures."""
    import contextlib
    import os
    import signal
    import threading
    import time

    import psutil

    from orchestrator.compare_tasks import measurer

    for run, kw in RUNS.items():
        write_run(tmp_path, run, flush_bytes=1, **kw)
    part = sorted((tmp_path / "candidate" / "rank00001").glob("part-*.safetensors"))[-1]
    part.unlink()
    os.mkfifo(part)   # opening it for reading waits for a writer that never comes
    at = lambda run, size=1: RunAt(str(tmp_path), run, size)
    tasks = measurer({}, at("reference"), at("candidate", 2), [at("perturbed-0")], 2, K_ELEM)
    outcome: list = []

    def judge() -> None:
        try:
            outcome.append(compare(*_lazy(tmp_path, "candidate"), TolerancePolicy(), measurer=tasks))
        except Exception as e:   # noqa: BLE001 - what the comparison raised is the test's subject
            outcome.append(e)

    thread = threading.Thread(target=judge, daemon=True)
    thread.start()
    seen: dict[int, float] = {}   # share worker pid -> first seen (Ray titles a running task's process)
    killed = []
    deadline = time.monotonic() + 120
    while thread.is_alive() and not killed and time.monotonic() < deadline:
        now = time.monotonic()
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if (proc.info["cmdline"] or [""])[0].startswith("ray::_share"):
                if now - seen.setdefault(proc.info["pid"], now) > 1.0:   # stuck, not just finishing
                    with contextlib.suppress(ProcessLookupError):   # unless it ended meanwhile
                        os.kill(proc.info["pid"], signal.SIGKILL)
                        killed.append(proc.info["pid"])
        time.sleep(0.1)
    thread.join(timeout=60)
    assert killed, "no share worker was found stalled on the part"
    (err,) = outcome
    assert isinstance(err, TraceError) and "its worker was lost" in str(err), err
    assert "comparison share" in str(err) and "Rerun the check" in str(err), err


def test_a_share_on_a_node_that_cannot_see_a_local_store_says_so(tmp_path):
    """What a share's task does first on its node (orchestrator.compare_tasks._share): a local store
    missing there (a directory only the driver's node holds) is named as such, not as runs never
    traced."""
    from orchestrator.compare_tasks import _share

    at = RunAt(str(tmp_path / "elsewhere"), "reference", 1)
    with pytest.raises(TraceError, match="share on node .* cannot see the store .*compare_workers=1"):
        _share({}, at, at, [at], _keys(), K_ELEM, 1)


@pytest.mark.parametrize("cpus", [-1, 10**6])
def test_a_task_size_no_node_can_hold_is_a_recipe_error_not_a_wait(ray_cluster, tmp_path, cpus):
    from orchestrator.compare_tasks import from_recipe
    from orchestrator.recipe import compose
    from tracer.errors import ConfigError

    rec = compose(["cluster.compare_workers=2", f"cluster.compare_cpus={cpus}"])
    at = RunAt(str(tmp_path), "reference", 1)
    with pytest.raises(ConfigError, match="cluster.compare_cpus"):
        from_recipe(rec, at, at, [at], K_ELEM)
    assert from_recipe(compose([]), at, at, [at], K_ELEM) is None   # compare_workers=1: this process


def test_a_walk_of_the_per_step_tensors_holds_no_part_once_done(tmp_path):
    """compare(per_step_only=True) (runs that cut the batch into different microbatches) walks the
    param_grad and param records only: a part that also holds activations was never dropped (its
    activations are not looked up) and stayed in memory to the end of the check."""
    for run, kw in RUNS.items():
        write_run(tmp_path, run, **kw)   # one part per rank: activations and parameters together
    ref, cand, pert = _lazy(tmp_path, "buggy")
    res = compare(ref, cand, pert, TolerancePolicy(), per_step_only=True)
    per_step = [n for n in ref.order if ref.info[n].get("microbatch") is None]
    assert [r.name for r in res.results] == per_step and res.verdict == "fail"
    assert all(not t.tensors.parts.held for t in (ref, cand, *pert))
    full = compare(*_lazy(tmp_path, "buggy"), TolerancePolicy())
    assert {r.name: r.ok for r in full.results if r.name in per_step} == {r.name: r.ok for r in res.results}
