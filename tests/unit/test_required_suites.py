"""``tests/required.py``: a suite that cannot run skips locally and fails under CI."""

from __future__ import annotations

import socket

import pytest
from required import CI_ENV, skip_unless_required


def test_a_local_run_skips_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CI_ENV, raising=False)
    monkeypatch.delenv("KVROUTE_REQUIRE_X", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not installed here"):
        skip_unless_required("the X suite", "not installed here", env="KVROUTE_REQUIRE_X")


def test_ci_fails_naming_the_suite_and_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CI_ENV, "1")
    with pytest.raises(pytest.fail.Exception,
                       match=r"the X suite cannot run, and CI \(KVROUTE_CI=1\) requires it: "
                             "not installed here"):
        skip_unless_required("the X suite", "not installed here")


def test_a_suite_variable_requires_that_suite_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CI_ENV, raising=False)
    monkeypatch.setenv("KVROUTE_REQUIRE_X", "1")
    with pytest.raises(pytest.fail.Exception, match="KVROUTE_REQUIRE_X=1 requires it"):
        skip_unless_required("the X suite", "gone", env="KVROUTE_REQUIRE_X")
    with pytest.raises(pytest.skip.Exception):
        skip_unless_required("the Y suite", "gone", env="KVROUTE_REQUIRE_Y")


def test_ci_run_exports_the_variable() -> None:
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    assert f"export {CI_ENV}=1" in script
    assert "|| true" not in script, "a set-up failure must be reported, not hidden"


def test_a_missing_nats_fails_under_ci_and_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    from required import nats_missing, require_nats

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"nats://127.0.0.1:{probe.getsockname()[1]}"
    assert "NATS is not reachable" in (nats_missing(url) or "")
    monkeypatch.setenv(CI_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="the NATS suite cannot run, and CI"):
        require_nats(url)
    monkeypatch.delenv(CI_ENV)
    monkeypatch.delenv("KVROUTE_REQUIRE_NATS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="NATS is not reachable"):
        require_nats(url)
