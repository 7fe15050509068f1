"""Checks that start where another stopped (issue 17): a single-device check saves its reference's final
state (checkpoint.save), and a TP+SP check starts from it on a token file (init.checkpoint, data.path):
clean it passes, with the LayerNorm grad bug it is named at the LayerNorm. One checkpoint for the
module; resuming bit-exactly is tests/workloads/test_resume.py, bad checkpoints and token files
tests/tracer/test_checkpoints_and_token_files.py."""

import numpy as np
import pytest
import torch

from orchestrator.check import run_check
from orchestrator.recipe import compose
from tracer.checkpoint import open_checkpoint
from tracer.logical import load_logical

CHEAP = ("localize=false", "tracking.enabled=false", "tolerance.perturbations=2")


def check(base, name, *overrides):
    return run_check(compose([*overrides, *CHEAP]), base / "out" / name, base_dir=str(base))


@pytest.fixture(scope="module")
def saved(ray_cluster, tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    res = check(base, "save", "parallel=single", "steps=3", "checkpoint.save=ck")
    np.random.default_rng(0).integers(0, 128, 20000).astype(np.uint16).tofile(base / "tokens.bin")
    return base, res


def test_a_single_device_check_saves_its_references_final_state(saved):
    base, res = saved
    assert res.verdict == "pass" and res.exit_code == 0, res.message or res.report.get("first_divergence")
    ck = open_checkpoint(str(base / "ck"))
    assert (ck.kind, ck.step, ck.optimizer) == ("ttrace", 3, True)
    assert ck.index["fingerprint"] and ck.index["model"]["name"] == "gpt_tiny"
    assert "checkpoint.save" in res.report["reference"]["not_stored_for_reuse"]   # the reference ran


def test_tp2_sp_from_the_checkpoint_on_a_token_file_passes_and_names_the_layernorm_bug(saved):
    base, _ = saved
    start = ("parallel=tp2_sp", "init.checkpoint=ck", "data.path=tokens.bin")
    clean = check(base, "clean", *start)
    assert clean.verdict == "pass" and clean.exit_code == 0, clean.message or clean.report["first_divergence"]
    # The candidate started from the checkpoint: its reassembled weights as attached are its tensors.
    ck = open_checkpoint(str(base / "ck"))
    cand = load_logical(clean.report["store"], "candidate", 2, lazy=True)
    for name in ("layers.0.ln1.weight", "layers.0.attn.qkv.weight", "embedding.word.weight"):
        assert torch.equal(cand.tensors[f"-1/-/{name}/param"].tensor, ck.tensor(name)), name
    assert not torch.equal(ck.tensor("layers.0.ln1.weight"), torch.ones(64))   # trained, not the init

    buggy = check(base, "bug", *start, "bug=sp_layernorm_grad_unreduced")
    assert buggy.verdict == "fail" and buggy.exit_code == 1, buggy.message
    fd = buggy.report["first_divergence"]
    assert (fd["module"], fd["module_type"], fd["kind"]) == ("layers.0.ln1", "LayerNorm", "param_grad"), fd
