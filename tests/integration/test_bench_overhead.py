"""``kvroute bench overhead``: the plan, the report, and one short real run on loopback.

The run is bounded (2 engines, 3 routers, 2 one-second phases, one pass: a few hundred
requests) and checks that every router served every phase without an error, that added
latency is taken against ``direct`` of the same pass and phase, and that the CPU figures come
from the router processes (none for ``direct``).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from kvroute.bench.live_client import LiveRequest
from kvroute.bench.overhead import (
    OverheadSpec,
    Phase,
    _add_overheads,
    _schedule,
    format_rows,
    parse_overhead_routers,
    parse_phases,
    run_overhead_bench,
)
from kvroute.bench.passthrough import build_app
from kvroute.core.errors import ConfigError
from kvroute.hf_tokenizer import bundled_tokenizer_dir


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
                        passes=1)
    report = run_overhead_bench(spec)
    rows = report["results"]
    assert {(r["router"], r["phase"]) for r in rows} == {
        (router, phase) for router in ("direct", "passthrough", "kvroute-local")
        for phase in ("r40", "s20")}
    for row in rows:
        assert row["errors"] == {}, row
        assert row["completed"] == (40 if row["phase"] == "r40" else 20)
        assert row["p50_ms"] is not None and row["p50_ms"] > 0
        assert row["tcp_nodelay"] in (True, None)  # None: the answer was whole before the check
        if row["router"] == "direct":
            assert row["router_cpu_ms_per_req"] is None and row["added_p50_ms"] is None
        else:
            assert row["router_cpu_ms_per_req"] > 0 and row["added_p50_ms"] is not None
    assert report["config"]["engine_tokenizer"].startswith("bundled")
    assert len(format_rows(report)) == 6
    json.dumps(report)
