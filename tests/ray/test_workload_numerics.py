"""Numerics of the built-in GPT workload: every parallel layout matches the single-process run.

4 worker processes (forked with torch imported, tests/ray/worker_processes.py) run every job in turn:
4-rank jobs on all of them, narrower jobs two at a time side by side (`in_lanes`).
Workers reuse their process, as Ray's do, which also checks that the job tears its process group
down. Ranks trace into an in-memory recorder (tracing to the store is disabled); the parent
reassembles every parameter and gradient with the plan's layouts and compares it with the reference.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from worker_processes import start_workers

from orchestrator.rank_tasks import free_port
from tracer import Layout, Replicate, param_layouts
from tracer.errors import ConfigError
from tracer.layouts import Piece, assemble
from workloads import bugs
from workloads.config import validate

BASE: dict[str, Any] = {
    "model": {"name": "gpt_tiny", "vocab": 128, "hidden": 64, "heads": 4, "layers": 4, "seq_len": 32,
              "ffn_hidden": 256},
    "parallel": {"name": "single", "world_size": 1, "tp": 1, "pp": 1, "sp": False},
    "precision": {"name": "fp32"},
    "bug": {"name": "none"},
    "steps": 2, "seed": 1234,
    "data": {"global_batch": 8, "micro_batch": 2},
    "optim": {"lr": 1e-3, "clip_grad": 1.0},
    # The session records into memory (Recorder); role and perturbation as a check would set them.
    "trace": {"store_url": "memory://unused", "run": "test", "role": "candidate", "perturb": None,
              "enabled": True},
    "timeout_s": 120,
}

PARALLEL = {  # name: (world_size, tp, pp, sp)
    "single": (1, 1, 1, False),
    "tp2": (2, 2, 1, False),
    "tp2_sp": (2, 2, 1, True),
    "dp2": (2, 1, 1, False),
    "pp2": (2, 1, 2, False),
    "tp2_pp2": (4, 2, 2, False),
    "tp2_dp2": (4, 2, 1, False),
}
HONEST = [p for p in PARALLEL if p != "single"]
PERTURBED = ["single~ulp1", "single~ulp2"]   # the reference with every weight moved by one ulp
BUGGY = {"dp_grad_not_averaged": "dp2", "sp_layernorm_grad_unreduced": "tp2_sp",
         "row_parallel_bias_per_rank": "tp2"}
NPROCS = 4
RTOL = 1e-5
NOISE_K = 4.0   # head-room over the perturbation noise (DESIGN.md: k >= 2)


def make_spec(parallel: str, bug: str = "none", perturb_seed: int | None = None) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    ws, tp, pp, sp = PARALLEL[parallel]
    spec["parallel"] = {"name": parallel, "world_size": ws, "tp": tp, "pp": pp, "sp": sp}
    spec["bug"] = {"name": bug}
    if perturb_seed is not None:
        spec["trace"].update(role="perturbed", perturb=perturb_seed)
    return spec


class Recorder:
    """In-memory stand-in for tracer.Tracer (a Session's tracer_factory): per-step param grads (after
    reduction), params after the last step, per-microbatch losses; each with the layout the plan
    gives it. The session around it is real: it perturbs the weights of perturbed runs."""

    def __init__(self, coords: Any, sizes: Any, meta: Any = None, dtensor: bool = False):
        self.coords, self.sizes = dict(coords), dict(sizes)
        self.grads: dict[int, dict[str, torch.Tensor]] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.losses: dict[tuple[int, int], float] = {}
        self.layouts: dict[str, Layout] = {}
        self._step = 0

    def attach(self, model: torch.nn.Module, plan: Any, rename: Any = None) -> None:
        self.rename = rename or (lambda n: n)
        self.layouts = {self.rename(n): lay for n, lay in param_layouts(model, plan).items()}

    def set_grad_scale(self, scale: float) -> None:
        pass

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        self._step = step
        yield

    @contextlib.contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        yield

    def record_loss(self, loss: torch.Tensor, microbatch: int) -> None:
        self.losses[(self._step, microbatch)] = loss.item()

    def record_param_grads(self, model: torch.nn.Module) -> None:
        self.grads[self._step] = {self.rename(n): p.grad.detach().clone()
                                  for n, p in model.named_parameters()}

    def record_params(self, model: torch.nn.Module) -> None:
        self.params = {self.rename(n): p.detach().clone() for n, p in model.named_parameters()}

    def close(self) -> None:
        pass


def run_in_process(spec: dict, rank: int, port: int, recorder: type) -> tuple[dict, Any]:
    """The built-in job's entrypoint as ttrace's launcher calls it (torchrun's environment), with a
    session whose tracer records into memory; returns (what main returned, the recorder)."""
    import os

    from tracer.job import Session
    from tracer.job_config import JobConfig
    from workloads.train import main

    world = spec["parallel"]["world_size"]
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    os.environ.update(env)
    recs: list = []
    factory = lambda coords, sizes, meta, dtensor: recs.append(recorder(coords, sizes)) or recs[-1]
    result = main(Session(JobConfig.from_spec(spec, env=env), tracer_factory=factory))
    return result, recs[0]


def in_lanes(jobs: list[tuple[str, dict, int]], nprocs: int = NPROCS) -> list[tuple[str, dict, int, int]]:
    """Each job with the first of the spawned processes that run it (its rank 0). Jobs wider than
    half the processes run on all of them, first and in list order; the others in two lanes (the
    first and the second half of the processes), alternately, each lane in list order. Every process
    meets its jobs in one order, so none waits in a job whose peers are busy elsewhere, and two 2-rank
    jobs keep 2 cores busy where one alone left them half idle (its ranks wait on each other)."""
    half = nprocs // 2
    wide = [(*j, 0) for j in jobs if j[1]["parallel"]["world_size"] > half]
    narrow = [j for j in jobs if j[1]["parallel"]["world_size"] <= half]
    return wide + [(*j, (i % 2) * half) for i, j in enumerate(narrow)]


def _worker(proc: int, jobs: list[tuple[str, dict, int, int]], out_dir: str) -> None:
    for name, spec, port, first in jobs:
        rank = proc - first
        if not 0 <= rank < spec["parallel"]["world_size"]:
            continue
        result, rec = run_in_process(spec, rank, port, Recorder)
        torch.save({"result": result, "coords": rec.coords, "sizes": rec.sizes, "grads": rec.grads,
                    "params": rec.params, "layouts": {k: v.to_json() for k, v in rec.layouts.items()},
                    "mb_losses": rec.losses}, Path(out_dir) / f"{name}.{rank}.pt")


def _assemble(shards: list[dict], key: str, step: int | None = None) -> dict[str, tuple[torch.Tensor, float]]:
    """Logical tensor and replica disagreement of every parameter (or grad at `step`)."""
    sizes = shards[0]["sizes"]
    pieces: dict[str, list[Piece]] = {}
    layouts: dict[str, Layout] = {}
    for rank, sh in enumerate(shards):
        tensors = sh[key] if step is None else sh[key][step]
        for name, t in tensors.items():
            pieces.setdefault(name, []).append(Piece(coords=sh["coords"], tensor=t, rank=rank))
            layouts[name] = Layout.from_json(sh["layouts"].get(name, Replicate().to_json()))
    out = {}
    for name, ps in pieces.items():
        a = assemble(name, layouts[name], ps, sizes)
        out[name] = (a.tensor, a.replica_err)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("workload_numerics")
    jobs = [(p, make_spec(p), free_port()) for p in PARALLEL]
    jobs += [(f"{p}+{b}", make_spec(p, b), free_port()) for b, p in BUGGY.items()]
    jobs += [(p, make_spec("single", perturb_seed=i + 1), free_port()) for i, p in enumerate(PERTURBED)]
    start_workers(_worker, (in_lanes(jobs), str(out)), NPROCS)
    runs = {}
    for name, spec, _ in jobs:
        shards = [torch.load(out / f"{name}.{r}.pt", weights_only=False)
                  for r in range(spec["parallel"]["world_size"])]
        losses = [sh["result"]["losses"] for sh in shards if sh["result"]["losses"]]
        runs[name] = {
            "losses": losses,
            "params": _assemble(shards, "params"),
            "grads": {s: _assemble(shards, "grads", s) for s in range(spec["steps"])},
        }
    return runs


def _per_tensor(run: dict, ref: dict) -> dict[tuple[str, str], float]:
    """Relative (Frobenius) difference of every compared tensor: per-step loss, grads, final params."""
    ref_losses = ref["losses"][0]
    d = {("loss", str(s)): max(abs(ls[s] - ref_losses[s]) / abs(ref_losses[s]) for ls in run["losses"])
         for s in range(len(ref_losses))}
    for s, grads in run["grads"].items():
        d.update({(f"grad{s}", n): _rel(t, ref["grads"][s][n][0]) for n, (t, _) in grads.items()})
    d.update({("param", n): _rel(t, ref["params"][n][0]) for n, (t, _) in run["params"].items()})
    return d


def _diffs(run: dict, ref: dict) -> dict[str, float]:
    """Max relative difference per kind (loss, grad0, grad1, param) and max replica disagreement."""
    d: dict[str, float] = {}
    for (kind, _), v in _per_tensor(run, ref).items():
        d[kind] = max(d.get(kind, 0.0), v)
    replica = [e for g in run["grads"].values() for _, e in g.values()]
    replica += [e for _, e in run["params"].values()]
    d["replica"] = max(replica)
    return d


def _show(name: str, d: dict[str, float]) -> None:
    print(f"\n{name}: " + ", ".join(f"{k}={v:.2e}" for k, v in d.items()))


@pytest.fixture(scope="module")
def noise(runs: dict) -> dict[tuple[str, str], float]:
    """How far the reference itself moves when every weight moves one ulp (DESIGN.md, tolerance)."""
    per = [_per_tensor(runs[p], runs["single"]) for p in PERTURBED]
    return {k: max(p[k] for p in per) for k in per[0]}


@pytest.mark.parametrize("parallel", HONEST)
def test_layout_matches_single_process(runs: dict, noise: dict, parallel: str) -> None:
    run, ref = runs[parallel], runs["single"]
    assert set(run["params"]) == set(ref["params"])
    d = _diffs(run, ref)
    _show(parallel, d)
    # RTOL everywhere, except where the reference is itself that sensitive to 1-ulp weight changes
    # (Adam's first step is ~lr*sign(g): tensors whose grads are at roundoff level, e.g. the
    # attention key bias, whose exact grad is zero, move by ~lr*O(1) under any reordering).
    bad = {k: (v, noise[k]) for k, v in _per_tensor(run, ref).items() if v > max(RTOL, NOISE_K * noise[k])}
    for k, v in _per_tensor(run, ref).items():
        if v > RTOL:
            print(f"  {k}: {v:.2e} (1-ulp reference noise {noise[k]:.2e})")
    assert not bad, bad
    assert d["replica"] < 1e-6, d


def test_dp_grad_not_averaged(runs: dict) -> None:
    run, ref = runs["dp2+dp_grad_not_averaged"], runs["single"]
    _show("dp2+dp_grad_not_averaged", _diffs(run, ref))
    # Every step-0 grad is exactly dp=2 times the reference grad.
    for name, (g, _) in run["grads"][0].items():
        assert _rel(g, 2 * ref["grads"][0][name][0]) < RTOL, name
    assert _diffs(run, ref)["grad0"] > 0.9


def test_sp_layernorm_grad_unreduced(runs: dict) -> None:
    run, ref = runs["tp2_sp+sp_layernorm_grad_unreduced"], runs["single"]
    _show("tp2_sp+sp_layernorm_grad_unreduced", _diffs(run, ref))
    for name, (g, replica_err) in run["grads"][0].items():
        err = _rel(g, ref["grads"][0][name][0])
        if "ln" in name.split(".")[-2]:       # ln1, ln2, final_ln: partial grads, replicas disagree
            assert err > 1e-2 and replica_err > 1e-2, (name, err, replica_err)
        else:                                 # everything else is still right at step 0
            assert err < RTOL, (name, err)
    assert _diffs(run, ref)["param"] > 1e-3


def test_row_parallel_bias_per_rank(runs: dict) -> None:
    run, ref = runs["tp2+row_parallel_bias_per_rank"], runs["single"]
    _show("tp2+row_parallel_bias_per_rank", _diffs(run, ref))
    d = _diffs(run, ref)
    # Biases start at zero: step 0 is exact, the bias counted twice shows from step 1 on.
    assert d["grad0"] < RTOL, d
    assert abs(run["losses"][0][1] - ref["losses"][0][1]) / ref["losses"][0][1] > 1e-5, d
    assert d["grad1"] > 1e-2 and d["param"] > 1e-3, d


def test_validate_rejects_bad_configs() -> None:
    validate(make_spec("tp2_sp"))
    bad = {
        "world_size": dict(parallel={"name": "x", "world_size": 3, "tp": 2, "pp": 1, "sp": False}),
        "hidden": dict(model={**BASE["model"], "hidden": 65, "heads": 5}),
        "heads": dict(model={**BASE["model"], "heads": 1}),
        "vocab": dict(model={**BASE["model"], "vocab": 127}),
        "layers": dict(parallel={"name": "x", "world_size": 3, "tp": 1, "pp": 3, "sp": False}),
        "seq_len": dict(model={**BASE["model"], "seq_len": 31}),
        "tp > 1": dict(parallel={"name": "x", "world_size": 1, "tp": 1, "pp": 1, "sp": True}),
        "global_batch": dict(data={"global_batch": 7, "micro_batch": 2}),
        "unknown bug": dict(bug={"name": "no_such_bug"}),
    }
    for what, override in bad.items():
        spec = {**make_spec("tp2_sp"), **override}
        with pytest.raises(ConfigError, match=what):
            validate(spec)
    assert set(BUGGY) <= set(bugs.CATALOG)
