"""parallel.recompute (activation recomputation in the candidate) as each built-in job validates it:
every job (the built-in trainer, torch-native, Hugging Face, megatron-core) takes `full` and refuses a
mode it does not know rather than ignore it. (That a check with it passes and names a bug:
tests/ray/test_checks.py, test_job_torch_native.py, test_job_hf.py, test_job_megatron_core.py.)"""

import pytest

from orchestrator.recipe import compose, job_spec
from tracer.errors import ConfigError
from workloads.adapters import hf, megatron_core, torch_native
from workloads.config import validate as builtin


def spec(*overrides: str) -> dict:
    return job_spec(compose(list(overrides)), role="candidate", store_url="")


JOBS = {"builtin": (builtin, ["parallel=tp2_sp"]),
        "torch_native": (torch_native.validate, ["job=torch_native", "parallel=tp2_sp"]),
        "hf": (hf.validate, ["job=hf", "parallel=tp2"]),
        "megatron_core": (megatron_core.validate, ["job=megatron_core", "parallel=tp2_sp"])}


def test_the_recipes_default_is_no_recomputation():
    assert spec()["parallel"]["recompute"] == "none"   # merged into every layout by recipes/config.yaml


@pytest.mark.parametrize("job", JOBS)
def test_each_job_takes_full_recomputation_and_refuses_an_unknown_mode(job):
    validate, overrides = JOBS[job]
    validate(spec(*overrides, "parallel.recompute=full"))
    with pytest.raises(ConfigError, match="parallel.recompute=selective must be one of none, full"):
        validate(spec(*overrides, "parallel.recompute=selective"))
