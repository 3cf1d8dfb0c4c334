"""``kvroute demo``: the README's first command, live and virtual.

The live runs start the real command as a subprocess in a session of its own, on a tiny slice
(a dozen requests, 2 engines, 4 output tokens), and check the table, the JSON report and
that no process is left behind: every process the demo starts (engines, routers) inherits a
marker environment variable, and after the demo exits no process on the machine may carry
it. The Ctrl-C test sends SIGINT to the demo's whole process group (what a terminal does)
once the first router is running, and checks the same.

The fast tests at the top need no process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvroute.cli import app
from kvroute.commands.demo import DEMO_POLICIES, conversation_slice, demo_table
from kvroute.core.errors import ConfigError

MARKER_VAR = "KVROUTE_DEMO_TEST_MARKER"
TINY = ["--requests", "12", "--rate-scale", "20", "--max-tokens", "4", "--replicas", "2",
        "--duration", "60", "--request-timeout", "30"]


# ---------------------------------------------------------------------------------------------
# Fast tests: no processes


def test_conversation_slice_keeps_whole_conversations_from_time_zero() -> None:
    chosen = conversation_slice(trace_minutes=3, every=4)
    reqs = chosen.requests
    assert reqs[0].arrival_s == 0.0
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    # Every kept multi-block request's conversation key is 0 mod 4, and conversations recur:
    # more requests than conversations means some conversation came back for another turn.
    keys = [r.prompt_token_ids.block_token_ids[1] for r in reqs  # type: ignore[attr-defined]
            if len(r.prompt_token_ids.block_token_ids) > 1]  # type: ignore[attr-defined]
    assert keys and all(k % 4 == 0 for k in keys)
    assert chosen.conversations < len(reqs) < chosen.source_requests
    assert chosen.span_s <= 3 * 60
    assert chosen.mean_prompt_tokens > 5000  # Mooncake prompts are long; nothing truncated


def test_conversation_slice_is_deterministic_and_limit_takes_the_earliest() -> None:
    full = conversation_slice(trace_minutes=2, every=5, seed=3)
    again = conversation_slice(trace_minutes=2, every=5, seed=3)
    assert [r.request_id for r in full.requests] == [r.request_id for r in again.requests]
    cut = conversation_slice(trace_minutes=2, every=5, seed=3, limit=7)
    assert [r.request_id for r in cut.requests] == [r.request_id for r in full.requests[:7]]
    assert cut.conversations <= 7


def test_every_one_keeps_every_request_of_the_window() -> None:
    chosen = conversation_slice(trace_minutes=1, every=1)
    assert len(chosen.requests) == chosen.source_requests


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"trace_minutes": 0}, "trace_minutes"),
    ({"every": 0}, "every"),
    ({"limit": 0}, "limit"),
])
def test_conversation_slice_rejects_bad_bounds(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        conversation_slice(**kwargs)


def test_demo_table_prints_seconds_and_per_engine_counts() -> None:
    report = {"routers": {"kvroute": {
        "completed": 9, "requests": 10, "token_hit_rate": 0.25, "ttft_p50_ms": 1234.0,
        "ttft_p99_ms": None, "e2e_p50_ms": 2000.0, "achieved_rps": 3.5,
        "requests_per_replica": {"e0": 4, "e1": 5}}}}
    rows = demo_table(report)
    assert rows[0][:5] == ["policy", "done", "hit rate", "TTFT p50", "TTFT p99"]
    assert rows[1] == ["kvroute", "9/10", "0.250", "1.23s", "-", "2.00s", "3.50", "4/5"]


def test_bad_option_is_one_clear_error_and_exit_code_2() -> None:
    result = CliRunner().invoke(app, ["demo", "--replicas", "0"])
    assert result.exit_code == 2
    assert "--replicas 0 must be >= 1" in result.output


def test_virtual_demo_prints_the_three_policies() -> None:
    result = CliRunner().invoke(app, ["demo", "--virtual", "--requests", "30",
                                      "--replicas", "2"])
    assert result.exit_code == 0, result.output
    for policy in DEMO_POLICIES:
        assert policy in result.output
    assert "30/30" in result.output
    assert "virtual" in result.output


# ---------------------------------------------------------------------------------------------
# Live: the real command, subprocesses


def _kvroute_command() -> list[str]:
    script = Path(sys.executable).parent / "kvroute"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c",
            "import sys; from kvroute.cli import main; sys.argv[0] = 'kvroute'; main()"]


def _marked_pids(marker: str) -> list[int]:
    """Processes on this machine whose environment carries ``marker`` (readable ones)."""
    needle = f"{MARKER_VAR}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def _env(marker: str) -> dict[str, str]:
    env = dict(os.environ)
    env[MARKER_VAR] = marker
    env["COLUMNS"] = "160"
    return env


def _wait_gone(marker: str, timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = _marked_pids(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _marked_pids(marker)
    return left


def _kill_marked(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.integration
@pytest.mark.slow
def test_live_demo_prints_the_table_and_leaves_no_process(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    report_path = tmp_path / "demo.json"
    try:
        proc = subprocess.run(
            [*_kvroute_command(), "demo", *TINY, "--json", str(report_path),
             "--log-dir", str(tmp_path / "logs")],
            env=_env(marker), capture_output=True, text=True, timeout=240,
            start_new_session=True, check=False)
        left = _wait_gone(marker)
    finally:
        _kill_marked(_marked_pids(marker))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert left == [], f"processes left behind: {left}"
    out = proc.stdout
    for head in ("policy", "hit rate", "TTFT p50", "TTFT p99", "req/s", "per engine"):
        assert head in out
    for policy in DEMO_POLICIES:
        assert policy in out
    assert out.count("12/12") == 3, out
    assert "Replaying 12 requests" in proc.stderr
    assert "hit rate: prompt tokens the engines served" in proc.stderr
    report = json.loads(report_path.read_text())
    assert list(report["routers"]) == list(DEMO_POLICIES)
    for entry in report["routers"].values():
        assert entry["completed"] == 12 and entry["errors"] == {}
        assert sum(entry["requests_per_replica"].values()) == 12
        assert entry["query_tokens"] > 12 * 500  # long Mooncake prompts reached the engines
        assert 0.0 <= entry["token_hit_rate"] <= 1.0
        assert entry["ttft_p50_ms"] <= entry["ttft_p99_ms"]
    rr = report["routers"]["round_robin"]["requests_per_replica"]
    assert sorted(rr.values()) == [6, 6]
    assert report["demo"]["requests"] == 12 and report["config"]["max_tokens"] == 4


@pytest.mark.integration
@pytest.mark.slow
def test_ctrl_c_stops_the_router_and_every_engine(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        [*_kvroute_command(), "demo", "--requests", "400", "--rate-scale", "1",
         "--max-tokens", "4", "--replicas", "2", "--log-dir", str(logs)],
        env=_env(marker), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        # The first router's config is written once every engine is up; give it a moment to
        # take requests, then interrupt the whole group as a terminal's Ctrl-C does.
        deadline = time.monotonic() + 90
        while not (logs / "kvroute.yaml").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the demo never started its first router"
            time.sleep(0.2)
        time.sleep(3.0)
        assert proc.poll() is None, "the 400-request run ended before the interrupt"
        assert len(_marked_pids(marker)) >= 4  # demo, 2 engines, router (at least)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        left = _wait_gone(marker)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        _kill_marked(_marked_pids(marker))
    assert proc.returncode == 130, out + err
    assert "interrupted" in err
    assert left == [], f"processes left behind: {left}"
