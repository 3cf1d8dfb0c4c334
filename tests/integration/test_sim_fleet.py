"""Fleets of simulated servers as child processes, the ``kvroute sim`` CLI, and calibration."""

from __future__ import annotations

import asyncio
import json
import random
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
    FitResult,
    Observation,
    calibrate,
    check_loopback_url,
    client_itl,
    fit_step_timing,
    prompt_ids,
    window_bounded_lengths,
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
    with start_fleet(specs, timeout_s=120, log_dir=tmp_path) as fleet:
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
        assert "  large:                 # window 1024, block size" in yaml
        assert "    model: qwen-large\n" in yaml and "  large: {pools: [large]}" in yaml
        procs = list(fleet.processes)
    assert all(p.returncode is not None for p in procs)
    assert all(port_is_closed(r.url) for r in fleet.replicas)


def test_a_replica_that_cannot_start_fails_the_fleet_with_its_log() -> None:
    specs = [ReplicaSpec(max_model_len=256, num_gpu_blocks=64),
             ReplicaSpec(profile="no-such-profile")]
    with pytest.raises(FleetStartError, match="no-such-profile"):
        start_fleet(specs, timeout_s=120)


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
    deadline = time.monotonic() + 120
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while b"routes:" not in out or out.count(b"kv_replay:") < 2 or not out.endswith(b"\n"):
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
                           decode_tokens=16, max_requests=100, timeout_s=8)
    with start_fleet([spec], timeout_s=120) as fleet:
        fit = asyncio.run(calibrate(fleet.replicas[0].url, plan=plan))
    t = fit.timing
    assert t.fixed_s == pytest.approx(fixed, rel=0.25)
    assert t.prefill_token_s == pytest.approx(prefill, rel=0.15)
    # Decode terms come from the mean of the engine's inter-token histogram over ~15 gaps per
    # stream, the noisiest signal on a shared machine (one preempted step moves the mean); the
    # tolerance says "right order and roughly right", which is what a fitted profile needs.
    assert t.decode_seq_s == pytest.approx(decode, rel=0.5)
    assert t.context_token_s == pytest.approx(context, rel=0.5)
    assert fit.r2 > 0.98
    assert fit.as_dict()["itl_sources"] == ["engine"]  # the sim exports vLLM's ITL histogram
    assert fit.weighting == "relative"


@pytest.mark.parametrize("engine_itl", [True, False], ids=["engine-itl", "client-itl"])
def test_calibrate_sweep_stays_inside_a_small_window(engine_itl: bool) -> None:
    """Plan lengths far over a 512-token window: no request is rejected, the sweep is cut at
    the window (and reaches it), and the fit still recovers the profile's prefill cost."""
    fixed, prefill, decode, context = 0.004, 5e-5, 1e-3, 2e-6
    spec = ReplicaSpec(max_model_len=512, num_gpu_blocks=1024, replay=False,
                       extra_args=("--timing", f"{fixed},{prefill},{decode},{context}",
                                   "--vocab-size", "1000"))
    plan = CalibrationPlan(prompt_lengths=(16, 128, 1024, 4096), ttft_repeats=2,
                           batch_sizes=(1, 4), decode_prompt_lengths=(16, 2048),
                           decode_tokens=16, max_requests=60, timeout_s=8, engine_itl=engine_itl)
    with start_fleet([spec], timeout_s=120) as fleet:
        fit = asyncio.run(calibrate(fleet.replicas[0].url, plan=plan))
    ttft = [o.prefill_tokens for o in fit.observations if o.kind == "ttft"]
    assert ttft == [16, 16, 128, 128, 511, 511]  # 1024 and 4096 replaced by window - 1
    itl = [o for o in fit.observations if o.kind == "itl"]
    assert [o.decode_seqs for o in itl] == [1, 4, 1, 4]
    # 2048 is replaced by window - decode_tokens = 496; context counts half the output.
    assert [o.context_tokens / o.decode_seqs for o in itl] == [16 + 8, 16 + 8, 496 + 8, 496 + 8]
    assert {o.source for o in itl} == {"engine" if engine_itl else "client"}
    assert fit.timing.prefill_token_s == pytest.approx(prefill, rel=0.3)
    assert fit.median_rel_error < 0.2


def test_token_id_prompts_are_exact_unique_and_inside_small_vocabularies() -> None:
    a, b = prompt_ids(300, 12345), prompt_ids(300, 12346)
    assert len(a) == 300 and all(100 <= t < 1000 for t in a)
    assert a[:4] != b[:4] and a[4:] == b[4:]
    assert prompt_ids(2, 7) == [107, 100] and prompt_ids(0, 7) == []


def test_window_bounded_lengths() -> None:
    assert window_bounded_lengths((16, 128, 2048), 511) == (16, 128, 511)
    assert window_bounded_lengths((16, 511, 2048), 511) == (16, 511)
    assert window_bounded_lengths((16, 128), 511) == (16, 128)
    assert window_bounded_lengths((0, 16, 16), 8) == (8,)


def test_client_itl_ignores_burst_reads() -> None:
    assert client_itl([5e-6, 4e-6, 0.004, 0.005, 0.006]) == 0.005
    assert client_itl([5e-6, 4e-6]) is None


def test_relative_weighting_minimises_relative_residuals() -> None:
    rng = random.Random(7)
    f, a, b, c, o = 0.002, 5e-5, 2e-4, 1e-6, 0.003
    obs = [Observation("ttft", p, 0, p, (f + a * p + c * p + o) * rng.uniform(0.8, 1.25))
           for p in (16, 256, 1024, 2048) for _ in range(2)]
    obs += [Observation("itl", 0, bs, bs * ctx, (f + b * bs + c * bs * ctx)
                        * rng.uniform(0.8, 1.25)) for bs in (1, 4, 8) for ctx in (20, 1000)]

    def rel_sq(fit: FitResult) -> float:
        t = fit.timing
        coef = (t.fixed_s, t.prefill_token_s, t.decode_seq_s, t.context_token_s, fit.overhead_s)
        return sum((sum(k * x for k, x in zip(coef, ob.features(), strict=True)) - ob.seconds)
                   ** 2 / ob.seconds ** 2 for ob in obs)

    rel, absolute = fit_step_timing(obs), fit_step_timing(obs, weighting="absolute")
    assert (rel.weighting, absolute.weighting) == ("relative", "absolute")
    assert rel_sq(rel) < rel_sq(absolute)
    assert rel.median_rel_error <= absolute.median_rel_error
    with pytest.raises(ConfigError, match="durations > 0"):
        fit_step_timing([*obs, Observation("itl", 0, 1, 10, 0.0)])


def test_replica_handle_endpoints_carry_events(tmp_path: Path) -> None:
    """A fleet replica's PUB endpoint is live: a request's blocks come back as one batch."""
    import zmq

    from kvroute.wire.vllm_events import decode_message

    with start_fleet([ReplicaSpec(max_model_len=256, num_gpu_blocks=64)], timeout_s=120) as fleet:
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


def test_fleet_replica_in_vllm_socket_mode_connects_to_the_subscriber() -> None:
    """``kv_events_socket="vllm"``: the replica connects its PUB socket to a bound SUB, says so
    in its handle, and the YAML block tells the router to bind (``kv_events_bind: true``)."""
    import zmq

    from kvroute.wire.vllm_events import decode_message

    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        start_fleet([ReplicaSpec(kv_events_socket="vllm")])
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:0")
    endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    spec = ReplicaSpec(max_model_len=256, num_gpu_blocks=64, kv_events_socket="vllm",
                       kv_events_endpoint=endpoint, root="/models/m", fault_injection=True)
    try:
        with start_fleet([spec], timeout_s=120) as fleet:
            r = fleet.replicas[0]
            assert (r.kv_events, r.kv_events_connect) == (endpoint, True)
            assert f"        kv_events: {endpoint}\n        kv_events_bind: true\n" in fleet.yaml()
            card = json.loads(get(r.url + "/v1/models")[1])["data"][0]
            assert card["root"] == "/models/m"
            assert json.loads(get(r.url + "/sim/faults")[1])["fail_next"] == 0
            batch = None
            for i in range(50):  # bounded: the child's connect completes asynchronously
                body = json.dumps({"model": r.model, "prompt": [9000 + i] * 32,
                                   "max_tokens": 1}).encode()
                req = urllib.request.Request(r.url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=3).read()
                if sub.poll(100):
                    batch = decode_message(sub.recv_multipart())
                    break
            assert batch is not None and batch.events
    finally:
        sub.close()
        ctx.term()


def test_replica_spec_passes_the_new_serve_options() -> None:
    spec = ReplicaSpec(kv_events_socket="vllm", root="Qwen/Qwen3-8B", fault_injection=True,
                       max_chars_per_token=13)
    args = spec.serve_args(host="127.0.0.1", port=8000, kv_port=8001, replay_port=8002)
    assert args[args.index("--kv-events") + 1] == "tcp://127.0.0.1:8001"
    assert args[args.index("--kv-events-socket") + 1] == "vllm"
    assert args[args.index("--root") + 1] == "Qwen/Qwen3-8B"
    assert args[args.index("--max-chars-per-token") + 1] == "13"
    assert "--fault-injection" in args
    assert "--fault-injection" not in ReplicaSpec().serve_args(
        host="127.0.0.1", port=0, kv_port=0, replay_port=0)
    with pytest.raises(ConfigError, match="kv_events_socket"):
        ReplicaSpec(kv_events_socket="connect")  # type: ignore[arg-type]
