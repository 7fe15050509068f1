"""What the processes of a check and of the test suite import (drivers, Ray workers, ranks, CLI runs),
imported once: `make setup` runs this with bytecode writing on, which compiles exactly those modules
(6,000 files of the venv's 24,000: 30 s of CPU here, where compiling the venv whole took 65) instead
of every process compiling them again (every time where PYTHONDONTWRITEBYTECODE is set).
scripts/bytecode_audit.py imports the same and lists what is still without bytecode.

Usage: .venv/bin/python scripts/suite_imports.py [torch] [services]   (default: both)
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import sys
import tempfile
import warnings

PACKAGES = ("tracer", "orchestrator", "workloads", "hydra_plugins")


def import_torch_side() -> None:
    """torch's parallel APIs and torchrun, megatron-core's GPT, the HF model the adapter builds, then every
    ttrace module."""
    warnings.filterwarnings("ignore")
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401
    from transformers.distributed import DistributedConfig  # noqa: F401

    for package in PACKAGES:
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            importlib.import_module(info.name)


def import_service_side() -> None:
    """MLflow with a logged run (its database migrations), Ray's worker and the processes a local cluster
    starts, Hydra composing a recipe, S3, the test tools."""
    warnings.filterwarnings("ignore")
    import mlflow
    import pytest  # noqa: F401
    import ray._private.log_monitor  # noqa: F401
    import ray._private.runtime_env.agent.main  # noqa: F401
    import ray._private.workers.default_worker  # noqa: F401
    import ray.autoscaler._private.monitor  # noqa: F401
    import ray.dashboard.agent  # noqa: F401
    import s3fs  # noqa: F401
    import xdist  # noqa: F401

    from orchestrator.recipe import compose

    compose([])

    logging.getLogger("mlflow").setLevel(logging.WARNING)   # its database set-up, said at INFO
    with tempfile.TemporaryDirectory() as tmp:
        mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
        with mlflow.start_run():
            mlflow.log_metric("x", 1.0)


SIDES = {"torch": import_torch_side, "services": import_service_side}


def import_all() -> None:
    for side in SIDES.values():
        side()


if __name__ == "__main__":
    for name in sys.argv[1:] or SIDES:
        SIDES[name]()
