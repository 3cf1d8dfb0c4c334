"""``gate.sample`` through ``kvroute serve`` on a ``kvroute sim serve`` engine: the finished
multi-turn conversations of the opted-in tenant appear in its own transcripts file, in the
format ``kvroute gate replay`` reads; the other tenant's, and one-turn chats, never do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvroute.core.shadow_replay import parse_transcripts
from kvroute.sim.launcher import ReplicaSpec, start_fleet

pytestmark = pytest.mark.integration

MODEL = "sim-model"
KEYS = {"ACME_KEY": "acme-secret", "BETA_KEY": "beta-secret",
        "KVROUTE_SALT_SECRET": "a-test-secret-of-some-length-0123456789"}


def _serve(tmp_path: Path, engine: str, directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    path = tmp_path / "kvroute.yaml"
    path.write_text(json.dumps({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"main": {"model": MODEL, "replicas": [{"name": "s0", "url": engine}]}},
        "routes": {"assistant": {"pools": ["main"]}},
        "tenants": [{"name": "acme", "api_key_env": "ACME_KEY"},
                    {"name": "beta", "api_key_env": "BETA_KEY"}],
        "gate": {"sample": {"directory": str(directory), "tenants": ["acme"], "rate": 1.0,
                            "idle_s": 0.5, "max_tokens": 8}},
        "log_level": "warning",
    }))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")} | KEYS
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kvroute.cli import main; main()", "serve", "-c", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"kvroute serve did not start: {proc.stderr.read().decode()}")
    info = json.loads(line)
    assert info["ready"] is True
    return proc, str(info["url"])


def _converse(url: str, key: str, session: str, turns: list[str]) -> None:
    """A multi-turn chat: each turn sends the history, the answers included."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly."}]
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        body = {"model": "assistant", "max_tokens": 4, "messages": messages}
        request = urllib.request.Request(
            url + "/v1/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}",
                     "x-session-id": session})
        with urllib.request.urlopen(request, timeout=20) as reply:
            answer = json.loads(reply.read())
        messages.append({"role": "assistant",
                         "content": answer["choices"][0]["message"]["content"]})


def test_finished_conversations_of_an_opted_in_tenant_become_replayable_transcripts(
        tmp_path: Path) -> None:
    fleet = start_fleet([ReplicaSpec(name="s0", pool="main", model=MODEL,
                                     extra_args=("--timing", "0.001,0.00005,0.0002,0"))],
                        timeout_s=30.0)
    directory = tmp_path / "transcripts"
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc, url = _serve(tmp_path, fleet.replicas[0].url, directory)
        acme_turns = ["Name three rivers in Europe.", "Which is the longest?",
                      "How long is it in kilometres?"]
        _converse(url, KEYS["ACME_KEY"], "conv-1", acme_turns)
        _converse(url, KEYS["ACME_KEY"], "conv-2", ["Only one turn here."])
        _converse(url, KEYS["BETA_KEY"], "conv-1", ["Beta's secret question.", "And again."])
        acme = directory / "acme.jsonl"
        deadline = time.monotonic() + 20.0  # idle 0.5 s, written within a second after
        while not (acme.exists() and acme.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        written = acme.read_text(encoding="utf-8")
        (transcript,) = parse_transcripts(written, str(acme))  # what gate replay loads
        assert transcript.turns == tuple(acme_turns)
        assert transcript.system == "Answer briefly."
        assert transcript.workload == "assistant" and transcript.max_tokens == 4
        assert "conv-1" not in written  # the id is a hash, not the client's session id
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
        counts = {line.split('outcome="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
                  for line in metrics.splitlines()
                  if line.startswith("kvroute_gate_sample_conversations{")}
        # acme's four answers offered (beta is not opted in: never offered), two of its
        # conversations taken, one line written so far.
        assert (counts["offered"], counts["sampled"], counts["written"]) == (4.0, 2.0, 1.0)
        proc.send_signal(signal.SIGTERM)  # stopping writes what is still open: nothing new
        proc.wait(timeout=30)
        assert acme.read_text(encoding="utf-8") == written
        assert sorted(p.name for p in directory.iterdir()) == ["acme.jsonl"]  # no beta file
    finally:
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        fleet.stop()
