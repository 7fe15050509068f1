"""parallel.recompute (activation recomputation in the candidate) as each built-in job validates it:
every job (the built-in trainer, torch-native, Hugging Face, megatron-core) takes `full`; `selective`
(the core attention alone, Megatron's way) is taken by the built-in trainer and megatron-core and
refused by the jobs whose frameworks recompute whole blocks; no job takes a mode it does not know.
(That a check with it passes and names a bug: tests/ray/test_checks.py, test_job_torch_native.py,
test_job_hf.py, test_job_megatron_core.py; the built-in model in one process:
test_recompute_in_model.py.)"""

import pytest

from orchestrator.recipe import compose, job_spec
from tracer.errors import ConfigError
from workloads.adapters import hf, megatron_core, torch_native
from workloads.config import validate as builtin


def spec(*overrides: str) -> dict:
    return job_spec(compose(list(overrides)), role="candidate", store_url="")


JOBS = {"builtin": (builtin, ["parallel=tp2_sp"], True),
        "torch_native": (torch_native.validate, ["job=torch_native", "parallel=tp2_sp"], False),
        "hf": (hf.validate, ["job=hf", "parallel=tp2"], False),
        "megatron_core": (megatron_core.validate, ["job=megatron_core", "parallel=tp2_sp"], True)}


def test_the_recipes_default_is_no_recomputation():
    assert spec()["parallel"]["recompute"] == "none"   # merged into every layout by recipes/config.yaml


@pytest.mark.parametrize("job", JOBS)
def test_each_job_takes_the_recomputation_its_framework_offers_and_refuses_the_rest(job):
    validate, overrides, selective = JOBS[job]
    validate(spec(*overrides, "parallel.recompute=full"))
    if selective:
        validate(spec(*overrides, "parallel.recompute=selective"))
    else:
        with pytest.raises(ConfigError, match="selective .* is offered by job=builtin and job=megatron_core"):
            validate(spec(*overrides, "parallel.recompute=selective"))
    with pytest.raises(ConfigError, match="recompute=sometimes must be one of none, full, selective"):
        validate(spec(*overrides, "parallel.recompute=sometimes"))
