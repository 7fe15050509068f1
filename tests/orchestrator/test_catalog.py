"""`ttrace bugs` (orchestrator/report/catalog.py)."""

from orchestrator.report.catalog import main
from workloads.bugs import CATALOG


def test_bugs_in_a_pipe_are_one_unwrapped_line_each(capsys):
    assert main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("\t") == ["#", "bug", "trigger recipe", "must localize at", "mechanism"]
    assert len(lines) == 1 + len(CATALOG)
    assert {ln.split("\t")[1] for ln in lines[1:]} == set(CATALOG)
    assert all(len(ln.split("\t")) == 5 for ln in lines)


def test_one_bug_in_full_with_the_command_that_runs_it(capsys):
    assert main(["dp_grad_not_averaged"]) == 0
    out = capsys.readouterr().out
    assert "run it:  ttrace parallel=tp2_dp2 bug=dp_grad_not_averaged" in out
    assert main(["no_such_bug"]) == 2


def test_every_bug_has_an_honest_counterpart_that_validates():
    """bench/bugs.py's detection needs the bug's recipe without the bug to pass: it must at least be a
    valid recipe (job=hf's bug is on one KV head, which transformers cannot split honestly: its
    counterpart runs two)."""
    from orchestrator.recipe import compose, validate
    from workloads.bugs import CATALOG

    for name, bug in CATALOG.items():
        validate(compose([*bug.clean_recipe, "bug=none", "tracking.enabled=false"]))
        assert bug.clean_recipe == bug.recipe or bug.clean, name


def test_the_bf16_bench_runs_every_bug_that_validates_in_bf16():
    """`make bench-bugs-bf16` (bench/bugs.py --precision bf16): the bugs are those whose check and honest
    counterpart validate in bf16 and whose trigger sets no precision; the rest are named with the reason."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "bugs.py"
    spec = importlib.util.spec_from_file_location("bench_bugs", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    keep, left = bench.runs_in("bf16")
    assert {"hf_gqa_kv_replicated_plan", "tn_gqa_kv_gathered_output", "dp_grad_not_averaged"} <= set(keep)
    assert "sets precision=fp8" in left["fp8_amax_unreduced"]
    megatron = {n for n, b in CATALOG.items() if b.job == "megatron_core"}
    assert megatron and megatron <= set(keep)   # megatron-core runs Megatron-LM's bf16
    assert sorted(keep + list(left)) == sorted(CATALOG)
