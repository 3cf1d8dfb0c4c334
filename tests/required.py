"""Suites CI must run: where a suite cannot run here, a local run skips it with the reason,
and CI fails with it.

``.ci/run`` exports ``KVROUTE_CI=1``: then the real vLLM, peer-router, LiteLLM, Redis and
NATS suites may not skip for want of their install or service (a CI run that skipped them all
would otherwise pass while testing none of it). A per-suite variable (e.g.
``KVROUTE_REQUIRE_REALVLLM=1``) asks the same of one suite outside CI. Skips for other
reasons (a test that cannot restart engines it does not own, a host too slow for a timing
comparison) stay skips.
"""

from __future__ import annotations

import os
import socket
from typing import NoReturn
from urllib.parse import urlsplit

import pytest

__all__ = ["CI_ENV", "NATS_URL", "ci_requires_suites", "nats_missing", "require_nats",
           "require_redis", "skip_unless_required"]

CI_ENV = "KVROUTE_CI"


def ci_requires_suites() -> bool:
    """Whether this run is CI's, where every suite must run."""
    return os.environ.get(CI_ENV) == "1"


def skip_unless_required(suite: str, reason: str, *, env: str | None = None) -> NoReturn:
    """Skip the calling test with ``reason``, or fail it when ``suite`` is required (under
    CI, or ``env`` set to 1)."""
    if ci_requires_suites():
        pytest.fail(f"{suite} cannot run, and CI ({CI_ENV}=1) requires it: {reason}",
                    pytrace=False)
    if env is not None and os.environ.get(env) == "1":
        pytest.fail(f"{suite} cannot run, and {env}=1 requires it: {reason}", pytrace=False)
    pytest.skip(reason)


NATS_URL = os.environ.get("KVROUTE_TEST_NATS_URL", "nats://127.0.0.1:4222")
"""The NATS server (with JetStream) the NATS suite uses; this machine runs one there."""


def nats_missing(url: str = NATS_URL, timeout_s: float = 1.0) -> str | None:
    """Why the NATS server at ``url`` cannot be used (None: it answered its ``INFO`` line)."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222),
                                      timeout=timeout_s) as sock:
            greeting = sock.recv(4096)
    except OSError as exc:
        return (f"NATS is not reachable at {url} ({exc}); start nats-server -js, or point "
                "KVROUTE_TEST_NATS_URL at one")
    if not greeting.startswith(b"INFO "):
        return f"{url} answered {greeting[:40]!r}, not a NATS INFO line"
    return None


def require_nats(url: str = NATS_URL) -> None:
    """Skip the calling test without a NATS server (fail under CI or KVROUTE_REQUIRE_NATS=1)."""
    reason = nats_missing(url)
    if reason is not None:
        skip_unless_required("the NATS suite", reason, env="KVROUTE_REQUIRE_NATS")


def require_redis(url: str) -> None:
    """Skip the calling test without a Redis server at ``url`` (fail under CI or
    KVROUTE_REQUIRE_REDIS=1)."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        client.ping()
        client.close()
    except (redis.RedisError, OSError) as exc:
        skip_unless_required("the Redis suite", f"Redis is not reachable at {url} "
                             f"({exc}); start redis-server to run this",
                             env="KVROUTE_REQUIRE_REDIS")
