"""Routing replay (tracer/routing.py, orchestrator/routing.py): a run takes the reference's top-k
experts from its traced router outputs, its gates from its own probabilities; which checks replay."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from orchestrator import recipe, routing
from tracer import Tracer
from tracer.errors import ConfigError, TraceError
from tracer.job_config import JobConfig
from tracer.plan import ModuleLayout
from tracer.routing import reference_routing
from workloads.moe import ExpertGroups, MoE

E, H, TOKENS = 4, 8, 6


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        m = SimpleNamespace(experts=E, top_k=2, aux_loss_coeff=0.0, hidden=H, ffn_hidden=H)
        cfg = SimpleNamespace(model=m, parallel=SimpleNamespace(sp=False), micro_batches_local=1)
        ps = SimpleNamespace(sizes={}, coords={}, tp_size=1, tp_group=None)
        self.moe = MoE(cfg, ps, ExpertGroups())
        g = torch.Generator().manual_seed(0)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.5

    def forward(self, x):
        return self.moe(x)


def _reference(root, logits: torch.Tensor, module_type: str = "Router") -> str:
    tr = Tracer(str(root), "reference", 0, coords={}, sizes={}, meta={"fingerprint": "moe"})
    with tr.step(0):
        tr.record("moe.router", "output", logits, microbatch=0, module_type=module_type)
        tr.record("moe", "output", logits.exp(), microbatch=0, module_type="MoE")   # not a router
    tr.close()
    return f"{root}/reference"


def _forward(net: _Net, x: torch.Tensor, replay_from: str | None, root) -> torch.Tensor:
    tr = Tracer(str(root), "candidate", 0, coords={}, sizes={}, meta={"fingerprint": "moe"})
    tr.attach(net, {"moe.router": ModuleLayout()})
    if replay_from:
        tr.replay_routing(reference_routing(replay_from, {}, {}))
    with tr.step(0), tr.microbatch(0):
        out = net(x)
    tr.close()
    return out


def _by_hand(net: _Net, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Each token: its chosen experts' outputs weighted by its OWN probabilities, renormalized."""
    probs = net.moe.router(x).softmax(-1)[0]
    out = torch.zeros(TOKENS, H)
    for t in range(TOKENS):
        gates = probs[t, experts[t]] / probs[t, experts[t]].sum()
        for e, gate in zip(experts[t].tolist(), gates, strict=True):
            out[t] += gate * net.moe.experts[e](x[0, t:t + 1])[0]
    return out


def test_the_moe_layer_takes_the_reference_experts_and_its_own_gates(tmp_path):
    net = _Net()
    x = torch.randn(1, TOKENS, H, generator=torch.Generator().manual_seed(1))
    own = net.moe.router(x).detach()
    ref_logits = -own   # the reference routes every token to the experts this run ranks last
    url = _reference(tmp_path / "store", ref_logits)
    ref_experts = ref_logits[0].topk(2, -1).indices
    assert not (ref_experts.sort(-1).values == own[0].topk(2, -1).indices.sort(-1).values).all(-1).any()
    with torch.no_grad():
        replayed = _forward(net, x, url, tmp_path / "a")[0]
        unreplayed = _forward(net, x, None, tmp_path / "b")[0]
        torch.testing.assert_close(replayed, _by_hand(net, x, ref_experts))
        torch.testing.assert_close(unreplayed, _by_hand(net, x, own[0].topk(2, -1).indices))
    # the router's own grads still flow (the gates are its probabilities)
    net.zero_grad()
    _forward(net, x, url, tmp_path / "c").sum().backward()
    assert net.moe.router.weight.grad is not None and net.moe.router.weight.grad.abs().sum() > 0


def test_a_reference_without_router_outputs_or_of_another_shape_is_an_error(tmp_path):
    net = _Net()
    x = torch.randn(1, TOKENS, H)
    with pytest.raises(TraceError, match="traced no router output.*tolerance.routing=own"):
        reference_routing(_reference(tmp_path / "linear", torch.randn(1, TOKENS, E), "Linear"), {}, {})
    short = _reference(tmp_path / "short", torch.randn(1, TOKENS - 1, E))   # another batch: a token less
    with pytest.raises(TraceError, match="does not cut to this rank's router output of shape"):
        _forward(net, x, short, tmp_path / "cand")


def test_which_checks_replay_routing():
    moe = ["model=moe_tiny", "tracking.enabled=false"]
    assert routing.replay(recipe.compose([*moe, "precision=bf16"]))
    assert routing.replay(recipe.compose([*moe, "precision=fp8"]))
    assert not routing.replay(recipe.compose([*moe, "precision=fp32"]))    # nothing flips in fp32
    assert not routing.replay(recipe.compose(["precision=bf16"]))           # no experts
    assert not routing.replay(recipe.compose([*moe, "precision=bf16", "tolerance.routing=own"]))
    assert not routing.replay(recipe.compose([*moe, "precision=bf16", "trace.mode=stats"]))
    assert not routing.replay(recipe.compose([*moe, "precision=bf16", "reference.micro_batch=8"]))
    assert routing.replay(recipe.compose([*moe, "tolerance.routing=replay"]))
    rec = recipe.compose([*moe, "precision=bf16"])
    own = recipe.compose([*moe, "precision=bf16", "tolerance.routing=own"])
    assert recipe.reference_key(rec) != recipe.reference_key(own)   # the perturbed runs differ
    spec = lambda role, **kw: recipe.job_spec(rec, role=role, store_url="s", **kw)["trace"]["routing_replay"]
    assert spec("candidate") and spec("perturbed", perturb=1)
    assert not spec("reference") and not spec("isolated")   # the isolated run is fed the reference anyway
    for bad, match in (("tolerance.routing=sometimes", "use auto, replay"),
                       ("tolerance.routing=replay trace.mode=stats", "trace in full"),
                       ("tolerance.routing=replay reference.micro_batch=8", "cuts the batch differently")):
        with pytest.raises(ConfigError, match=match):
            recipe.validate(recipe.compose([*moe, *bad.split()]))


def test_a_replaying_run_needs_the_reference_url():
    spec = {"trace": {"role": "candidate", "store_url": "s", "routing_replay": True}}
    with pytest.raises(ConfigError, match="routing replay needs TTRACE_REFERENCE"):
        JobConfig.from_spec(spec)
    assert JobConfig.from_spec({"trace": dict(spec["trace"], reference="s/reference")}).routing_replay
