"""Which installed modules the test suite's processes import without compiled bytecode.

`make setup` compiles the bytecode of what scripts/suite_imports.py imports, by importing it. A
module left out that a driver, a Ray worker or a rank imports is compiled again by every process
importing it (every time where PYTHONDONTWRITEBYTECODE is set). This imports the same, runs a Ray
task, and lists the modules whose bytecode file is missing, in the driver and in a Ray worker (what
a worker imports beyond its start). Exit 1 if any is.

Usage: .venv/bin/python scripts/bytecode_audit.py
"""

from __future__ import annotations

import importlib.util
import os
import sys

from suite_imports import import_all


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
    import ray

    import_all()
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
