"""Fleets of simulated servers as child processes, the ``kvroute sim`` CLI, and calibration."""

from __future__ import annotations

import asyncio
import json
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvroute.core.errors import ConfigError
from kvroute.core.events import EventBatch
from kvroute.sim.calibrate import (
    CalibrationPlan,
    Observation,
    calibrate,
    check_loopback_url,
    fit_step_timing,
)
from kvroute.sim.launcher import FleetStartError, ReplicaSpec, start_fleet

pytestmark = pytest.mark.integration


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def port_is_closed(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def test_fleet_starts_pools_and_stops_every_child(tmp_path: Path) -> None:
    specs = [
        ReplicaSpec(pool="small", model="qwen-small", max_model_len=256, num_gpu_blocks=64),
        ReplicaSpec(pool="small", model="qwen-small", max_model_len=256, num_gpu_blocks=64),
        ReplicaSpec(pool="large", model="qwen-large", max_model_len=1024, num_gpu_blocks=128,
                    replay=False),
    ]
    with start_fleet(specs, timeout_s=20, log_dir=tmp_path) as fleet:
        assert [r.name for r in fleet.replicas] == ["small-0", "small-1", "large-0"]
        assert len({r.url for r in fleet.replicas}) == 3
        for r in fleet.replicas:
            status, raw = get(r.url + "/v1/models")
            card = json.loads(raw)["data"][0]
            assert (status, card["id"], card["max_model_len"]) == (200, r.model, r.max_model_len)
            sources = json.loads(get(r.url + "/kv_event_sources")[1])["0"]
            assert sources["endpoint"] == r.kv_events
            assert sources["replay_endpoint"] == r.kv_replay
        assert fleet.replicas[2].kv_replay is None
        yaml = fleet.yaml()
        assert "  - name: large\n    model: qwen-large\n    max_model_len: 1024\n" in yaml
        procs = list(fleet.processes)
    assert all(p.returncode is not None for p in procs)
    assert all(port_is_closed(r.url) for r in fleet.replicas)


def test_a_replica_that_cannot_start_fails_the_fleet_with_its_log() -> None:
    specs = [ReplicaSpec(max_model_len=256, num_gpu_blocks=64),
             ReplicaSpec(profile="no-such-profile")]
    with pytest.raises(FleetStartError, match="no-such-profile"):
        start_fleet(specs, timeout_s=20)


def test_fleet_refuses_non_loopback_hosts() -> None:
    with pytest.raises(ConfigError, match="loopback"):
        start_fleet([ReplicaSpec()], host="0.0.0.0")


def test_cli_fleet_prints_endpoints_and_exits_cleanly_on_sigint() -> None:
    entry = "import sys; from kvroute.cli import main; sys.argv[0] = 'kvroute'; main()"
    proc = subprocess.Popen(
        [sys.executable, "-c", entry, "sim", "fleet", "--base-port", "0",
         "--pool", "small:1:m-small:512", "--pool", "large:1:m-large:2048",
         "--num-gpu-blocks", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    out = b""
    deadline = time.monotonic() + 20
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while b"kv_replay" not in out.split(b"pools:")[-1] or out.count(b"kv_replay:") < 2:
                assert time.monotonic() < deadline, f"no YAML block in time: {out!r}"
                if sel.select(0.5):
                    chunk = proc.stdout.read1(65536)  # type: ignore[attr-defined]
                    assert chunk, f"fleet exited early: {proc.stderr.read() if proc.stderr else b''!r}"
                    out += chunk
        text = out.decode()
        table = text.split("pools:")[0]
        urls = [w for w in table.split() if w.startswith("http://")]
        assert len(urls) == 2 and "name: large" in text and "name: small" in text
        assert all(u in text.split("pools:")[1] for u in urls)
        assert all(get(u + "/health")[0] == 200 for u in urls)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
        assert all(port_is_closed(u) for u in urls)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()


# ------------------------------------------------------------------------------ calibration


def test_fit_recovers_constants_from_exact_observations() -> None:
    f, a, b, c, o = 0.010, 4e-5, 1e-3, 2e-6, 0.0007
    obs = [Observation("ttft", p, 0, p, f + a * p + c * p + o) for p in (16, 256, 1024, 2048)]
    obs += [Observation("itl", 0, bs, bs * ctx, f + b * bs + c * bs * ctx)
            for bs in (1, 4, 8) for ctx in (20, 1000)]
    fit = fit_step_timing(obs)
    assert fit.timing.fixed_s == pytest.approx(f, rel=1e-6)
    assert fit.timing.prefill_token_s == pytest.approx(a, rel=1e-6)
    assert fit.timing.decode_seq_s == pytest.approx(b, rel=1e-6)
    assert fit.timing.context_token_s == pytest.approx(c, rel=1e-6)
    assert fit.overhead_s == pytest.approx(o, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)


def test_fit_keeps_constants_non_negative_and_needs_enough_data() -> None:
    obs = [Observation("itl", 0, bs, bs * ctx, 0.01 - 1e-4 * bs + 1e-6 * bs * ctx)
           for bs in (1, 2, 4, 8) for ctx in (10, 100)]
    fit = fit_step_timing(obs)
    assert fit.timing.decode_seq_s == 0.0  # the unconstrained fit is -1e-4
    assert fit.timing.fixed_s > 0 and fit.timing.context_token_s > 0
    with pytest.raises(ConfigError, match="at least 5"):
        fit_step_timing(obs[:4])


def test_calibrate_refuses_non_loopback_urls() -> None:
    with pytest.raises(ConfigError, match="not a loopback URL"):
        check_loopback_url("http://10.0.0.5:8000")
    assert check_loopback_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"


def test_calibrate_recovers_a_known_profile_from_a_sim_server() -> None:
    fixed, prefill, decode, context = 0.010, 4e-5, 1.5e-3, 3e-6
    spec = ReplicaSpec(max_model_len=4096, num_gpu_blocks=2048, replay=False,
                       extra_args=("--timing", f"{fixed},{prefill},{decode},{context}"))
    plan = CalibrationPlan(prompt_lengths=(16, 256, 1024, 2048), ttft_repeats=2,
                           batch_sizes=(1, 4, 8), decode_prompt_lengths=(16, 1024),
                           decode_tokens=8, max_requests=100, timeout_s=8)
    with start_fleet([spec], timeout_s=20) as fleet:
        fit = asyncio.run(calibrate(fleet.replicas[0].url, plan=plan))
    t = fit.timing
    assert t.fixed_s == pytest.approx(fixed, rel=0.25)
    assert t.prefill_token_s == pytest.approx(prefill, rel=0.15)
    # Decode terms come from wall-clock gaps between streamed tokens, the noisiest signal on
    # a shared machine; the tolerance says "right order and roughly right", which is what
    # a fitted profile needs.
    assert t.decode_seq_s == pytest.approx(decode, rel=0.5)
    assert t.context_token_s == pytest.approx(context, rel=0.5)
    assert fit.r2 > 0.98


def test_replica_handle_endpoints_carry_events(tmp_path: Path) -> None:
    """A fleet replica's PUB endpoint is live: a request's blocks come back as one batch."""
    import zmq

    from kvroute.wire.vllm_events import decode_message

    with start_fleet([ReplicaSpec(max_model_len=256, num_gpu_blocks=64)], timeout_s=20) as fleet:
        r = fleet.replicas[0]
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        assert r.kv_events is not None
        sub.connect(r.kv_events)
        batch: EventBatch | None = None
        try:
            for i in range(50):  # bounded: close the PUB/SUB slow-joiner window
                body = json.dumps({"model": r.model, "prompt": [9000 + i] * 32,
                                   "max_tokens": 1}).encode()
                req = urllib.request.Request(r.url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=3).read()
                if sub.poll(100):
                    batch = decode_message(sub.recv_multipart())
                    break
        finally:
            sub.close()
            ctx.term()
        assert batch is not None
        assert batch.events and all(len(e.block_hashes) >= 1 for e in batch.events)  # type: ignore[union-attr]
