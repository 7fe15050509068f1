"""Resuming is exact: the built-in trainer run 3 steps, saved (checkpoint.save), then run 2 more from that
checkpoint (init.checkpoint), ends bit-identical to a 5-step run, weights and Adam state, on a token
file (data.path): the data step, Adam's step count and the LR schedule continue where the first run
stopped. In bf16 too: the checkpoint holds the FP32 master weights the optimizer steps, not the BF16
parameters rounded from them, and the resumed run's masters start from those. One process, one rank
(the reference role, which is the one that saves)."""

import socket

import numpy as np
import pytest
import torch

from tracer.checkpoint import open_checkpoint

SPEC = {
    "model": {"name": "gpt_tiny", "vocab": 128, "hidden": 32, "heads": 4, "layers": 2, "seq_len": 16,
              "ffn_hidden": 64},
    "parallel": {"name": "single", "world_size": 1, "tp": 1, "pp": 1, "sp": False},
    "precision": {"name": "fp32"}, "bug": {"name": "none"}, "seed": 7,
    "data": {"global_batch": 4, "micro_batch": 2},
    # An LR decay from step 2: the resumed run must continue the schedule, not restart it.
    "optim": {"lr": 1e-2, "clip_grad": 1.0, "lr_decay_from": 2, "lr_decay_steps": 4},
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(tmp_path, name: str, steps: int, save: str, init: str | None, data: str, precision: str) -> None:
    import os

    from tracer.job import Session
    from tracer.job_config import JobConfig
    from workloads.train import main

    spec = {**SPEC, "steps": steps, "data": {**SPEC["data"], "path": data}, "precision": {"name": precision},
            "init": {"checkpoint": init}, "checkpoint": {"save": save},
            "trace": {"store_url": str(tmp_path / "store" / name), "run": "reference", "role": "reference",
                      "enabled": True}}
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_port())}
    os.environ.update(env)
    main(Session(JobConfig.from_spec(spec, env=env)))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_three_steps_then_two_from_the_checkpoint_equal_five_steps(tmp_path, precision):
    data = str(tmp_path / "tokens.bin")
    np.random.default_rng(0).integers(0, 128, 5000).astype(np.uint16).tofile(data)
    ck = {n: str(tmp_path / n) for n in ("three", "resumed", "five")}
    train(tmp_path, "three", 3, ck["three"], None, data, precision)
    train(tmp_path, "resumed", 2, ck["resumed"], ck["three"], data, precision)
    train(tmp_path, "five", 5, ck["five"], None, data, precision)
    resumed, five, three = (open_checkpoint(ck[n]) for n in ("resumed", "five", "three"))
    assert (three.step, resumed.step, five.step) == (3, 5, 5)
    assert resumed.index["started_from"] == ck["three"]
    assert set(resumed.files) == set(five.files) and resumed.optimizer
    for name in five.files:   # parameters, exp_avg, exp_avg_sq
        assert torch.equal(resumed.tensor(name), five.tensor(name)), name
    # Not vacuous: the first run's state differs from the final one.
    w = "layers.0.attn.qkv.weight"
    assert not torch.equal(three.tensor(w), five.tensor(w))
    # The weights as the optimizer steps them: FP32 masters in bf16, more than BF16 holds.
    assert all(three.tensor(n).dtype == torch.float32 for n in three.index["tensors"])
    if precision == "bf16":
        assert not torch.equal(three.tensor(w), three.tensor(w).bfloat16().float())
