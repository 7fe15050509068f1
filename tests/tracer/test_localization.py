"""Isolation pass and culprit: unit tests on an in-process chain, and a real Ray check where a bug in
every row-parallel layer makes every later tensor diverge but the culprit is still the first of them."""

from pathlib import Path

import pytest
import torch
from torch import nn

from tracer import ModuleLayout, Tracer, perturb_ulp
from tracer.compare import compare
from tracer.feed import ReferenceFeed
from tracer.isolation import name_culprit
from tracer.layouts import Layout
from tracer.logical import load_logical
from tracer.tolerance import TolerancePolicy

NAMES = ("l0", "l1", "l2", "l3")
PLAN = {n: ModuleLayout() for n in NAMES}
X = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))


class Chain(nn.Module):
    """Four tanh-linear layers; `bug_scale` corrupts the output of layer `bug_at` (a forward bug)."""

    def __init__(self, perturb: int | None = None, bug_at: str | None = None, bug_scale: float = 1.0):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        for n in NAMES:
            lin = nn.Linear(8, 8, bias=False)
            w = torch.randn(8, 8, generator=g) / 8**0.5
            lin.weight.data.copy_(perturb_ulp(w, perturb, n) if perturb is not None else w)
            setattr(self, n, lin)
        self.bug_at, self.bug_scale = bug_at, bug_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for n in NAMES:
            y = getattr(self, n)(x)
            x = torch.tanh(y * self.bug_scale if n == self.bug_at else y)
        return x.square().mean()


def _run(root: Path, run: str, model: Chain, feed_from: str | None = None) -> None:
    tr = Tracer(str(root), run, 0, coords={}, sizes={}, meta={"fingerprint": "chain"})
    tr.attach(model, PLAN)
    if feed_from:
        tr.isolate(ReferenceFeed(load_logical(str(root), feed_from, 1), {}, {}))
    with tr.step(0):
        with tr.microbatch(0):
            loss = model(X)
        tr.record_loss(loss, 0)
        loss.backward()
        tr.record_param_grads(model)
    tr.close()


class BuggyLinear(nn.Linear):
    """A module whose own computation is wrong (the bug lives inside the traced module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 1.01


@pytest.fixture
def traces(tmp_path):
    _run(tmp_path, "reference", Chain())
    for i in range(3):
        _run(tmp_path, f"perturbed-{i}", Chain(perturb=i + 1))
    buggy = Chain()
    bad = BuggyLinear(8, 8, bias=False)
    bad.weight.data.copy_(buggy.l1.weight.data)
    buggy.l1 = bad
    _run(tmp_path, "candidate", buggy)
    isolated = Chain()
    bad2 = BuggyLinear(8, 8, bias=False)
    bad2.weight.data.copy_(isolated.l1.weight.data)
    isolated.l1 = bad2
    _run(tmp_path, "isolated", isolated, feed_from="reference")
    _run(tmp_path, "clean-isolated", Chain(), feed_from="reference")
    load = lambda run: load_logical(str(tmp_path), run, 1)
    ref, perturbed = load("reference"), [load(f"perturbed-{i}") for i in range(3)]
    return {run: compare(ref, load(run), perturbed, TolerancePolicy())
            for run in ("candidate", "isolated", "clean-isolated")}


def test_cascade_is_reduced_to_the_module_at_fault(traces):
    normal, isolated = traces["candidate"], traces["isolated"]
    # Without isolation the bug in l1 spreads: l1, l2, l3, the loss and backward tensors all diverge.
    diverged = {r.module for r in normal.results if not r.ok}
    assert {"l1", "l2", "l3", "loss"} <= diverged
    assert normal.first_divergence.name == "0/0/l1/output"
    # Fed the reference's tensors, only l1's own computations are wrong: its output, and in backward
    # its weight grad and the grad it hands to its input (recorded as l0's grad_output).
    assert {r.name for r in isolated.results if not r.ok} == {
        "0/0/l1/output", "0/-/l1.weight/param_grad", "0/0/l0/grad_output"}
    loc = name_culprit(normal, isolated)
    assert loc["culprit"]["module"] == "l1" and loc["culprit"]["kind"] == "output"
    assert loc["culprit"]["resolved"]
    assert loc["blame_window"] == {"size": 1, "modules": ["l1"]}
    assert loc["origin"] == "local"


def test_isolation_of_an_honest_run_flags_nothing(traces):
    assert traces["clean-isolated"].verdict == "pass"


def test_substitution_keeps_parameter_gradients_flowing(tmp_path):
    """The substituted output must still backpropagate into the module that computed it."""
    _run(tmp_path, "reference", Chain())
    model = Chain()
    tr = Tracer(str(tmp_path), "iso", 0, coords={}, sizes={}, meta={})
    tr.attach(model, PLAN)
    tr.isolate(ReferenceFeed(load_logical(str(tmp_path), "reference", 1), {}, {}))
    with tr.step(0), tr.microbatch(0):
        model(X).backward()
    tr.close()
    assert all(getattr(model, n).weight.grad is not None and getattr(model, n).weight.grad.abs().sum() > 0
               for n in NAMES)


def test_partial_layout_summand_reassembles():
    full = torch.arange(12.0).reshape(3, 4)
    lay = Layout(shard=((1, "tp"),), partial=("kvr",))
    sizes = {"tp": 2, "kvr": 2}
    parts = {(t, k): lay.summand(full, {"tp": t, "kvr": k}, sizes) for t in range(2) for k in range(2)}
    for t in range(2):
        assert torch.equal(parts[(t, 0)] + parts[(t, 1)], full.chunk(2, 1)[t])
    assert torch.count_nonzero(parts[(0, 1)]) == 0


@pytest.fixture(scope="module")
def row_parallel_checks(ray_cluster, tmp_path_factory):
    from orchestrator.check import run_checks
    from orchestrator.recipe import compose

    work = tmp_path_factory.mktemp("localization")
    common = ["parallel=tp2", "tracking.enabled=false", "tolerance.perturbations=2",
              f"cluster.address={ray_cluster}"]
    items = [(compose([*common, "bug=row_parallel_bias_per_rank"]), work / "bug"),
             (compose([*common, "localize=always"]), work / "clean")]
    bug, clean = run_checks(items, base_dir=str(work))
    return bug, clean


def test_row_parallel_bias_culprit_is_the_first_row_parallel_layer(row_parallel_checks):
    bug, _ = row_parallel_checks
    rep = bug.report
    assert bug.verdict == "fail" and bug.exit_code == 1
    # The first tensor beyond tolerance is the first row-parallel output, at step 1 (biases start at 0).
    fd, first = rep["first_divergence"], next(t for t in rep["tensors"] if not t["ok"])
    assert (fd["module"], fd["kind"]) == ("layers.0.attn.proj", "output") and first["step"] == 1, fd
    # The bias is added once per TP rank in EVERY RowParallelLinear: from layers.0.attn.proj on,
    # every tensor of step 1 diverges (a cascade over the whole network) ...
    failing = {t["module"] for t in rep["tensors"] if not t["ok"] and t["step"] == 1}
    assert len(failing) > 10 and "head" in failing and "layers.3.mlp.fc1" in failing
    # ... while the isolation pass flags row-parallel outputs only, and names the first one.
    assert rep["isolation"]["flagged"] > 0
    assert all(m.endswith(("attn.proj/output", "mlp.fc2/output")) for m in rep["flagged_modules"])
    assert rep["culprit"]["module"] == "layers.0.attn.proj" and rep["culprit"]["kind"] == "output"
    assert rep["culprit"]["module_type"] == "RowParallelLinear"
    assert rep["blame_window"]["size"] == 1 and rep["origin"] == "local"


def test_isolation_of_a_clean_distributed_run_flags_nothing(row_parallel_checks):
    _, clean = row_parallel_checks
    assert clean.verdict == "pass"
    assert clean.report["isolation"]["flagged"] == 0 and "culprit" not in clean.report
