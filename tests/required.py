"""Suites CI must run: where a suite cannot run here, a local run skips it with the reason,
and CI fails with it.

``.ci/run`` exports ``KVROUTE_CI=1``: then the real vLLM, peer-router, LiteLLM and Redis
suites may not skip for want of their install or service (a CI run that skipped them all
would otherwise pass while testing none of it). A per-suite variable (e.g.
``KVROUTE_REQUIRE_REALVLLM=1``) asks the same of one suite outside CI. Skips for other
reasons (a test that cannot restart engines it does not own, a host too slow for a timing
comparison) stay skips.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

__all__ = ["CI_ENV", "ci_requires_suites", "skip_unless_required"]

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
