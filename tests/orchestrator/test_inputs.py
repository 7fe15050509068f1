"""The recipe's input files before anything is scheduled (orchestrator/inputs.py): refused when they
cannot serve, keyed into the reference cache by content, and handed to the jobs as absolute paths."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from orchestrator import recipe
from tracer.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def token_file(path, ids) -> str:
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return str(path)


def test_an_out_of_vocab_token_file_is_refused_before_anything_runs(tmp_path):
    ids = np.zeros(1000)
    ids[700] = 500
    rec = recipe.compose([f"data.path={token_file(tmp_path / 't.bin', ids)}"])
    with pytest.raises(ConfigError, match=r"token id 500 at offset 700 .* model.vocab=128"):
        recipe.validate(rec, str(tmp_path))


def test_the_reference_key_follows_the_files_content_not_their_path(tmp_path):
    a = token_file(tmp_path / "a.bin", np.arange(1000) % 100)
    b = str(tmp_path / "b.bin")
    shutil.copy(a, b)
    key = lambda path: recipe.reference_key(recipe.compose([f"data.path={path}"]))
    assert key(a) == key(b)                                           # a copy: the same data
    token_file(b, np.arange(1000) % 99)
    assert key(a) != key(b)                                           # other content, other reference
    assert key(a) != recipe.reference_key(recipe.compose([]))         # synthetic tokens
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model.safetensors").write_bytes(b"x")
    with_ck = recipe.reference_key(recipe.compose([f"init.checkpoint={ck}"]))
    (ck / "model.safetensors").write_bytes(b"y")
    assert recipe.reference_key(recipe.compose([f"init.checkpoint={ck}"])) != with_ck


def test_checkpoint_save_runs_the_reference_and_only_the_reference_writes(tmp_path):
    rec = recipe.compose(["checkpoint.save=out/ck", "init.checkpoint=in/ck"])
    assert "checkpoint.save" in recipe.cacheable(rec)
    # Two checks of a sweep saving to two directories do not share one reference computation.
    assert recipe.reference_key(rec) != recipe.reference_key(recipe.compose(["checkpoint.save=out/ck2",
                                                                             "init.checkpoint=in/ck"]))
    ref = recipe.job_spec(rec, role="reference", store_url="", base_dir=str(tmp_path))
    cand = recipe.job_spec(rec, role="candidate", store_url="", base_dir=str(tmp_path))
    assert ref["checkpoint"]["save"] == str(tmp_path / "out" / "ck") and not cand["checkpoint"]
    assert ref["init"]["checkpoint"] == cand["init"]["checkpoint"] == str(tmp_path / "in" / "ck")


def test_unusable_checkpoint_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        recipe.validate(recipe.compose(["init.checkpoint=nowhere"]), str(tmp_path))
    with pytest.raises(ConfigError, match="would overwrite the checkpoint"):
        recipe.validate(recipe.compose([f"init.checkpoint={tmp_path}", f"checkpoint.save={tmp_path}"]),
                        str(tmp_path))
    from tracer.checkpoint import save_checkpoint

    save_checkpoint(str(tmp_path / "llama"), {}, {}, {"model": recipe.compose(["model=llama_tiny"])["model"]})
    with pytest.raises(ConfigError, match="written by model=llama_tiny and this check runs model=gpt_tiny: "
                                          "arch=llama \\(here gpt\\)"):
        recipe.validate(recipe.compose([f"init.checkpoint={tmp_path / 'llama'}"]), str(tmp_path))

    # A reference on several ranks saves what its ranks gather: not pipeline stages, nor a distributed
    # optimizer's ranges (the ranks refuse the rest, tracer/checkpoint_gather.py).
    save = f"checkpoint.save={tmp_path / 'out'}"
    for job, ref, why in (("builtin", "pp2", "pipeline stages"), ("torch_native", "pp2", "pipeline stages"),
                          ("megatron_core", "dp2_zero1", "a distributed optimizer")):
        with pytest.raises(ConfigError, match=f"reference.parallel={ref}\\) with {why}"):
            recipe.validate(recipe.compose([f"job={job}", save, f"reference.parallel={ref}"]), str(tmp_path))
    (tmp_path / "train.py").write_text("")
    for job, candidate in (("job=torch_native", "tp2_sp"), ("job=hf", "dp2"), ("job=builtin", "tp2_sp"),
                           ("job=megatron_core", "tp2_dp2"), ("job.command=python train.py", "tp2_sp")):
        recipe.validate(recipe.compose([job, f"parallel={candidate}", save, "reference.parallel=tp2"]),
                        str(tmp_path))
    with pytest.raises(ConfigError, match="not a URL"):
        recipe.validate(recipe.compose(["data.path=s3://bucket/t.bin"]), str(tmp_path))


def test_the_cli_exits_2_on_a_token_file_too_short_without_starting_a_job(tmp_path):
    token_file(tmp_path / "short.bin", [1, 2, 3])
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "data.path=short.bin",
                          "tracking.enabled=false", "store.url=runs"], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "holds 3 tokens, fewer than one window" in out.stdout + out.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("MANIFEST*"))
