"""parallel.recompute (activation recomputation in the candidate) as each built-in job validates it:
the built-in trainer and the torch-native job take `full`, no job takes an unknown mode, and the jobs
whose recomputation is not wired refuse it rather than ignore it. (That a check with it passes and
names a bug: tests/ray/test_checks.py, tests/ray/test_job_torch_native.py.)"""

import pytest

from orchestrator.recipe import compose, job_spec
from tracer.errors import ConfigError
from workloads.adapters import hf, megatron_core, torch_native
from workloads.config import validate as builtin


def spec(*overrides: str) -> dict:
    return job_spec(compose(list(overrides)), role="candidate", store_url="")


def test_each_job_takes_full_recomputation_or_refuses_it():
    assert spec()["parallel"]["recompute"] == "none"   # the recipe's default, merged into every layout
    builtin(spec("parallel=tp2_sp", "parallel.recompute=full"))
    torch_native.validate(spec("job=torch_native", "parallel=tp2_sp", "parallel.recompute=full"))
    with pytest.raises(ConfigError, match="parallel.recompute=selective must be one of none, full"):
        builtin(spec("parallel.recompute=selective"))
    with pytest.raises(ConfigError, match="parallel.recompute=selective must be one of none, full"):
        torch_native.validate(spec("job=torch_native", "parallel=tp2_sp", "parallel.recompute=selective"))
    with pytest.raises(ConfigError, match="recomputation is wired for job=builtin and job=torch_native"):
        hf.validate(spec("job=hf", "parallel=tp2", "parallel.recompute=full"))
    with pytest.raises(ConfigError, match="wired for job=builtin and job=torch_native only"):
        megatron_core.validate(spec("job=megatron_core", "parallel=tp2", "parallel.recompute=full"))
    megatron_core.validate(spec("job=megatron_core", "parallel=tp2"))
