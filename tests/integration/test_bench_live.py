"""``kvroute bench live``: real routers on loopback in front of 4 simulated engines.

The integration runs are bounded (192 hot-prefix requests; 48 distinct-prefix requests) and
check the report's shape and the hot-spot reproduction of ``docs/reference/peer-routers.md`` §9:
``cache_aware`` — the real sglang-router 0.3.2 and vllm-router 0.1.17, and kvroute's
reimplementation — sends every request sharing a system prompt to one engine; kvroute's own
policy is reported but not asserted (see the NOTE in the hot-spot test), and
distinct prefixes go 12/12/12/12.

The peers come from ``scripts/peer_routers/setup.sh``; when they are not installed, their
tests skip with the reason the script recorded. ``KVROUTE_REQUIRE_PEERS=1`` turns those skips
into failures (for a CI job that must exercise the peers).

The fast tests at the top need no process.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from required import skip_unless_required

from kvroute.bench.live import (
    FIDELITY_SCENARIOS,
    LiveBenchSpec,
    build_workload,
    format_table,
    run_fidelity,
    run_live_bench,
)
from kvroute.bench.live_client import (
    ClientRun,
    ControlLane,
    LiveRequest,
    RequestResult,
    build_live_requests,
    run_client,
    summarize,
)
from kvroute.bench.live_routers import (
    PeerRouters,
    RouterSpec,
    find_peer_routers,
    kvroute_yaml,
    parse_router_specs,
)
from kvroute.bench.processes import free_port
from kvroute.bench.workloads import hot_prefix_bursts
from kvroute.config import parse_config
from kvroute.core.errors import ConfigError
from kvroute.sim.launcher import ReplicaHandle

# 48 concurrent requests per burst need engine time to overlap: ~6 ms per step and 32 output
# tokens keep each request in flight for a few hundred milliseconds.
PROFILE = "llama-3.1-8b-h100"


def require_peers() -> PeerRouters:
    peers = find_peer_routers()
    if not peers.available:
        skip_unless_required("the peer-router suite", peers.reason, env="KVROUTE_REQUIRE_PEERS")
    return peers


# ---------------------------------------------------------------------------------------------
# Fast tests: no processes


def test_parse_router_specs_expands_kvroute_policies_in_order() -> None:
    specs = parse_router_specs("direct,kvroute,sglang-router,vllm-router:round_robin",
                               "kvroute,cache_aware")
    assert specs == [
        RouterSpec("direct", "direct", "round_robin"),
        RouterSpec("kvroute", "kvroute", "kvroute"),
        RouterSpec("kvroute:cache_aware", "kvroute", "cache_aware"),
        RouterSpec("sglang-router", "sglang", "cache_aware"),
        RouterSpec("vllm-router:round_robin", "vllm", "round_robin"),
    ]


@pytest.mark.parametrize(("routers", "policies", "message"), [
    ("nginx", "kvroute", "unknown router 'nginx'"),
    ("kvroute", "kvroute,nope", "unknown kvroute policy 'nope'"),
    ("direct,direct", "kvroute", "listed twice"),
    ("", "kvroute", "at least one router"),
])
def test_parse_router_specs_rejects_bad_input(routers: str, policies: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_router_specs(routers, policies)


def test_kvroute_yaml_is_a_valid_config_with_events_wired() -> None:
    engines = [ReplicaHandle(f"e{i}", "default", "sim-model", f"http://127.0.0.1:{9000 + i}",
                             f"tcp://127.0.0.1:{9100 + i}", f"tcp://127.0.0.1:{9200 + i}",
                             4096, 16) for i in range(3)]
    text = kvroute_yaml(engines, port=8123, policy="cache_aware", model="sim-model", seed=7)
    config = parse_config(yaml.safe_load(text), env={})
    assert config.listen.port == 8123
    assert config.policy.name == "cache_aware" and config.policy.seed == 7
    assert config.retries.max_retries == 0
    assert not config.warm_ahead.enabled
    assert list(config.routes) == ["sim-model"]
    reps = [rep for _, rep in config.replicas()]
    assert [r.url for r in reps] == [e.url for e in engines]
    assert [r.kv_events for r in reps] == [e.kv_events for e in engines]
    assert [r.kv_replay for r in reps] == [e.kv_replay for e in engines]


def test_find_peer_routers_reports_the_marker_or_missing_install(tmp_path: Path) -> None:
    missing = find_peer_routers(tmp_path)
    assert not missing.available and "scripts/peer_routers/setup.sh" in missing.reason
    (tmp_path / "peer-routers").mkdir()
    (tmp_path / "peer-routers" / "unavailable.txt").write_text("peer routers unavailable: offline\n")
    marked = find_peer_routers(tmp_path)
    assert not marked.available and marked.reason == "peer routers unavailable: offline"


def test_build_live_requests_encodes_streaming_chat_with_capped_output() -> None:
    workload = hot_prefix_bursts(num_bursts=1, burst_size=2, system_prompt_tokens=5,
                                 suffix_tokens=2, output_tokens=64, with_messages=True)
    reqs = build_live_requests(workload, model="m", max_tokens_cap=16)
    body = json.loads(reqs[0].body)
    assert body["model"] == "m" and body["stream"] is True and body["max_tokens"] == 16
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert reqs[0].prompt_tokens == 7 and reqs[0].max_tokens == 16
    with pytest.raises(ConfigError, match="empty"):
        build_live_requests([], model="m")


def test_summarize_counts_errors_and_uses_ok_requests_only() -> None:
    ok = RequestResult("a", start_s=0.0, lag_s=0.0, status=200, ttft_s=0.010, e2e_s=0.030,
                       itl_s=[0.005, 0.015], output_events=3)
    bad = RequestResult("b", start_s=0.0, lag_s=0.002, status=503, error="http_503",
                        ttft_s=9.0, e2e_s=9.0)
    out = summarize(ClientRun([ok, bad], wall_s=2.0, tcp_nodelay=True))
    assert out["requests"] == 2 and out["completed"] == 1
    assert out["errors"] == {"http_503": 1}
    assert out["ttft_p50_ms"] == 10.0 and out["e2e_p99_ms"] == 30.0
    assert out["itl_p50_ms"] == 5.0 and out["itl_p99_ms"] == 15.0
    assert out["achieved_rps"] == 0.5 and out["start_lag_p99_ms"] == 2.0


def test_summarize_counts_slo_goodput_like_the_simulator() -> None:
    def result(name: str, ttft: float, gaps: list[float], error: str | None = None
               ) -> RequestResult:
        return RequestResult(name, start_s=0.0, lag_s=0.0, status=200, error=error,
                             ttft_s=ttft, e2e_s=ttft + sum(gaps), itl_s=gaps,
                             output_events=len(gaps) + 1)

    run = ClientRun([
        result("good", 1.0, [0.02, 0.03]),          # mean gap 25 ms: meets both
        result("slow-first", 2.5, [0.01]),         # TTFT over 2 s
        result("slow-tokens", 0.1, [0.01, 0.07]),  # mean gap 40 ms, though one gap is fast
        result("one-token", 0.5, []),              # no gap: judged on TTFT alone
        result("failed", 0.1, [0.01], error="no_done"),
    ], wall_s=4.0, tcp_nodelay=True)
    out = summarize(run)
    assert out["slo_goodput_rps"] == 0.5 and out["slo_goodput_fraction"] == 0.4
    assert out["itl_request_p99_ms"] == 40.0
    assert summarize(run, itl_slo_s=0.05)["slo_goodput_fraction"] == 0.6
    assert summarize(run, ttft_slo_s=3.0)["slo_goodput_fraction"] == 0.6


def test_summarize_takes_one_lane_or_both() -> None:
    def result(name: str, e2e: float, control: bool) -> RequestResult:
        return RequestResult(name, control=control, start_s=0.0, lag_s=0.0, status=200,
                             ttft_s=e2e, e2e_s=e2e, output_events=1)

    run = ClientRun([result("a", 0.010, False), result("b", 0.002, True),
                     result("c", 0.020, False)], wall_s=1.0, tcp_nodelay=True)
    assert summarize(run)["completed"] == 3
    router = summarize(run, control=False)
    assert router["completed"] == 2 and router["e2e_p99_ms"] == 20.0
    direct = summarize(run, control=True)
    assert direct["completed"] == 1 and direct["e2e_p50_ms"] == 2.0


def test_a_control_lane_needs_engines_and_leaves_the_router_most_requests() -> None:
    with pytest.raises(ConfigError, match="at least one engine URL"):
        ControlLane((), 5)
    with pytest.raises(ConfigError, match="every=1 must be >= 2"):
        ControlLane(("http://127.0.0.1:1",), 1)
    lane = ControlLane(("http://127.0.0.1:1",), 5)
    assert [i for i in range(15) if lane.has(i)] == [4, 9, 14]


def test_the_control_lane_sends_every_kth_request_straight_to_the_engines() -> None:
    """Real HTTP on loopback: a stand-in router and two stand-in engines count what reaches
    them; the client marks the control lane's results and each lane keeps its round robin."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    seen: dict[str, list[str]] = {"router": [], "e0": [], "e1": []}

    def server_for(name: str) -> web.Application:
        async def chat(request: web.Request) -> web.Response:
            body = await request.json()
            seen[name].append(body["messages"][-1]["content"])
            return web.json_response({"choices": [{"message": {"content": "ok"}}]})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        return app

    reqs = [LiveRequest(f"q{i}", i * 0.002, json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}).encode(), 5, 1,
        stream=False) for i in range(9)]

    async def scenario() -> ClientRun:
        servers = {name: TestServer(server_for(name), host="127.0.0.1") for name in seen}
        for server in servers.values():
            await server.start_server()
        try:
            def url(name: str) -> str:
                return str(servers[name].make_url("")).rstrip("/")

            lane = ControlLane((url("e0"), url("e1")), 3)
            return await run_client([url("router")], reqs, control=lane,
                                    request_timeout_s=5, duration_s=10)
        finally:
            for server in servers.values():
                await server.close()

    run = asyncio.run(scenario())
    assert all(r.ok for r in run.results), [r.error for r in run.results]
    assert [r.control for r in run.results] == [False, False, True] * 3
    assert sorted(seen["router"]) == ["q0", "q1", "q3", "q4", "q6", "q7"]
    assert (seen["e0"], seen["e1"]) == (["q2", "q8"], ["q5"])  # the lane's own round robin
    assert summarize(run, control=True)["completed"] == 3


def test_client_counts_refused_connections_without_hanging() -> None:
    reqs = build_live_requests(hot_prefix_bursts(num_bursts=1, burst_size=3, with_messages=True),
                               model="m")
    run = asyncio.run(run_client([f"http://127.0.0.1:{free_port()}"], reqs,
                                 request_timeout_s=5, duration_s=10))
    assert [r.error for r in run.results] == ["connect"] * 3


def test_spec_validation_names_the_bad_field() -> None:
    spec = LiveBenchSpec(routers=(RouterSpec("direct", "direct", "round_robin"),),
                         workload="nope")
    with pytest.raises(ConfigError, match="unknown workload 'nope'"):
        spec.validate()
    spec = LiveBenchSpec(routers=(RouterSpec("direct", "direct", "round_robin"),),
                         workload="hot_prefix_bursts", workload_params={"burst_sise": 3})
    with pytest.raises(ConfigError, match="burst_sise"):
        build_workload(spec)


# ---------------------------------------------------------------------------------------------
# Integration: real processes

ROUTER_KEYS = {
    "kind", "policy", "requests", "completed", "errors",
    *(f"{m}_{s}_ms" for m in ("ttft", "itl", "e2e") for s in ("mean", "p50", "p90", "p99")),
    "token_hit_rate", "hit_tokens", "query_tokens",
    "requests_per_replica", "max_replica_share", "router_cpu_s", "router_cpu_ms_per_req",
    "ready_s", "wall_s", "achieved_rps", "start_lag_p99_ms", "tcp_nodelay",
    "overhead_vs_direct", "command",
    "itl_request_mean_ms", "itl_request_p99_ms", "slo_goodput_rps", "slo_goodput_fraction",
}
HOT_REQUESTS = 4 * 48


@pytest.fixture(scope="module")
def hot_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One bounded run: 4 bursts of 48 requests sharing a system prompt, every router."""
    spec = LiveBenchSpec(
        routers=tuple(parse_router_specs("direct,kvroute,sglang-router,vllm-router",
                                         "kvroute,cache_aware")),
        workload="hot_prefix_bursts",
        workload_params={"num_bursts": 4, "burst_size": 48, "system_prompt_tokens": 345,
                         "suffix_tokens": 8, "output_tokens": 32, "burst_interval_s": 1.5},
        engines=4, profile=PROFILE, duration_s=120.0, request_timeout_s=60.0,
        log_dir=tmp_path_factory.mktemp("live"),
    )
    return run_live_bench(spec)


@pytest.mark.integration
@pytest.mark.slow
def test_live_report_shape(hot_report: dict[str, Any]) -> None:
    assert set(hot_report) == {"routers", "skipped", "config"}
    ran = set(hot_report["routers"])
    assert {"direct", "kvroute", "kvroute:cache_aware"} <= ran
    assert ran | set(hot_report["skipped"]) == {"direct", "kvroute", "kvroute:cache_aware",
                                                "sglang-router", "vllm-router"}
    cfg = hot_report["config"]
    assert cfg["requests"] == HOT_REQUESTS and cfg["engines"] == 4 and cfg["profile"] == PROFILE
    for name, entry in hot_report["routers"].items():
        assert set(entry) == ROUTER_KEYS, name
        assert entry["errors"] == {}, (name, entry["errors"])
        assert entry["completed"] == entry["requests"] == HOT_REQUESTS, name
        assert sum(entry["requests_per_replica"].values()) == HOT_REQUESTS, name
        assert list(entry["requests_per_replica"]) == ["e0", "e1", "e2", "e3"]
        assert entry["tcp_nodelay"] is True, name
        assert 0 < entry["ttft_p50_ms"] <= entry["ttft_p99_ms"] <= entry["e2e_p99_ms"], name
        assert entry["itl_p50_ms"] is not None, name
        # One shared system prompt: every router sees hits once the prompt is cached somewhere.
        assert entry["token_hit_rate"] > 0.5, (name, entry["token_hit_rate"])
        if name == "direct":
            assert entry["overhead_vs_direct"] is None
            assert entry["router_cpu_s"] is None and entry["command"] is None
        else:
            assert set(entry["overhead_vs_direct"]) == {"ttft_p50_ms", "ttft_p99_ms",
                                                        "e2e_p50_ms", "e2e_p99_ms"}
            assert entry["router_cpu_s"] > 0, name
    # The client's round robin is exact.
    assert list(hot_report["routers"]["direct"]["requests_per_replica"].values()) == [48] * 4
    rows = format_table(hot_report)
    assert rows[0][0] == "router" and [r[0] for r in rows[1:]] == list(hot_report["routers"])


@pytest.mark.integration
@pytest.mark.slow
def test_kvroute_cache_aware_reproduces_the_hot_spot(hot_report: dict[str, Any]) -> None:
    routers = hot_report["routers"]
    assert routers["kvroute:cache_aware"]["max_replica_share"] == 1.0, \
        routers["kvroute:cache_aware"]["requests_per_replica"]
    # NOTE: kvroute's own policy is not asserted to spread this burst: whether its cost model
    # keeps 48 short requests on the cached engine depends on engine timing and on the load it
    # has seen at each decision (measured 24/8/8/8, 42/0/0/6 and 192/0/0/0 on this workload;
    # docs/peer-fidelity.md). Its distribution is in the report for the reader.


@pytest.mark.integration
@pytest.mark.slow
def test_real_peers_send_a_shared_prefix_to_one_engine(hot_report: dict[str, Any]) -> None:
    require_peers()
    for name in ("sglang-router", "vllm-router"):
        entry = hot_report["routers"][name]
        assert entry["max_replica_share"] == 1.0, (name, entry["requests_per_replica"])


@pytest.mark.integration
@pytest.mark.slow
def test_distinct_prefixes_are_spread_evenly_by_cache_aware(tmp_path: Path) -> None:
    peers = find_peer_routers()
    out = run_fidelity(routers=parse_router_specs("kvroute,sglang-router,vllm-router",
                                                  "cache_aware"),
                       scenarios=("distinct_48",), profile=PROFILE, log_dir=tmp_path)
    dist = out["scenarios"]["distinct_48"]

    def even(counts: list[int]) -> bool:
        # 12/12/12/12 when all 48 are in flight together; a request that completes while
        # the burst is still being sent (a loaded machine) may shift one.
        return sum(counts) == 48 and max(counts) - min(counts) <= 2

    assert even(dist["kvroute:cache_aware"]), dist
    report = out["reports"]["distinct_48"]
    assert report["config"]["workload_params"] == FIDELITY_SCENARIOS["distinct_48"][1]
    assert all(e["token_hit_rate"] == 0.0 for e in report["routers"].values()), dist
    if peers.available:
        assert even(dist["sglang-router"]), dist
        assert even(dist["vllm-router"]), dist
    else:
        assert report["skipped"] == {"sglang-router": peers.reason,
                                     "vllm-router": peers.reason}
        require_peers()  # skips (or fails under KVROUTE_REQUIRE_PEERS=1) with the reason


def test_a_requests_session_travels_in_an_x_session_id_header() -> None:
    """Real HTTP on loopback: the stand-in router records the header of each request."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from kvroute.sim.workload import WorkloadRequest

    seen: dict[str, str | None] = {}

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen[body["messages"][-1]["content"]] = request.headers.get("x-session-id")
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    workload = [WorkloadRequest(0.0, "a", [1, 2, 3], 4, session_id="agent-7"),
                WorkloadRequest(0.0, "b", [4, 5, 6], 4)]
    reqs = build_live_requests(workload, model="m", stream=False)
    assert [r.session_id for r in reqs] == ["agent-7", None]

    async def scenario() -> ClientRun:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            return await run_client([str(server.make_url("")).rstrip("/")], reqs,
                                    request_timeout_s=5, duration_s=10)
        finally:
            await server.close()

    run = asyncio.run(scenario())
    assert all(r.ok for r in run.results), [r.error for r in run.results]
    assert len(seen) == 2 and set(seen.values()) == {"agent-7", None}
