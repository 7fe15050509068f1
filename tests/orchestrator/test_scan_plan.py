"""`ttrace scan`'s planning without Ray: which steps phase 2 reruns from which saved state, the recipe
phase 1 runs, the recipes it refuses, and its per-step report panel and MLflow metrics."""

from orchestrator.recipe import compose
from orchestrator.report.html import render
from orchestrator.report.scan_report import metrics
from orchestrator.scan import _plan, full_steps, scan_recipe
from orchestrator.scan_rerun import rerun_plan


def test_the_rerun_covers_the_step_before_and_the_first_step_from_the_state_before_them():
    assert rerun_plan(100) == (99, 2)      # save after 99 steps; rerun steps 99 and 100
    assert rerun_plan(2) == (1, 2)
    assert rerun_plan(1) == (0, 2)         # no state to save: steps 0 and 1 from the start
    assert rerun_plan(0) == (0, 1)
    assert rerun_plan(-1) == (0, 1)        # the weights as attached differ: step 0 in full


def test_phase_one_logs_the_per_step_kinds_and_drops_the_loss_when_microbatches_differ():
    rec = scan_recipe(compose(["parallel=tp2_dp2"]))
    assert rec["trace"] == {"mode": "scan", "kinds": ["param_grad", "param", "loss"]}
    assert rec["localize"] is False
    other = scan_recipe(compose(["parallel=tp2_dp2", "reference.micro_batch=8"]))
    assert other["trace"]["kinds"] == ["param_grad", "param"]


def test_a_scan_refuses_a_trace_mode_or_selection_of_its_own(tmp_path):
    for bad in ("trace.mode=stats", "trace.kinds=[param]", "checkpoint.save=ck"):
        p = _plan(compose(["parallel=tp2", bad]), tmp_path / "out", str(tmp_path))
        assert p.error and ("ttrace scan" in p.error), (bad, p.error)


def test_the_report_draws_each_modules_error_over_steps_and_mlflow_gets_a_point_per_step():
    steps = [{"step": s, "ok": s < 3, "worst": 0.5 if s < 3 else 40.0, "tensor": "x",
              "kinds": {"param_grad": 0.5 if s < 3 else 40.0, "param": 0.2},
              "modules": {"layers.0.mlp.fc1": 0.5 if s < 3 else 40.0, "head": 0.1},
              "loss": {"candidate": 4.0 + 1e-3 * (s >= 3), "reference": 4.0, "spread": 1e-7}, "failing": []}
             for s in range(-1, 6)]
    report = {"verdict": "fail", "recipe": {}, "tensors": [], "first_divergence": None,
              "scan": {"first_step": 3, "steps": steps, "line": "first step out of the band: 3",
                       "rerun": {"steps": [2, 3], "verdict": "fail"}}}
    page = render(report)
    assert 'data-panel="fingerprint error' in page and "first step out of the band: 3" in page
    assert page.count("<polyline") >= 4 and "layers.0.mlp.fc1" in page and "loss:" in page
    got = metrics(report)
    # the weights as attached (step -1) are not a training step
    assert [s for n, _, s in got if n == "scan.err_over_tol"] == [0, 1, 2, 3, 4, 5]
    assert {n for n, _, _ in got} == {"scan.err_over_tol", "scan.err_over_tol.param_grad",
                                      "scan.err_over_tol.param", "scan.loss_gap", "scan.loss_spread"}


def test_the_reports_table_data_is_json_a_browser_parses_with_infinite_and_nan_figures():
    """An untrained param grad (rel_err inf, cosine NaN) in report.html's table data: strict JSON
    (JSON.parse refuses Python's Infinity and NaN, and the table stayed empty), inf as 1e999."""
    import json
    import math
    import re

    tensor = {"index": 0, "name": "0/-/w/param_grad", "module": "w", "module_type": "Linear",
              "kind": "param_grad", "rel_err": math.inf, "tolerance": 1e-6, "max_err": -math.inf,
              "cosine": math.nan, "nonfinite": 0, "replica_err": 0.0, "ok": False, "reason": "no gradient"}
    report = {"verdict": "fail", "recipe": {}, "tensors": [tensor],
              "first_divergence": {**tensor, "reason": "no gradient"}}
    data = re.search(r'<script type="application/json" id="data">(.*?)</script>', render(report), re.S)[1]

    def strict(token):
        raise ValueError(f"{token} is not JSON")
    (row,) = json.loads(data, parse_constant=strict)
    assert row["rel_err"] == math.inf and row["max_err"] == -math.inf and row["cosine"] == "nan"
    assert row["ratio"] == math.inf and row["name"] == "0/-/w/param_grad"


def test_the_first_steps_checked_in_full_default_to_a_checks_two_and_never_exceed_the_scan(tmp_path):
    assert full_steps(compose(["steps=150"])) == 2
    assert full_steps(compose(["steps=1"])) == 1
    assert full_steps(compose(["steps=150", "scan.full_steps=0"])) == 0
    p = _plan(compose(["parallel=tp2", "scan.full_steps=-1"]), tmp_path / "out", str(tmp_path))
    assert p.error and "scan.full_steps=-1" in p.error, p.error
