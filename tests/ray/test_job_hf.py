"""job=hf: a tiny random Hugging Face LlamaForCausalLM under transformers' own tensor parallelism
(DistributedConfig(tp_size=2), real library code on CPU/gloo), or under torch DDP, against the same
model in one process. Param layouts come from its DTensor placements, output layouts from its TP
styles (tracer/integrations/hf.py). Clean tp2 passes, with transformers' activation checkpointing
switched on as a user switches it, and so does clean dp2 (DDP); a K/V plan that leaves input grads
unreduced exits 1 (without it), and so do DDP grads never all-reduced."""

import re

import pytest
from recomputation import assert_recomputed_and_traced_as_without

pytest.importorskip("transformers")


def test_tp_style_layouts():
    """The layouts read from transformers' TP styles for the outputs it hands out as local tensors."""
    from torch import nn

    from tracer.integrations.hf import tp_local_layouts
    from tracer.layouts import Layout

    class Fake(nn.Module):
        _tp_plan = {"lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise",
                    "model.layers.*.self_attn.q_proj": "colwise",
                    "model.layers.*.self_attn.o_proj": "rowwise",
                    "model.layers.*.self_attn.k_proj": "replicated_with_grad_allreduce"}
        _device_mesh = object()

    f = tp_local_layouts(Fake())
    assert f("model.layers.0.self_attn.q_proj", nn.Linear(2, 2)) == (Layout(shard=((-1, "tp"),)),) * 2
    assert f("model.layers.3.self_attn.o_proj", nn.Linear(2, 2)) == (Layout(), Layout())
    assert f("model.embed_tokens", nn.Embedding(2, 2)) == (Layout(), Layout())
    assert f("lm_head", nn.Linear(2, 2)) == (Layout(), Layout())
    assert f("model.layers.0.self_attn.k_proj", nn.Linear(2, 2)) == (Layout(), Layout(partial=("tp",)))
    assert f("model.layers.0.input_layernorm", nn.RMSNorm(2)) is None   # no style: replicated (checked)


BUGGY = {"hf_gqa_kv_replicated_plan": (["model=llama_tiny", "parallel=tp2"],
                                       "model.layers.3.input_layernorm", "grad_output"),
         # torch DDP's grads never all-reduced: the first param grad, its DP replicas apart
         "hf_ddp_grads_never_synced": (["parallel=dp2"], "model.embed_tokens", "param_grad")}


@pytest.fixture(scope="module")
def results(ray_cluster, tmp_path_factory):
    from orchestrator.check import run_checks
    from orchestrator.recipe import compose

    work = tmp_path_factory.mktemp("hf_checks")
    common = ["job=hf", "tracking.enabled=false", "tolerance.perturbations=2",
              f"cluster.address={ray_cluster}"]
    items = [(compose(["parallel=tp2", "parallel.recompute=full", *common]), work / "clean-tp2"),
             # bf16 at the default R = 3, which its clean seeds ran at (docs/tolerance.md "Known gaps")
             (compose(["parallel=tp2", "precision=bf16", *common, "tolerance.perturbations=3"]),
              work / "clean-tp2-bf16"),
             (compose(["parallel=dp2", *common]), work / "clean-dp2")]   # torch DDP around the model
    items += [(compose([*over, f"bug={b}", *common]), work / b) for b, (over, _, _) in BUGGY.items()]
    out = run_checks(items, base_dir=str(work))
    return dict(zip(["clean-tp2", "clean-tp2-bf16", "clean-dp2", *BUGGY], out, strict=True))


def test_clean_hf_tp_passes(results):
    res = results["clean-tp2"]
    assert res.verdict == "pass" and res.exit_code == 0, res.report.get("first_divergence") or res.message
    assert res.report["recipe"]["model"]["name"] == "llama_tiny_kv2"
    assert len(res.report["tensors"]) > 500
    # activation_checkpointing_enable(): every decoder layer recomputed (non-reentrant, transformers'
    # default), the tensors traced those of a check without it (the bug's: its report lists them all)
    assert_recomputed_and_traced_as_without(res, results["hf_gqa_kv_replicated_plan"])


def test_clean_hf_under_ddp_passes(results):
    """The loaded model wrapped in torch DDP and attached as it is: traced under the one-device
    model's names (the wrapper's `module.` in none), grads all-reduced in the last microbatch's
    backward; the same recipe with every backward in no_sync fails (test_hf_plan_bug_is_named)."""
    res = results["clean-dp2"]
    assert res.verdict == "pass" and res.exit_code == 0, res.report.get("first_divergence") or res.message
    assert len(res.report["tensors"]) > 500
    assert not any(t["name"].split("/")[2].startswith("module") for t in res.report["tensors"])


def test_bf16_runs_under_autocast_and_its_perturbed_references_draw_gemm_roundings(results):
    """precision=bf16 is the forward under torch.autocast, as Hugging Face's Trainer runs it: FP32
    parameters and grads, each Linear's output in BF16, the norms' and embeddings' in FP32. Its
    perturbed references draw every Linear's rounding (bit-identical runs would end the check with
    exit 2), its perturbed references and candidate replay the reference's grad signs, and the clean
    tp2 check passes."""
    import json
    from pathlib import Path

    res = results["clean-tp2-bf16"]
    assert res.verdict == "pass" and res.exit_code == 0, res.report.get("first_divergence") or res.message
    # auto replays the reference's grad signs for ttrace's DTensor jobs in bf16 (orchestrator/grad_signs.py)
    assert res.report["reference"]["grad_signs"] == "replay"
    for log in res.report["logs"]["candidate"]:   # each rank took the reference's value somewhere
        text = (res.report_path.parent / log).read_text()
        taken = re.search(r"grad-sign replay: (\d+) of (\d+) grad elements", text)
        assert taken and 0 < int(taken[1]) < int(taken[2]), (log, taken)
    runs = {"candidate": Path(res.report["store"]), "perturbed-1": Path(res.report["reference"]["url"])}
    for run, root in runs.items():
        manifests = sorted((root / run).glob("rank*/manifest.json"))
        assert len(manifests) == (2 if run == "candidate" else 1), (run, manifests)
        m = json.loads(manifests[0].read_text())
        dtype = {(e["kind"], e["module_type"]): e["dtype"] for e in m["entries"]}
        assert dtype[("output", "Linear")] == dtype[("grad_output", "Linear")] == "bfloat16", run
        assert dtype[("output", "LlamaRMSNorm")] == dtype[("param_grad", "Linear")] == "float32", run
        assert m["meta"]["perturbation"] == "gemm" and m["meta"]["precision"] == "bf16", (run, m["meta"])


def test_validate_names_what_precision_it_runs():
    from orchestrator.recipe import compose, job_spec, validate
    from tracer.errors import ConfigError
    from workloads.adapters import hf

    def spec(*over):
        return job_spec(compose(["job=hf", "parallel=tp2", *over]), role="candidate", store_url="")

    with pytest.raises(ConfigError, match="fp32 or bf16"):
        hf.validate(spec("precision=fp8"))
    with pytest.raises(ConfigError, match="BF16 cast"):
        hf.validate(spec("precision=bf16", "tolerance.perturbation=weights"))
    hf.validate(spec("precision=bf16"))
    hf.validate(spec("parallel=dp2"))   # torch DDP
    with pytest.raises(ConfigError, match="one at a time"):   # transformers' TP and DDP are not combined
        hf.validate(spec("parallel=tp2_dp2"))
    # A sharded reference in bf16 is refused before any job starts (its GEMM draws are not wired).
    with pytest.raises(ConfigError, match=r"reference.parallel=tp2 .*GEMM draws on sharded weights"):
        validate(compose(["job=hf", "parallel=tp2", "precision=bf16", "reference.parallel=tp2"]))
    validate(compose(["job=hf", "parallel=tp2", "precision=fp32", "reference.parallel=tp2"]))


@pytest.mark.parametrize("bug", list(BUGGY))
def test_hf_bugs_are_named(results, bug):
    res = results[bug]
    assert res.verdict == "fail" and res.exit_code == 1, res.message
    fd, culprit = res.report["first_divergence"], res.report["culprit"]
    _, module, kind = BUGGY[bug]
    assert (fd["module"], fd["kind"]) == (module, kind), fd
    assert culprit["resolved"] and (culprit["module"], culprit["kind"]) == (module, kind), culprit
    assert res.report["blame_window"]["size"] == 1
