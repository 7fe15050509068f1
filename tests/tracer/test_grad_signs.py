"""Grad-sign replay (tracer/grad_signs.py, orchestrator/grad_signs.py): after tracing its param grads, a
run takes the reference's grad where its own differs in sign; what it traced is its own; which checks
replay."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from orchestrator import grad_signs, recipe, routing
from tracer import Tracer
from tracer.errors import ConfigError, TraceError
from tracer.grad_signs import reference_grads, take_reference_signs
from tracer.job_config import JobConfig
from tracer.layouts import Layout, Partial, Shard
from tracer.logical import load_logical
from tracer.plan import ModuleLayout


def test_elements_of_the_other_sign_or_zero_take_the_reference_value():
    grad = torch.tensor([1.0, -2.0, 0.0, 3.0, -0.5, 0.0])
    ref = torch.tensor([4.0, 2.0, 1.0, 0.0, -0.1, 0.0])
    assert take_reference_signs(grad, ref) == 3
    assert grad.tolist() == [1.0, 2.0, 1.0, 0.0, -0.5, 0.0]   # same sign: the run's own value


def test_elements_whose_reference_grad_is_below_adams_eps_band_take_its_value():
    """Near Adam's eps an update's size follows |g|: a grad of 3e-8 against the reference's 7e-7, both
    positive, moved an element 0.75 lr against 0.99 lr (tracer/grad_signs.py). The band is the
    reference's, so every run decides an element alike: a run's own small grad above a reference's
    outside the band keeps its value, as every other run's there does, while its first update stays
    within 1% of lr of the reference's."""
    grad = torch.tensor([3e-8, 9e-7, 2e-6, 5e-6, -1e-9])
    ref = torch.tensor([7e-7, 1.2e-6, 3e-6, 4e-6, -1e-9])
    assert take_reference_signs(grad, ref) == 1   # the last is the reference's already
    assert grad.tolist() == torch.tensor([7e-7, 9e-7, 2e-6, 5e-6, -1e-9]).tolist()


def test_a_grad_of_the_reference_sign_whose_update_differs_by_over_1_percent_of_lr_takes_its_value():
    """A reference grad above the band does not keep a run's own out of eps's reach: on an Intel Xeon a
    clean hf bf16 check's embedding element had grad -1.6e-8 against the reference's -4.5e-5 (first
    updates 0.59 and 1.0 lr), and the next step's embedding output failed at 1.83x. Its own update
    0.98 lr against the reference's 0.99 (5e-7 against 1.2e-6) is over the 1% too; 0.989 against
    0.992 (9e-7) and every update of grads far above eps are not."""
    grad = torch.tensor([-1.6e-8, 5e-7, 9e-7, 1e-4, -3e-3])
    ref = torch.tensor([-4.5e-5, 1.2e-6, 1.2e-6, 3e-4, -1e-3])
    assert take_reference_signs(grad, ref) == 2
    assert grad.tolist() == torch.tensor([-4.5e-5, 1.2e-6, 9e-7, 1e-4, -3e-3]).tolist()


def test_a_grad_whose_update_moves_over_1_percent_of_lr_at_the_fitted_eps_takes_the_reference_value():
    """Clipped 10x, Adam's eps acts as 1.1e-7 on the traced grads: a grad of -8e-6 against the
    reference's -2e-5 moves the first update 0.81% of lr (kept) and -5e-6 1.6% (taken); at ADAM_EPS
    both read as under 0.2% (kept): the deviation a clean hf bf16 check clipping at 0.1 kept (seed 522
    on an Intel Xeon: 6% of lr read as 0.59%)."""
    ref = torch.tensor([-2e-5, -2e-5, 5e-5])
    grad = torch.tensor([-8e-6, -5e-6, 4e-5])
    assert take_reference_signs(grad.clone(), ref) == 0
    at_fit = grad.clone()
    assert take_reference_signs(at_fit, ref, eps=1.1e-7) == 1
    assert at_fit.tolist() == torch.tensor([-8e-6, -2e-5, 4e-5]).tolist()


def _first_step(root, run: str, optimizer: str, clip: float, meta: dict) -> None:
    """A traced fresh first step of a 64x64 weight whose grad spans 1e-10 to 1e-3 (so some of it lies
    near eps), clipped to `clip` of its norm before `optimizer` (adam, sgd) steps it."""
    g = torch.Generator().manual_seed(3)
    net = nn.Linear(64, 64, bias=False)
    grad = torch.exp(torch.empty(64, 64).uniform_(-23.0, -6.9, generator=g))   # |g| 1e-10 .. 1e-3
    grad *= torch.randint(0, 2, (64, 64), generator=g) * 2 - 1
    tr = Tracer(str(root), run, 0, coords={}, sizes={}, meta={"fingerprint": "lin", **meta})
    tr.attach(net, {"": ModuleLayout()})
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3) if optimizer == "adam" else \
        torch.optim.SGD(net.parameters(), lr=1e-3)
    with tr.step(-1):
        tr.record_params(net)
    net.weight.grad = grad.clone()
    with tr.step(0):
        tr.record_param_grads(net)   # before clipping, as the job contract says
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip * float(grad.norm()))
        opt.step()
        tr.record_params(net)
    tr.close()


def test_the_eps_of_a_clipped_first_update_is_fitted_from_the_reference(tmp_path):
    """tracer.grad_signs.reference_eps: Adam's eps over the clip factor, read off the reference's own
    first update (tracer/adam.py); ADAM_EPS where it cannot be told: moves unlike Adam's (SGD), a run
    from a checkpoint (its moments not fresh) or one that does not say."""
    from tracer.adam import ADAM_EPS
    from tracer.grad_signs import reference_eps

    fitted = {}
    for run, optimizer, clip, meta in (("adam10", "adam", 0.1, {"from_checkpoint": False}),
                                        ("adam1", "adam", 1.0, {"from_checkpoint": False}),
                                        ("sgd", "sgd", 0.1, {"from_checkpoint": False}),
                                        ("resumed", "adam", 0.1, {"from_checkpoint": True}),
                                        ("unsaid", "adam", 0.1, {})):
        _first_step(tmp_path, run, optimizer, clip, meta)
        fitted[run] = reference_eps(load_logical(str(tmp_path), run, 1))
    assert fitted["adam10"] == pytest.approx(10 * ADAM_EPS, rel=0.02)
    assert fitted["adam1"] == pytest.approx(ADAM_EPS, rel=0.02)
    assert fitted["sgd"] == fitted["resumed"] == fitted["unsaid"] == ADAM_EPS


def test_a_replaying_run_takes_at_the_fitted_eps_and_records_it_for_the_comparison(tmp_path, capfd):
    """The replay decides at the eps the reference's first update shows, and the run's manifest says
    which (`first_update_eps`): the comparison's first-update rule reads it there
    (tracer.compare_inputs.first_update_eps)."""
    _first_step(tmp_path, "reference", "adam", 0.1, {"from_checkpoint": False})
    ref = load_logical(str(tmp_path), "reference", 1).tensors["0/-/weight/param_grad"].tensor
    own = ref.clone()
    i = int(((ref.abs() - 2e-5).abs()).argmin())   # a grad ~2e-5: above the band at the fitted eps too
    own.view(-1)[i] *= 0.25                         # 1.6% of lr off at the fitted eps, 0.15% at ADAM_EPS
    net = nn.Linear(64, 64, bias=False)
    tr = Tracer(str(tmp_path), "candidate", 0, coords={}, sizes={}, meta={"fingerprint": "lin"})
    tr.attach(net, {"": ModuleLayout()})
    tr.replay_grad_signs(reference_grads(f"{tmp_path}/reference", {}, {}))
    net.weight.grad = own.clone()
    with tr.step(0):
        tr.record_param_grads(net)
    tr.close()
    assert net.weight.grad.view(-1)[i] == ref.view(-1)[i]
    said = load_logical(str(tmp_path), "candidate", 1).meta["first_update_eps"]
    assert said == pytest.approx(1e-7, rel=0.02)
    assert f"(Adam's eps {said})" in capfd.readouterr().err


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


REF_GRAD = torch.tensor([[1.0, -2.0, 3.0], [-4.0, 5.0, -6.0]])


def _replaying(tmp_path, axis: str) -> Tracer:
    """A candidate rank (coordinate 1 of `axis`, size 2) replaying REF_GRAD, the reference's Linear grad."""
    store = tmp_path / "store"
    _run(store, "reference", REF_GRAD)
    tr = Tracer(str(store), "candidate", 1, coords={axis: 1}, sizes={axis: 2}, meta={"fingerprint": "lin"})
    tr.attach(nn.Linear(3, 2), {"": ModuleLayout()})
    tr.replay_grad_signs(reference_grads(f"{store}/reference", {axis: 1}, {axis: 2}))
    return tr


def test_a_distributed_optimizers_grad_shards_take_the_reference_signs(tmp_path):
    """ZeRO-1: each DP rank traces the shard of the grad its optimizer steps (layout: the rows this rank
    holds); the shard takes the signs of the same rows of the reference's grad."""
    tr = _replaying(tmp_path, "dp")
    shard = torch.tensor([[4.0, -5.0, 6.0]])   # row 1, every sign the other way
    with tr.step(0):
        tr.record_param_grad_shards({"weight": (shard, Shard(0, "dp"))})
    tr.close()
    assert torch.equal(shard, REF_GRAD[1:])


def test_a_distributed_optimizers_owned_range_takes_the_reference_signs(tmp_path):
    """megatron's distributed optimizer: each DP rank holds the reduced grad in the flat range it owns,
    zeros elsewhere (a disjoint partial sum over dp). The owned elements take the reference's signs, the
    rest stay zero: the owner's value counts once (before, the piece was left as it was, and a clean
    megatron-core bf16 tp2_dp2 zero1 candidate stepped its own signs)."""
    tr = _replaying(tmp_path, "dp")
    owned = torch.tensor([[False, False, True], [True, True, False]])   # flat range [2, 5)
    piece = torch.tensor([[0.0, 0.0, -3.0], [-4.5, -5.0, 0.0]])   # two owned signs the other way
    with tr.step(0):
        tr.record_param_grad_shards({"weight": (piece, Layout((), ("dp",), (), ("dp",)), owned)})
    tr.close()
    assert torch.equal(piece, torch.tensor([[0.0, 0.0, 3.0], [-4.5, 5.0, 0.0]]))


def test_a_partial_sums_piece_keeps_its_own_signs(tmp_path):
    """A grad not reduced yet (a Partial DTensor grad: torch-native's replicated K/V weights) is a
    summand: the reference's signs are the sum's, and its value taken into each piece would count it
    once per piece (every clean torch-native tp2_sp bf16 check failed that way, 5 of 5)."""
    tr = _replaying(tmp_path, "tp")
    piece = torch.tensor([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]])   # every sign the other way
    with tr.step(0):
        tr.record_param_grad_shards({"weight": (piece, Partial("tp"))})
    tr.close()
    assert torch.equal(piece, torch.tensor([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]]))


def test_a_partial_sums_pieces_given_their_sum_make_the_sum_the_references(tmp_path):
    """Given the sum (the DTensor tracer all-reduces a Partial grad's pieces to read it), the elements
    whose summed sign differs from the reference's are set so the sum is the reference's value: its
    value on coordinate 0 of the partial axis, zero elsewhere; the rest keep their own, as a one-device
    run replaying the same parameter does. Replay was lopsided before: the one-device perturbed runs
    replayed these parameters and the candidate did not."""
    from tracer.feed import ReferenceFeed
    from tracer.grad_signs import GradSigns

    store = tmp_path / "store"
    ref = torch.tensor([[1.0, -2.0, 3.0], [-4.0, 5.0, 1e-6]])
    _run(store, "reference", ref)
    pieces = [torch.tensor([[0.6, 1.0, 1.0], [-2.0, 1.0, -3e-6]]),
              torch.tensor([[0.5, 0.5, 2.0], [-2.5, 2.0, 1e-6]])]
    summed = pieces[0] + pieces[1]   # signs: (0, 1) and (1, 2) differ from the reference's
    for rank, piece in enumerate(pieces):
        signs = GradSigns(ReferenceFeed(load_logical(str(store), "reference", 1, lazy=True), {"tp": rank},
                                        {"tp": 2}, purpose="grad-sign replay"))
        signs.take(0, "weight", Partial("tp"), piece, summed.clone())
        assert signs.taken == 2
    assert torch.equal(pieces[0], torch.tensor([[0.6, -2.0, 1.0], [-2.0, 1.0, 1e-6]]))
    assert torch.equal(pieces[1], torch.tensor([[0.5, 0.0, 2.0], [-2.5, 2.0, 0.0]]))
    after = pieces[0] + pieces[1]
    assert torch.equal(after[0, 1], ref[0, 1]) and torch.equal(after[1, 2], ref[1, 2])
    assert torch.equal(torch.sign(after), torch.sign(ref))


_TWO_RANKS = """
import json, os, socket, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank(r, store, port, pieces):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    from tracer.grad_signs import reference_grads
    from tracer.integrations.dtensor import _summed, layout_of, local_of
    grad = DTensor.from_local(torch.tensor(pieces[r]), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)),
                              [Partial()])
    signs = reference_grads(store, {"tp": r}, {"tp": 2})
    signs.take(0, "weight", layout_of(grad), local_of(grad), _summed(grad))
    full = grad.full_tensor()   # the reduction the optimizer's first read of the grad does
    if r == 0:
        print(json.dumps({"sum": full.tolist(), "taken": signs.taken}))
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.start_processes(rank, args=(sys.argv[1], port, json.loads(sys.argv[2])), nprocs=2, start_method="fork")
"""


def test_a_partial_dtensor_grad_replays_its_reduced_sum(tmp_path):
    """Two gloo ranks hold a Partial("sum") DTensor grad; the DTensor tracer's `_summed` all-reduces it
    for the replay, and after the optimizer's reduction the sum is the reference's where its sign
    differed and the ranks' own sum elsewhere."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    store = tmp_path / "store"
    ref = [[1.0, -2.0, 3.0], [-4.0, 5.0, 1e-6]]
    _run(store, "reference", torch.tensor(ref))
    pieces = [[[0.6, 1.0, 1.0], [-2.0, 1.0, -3e-6]], [[0.5, 0.5, 2.0], [-2.5, 2.0, 1e-6]]]
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", _TWO_RANKS, f"{store}/reference", json.dumps(pieces)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    own = (torch.tensor(pieces[0]) + torch.tensor(pieces[1])).tolist()
    want = [[own[0][0], ref[0][1], own[0][2]], [own[1][0], own[1][1], ref[1][2]]]
    assert torch.equal(torch.tensor(got["sum"]), torch.tensor(want)) and got["taken"] == 2, got


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
    # ttrace's DTensor jobs too, in bf16 (since their replay is symmetric); a user's job when asked
    for job in (["job=torch_native", "model=llama_tiny"], ["job=hf", "parallel=tp2"]):
        assert grad_signs.replay(recipe.compose([*job, "precision=bf16"])), job
        assert not grad_signs.replay(recipe.compose([*job, "precision=fp32"])), job
    user = ["job.entrypoint=mypkg.train:main", "precision=bf16"]
    assert not grad_signs.replay(recipe.compose(user))
    assert grad_signs.replay(recipe.compose([*user, "tolerance.grad_signs=replay"]))
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
