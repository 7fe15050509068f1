"""Grad-sign replay (tracer/grad_signs.py, orchestrator/grad_signs.py): after tracing its param grads, a
run takes the reference's grad where its own differs in sign; what it traced is its own; which checks
replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orchestrator import grad_signs, recipe, routing
from tracer import Tracer
from tracer.errors import ConfigError, TraceError
from tracer.grad_signs import reference_grads, take_reference_signs
from tracer.job_config import JobConfig
from tracer.layouts import Partial, Shard
from tracer.logical import load_logical
from tracer.plan import ModuleLayout


def test_elements_of_the_other_sign_or_zero_take_the_reference_value():
    grad = torch.tensor([1.0, -2.0, 0.0, 3.0, -0.5, 0.0])
    ref = torch.tensor([4.0, 2.0, 1.0, 0.0, -0.1, 0.0])
    assert take_reference_signs(grad, ref) == 3
    assert grad.tolist() == [1.0, 2.0, 1.0, 0.0, -0.5, 0.0]   # same sign: the run's own value


def _run(root, run: str, weight_grad: torch.Tensor, signs_from: str | None = None) -> nn.Linear:
    """A run whose Linear has `weight_grad` (and a zero bias grad) at step 0, traced; `signs_from`:
    replay the grad signs of that reference run."""
    net = nn.Linear(3, 2)
    tr = Tracer(str(root), run, 0, coords={}, sizes={}, meta={"fingerprint": "lin"})
    tr.attach(net, {"": ModuleLayout()})
    if signs_from:
        tr.replay_grad_signs(reference_grads(signs_from, {}, {}))
    net.weight.grad, net.bias.grad = weight_grad.clone(), torch.zeros(2)
    with tr.step(0):
        tr.record_param_grads(net)
    tr.close()
    return net


def test_a_replaying_run_updates_with_the_reference_signs_and_traces_its_own_grads(tmp_path, capfd):
    store = tmp_path / "store"
    ref_grad = torch.tensor([[1.0, -1e-6, 2.0], [3e-7, -4.0, 0.5]])
    _run(store, "reference", ref_grad)
    own = torch.tensor([[0.9, 2e-6, 2.1], [-1e-7, -3.9, 0.0]])   # two noise-level flips and a zero
    net = _run(store, "candidate", own, signs_from=f"{store}/reference")
    # what the optimizer reads: the reference's value at the three elements, the run's own elsewhere
    assert torch.equal(net.weight.grad, torch.tensor([[0.9, -1e-6, 2.1], [3e-7, -3.9, 0.5]]))
    assert "grad-sign replay: 3 of 8 grad elements took the reference's value" in capfd.readouterr().err
    traced = load_logical(str(store), "candidate", 1).tensors["0/-/weight/param_grad"].tensor
    assert torch.equal(traced, own)                             # the traced grad is the run's own
    unreplayed = _run(store, "unreplayed", own)
    assert torch.equal(unreplayed.weight.grad, own)


def test_a_dtensor_traced_run_takes_the_reference_signs(tmp_path, capfd):
    """The DTensor tracer (torch-native, Hugging Face, a user's DTensor script) records its param grads
    itself: it replays too. Until 2026-12-06 it did not, and `tolerance.grad_signs=replay` on such a job
    took 0 of 0 elements, silently."""
    from tracer.integrations.dtensor import DTensorTracer

    store = tmp_path / "store"
    ref_grad = torch.tensor([[1.0, -1e-6, 2.0], [3e-7, -4.0, 0.5]])
    _run(store, "reference", ref_grad)
    net = nn.Linear(3, 2)
    tr = DTensorTracer(str(store), "candidate", 0, meta={"fingerprint": "lin"})
    tr.attach(net)
    tr.replay_grad_signs(reference_grads(f"{store}/reference", {}, {}))
    own = torch.tensor([[0.9, 2e-6, 2.1], [-1e-7, -3.9, 0.0]])
    net.weight.grad, net.bias.grad = own.clone(), torch.zeros(2)
    with tr.step(0):
        tr.record_param_grads(net)
    tr.close()
    assert torch.equal(net.weight.grad, torch.tensor([[0.9, -1e-6, 2.1], [3e-7, -3.9, 0.5]]))
    assert "grad-sign replay: 3 of 8 grad elements took the reference's value" in capfd.readouterr().err
    assert torch.equal(load_logical(str(store), "candidate", 1).tensors["0/-/weight/param_grad"].tensor, own)


def test_a_distributed_optimizers_grad_shards_take_the_reference_signs(tmp_path):
    """ZeRO-1: each DP rank traces the shard of the grad its optimizer steps (layout: the rows this rank
    holds); the shard takes the signs of the same rows of the reference's grad."""
    store = tmp_path / "store"
    ref_grad = torch.tensor([[1.0, -2.0, 3.0], [-4.0, 5.0, -6.0]])
    _run(store, "reference", ref_grad)
    net = nn.Linear(3, 2)
    tr = Tracer(str(store), "candidate", 1, coords={"dp": 1}, sizes={"dp": 2}, meta={"fingerprint": "lin"})
    tr.attach(net, {"": ModuleLayout()})
    tr.replay_grad_signs(reference_grads(f"{store}/reference", {"dp": 1}, {"dp": 2}))
    shard = torch.tensor([[4.0, -5.0, 6.0]])   # row 1, every sign the other way
    with tr.step(0):
        tr.record_param_grad_shards({"weight": (shard, Shard(0, "dp"))})
    tr.close()
    assert torch.equal(shard, ref_grad[1:])


def test_a_partial_sums_piece_keeps_its_own_signs(tmp_path):
    """A grad not reduced yet (a Partial DTensor grad: torch-native's replicated K/V weights) is a
    summand: the reference's signs are the sum's, and its value taken into each piece would count it
    once per piece (every clean torch-native tp2_sp bf16 check failed that way, 5 of 5)."""
    store = tmp_path / "store"
    _run(store, "reference", torch.tensor([[1.0, -2.0, 3.0], [-4.0, 5.0, -6.0]]))
    net = nn.Linear(3, 2)
    tr = Tracer(str(store), "candidate", 1, coords={"tp": 1}, sizes={"tp": 2}, meta={"fingerprint": "lin"})
    tr.attach(net, {"": ModuleLayout()})
    tr.replay_grad_signs(reference_grads(f"{store}/reference", {"tp": 1}, {"tp": 2}))
    piece = torch.tensor([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]])   # every sign the other way
    with tr.step(0):
        tr.record_param_grad_shards({"weight": (piece, Partial("tp"))})
    tr.close()
    assert torch.equal(piece, torch.tensor([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]]))


def test_a_reference_of_another_shape_is_an_error(tmp_path):
    store = tmp_path / "store"
    _run(store, "reference", torch.ones(2, 3))
    net = nn.Linear(4, 2)   # another model
    tr = Tracer(str(store), "candidate", 0, coords={}, sizes={}, meta={"fingerprint": "lin"})
    tr.attach(net, {"": ModuleLayout()})
    tr.replay_grad_signs(reference_grads(f"{store}/reference", {}, {}))
    net.weight.grad, net.bias.grad = torch.ones(2, 4), torch.ones(2)
    with pytest.raises(TraceError, match="grad-sign replay: the reference's '0/-/weight/param_grad' does "):
        with tr.step(0):
            tr.record_param_grads(net)


def test_which_checks_replay_grad_signs():
    moe = ["model=moe_tiny", "tracking.enabled=false"]
    bf16 = recipe.compose([*moe, "precision=bf16"])
    assert grad_signs.replay(bf16) and routing.replay(bf16)
    assert not grad_signs.replay(recipe.compose([*moe, "precision=fp32"]))
    # auto: the built-in trainer in bf16, dense models too (routing replays MoE only); fp8 where routing
    # replays (MoE); never fp32
    dense_bf16 = recipe.compose(["precision=bf16"])
    assert grad_signs.replay(dense_bf16) and not routing.replay(dense_bf16)
    assert grad_signs.replay(recipe.compose([*moe, "precision=fp8"]))
    assert not grad_signs.replay(recipe.compose(["precision=fp8"]))
    assert not grad_signs.replay(recipe.compose(["precision=fp32"]))
    # DTensor jobs (ttrace's and a user's) replay when asked: a Partial grad keeps its own signs there
    for job in (["job=torch_native", "model=llama_tiny"], ["job=hf", "parallel=tp2"],
                ["job.entrypoint=mypkg.train:main"]):
        assert not grad_signs.replay(recipe.compose([*job, "precision=bf16"])), job
        assert grad_signs.replay(recipe.compose([*job, "precision=bf16", "tolerance.grad_signs=replay"])), job
    assert grad_signs.replay(recipe.compose(["precision=bf16", "tolerance.grad_signs=replay"]))
    assert not grad_signs.replay(recipe.compose([*moe, "precision=bf16", "tolerance.grad_signs=own"]))
    assert not grad_signs.replay(recipe.compose([*moe, "precision=bf16", "trace.kinds=[output,param]"]))
    own = recipe.compose([*moe, "precision=bf16", "tolerance.grad_signs=own"])
    assert recipe.reference_key(bf16) != recipe.reference_key(own)   # the perturbed runs differ
    dense = recipe.compose(["precision=bf16", "tolerance.grad_signs=replay"])
    spec = lambda role, **kw: recipe.job_spec(dense, role=role, store_url="s", **kw)
    replays = lambda role, **kw: spec(role, **kw)["trace"]["grad_sign_replay"]
    assert replays("candidate") and replays("perturbed", perturb=1)
    assert not spec("reference")["trace"]["grad_sign_replay"]
    assert routing.reads_reference(spec("candidate")) and not routing.reads_reference(spec("reference"))
    for bad, match in (("tolerance.grad_signs=sometimes", "use auto, replay"),
                       ("tolerance.grad_signs=replay trace.mode=stats", "trace them in full")):
        with pytest.raises(ConfigError, match=match):
            recipe.validate(recipe.compose(bad.split()))


def test_a_replaying_run_needs_the_reference_url():
    spec = {"trace": {"role": "perturbed", "perturb": 1, "store_url": "s", "grad_sign_replay": True}}
    with pytest.raises(ConfigError, match="grad-sign replay needs TTRACE_REFERENCE"):
        JobConfig.from_spec(spec)
    assert JobConfig.from_spec({"trace": dict(spec["trace"], reference="s/reference")}).grad_sign_replay
