"""One local Ray cluster for the whole test session (starting Ray costs ~15 s on 2 cores).

Layout: tests/tracer, tests/workloads, tests/orchestrator hold the single-process tests of each
package; tests/ray the multi-rank ones (Ray checks, or rank processes of their own). Every test in
tests/ray, and any test that uses the `ray_cluster` fixture, is marked `ray`:
`pytest -m "not ray"` runs the fast ones."""

import os
import socket
from pathlib import Path

import pytest

RAY_DIR = Path(__file__).parent / "ray"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if RAY_DIR in Path(item.path).parents or "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from orchestrator.cluster import ensure_ray

    # Ray workers inherit the environment at start: credentials for the local S3 test server (moto
    # accepts any), given the standard AWS way, as on a real cluster. Never used for a real AWS.
    for var, val in (("AWS_ACCESS_KEY_ID", "ttrace-test"), ("AWS_SECRET_ACCESS_KEY", "ttrace-test-secret"),
                     ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(var, val)
    ensure_ray({"address": None, "num_cpus": None})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Run checks from a scratch directory: store, MLflow db and artifacts land there."""
    monkeypatch.chdir(tmp_path)
    os.environ.setdefault("TTRACE_TEST", "1")
    return tmp_path


@pytest.fixture
def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
