"""Grad-sign replay in the built-in trainer (tracer/grad_signs.py): a bf16 perturbed reference (GEMM
rounding draws) flips Adam's first update, lr * sign(g), on the elements whose grad is at noise level: they
end the step 2 lr from the reference's. Replaying the reference's grad signs, none does. One process,
one rank per job: the reference, then a perturbed run with and one without replay."""

import os
import socket

import torch

from orchestrator import recipe
from tracer.logical import load_logical

LR = 1e-3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(store: str, role: str, run: str, replay: bool) -> None:
    from tracer.job import Session
    from tracer.job_config import JobConfig
    from workloads.train import main

    rec = recipe.compose(["precision=bf16", "steps=1", f"optim.lr={LR}", "tracking.enabled=false",
                          f"tolerance.grad_signs={'replay' if replay else 'own'}"])
    spec = recipe.job_spec(rec, role=role, run=run, store_url=store, parallel=recipe.SINGLE_DEVICE,
                           perturb=1 if role == "perturbed" else None)
    if spec["trace"]["grad_sign_replay"]:
        spec["trace"]["reference"] = f"{store}/reference"   # as orchestrator/routing.order_jobs sets it
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_port())}
    os.environ.update(env)
    main(Session(JobConfig.from_spec(spec, env=env)))


def _flipped(store: str, run: str) -> int:
    """Elements of the step-0 weights (|w| < 0.25: a bf16 ulp below 1.5 lr) 1.5 lr or more from the
    reference's."""
    ref, other = load_logical(store, "reference", 1), load_logical(store, run, 1)
    out = 0
    for name in ref.order:
        if name.startswith("0/-/") and ref.info[name]["kind"] == "param":
            r, p = ref.tensors[name].tensor.double(), other.tensors[name].tensor.double()
            out += int((((p - r).abs() >= 1.5 * LR) & (r.abs() < 0.25)).sum())
    return out


def test_replaying_perturbed_run_makes_the_reference_first_update(tmp_path):
    store = str(tmp_path / "store")
    _run(store, "reference", "reference", replay=False)
    _run(store, "perturbed", "own", replay=False)
    _run(store, "perturbed", "replayed", replay=True)
    assert _flipped(store, "own") > 0        # noise-level grads flipped some updates
    assert _flipped(store, "replayed") == 0
    # the traced grads are the runs' own: replay changes the update, not what is judged
    own = load_logical(store, "own", 1).tensors
    replayed = load_logical(store, "replayed", 1).tensors
    name = "0/-/layers.0.mlp.fc1.weight/param_grad"
    assert torch.equal(own[name].tensor, replayed[name].tensor)
