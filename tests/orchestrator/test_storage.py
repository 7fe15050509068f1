"""The store's preflight (orchestrator/storage.py): an explicit S3 endpoint that nothing answers, or
that is no URL, is an error at once that names it, before any request and its retries."""

import pytest

from orchestrator.storage import preflight
from tracer.errors import TTraceError


def test_a_closed_endpoint_is_named_by_the_connection_tried_first(monkeypatch, closed_port):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    port = closed_port
    with pytest.raises(TTraceError, match=rf"unreachable \(no connection to 127.0.0.1:{port} within 5s: "
                                          "ConnectionRefusedError"):
        preflight("s3://bucket1/runs", {"protocol": "s3", "endpoint_url": f"http://127.0.0.1:{port}"})


def test_an_endpoint_with_a_port_out_of_range_is_no_url():
    with pytest.raises(TTraceError, match=r"store.endpoint_url 'http://127.0.0.1:99999' is not a valid URL"):
        preflight("s3://bucket1/runs", {"protocol": "s3", "endpoint_url": "http://127.0.0.1:99999"})
