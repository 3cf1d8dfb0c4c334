"""``kvroute bench overhead``: the plan, the report, and one short real run on loopback.

The run is bounded (2 engines, 3 routers, 2 one-second phases, one pass: a few hundred
requests) and checks that every router served every phase without an error, that added
latency is taken against ``direct`` of the same pass and phase, and that the CPU figures come
from the router processes (none for ``direct``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvroute.bench import overhead
from kvroute.bench.live_client import LiveRequest
from kvroute.bench.live_routers import start_router
from kvroute.bench.overhead import (
    OverheadSpec,
    Phase,
    _add_overheads,
    _add_same_window,
    _engine_warmup,
    _schedule,
    format_rows,
    parse_cpus,
    parse_overhead_routers,
    parse_phases,
    run_overhead_bench,
)
from kvroute.bench.passthrough import build_app
from kvroute.bench.procfs import pin_process_tree
from kvroute.bench.settle import caught_up, event_primers
from kvroute.core.errors import ConfigError
from kvroute.sim.launcher import ReplicaSpec, start_fleet
from kvroute.tokenize.hf import bundled_tokenizer_dir


def test_phases_parse_and_bad_ones_say_what_is_expected() -> None:
    phases = parse_phases("r100, s50,c32")
    assert [(p.kind, p.value, p.stream) for p in phases] == [
        ("r", 100.0, False), ("s", 50.0, True), ("c", 32.0, False)]
    for bad in ("x100", "r", "r-5", "c2.5", ""):
        with pytest.raises(ConfigError, match="r<rate>|at least one phase"):
            parse_phases(bad)


def test_routers_parse_direct_first_and_local_tokenizer_is_the_bundled_one() -> None:
    specs = parse_overhead_routers("kvroute-local,passthrough")
    assert [s.name for s in specs] == ["direct", "kvroute-local", "passthrough"]
    assert specs[1].tokenizer == str(bundled_tokenizer_dir())
    with pytest.raises(ConfigError, match="unknown router"):
        parse_overhead_routers("kvroute,nginx")
    with pytest.raises(ConfigError, match="twice"):
        parse_overhead_routers("kvroute,kvroute")


def test_schedule_is_fixed_rate_or_a_closed_loop_pool() -> None:
    pool = [LiveRequest(f"q{i}", 0.0, b"{}", 10, 8) for i in range(3)]
    fixed = _schedule(pool, Phase("r50", "r", 50.0), 2.0)
    assert len(fixed) == 100
    assert fixed[10].arrival_s == pytest.approx(0.2)
    assert fixed[4].body is pool[1].body
    closed = _schedule(pool, Phase("c8", "c", 8.0), 1.0)
    assert len(closed) == 5000 and all(r.arrival_s == 0.0 for r in closed)


def test_a_same_window_schedule_keeps_the_routers_rate() -> None:
    pool = [LiveRequest(f"q{i}", 0.0, b"{}", 10, 8) for i in range(3)]
    mixed = _schedule(pool, Phase("r400", "r", 400.0), 2.0, same_window=4)
    assert len(mixed) == 1000  # 800 for the router, 200 straight to the engines
    assert mixed[5].arrival_s == pytest.approx(5 / 500)
    closed = _schedule(pool, Phase("c8", "c", 8.0), 1.0, same_window=4)
    assert len(closed) == 5000  # a closed loop has no control lane
    with pytest.raises(ConfigError, match="same_window=-1 must be >= 0"):
        OverheadSpec(routers=parse_overhead_routers("direct"), same_window=-1).validate()


def test_same_window_figures_are_the_routers_requests_against_the_lanes() -> None:
    row: dict[str, Any] = {"p50_ms": 1.5, "p99_ms": 3.0}
    lane = {"completed": 100, "errors": {"timeout": 1}, "e2e_p50_ms": 1.0, "e2e_p99_ms": 2.25,
            "ttft_p50_ms": 9.0, "ttft_p99_ms": 9.0}
    _add_same_window(row, lane, "e2e")
    assert row["same_window_direct_completed"] == 100
    assert row["same_window_direct_errors"] == {"timeout": 1}
    assert (row["same_window_direct_p50_ms"], row["same_window_direct_p99_ms"]) == (1.0, 2.25)
    assert (row["added_same_window_p50_ms"], row["added_same_window_p99_ms"]) == (0.5, 0.75)
    _add_same_window(row, {**lane, "e2e_p99_ms": None}, "e2e")
    assert row["added_same_window_p99_ms"] is None


def test_caught_up_needs_events_from_every_replica_and_no_replay() -> None:
    def metrics(applied: dict[str, int], replaying: dict[str, int]) -> str:
        lines = [f'kvroute_kv_event_batches_applied_total{{replica="{r}"}} {n}'
                 for r, n in applied.items()]
        lines += [f'kvroute_kv_event_replaying{{replica="{r}"}} {n}'
                  for r, n in replaying.items()]
        return "\n".join(lines) + "\n"

    assert caught_up(metrics({"e0": 3, "e1": 1}, {"e0": 0, "e1": 0}), ["e0", "e1"])
    assert not caught_up(metrics({"e0": 3, "e1": 1}, {"e0": 0, "e1": 1}), ["e0", "e1"])
    assert not caught_up(metrics({"e0": 3}, {"e0": 0}), ["e0", "e1"])  # e1: nothing yet
    assert not caught_up("", ["e0"])


def test_event_primers_give_each_engine_a_prompt_no_one_has_seen() -> None:
    primers = event_primers(4, "kvroute-auto-2", "sim-model")
    assert len(primers) == 4  # the client sends primer i to engine i
    texts = [json.loads(p.body)["messages"][0]["content"] for p in primers]
    assert len(set(texts)) == 4 and all("kvroute-auto-2" in t for t in texts)
    assert all(len(t) > 200 for t in texts)  # several blocks of new tokens
    assert all(not p.stream and json.loads(p.body)["max_tokens"] == 1 for p in primers)
    assert event_primers(4, "other", "sim-model")[0].body != primers[0].body


def test_engine_warmup_shows_every_engine_every_prompt_group() -> None:
    pool = [LiveRequest(f"q{i}", 0.0, f"body{i}".encode(), 10, 8, group=f"g{i % 3}")
            for i in range(12)]
    warm = _engine_warmup(pool, 4)
    assert len(warm) == 3 * 4
    # The client sends request i to engine i mod 4: every (group, engine) pair once.
    assert {(r.group, i % 4) for i, r in enumerate(warm)} == {
        (f"g{g}", e) for g in range(3) for e in range(4)}
    assert len({r.request_id for r in warm}) == len(warm)


def test_added_latency_is_against_direct_of_the_same_pass_and_phase() -> None:
    rows = [
        {"router": "direct", "pass": 1, "phase": "r100", "p50_ms": 1.0, "p99_ms": 2.0},
        {"router": "direct", "pass": 2, "phase": "r100", "p50_ms": 3.0, "p99_ms": 4.0},
        {"router": "kvroute", "pass": 1, "phase": "r100", "p50_ms": 1.5, "p99_ms": 3.0},
        {"router": "kvroute", "pass": 2, "phase": "r100", "p50_ms": 3.2, "p99_ms": None},
    ]
    _add_overheads(rows)
    assert rows[0]["added_p50_ms"] is None
    assert (rows[2]["added_p50_ms"], rows[2]["added_p99_ms"]) == (0.5, 1.0)
    assert rows[3]["added_p50_ms"] == pytest.approx(0.2)
    assert rows[3]["added_p99_ms"] is None


def test_spec_bounds() -> None:
    routers = parse_overhead_routers("direct")
    for bad in ({"phase_s": 0}, {"phase_s": 500}, {"passes": 0}, {"engines": 0},
                {"warmup_s": -1}):
        with pytest.raises(ConfigError):
            OverheadSpec(routers=routers, **bad).validate()  # type: ignore[arg-type]


def test_router_cpus_parse_and_must_leave_cpus_for_the_rest() -> None:
    assert parse_cpus("1") == frozenset({1})
    assert parse_cpus(" 0, 2,") == frozenset({0, 2})
    for bad in ("", "one", "-1", "1.5"):
        with pytest.raises(ConfigError, match="CPU"):
            parse_cpus(bad)
    routers = parse_overhead_routers("direct")
    usable = frozenset(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match="some, not all"):
        OverheadSpec(routers=routers, router_cpus=usable).validate()
    with pytest.raises(ConfigError, match="some, not all"):
        OverheadSpec(routers=routers, router_cpus=frozenset({max(usable) + 1})).validate()


def _affinities(pid: int) -> list[frozenset[int]]:
    return [frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")]


def test_pinning_a_process_tree_binds_every_thread_of_every_process() -> None:
    cpu = min(os.sched_getaffinity(0))
    script = ("import subprocess, sys, threading, time\n"
              "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
              "print('ready', child.pid, flush=True)\n"
              "time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        _, child = proc.stdout.readline().split()
        pinned = pin_process_tree(proc.pid, frozenset({cpu}))
        assert pinned >= 3  # the main thread, the sleeping thread, the child
        for pid in (proc.pid, int(child)):
            assert set(_affinities(pid)) == {frozenset({cpu})}
    finally:
        for p in _children(proc.pid):
            os.kill(p, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def _children(pid: int) -> list[int]:
    """Child pids from /proc (no psutil in the test extras)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def test_passthrough_relays_whole_and_streamed_answers() -> None:
    """The bare relay in front of a stub upstream (aiohttp test servers on loopback)."""
    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"choices": [{"message": {"content": "hi"}}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b"data: [DONE]\n\n"):
            await resp.write(piece)
        await resp.write_eof()
        return resp

    async def scenario() -> None:
        upstream_app = web.Application()
        upstream_app.router.add_post("/v1/chat/completions", chat)
        upstream = TestServer(upstream_app, host="127.0.0.1")
        await upstream.start_server()
        relay = TestServer(build_app([str(upstream.make_url("")).rstrip("/")]),
                           host="127.0.0.1")
        await relay.start_server()
        try:
            async with aiohttp.ClientSession() as client:
                url = str(relay.make_url("/v1/chat/completions"))
                async with client.post(url, json={"stream": False}) as whole:
                    assert whole.status == 200
                    assert (await whole.json())["choices"][0]["message"]["content"] == "hi"
                async with client.post(url, json={"stream": True}) as streamed:
                    assert streamed.headers["Content-Type"].startswith("text/event-stream")
                    assert (await streamed.text()).endswith("data: [DONE]\n\n")
                async with client.get(str(relay.make_url("/health"))) as health:
                    assert health.status == 200
        finally:
            await relay.close()
            await upstream.close()

    asyncio.run(scenario())


@pytest.mark.integration
@pytest.mark.slow
def test_a_short_run_measures_every_router_on_every_phase() -> None:
    spec = OverheadSpec(routers=parse_overhead_routers("direct,passthrough,kvroute-local"),
                        phases=parse_phases("r40,s20"), engines=2, phase_s=1.0, warmup_s=0.5,
                        passes=1, same_window=4)
    report = run_overhead_bench(spec)
    rows = report["results"]
    assert {(r["router"], r["phase"]) for r in rows} == {
        (router, phase) for router in ("direct", "passthrough", "kvroute-local")
        for phase in ("r40", "s20")}
    for row in rows:
        assert row["errors"] == {}, row
        # The router still gets the phase's rate; one more in five went straight to an engine.
        assert row["completed"] == (40 if row["phase"] == "r40" else 20)
        assert row["same_window_direct_completed"] == (10 if row["phase"] == "r40" else 5)
        assert row["same_window_direct_errors"] == {}
        assert 0 < row["same_window_direct_p50_ms"] <= row["same_window_direct_p99_ms"]
        assert row["added_same_window_p99_ms"] == pytest.approx(
            row["p99_ms"] - row["same_window_direct_p99_ms"], abs=1e-3)
        assert row["p50_ms"] is not None and row["p50_ms"] > 0
        assert row["tcp_nodelay"] in (True, None)  # None: the answer was whole before the check
        if row["router"] == "direct":
            assert row["router_cpu_ms_per_req"] is None and row["added_p50_ms"] is None
        else:
            assert row["router_cpu_ms_per_req"] > 0 and row["added_p50_ms"] is not None
        if row["router"] == "kvroute-local":
            # Measured once its KV-event catch-up (start-up work) was over.
            assert row["caught_up"] is True and 0 <= row["catch_up_wait_s"] < 60
        else:
            assert "caught_up" not in row
        if row["router"] == "kvroute-local":  # its own share, from its router_time metric
            # A share of what the client waited: per request always, but an interpolated
            # bucket quantile of a few requests can pass the client's own p99, so the
            # median is compared.
            assert 0 < row["router_own_p50_ms"] <= row["router_own_p99_ms"]
            assert row["router_own_p50_ms"] < row["p99_ms"]
            stages = row["router_own_stages_ms"]
            assert set(stages) == {"before_engine", "after_engine", "total"}
            assert stages["total"]["p50"] == row["router_own_p50_ms"]
            assert 0 < stages["before_engine"]["p50"] <= stages["total"]["p50"]
        else:
            assert "router_own_p99_ms" not in row
    assert report["config"]["engine_tokenizer"].startswith("bundled")
    assert report["config"]["router_cpus"] is None
    assert report["config"]["same_window"] == 4
    assert len(format_rows(report)) == 6
    json.dumps(report)


@pytest.mark.integration
@pytest.mark.slow
def test_a_pinned_run_puts_routers_and_the_rest_on_separate_cpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    usable = frozenset(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip(f"pinning needs 2 CPUs; this process may use {sorted(usable)}")
    router_cpus = frozenset({max(usable)})
    seen: dict[str, list[frozenset[int]]] = {}
    real_start = start_router

    router_pids: list[int] = []

    def start_and_look(*args: Any, **kwargs: Any) -> Any:
        router = real_start(*args, **kwargs)
        seen["client"] = [frozenset(os.sched_getaffinity(0))]
        router_pids[:] = [router.process.pid] if router.process is not None else []
        return router

    real_run_phase = overhead._run_phase

    def run_and_look(router_targets: Any, requests: Any, phase: Any, spec: Any, cpu: Any,
                     fleet: Any, *rest: Any) -> Any:
        seen["engines"] = [a for e in fleet.replicas for a in _affinities(e.pid)]
        if router_pids:
            tree = [router_pids[0], *_children(router_pids[0])]
            seen["router"] = [a for p in tree for a in _affinities(p)]
        return real_run_phase(router_targets, requests, phase, spec, cpu, fleet, *rest)

    monkeypatch.setattr(overhead, "start_router", start_and_look)
    monkeypatch.setattr(overhead, "_run_phase", run_and_look)
    spec = OverheadSpec(routers=parse_overhead_routers("direct,passthrough"),
                        phases=parse_phases("r20"), engines=2, phase_s=0.5, warmup_s=0.0,
                        passes=1, router_cpus=router_cpus)
    report = run_overhead_bench(spec)
    assert all(row["errors"] == {} for row in report["results"])
    assert report["config"]["router_cpus"] == sorted(router_cpus)
    assert report["config"]["apparatus_cpus"] == sorted(usable - router_cpus)
    assert set(seen["client"]) == {usable - router_cpus}
    assert set(seen["engines"]) == {usable - router_cpus}
    assert seen["router"] and set(seen["router"]) == {router_cpus}
    assert frozenset(os.sched_getaffinity(0)) == usable  # given back after the run


@pytest.mark.integration
@pytest.mark.slow
def test_kvroute_auto_is_ready_only_once_its_tokenizer_is_checked(tmp_path: Path) -> None:
    """Measured before the check, a run would mix the engines' /tokenize with local ids."""
    specs = [ReplicaSpec(name=f"e{i}", model="sim-model", profile="zero",
                         extra_args=("--tokenizer", str(bundled_tokenizer_dir())))
             for i in range(2)]
    (auto,) = [s for s in parse_overhead_routers("kvroute-auto") if s.name == "kvroute-auto"]
    with start_fleet(specs, log_dir=tmp_path / "engines") as fleet, \
            start_router(auto, fleet.replicas, work_dir=tmp_path) as router, \
            urllib.request.urlopen(router.targets[0] + "/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    checks = [line for line in metrics.splitlines()
              if line.startswith("kvroute_tokenizer_check{") and line.endswith(" 1.0")]
    assert len(checks) == 1 and 'result="verified"' in checks[0], checks


def test_a_kvroute_router_may_carry_another_of_its_policies() -> None:
    specs = parse_overhead_routers("kvroute-auto,kvroute-auto:round_robin")
    assert [(s.name, s.kind, s.policy, s.tokenizer) for s in specs[1:]] == [
        ("kvroute-auto", "kvroute", "kvroute", "auto"),
        ("kvroute-auto:round_robin", "kvroute", "round_robin", "auto")]
    with pytest.raises(ConfigError, match="only kvroute routers take a policy"):
        parse_overhead_routers("sglang-router:round_robin")
    with pytest.raises(ConfigError, match="unknown kvroute policy 'fastest'"):
        parse_overhead_routers("kvroute-auto:fastest")
    with pytest.raises(ConfigError, match="unknown router"):
        parse_overhead_routers("kvroutex:round_robin")


@pytest.mark.integration
@pytest.mark.slow
def test_growing_sessions_run_as_a_phase_and_as_a_sweep(tmp_path: Path) -> None:
    spec = OverheadSpec(routers=parse_overhead_routers("direct,kvroute-local"),
                        phases=parse_phases("g2"), engines=2, phase_s=1.0, warmup_s=0.0,
                        passes=1, same_window=3, long_sweep=True, long_target_tokens=14_000,
                        long_growth_chars=(3_000, 9_000), plot=tmp_path / "sweep.png")
    report = run_overhead_bench(spec)
    rows = {row["router"]: row for row in report["results"]}
    for router, row in rows.items():
        assert row["errors"] == {}, row
        assert row["long_completed"] >= 1 and 0 < row["long_p50_ms"] <= row["long_p99_ms"]
        assert row["same_window_direct_long_p50_ms"] is not None
    assert rows["kvroute-local"]["added_long_p50_ms"] is not None
    sweep = report["long_sweep"]
    assert set(sweep) == {"direct", "kvroute-local"}
    for router, turns in sweep.items():
        assert {t["growth_chars"] for t in turns} == {3_000, 9_000}
        assert all(t["status"] == 200 for t in turns)
        assert max(t["total_tokens"] for t in turns) >= 14_000
        cpu = [t["router_cpu_ms"] for t in turns]
        assert all(c is None for c in cpu) if router == "direct" else all(c > 0 for c in cpu)
    assert (tmp_path / "sweep.png").stat().st_size > 0
    json.dumps(report)


@pytest.mark.integration
@pytest.mark.slow
def test_short_unique_prompts_run_as_a_closed_loop() -> None:
    spec = OverheadSpec(routers=parse_overhead_routers("direct,kvroute-local"),
                        phases=parse_phases("u4"), engines=2, phase_s=0.5, warmup_s=0.0,
                        passes=1)
    report = run_overhead_bench(spec)
    rows = {row["router"]: row for row in report["results"]}
    assert set(rows) == {"direct", "kvroute-local"}
    for row in rows.values():
        assert row["errors"] == {}, row
        assert 0 < row["completed"] <= 750 and row["p50_ms"] > 0
    assert rows["kvroute-local"]["router_cpu_ms_per_req"] > 0
    assert report["config"]["unique_workload"]["user_words"] > 0
    json.dumps(report)
