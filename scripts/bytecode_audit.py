"""Which installed modules the test suite's processes import without compiled bytecode.

`make setup` compiles the venv's bytecode once, leaving out BYTECODE_SKIP (Makefile). A module left
out that a driver, a Ray worker or a rank imports is compiled again by every process importing it
(every time where PYTHONDONTWRITEBYTECODE is set). This imports what those processes import (every
ttrace module, torch's parallel APIs, megatron-core, the HF model the adapter builds, MLflow with a
logged run, a Ray task) and lists the modules whose bytecode file is missing, in the driver and in a
Ray worker. Exit 1 if any is.

Usage: .venv/bin/python scripts/bytecode_audit.py
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
import tempfile
import warnings


def missing() -> list[str]:
    """Imported modules under site-packages whose bytecode file does not exist."""
    out = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if "site-packages" in path and path.endswith(".py") \
                and not os.path.exists(importlib.util.cache_from_source(path)):
            out.append(name)
    return sorted(out)


def main() -> int:
    warnings.filterwarnings("ignore")
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    for package in ("tracer", "orchestrator", "workloads", "hydra_plugins"):
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            importlib.import_module(info.name)
    import megatron.core  # noqa: F401
    import mlflow
    import pytest  # noqa: F401
    import ray
    import s3fs  # noqa: F401
    import xdist  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401
    from transformers.distributed import DistributedConfig  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
        with mlflow.start_run():
            mlflow.log_metric("x", 1.0)
        ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
        try:
            found = {"driver": missing(), "Ray worker": ray.get(ray.remote(missing).remote())}
        finally:
            ray.shutdown()
    for where, names in found.items():
        print(f"{where}: {len(names)} imported module(s) without bytecode{': ' if names else ''}"
              + ", ".join(names[:40]))
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
