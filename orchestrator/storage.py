"""Store options (S3 endpoint, timeouts, retries) applied process-wide, in the driver and every rank.

The trace store is any fsspec URL. Object stores need more than a URL: an endpoint, a region,
bounded timeouts and retries (a dead endpoint must end a check with an error, not hang it). Those
go into `fsspec.config.conf[protocol]`, which fsspec applies to every filesystem it creates, so the
tracer and the comparison stage open the store with them without a storage-options parameter.
Credentials are never part of these options: they come from the standard AWS environment or config
files of each process (driver and Ray workers), and are never logged.
"""

from __future__ import annotations

import socket
import uuid
from typing import Any
from urllib.parse import urlsplit

import fsspec

from tracer.errors import TTraceError
from tracer.store import configure

S3_KEYS = ("endpoint_url", "region", "connect_timeout", "read_timeout", "max_attempts")


def options(store: dict[str, Any]) -> dict[str, Any]:
    """Plain, credential-free options for the store's protocol (what job specs carry to the ranks)."""
    url = str(store.get("url", ""))
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol not in ("s3", "s3a"):
        return {"protocol": protocol}
    return {"protocol": "s3", **{k: store.get(k) for k in S3_KEYS if store.get(k) is not None}}


def preflight(url: str, opts: dict[str, Any]) -> None:
    """Fail fast with a clear message when the store cannot be reached or written (before any job)."""
    configure(opts)
    if opts.get("endpoint_url"):
        _connect(url, str(opts["endpoint_url"]), float(opts.get("connect_timeout", 5)))
    try:
        fs, path = fsspec.core.url_to_fs(url)
        fs.makedirs(path, exist_ok=True)
        # Unique per check: checks sharing a store run concurrently (sweeps, test fixtures), and a
        # shared probe name let one check delete the probe another was about to remove.
        probe = f"{path.rstrip('/')}/.ttrace-probe-{uuid.uuid4().hex}"
        fs.pipe_file(probe, b"ok")
        fs.rm_file(probe)
    except Exception as e:
        where = f" at endpoint {opts['endpoint_url']}" if opts.get("endpoint_url") else ""
        reason = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        raise TTraceError(f"trace store {url}{where} is unreachable or not writable ({type(e).__name__}: "
                          f"{reason}); check store.url / store.endpoint_url, the bucket, and the AWS "
                          "credentials in this environment") from None


def _connect(url: str, endpoint: str, timeout: float) -> None:
    """One TCP connection to an explicit endpoint first: nothing listening there is known at once,
    where botocore's retries of each of the probe's three requests spent 3-6 s in backoff before
    saying the same (measured against a closed local port)."""
    parts = urlsplit(endpoint)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:   # a port out of range
        raise TTraceError(f"store.endpoint_url {endpoint!r} is not a valid URL ({e})") from None
    if not host:   # no scheme://host: botocore's own message says what is wrong with it
        return
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise TTraceError(f"trace store {url} at endpoint {endpoint} is unreachable (no connection to "
                          f"{host}:{port} within {timeout:g}s: {type(e).__name__}: {e}); check "
                          "store.endpoint_url and that the object store is running") from None
