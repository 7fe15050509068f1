"""parallel.recompute (activation recomputation in the candidate) as each built-in job validates it:
the built-in trainer, the torch-native and the Hugging Face jobs take `full`, no job takes an unknown
mode, and megatron-core's job, whose recomputation is not wired, refuses it rather than ignore it.
(That a check with it passes and names a bug: tests/ray/test_checks.py, test_job_torch_native.py,
test_job_hf.py.)"""

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
    hf.validate(spec("job=hf", "parallel=tp2", "parallel.recompute=full"))
    with pytest.raises(ConfigError, match="parallel.recompute=selective must be one of none, full"):
        hf.validate(spec("job=hf", "parallel=tp2", "parallel.recompute=selective"))
    with pytest.raises(ConfigError, match="wired for job=builtin, job=torch_native and job=hf only"):
        megatron_core.validate(spec("job=megatron_core", "parallel=tp2", "parallel.recompute=full"))
    megatron_core.validate(spec("job=megatron_core", "parallel=tp2"))
