"""The router under faults the simulated engines inject: lost KV events, vanished clients.

Real HTTP and ZMQ on loopback: ``kvroute sim serve`` engines with ``--fault-injection``
(``POST /sim/faults``, see ``kvroute.sim.server.SimFaults``) and a ``RouterRuntime`` in the
test's event loop, so a test can read the router's core after talking to it over HTTP.

Dropped event messages: ``{"drop_events": 1}`` makes the engine give its next KV-event batch
a sequence number and keep it in its replay buffer without sending it, exactly what a SUB
socket that lost a message sees. The batch is the one request A (a 200-word prompt, sent to
the engine directly, one output token: a single prefill step, a single batch) produced, so
until the engine publishes again the router does not know A's blocks are cached. The next
batch (request B, also sent directly) reveals the gap. With a replay endpoint the router
must fetch the lost batch, after which its index must equal the engine's own event history
(read independently from the engine's replay buffer) and a request sharing A's prefix must
be expected to hit exactly what the engine then reports it hit. Without one, the gap must
reset that replica's index (counted) and routing must go on.

Requests A and B go to the engine directly, not through the router, so that no *predicted*
index entry (written on dispatch) can stand in for the lost events.

Failures before the first byte: ``{"fail_next": 1, "status": 503}`` (a 5xx answer) and
``{"stall_first_byte_s": S, "stall_next": 1}`` (a stream whose first byte does not come within
``timeouts.first_byte_s``) on the replica the request goes to first: the router must serve it
from another replica, count the error and the retry, and keep the replica in routing. With
every engine armed, it must stop after ``retries.max_retries`` and tell the client why (or
relay the engine's own error answer).

Client disconnect: a streaming client that goes away mid-stream must make the router close
its upstream request; the engine aborts it (``vllm:request_success_total`` with
``finished_reason="abort"``) and the router's load accounting releases it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import pytest
import redis
import zmq
import zmq.asyncio
from required import skip_unless_required
from settling import settled

from kvroute.bench.processes import free_port
from kvroute.config import RouterConfig
from kvroute.core.clock import ManualClock
from kvroute.core.events import BlockStored, EventBatch
from kvroute.core.index import AdminCapability, PrefixIndex
from kvroute.core.types import ReplicaId
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet, ReplicaHandle
from kvroute.wire.prom import parse_exposition
from kvroute.wire.vllm_events import ReplayEnd, decode_replay_reply, encode_replay_request

pytestmark = pytest.mark.integration

MODEL = "sim-model"  # as tests/integration/conftest.py starts the engines
ROUTE = "assistant"
FleetFactory = Callable[..., Fleet]
ConfigFor = Callable[..., RouterConfig]


def run(coro: Any, timeout_s: float = 120.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))


def words(rng: random.Random, n: int, tag: str = "w") -> str:
    """``n`` distinct words: the simulated tokenizer makes each one token."""
    return " ".join(f"{tag}{rng.getrandbits(40):x}" for _ in range(n))


def chat(content: str, *, model: str = ROUTE, stream: bool = False,
         max_tokens: int = 1) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": stream}


async def wait_for(predicate: Callable[[], Any], timeout_s: float = 30.0,
                   what: str = "condition") -> None:
    """Polls until ``predicate`` holds. The bound is for a hung test, not a figure: on a
    loaded 2-core machine a warm-up's events took over 5 s to arrive."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await _maybe_await(predicate()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


async def _maybe_await(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


def entries(rt: RouterRuntime, replica: str) -> int:
    """Stored (event-confirmed) index entries of ``replica``; predicted ones are not counted."""
    return rt.core.index.stats().num_entries_by_replica.get(ReplicaId(replica), 0)


async def post_json(session: aiohttp.ClientSession, url: str,
                    body: Mapping[str, Any]) -> tuple[int, Mapping[str, str], dict[str, Any]]:
    async with session.post(url, json=body) as resp:
        return resp.status, resp.headers.copy(), json.loads(await resp.read())


async def direct(session: aiohttp.ClientSession, engine: ReplicaHandle, content: str) -> None:
    """One chat request straight to the engine, bypassing the router."""
    status, _, body = await post_json(session, engine.url + "/v1/chat/completions",
                                      chat(content, model=MODEL))
    assert status == 200, body


async def faults(session: aiohttp.ClientSession, engine: ReplicaHandle,
                 arm: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if arm is None:
        async with session.get(engine.url + "/sim/faults") as resp:
            assert resp.status == 200
            return dict(await resp.json())
    status, _, state = await post_json(session, engine.url + "/sim/faults", arm)
    assert status == 200, state
    return state


async def samples(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    """``/metrics`` samples of ``name``, keyed by their labels as ``k=v,k=v``."""
    async with session.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, float] = {}
    for s in parse_exposition(text, names=(name,)).samples:
        if s.name == name:
            out[",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


async def event_counter(session: aiohttp.ClientSession, rt: RouterRuntime, kind: str,
                        replica: str) -> float:
    """``kvroute_kv_event_<kind>_total{replica}`` as the router's ``/metrics`` serves it."""
    values = await samples(session, rt.url, f"kvroute_kv_event_{kind}_total")
    return values.get(f"replica={replica}", 0.0)


async def engine_history(replay_endpoint: str, timeout_s: float = 5.0) -> list[EventBatch]:
    """Every batch the engine still buffers, from its replay socket (sequence order)."""
    ctx = zmq.asyncio.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    batches: list[EventBatch] = []
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay_endpoint)
        await dealer.send_multipart(encode_replay_request(0))
        while True:
            assert await dealer.poll(timeout_s * 1000), "the replay socket did not answer"
            reply = decode_replay_reply(await dealer.recv_multipart())
            if isinstance(reply, ReplayEnd):
                return sorted(batches, key=lambda b: b.seq)
            batches.append(reply.batch)
    finally:
        dealer.close(linger=0)


# --------------------------------------------------------------------------------------------
# Dropped event messages
# --------------------------------------------------------------------------------------------


def test_a_dropped_event_batch_is_replayed_and_the_index_matches_the_engine(
        make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    fleet = make_fleet(2, fault_injection=True, enable_prompt_tokens_details=True)
    engine = fleet.replicas[0]
    name = engine.name
    assert engine.kv_replay is not None
    rng = random.Random(41)
    prefix = words(rng, 200)
    # Predicted entries expire before the follow-up, so only event-confirmed blocks count.
    config = config_for(fleet, predicted_ttl_s=0.05)

    async def body(rt: RouterRuntime, session: aiohttp.ClientSession) -> None:
        # Warm-up: the subscription is live once a batch has arrived (ZMQ slow joiner).
        await direct(session, engine, words(rng, 40, "warm"))
        await wait_for(lambda: entries(rt, name) > 0, what="the warm-up's events")
        before = await settled(lambda: entries(rt, name))
        armed = await faults(session, engine, {"drop_events": 1})
        assert armed["drop_events"] == 1

        await direct(session, engine, prefix + " " + words(rng, 3, "a"))  # A: dropped
        state = await faults(session, engine)
        assert state["fired"]["events_dropped"] == 1 and state["drop_events"] == 0
        await asyncio.sleep(0.3)
        assert entries(rt, name) == before, "the dropped batch cannot have reached the router"
        assert await event_counter(session, rt, "gaps", name) == 0

        await direct(session, engine, words(rng, 40, "b"))  # B: published, reveals the gap
        await wait_for(lambda: rt.subscribers[ReplicaId(name)].stats.gaps == 1, what="the gap")
        await wait_for(lambda: rt.subscribers[ReplicaId(name)].stats.replayed_batches >= 1,
                       what="the replay")
        assert await event_counter(session, rt, "gaps", name) == 1
        assert await event_counter(session, rt, "replays", name) >= 1
        assert await event_counter(session, rt, "resets", name) == 0

        # The router's index equals the engine's own event history, block for block.
        history = await engine_history(engine.kv_replay)  # type: ignore[arg-type]
        truth = PrefixIndex(clock=ManualClock())
        for batch in history:
            truth.apply_batch(ReplicaId(name), batch)
        scope = AdminCapability().fleet_scope()
        assert entries(rt, name) == truth.stats().num_entries_by_replica[ReplicaId(name)]
        stored = [e.block_hashes for b in history for e in b.events if isinstance(e, BlockStored)]
        assert len(stored) >= 3  # warm-up, A (the dropped one), B
        for hashes in stored:
            if hashes:  # each stored run is held, as a leading run, exactly as the engine holds it
                got = rt.core.index.match(list(hashes), scope).get(ReplicaId(name))
                want = truth.match(list(hashes), scope)[ReplicaId(name)]
                assert got is not None and got.num_gpu_blocks == want.num_gpu_blocks

        # A request sharing A's prefix goes there and hits what the router expected.
        status, headers, answer = await post_json(
            session, rt.url + "/v1/chat/completions", chat(prefix + " " + words(rng, 3, "c")))
        assert status == 200, answer
        assert headers["x-kvroute-replica"] == name
        expected = int(headers["x-kvroute-cached-tokens"])
        assert expected >= 192  # 12 of the prefix's 13 blocks, at least
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == expected

    async def main() -> None:
        async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as session:
            await body(rt, session)

    run(main())


def test_a_gap_without_replay_resets_the_replicas_index_and_routing_goes_on(
        make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    fleet = make_fleet(2, fault_injection=True, replay=False, enable_prompt_tokens_details=True)
    engine = fleet.replicas[0]
    name = engine.name
    assert engine.kv_replay is None
    rng = random.Random(42)
    prefix = words(rng, 200)
    config = config_for(fleet, predicted_ttl_s=0.05)

    async def body(rt: RouterRuntime, session: aiohttp.ClientSession) -> None:
        await direct(session, engine, prefix)  # warm-up: the prefix is cached and indexed
        await wait_for(lambda: entries(rt, name) >= 12, what="the warm-up's events")
        await faults(session, engine, {"drop_events": 1})
        await direct(session, engine, words(rng, 200, "a"))  # A: dropped
        assert (await faults(session, engine))["fired"]["events_dropped"] == 1
        await direct(session, engine, words(rng, 40, "b"))  # B: reveals the gap
        sub = rt.subscribers[ReplicaId(name)]
        await wait_for(lambda: sub.stats.resets == 1, what="the reset")
        assert sub.stats.gaps == 1 and sub.stats.replays == 0
        assert await event_counter(session, rt, "resets", name) == 1
        assert await event_counter(session, rt, "gaps", name) == 1
        # After the reset the index holds only what was published since: B's blocks (2 of
        # its ~3 blocks are full), not the warm-up prefix the router can no longer vouch for.
        await wait_for(lambda: 0 < entries(rt, name) < 12, what="B's events after the reset")

        # Routing goes on, and what the router expects is never more than the engine hits.
        for i in range(4):
            status, headers, answer = await post_json(
                session, rt.url + "/v1/chat/completions",
                chat(prefix + " " + words(rng, 3, f"r{i}")))
            assert status == 200, answer
            expected = int(headers["x-kvroute-cached-tokens"])
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= expected
        # The index keeps following the engine's events after the reset.
        fresh = entries(rt, name)
        await direct(session, engine, words(rng, 100, "d"))
        await wait_for(lambda: entries(rt, name) >= fresh + 6, what="events after the reset")
        assert sub.stats.resets == 1

    async def main() -> None:
        async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as session:
            await body(rt, session)

    run(main())


# --------------------------------------------------------------------------------------------
# Failures before the first byte
# --------------------------------------------------------------------------------------------

# A 5xx answer, or a stream whose first byte does not come within ``timeouts.first_byte_s``:
# another replica may well succeed, and nothing has reached the client yet.
PRE_FIRST_BYTE = {
    "status": ({"fail_next": 1, "status": 503}, "requests_failed", False),
    "timeout": ({"stall_first_byte_s": 3.0, "stall_next": 1}, "requests_stalled", True),
}
QUICK_FIRST_BYTE = {"connect_s": 1.0, "first_byte_s": 0.5, "total_s": 10.0}
# Health probes too slow to matter: the router learns of a failure from the request itself.
SLOW_PROBES = {"health_interval_s": 30, "metrics_interval_s": 30}


def decision_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvroute.decision"]


@pytest.mark.parametrize("kind", sorted(PRE_FIRST_BYTE))
def test_a_failure_before_the_first_byte_is_retried_on_another_replica(
        make_fleet: FleetFactory, config_for: ConfigFor, caplog: pytest.LogCaptureFixture,
        kind: str) -> None:
    arm, fired, stream = PRE_FIRST_BYTE[kind]
    fleet = make_fleet(3, fault_injection=True)
    rng = random.Random(44)
    prefix = words(rng, 200)
    config = config_for(fleet, timeouts=QUICK_FIRST_BYTE,
                        discovery=SLOW_PROBES)

    async def body(rt: RouterRuntime, session: aiohttp.ClientSession) -> None:
        status, headers, _ = await post_json(session, rt.url + "/v1/chat/completions",
                                             chat(prefix))
        assert status == 200
        home = headers["x-kvroute-replica"]
        await wait_for(lambda: entries(rt, home) >= 12, what="the prefix's events")
        await settled(lambda: entries(rt, home))
        engines = {e.name: e for e in fleet.replicas}
        await faults(session, engines[home], arm)
        caplog.clear()
        # The prefix is cached at home, so home is the first choice; it fails, and the
        # request is served by another replica instead.
        async with session.post(rt.url + "/v1/chat/completions",
                                json=chat(prefix + " " + words(rng, 3), stream=stream,
                                          max_tokens=3)) as resp:
            assert resp.status == 200
            served = resp.headers["x-kvroute-replica"]
            raw = await resp.read()
        assert served != home and served in engines
        if stream:
            assert raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw
        else:
            assert json.loads(raw)["object"] == "chat.completion"
        assert (await faults(session, engines[home]))["fired"][fired] == 1
        assert rt.metrics is not None
        assert rt.metrics.value("kvroute_upstream_errors_total",
                                {"replica": home, "kind": kind}) == 1
        assert rt.metrics.value("kvroute_retries_total", {"replica": home}) == 1
        # One slow or failed answer is not a dead replica: it stays in routing.
        assert rt.core.is_healthy(ReplicaId(home))
        [line] = decision_lines(caplog)
        assert line["replica"] == served and line["retries"] == 1 and line["outcome"] == "ok"

    async def main() -> None:
        async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as session:
            await body(rt, session)

    with caplog.at_level(logging.INFO, logger="kvroute.decision"):
        run(main())


@pytest.mark.parametrize("kind", sorted(PRE_FIRST_BYTE))
def test_retries_stop_at_max_retries_and_the_client_is_told_why(
        make_fleet: FleetFactory, config_for: ConfigFor, caplog: pytest.LogCaptureFixture,
        kind: str) -> None:
    arm, fired, stream = PRE_FIRST_BYTE[kind]
    fleet = make_fleet(3, fault_injection=True)
    rng = random.Random(45)
    config = config_for(fleet, timeouts=QUICK_FIRST_BYTE, retries={"max_retries": 1},
                        discovery=SLOW_PROBES)

    async def body(rt: RouterRuntime, session: aiohttp.ClientSession) -> None:
        for engine in fleet.replicas:  # every engine would fail once
            await faults(session, engine, arm)
        caplog.clear()
        async with session.post(rt.url + "/v1/chat/completions",
                                json=chat(words(rng, 30), stream=stream)) as resp:
            status, headers = resp.status, resp.headers.copy()
            answer = json.loads(await resp.read())
        states = [await faults(session, engine) for engine in fleet.replicas]
        # The first choice and one retry: two engines tried, the third never asked.
        assert sorted(state["fired"][fired] for state in states) == [0, 1, 1]
        last = headers["x-kvroute-replica"]
        assert rt.metrics is not None
        retries = {e.name: rt.metrics.value("kvroute_retries_total", {"replica": e.name}) or 0
                   for e in fleet.replicas}
        assert sum(retries.values()) == 1 and retries[last] == 0
        if kind == "status":
            # The engine's own answer is relayed as it is, in OpenAI's error shape.
            assert status == 503 and answer["error"]["code"] == 503
        else:
            assert status == 504
            message = answer["error"]["message"]
            assert last in message and "first byte" in message
            assert "Gave up after 1 retry on other replicas (retries.max_retries: 1)" in message
        [line] = decision_lines(caplog)
        assert line["retries"] == 1 and line["outcome"] == f"upstream_{kind}"
        assert line["replica"] == last

    async def main() -> None:
        async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as session:
            await body(rt, session)

    with caplog.at_level(logging.INFO, logger="kvroute.decision"):
        run(main())


def test_a_whole_answer_past_its_deadline_is_not_sent_again(
        make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    """A whole answer that runs past ``timeouts.total_s`` may have been computed already:
    running it again elsewhere could double its cost (and its side effects), so the client
    gets a 504 that says so."""
    fleet = make_fleet(2, fault_injection=True)
    rng = random.Random(46)
    config = config_for(fleet, timeouts={"connect_s": 1.0, "first_byte_s": 0.5, "total_s": 0.5},
                        discovery=SLOW_PROBES)

    async def body(rt: RouterRuntime, session: aiohttp.ClientSession) -> None:
        for engine in fleet.replicas:
            await faults(session, engine, {"stall_first_byte_s": 3.0, "stall_next": 1})
        status, headers, answer = await post_json(session, rt.url + "/v1/chat/completions",
                                                  chat(words(rng, 30)))
        assert status == 504
        tried = headers["x-kvroute-replica"]
        assert tried in answer["error"]["message"]
        assert "Not retried: the engine may already have run the request" in \
            answer["error"]["message"]
        stalled = {e.name: (await faults(session, e))["fired"]["requests_stalled"]
                   for e in fleet.replicas}
        assert stalled == {e.name: int(e.name == tried) for e in fleet.replicas}
        assert rt.metrics is not None
        assert rt.metrics.value("kvroute_retries_total", {"replica": tried}) in (None, 0.0)

    async def main() -> None:
        async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as session:
            await body(rt, session)

    run(main())


# --------------------------------------------------------------------------------------------
# Client disconnect
# --------------------------------------------------------------------------------------------


def test_a_client_that_disconnects_mid_stream_cancels_the_upstream_request(
        make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    fleet = make_fleet(2)
    rng = random.Random(43)
    config = config_for(fleet)

    async def engine_counts(session: aiohttp.ClientSession,
                            engine: ReplicaHandle) -> tuple[float, float, float]:
        success = await samples(session, engine.url, "vllm:request_success_total")
        running = await samples(session, engine.url, "vllm:num_requests_running")
        abort = sum(v for k, v in success.items() if "finished_reason=abort" in k)
        length = sum(v for k, v in success.items() if "finished_reason=length" in k)
        return abort, length, sum(running.values())

    async def body(rt: RouterRuntime, session: aiohttp.ClientSession) -> None:
        assert rt.app is not None
        admission = rt.app.router.admission
        # 4,000 tokens at >= 1.2 ms a step: several seconds if nobody stops it.
        request = chat(words(rng, 30), stream=True, max_tokens=4000)
        client = aiohttp.ClientSession()
        try:
            resp = await client.post(rt.url + "/v1/chat/completions", json=request)
            assert resp.status == 200
            victim = resp.headers["x-kvroute-replica"]
            engine = next(e for e in fleet.replicas if e.name == victim)
            received = b""
            while received.count(b"data: ") < 3:  # the role chunk and two tokens, at least
                chunk = await resp.content.readany()
                assert chunk, "the stream ended early"
                received += chunk
            abort0, length0, running = await engine_counts(session, engine)
            assert running == 1
            load = rt.core.load.snapshot(ReplicaId(victim))
            assert load.num_in_flight == 1 and admission.in_flight == 1
            resp.close()  # the client goes away: its TCP connection is closed mid-stream
        finally:
            await client.close()

        async def aborted() -> bool:
            abort, _, running = await engine_counts(session, engine)
            return abort == abort0 + 1 and running == 0

        # An abort shows in the engine's counts; a request that ran to its end instead would
        # not count as aborted, and the length check below tells the two apart.
        await wait_for(aborted, what="the engine to abort the request")
        _, length, _ = await engine_counts(session, engine)
        assert length == length0, "the request ran to its end instead of being aborted"
        await wait_for(lambda: rt.core.load.snapshot(ReplicaId(victim)).num_in_flight == 0
                       and admission.in_flight == 0,
                       what="the router to release the request")
        load = rt.core.load.snapshot(ReplicaId(victim))
        assert load.num_decoding == 0 and load.outstanding_prefill_tokens == 0
        assert load.active_kv_tokens == 0
        # The replica is not left looking busy: the next request is served normally.
        status, _, answer = await post_json(session, rt.url + "/v1/chat/completions",
                                            chat(words(rng, 30), max_tokens=3))
        assert status == 200, answer

    async def main() -> None:
        async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as session:
            await body(rt, session)

    run(main())


# --------------------------------------------------------------------------------------------
# An engine stalled mid-stream (docs/reliability.md)
# --------------------------------------------------------------------------------------------


def test_an_engine_stalled_mid_stream_ends_the_stream_and_its_request_is_aborted(
        make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    """The engine process is stopped (SIGSTOP) after the stream's first tokens: its socket
    stays open and silent. After ``timeouts.stall_s`` the client gets every event so far, a
    well-formed error event and ``[DONE]``; the router drops the upstream connection, so once
    the engine runs again it aborts the request; the next request is served."""
    fleet = make_fleet(2)
    rng = random.Random(45)
    config = config_for(fleet, timeouts={"connect_s": 1.0, "first_byte_s": 5.0,
                                         "total_s": 60.0, "stall_s": 1.0},
                        discovery=SLOW_PROBES)

    async def aborted(session: aiohttp.ClientSession, engine: ReplicaHandle) -> bool:
        """The (fresh) engine has aborted a request."""
        success = await samples(session, engine.url, "vllm:request_success_total")
        return sum(v for k, v in success.items() if "finished_reason=abort" in k) >= 1

    async def body(rt: RouterRuntime, session: aiohttp.ClientSession) -> None:
        request = chat(words(rng, 30), stream=True, max_tokens=4000)
        stopped: int | None = None
        try:
            async with session.post(rt.url + "/v1/chat/completions", json=request) as resp:
                assert resp.status == 200
                victim = resp.headers["x-kvroute-replica"]
                index = [r.name for r in fleet.replicas].index(victim)
                engine = fleet.replicas[index]
                received = b""
                while received.count(b"data: ") < 3:
                    chunk = await resp.content.readany()
                    assert chunk, "the stream ended early"
                    received += chunk
                stopped = fleet.processes[index].pid
                fleet.processes[index].send_signal(signal.SIGSTOP)
                started = asyncio.get_running_loop().time()
                async with asyncio.timeout(20.0):  # stall_s is 1 s: hung if this runs out
                    received += await resp.content.read()
                ended_s = asyncio.get_running_loop().time() - started
        finally:
            if stopped is not None:
                fleet.processes[index].send_signal(signal.SIGCONT)
        events = [e for e in received.decode().split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert "stall_s" in error["message"] and error["code"] == 502
        assert all(json.loads(e.removeprefix("data: "))["object"] == "chat.completion.chunk"
                   for e in events[:-2])
        await wait_for(lambda: aborted(session, engine), timeout_s=10.0,
                       what="the engine to abort the stalled request")
        status, _, answer = await post_json(session, rt.url + "/v1/chat/completions",
                                            chat(words(rng, 30), max_tokens=3))
        assert status == 200, answer
        print(f"\nstalled engine: the stream ended {ended_s:.2f} s after SIGSTOP (stall_s 1)")

    async def main() -> None:
        async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as session:
            await body(rt, session)

    run(main())


# --------------------------------------------------------------------------------------------
# A tenth of the event batches lost (docs/reliability.md)
# --------------------------------------------------------------------------------------------


def test_a_tenth_of_event_batches_dropped_and_the_index_still_equals_the_engine(
        make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    """40 requests straight to the engine, every tenth one's event batch lost on the PUB
    socket: the router replays each gap, resets nothing, and its index ends equal to the
    engine's own event history."""
    fleet = make_fleet(1, fault_injection=True)
    engine = fleet.replicas[0]
    name = engine.name
    assert engine.kv_replay is not None
    rng = random.Random(43)
    config = config_for(fleet, predicted_ttl_s=0.05)

    async def body(rt: RouterRuntime, session: aiohttp.ClientSession) -> None:
        await direct(session, engine, words(rng, 40, "warm"))
        await wait_for(lambda: entries(rt, name) > 0, what="the warm-up's events")
        for i in range(40):
            if i % 10 == 3:
                await faults(session, engine, {"drop_events": 1})
            await direct(session, engine, words(rng, 40, f"r{i}-"))
        last_sent = asyncio.get_running_loop().time()
        assert (await faults(session, engine))["fired"]["events_dropped"] == 4
        history = await engine_history(engine.kv_replay)  # type: ignore[arg-type]
        truth = PrefixIndex(clock=ManualClock())
        for batch in history:
            truth.apply_batch(ReplicaId(name), batch)
        want = truth.stats().num_entries_by_replica[ReplicaId(name)]
        await wait_for(lambda: entries(rt, name) == want, timeout_s=10.0,
                       what=f"the router's index to equal the engine's {want} blocks")
        caught_up_s = asyncio.get_running_loop().time() - last_sent
        assert await event_counter(session, rt, "gaps", name) == 4
        assert await event_counter(session, rt, "resets", name) == 0
        print(f"\n10% of event batches dropped: index equal to the engine's {want} blocks "
              f"{caught_up_s:.3f} s after the last request")

    async def main() -> None:
        async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as session:
            await body(rt, session)

    run(main())


# --------------------------------------------------------------------------------------------
# Redis stopped and started under traffic (docs/reliability.md)
# --------------------------------------------------------------------------------------------


def _start_redis(port: int) -> subprocess.Popen[bytes]:
    server = shutil.which("redis-server")
    if server is None:
        skip_unless_required("the Redis suite", "redis-server is not installed; install "
                             "redis-server to run this", env="KVROUTE_REQUIRE_REDIS")
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10.0
    while True:
        try:
            redis.Redis(port=port, socket_timeout=0.5).ping()
            return proc
        except (redis.RedisError, OSError):
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise AssertionError(f"redis-server on port {port} did not start") from None
            time.sleep(0.05)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_redis_stopped_and_started_under_traffic_fails_no_request(
        make_fleet: FleetFactory, config_for: ConfigFor, caplog: pytest.LogCaptureFixture,
) -> None:
    """A private Redis (the machine's own serves other tests) holds the session pins; it is
    stopped after 10 requests and started again after 20 more. Every request is answered
    (failed 0, hung 0); the outage is logged, the router runs without pins meanwhile, and
    pins are written to Redis again once it is back."""
    port = free_port()
    server = _start_redis(port)
    fleet = make_fleet(2)
    url = f"redis://127.0.0.1:{port}/0"
    config = config_for(fleet, state={"backend": "redis", "url": url, "timeout_s": 0.25})
    rng = random.Random(44)
    outcome = {"ok": 0, "failed": 0, "hung": 0}
    client = redis.Redis(port=port, socket_timeout=1.0)

    async def ask(rt: RouterRuntime, session: aiohttp.ClientSession, i: int) -> None:
        request = chat(words(rng, 30, f"q{i}-"))
        try:
            async with asyncio.timeout(10.0):
                async with session.post(rt.url + "/v1/chat/completions", json=request,
                                        headers={"x-session-id": f"session-{i % 3:04d}"}) as resp:
                    await resp.read()
                    outcome["ok" if resp.status == 200 else "failed"] += 1
        except TimeoutError:
            outcome["hung"] += 1

    def pins() -> int:
        return len(client.keys("kvroute:session:*"))

    async def body(rt: RouterRuntime, session: aiohttp.ClientSession) -> None:
        nonlocal server
        for i in range(10):
            await ask(rt, session, i)
        assert pins() == 3
        _stop(server)
        for i in range(10, 30):
            await ask(rt, session, i)
        assert rt.state is not None and not getattr(rt.state, "available", True)
        server = _start_redis(port)  # empty: what it held is gone, as after a crash
        for i in range(30, 40):
            await ask(rt, session, i)
        await wait_for(lambda: pins() == 3, what="pins written to the restarted Redis")

    async def main() -> None:
        env = {"KVROUTE_CLUSTER_SECRET": "cluster-secret-for-tests-" + "0" * 16}
        async with RouterRuntime(config, env=env) as rt, aiohttp.ClientSession() as session:
            await body(rt, session)

    try:
        with caplog.at_level(logging.WARNING, logger="kvroute"):
            run(main(), timeout_s=120.0)
    finally:
        client.close()
        _stop(server)
    assert outcome == {"ok": 40, "failed": 0, "hung": 0}
    messages = [r.getMessage() for r in caplog.records]
    assert any("shared state (Redis) unavailable" in m for m in messages)
    assert any("shared state (Redis) reachable again" in m for m in messages)


# --------------------------------------------------------------------------------------------
# The router restarted under load (docs/reliability.md)
# --------------------------------------------------------------------------------------------


def test_a_router_restarted_under_load_finishes_its_streams_and_rebuilds_its_index(
        make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    """A router stopped while six streams are in flight lets them end whole; a new router on
    the same port starts with an empty index and rebuilds it from the engines' replay
    buffers (vLLM's protocol) until it equals each engine's event history, and then routes
    a request to the replica holding its prefix."""
    fleet = make_fleet(2)
    rng = random.Random(46)
    config = config_for(fleet, predicted_ttl_s=0.05)
    prefix = words(rng, 200, "p")
    outcome = {"ok": 0, "failed": 0, "hung": 0}

    async def stream(session: aiohttp.ClientSession, url: str) -> None:
        request = chat(words(rng, 30, "s"), stream=True, max_tokens=200)
        try:
            async with asyncio.timeout(20.0):
                async with session.post(url + "/v1/chat/completions", json=request) as resp:
                    raw = await resp.read()
            whole = raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw
            outcome["ok" if resp.status == 200 and whole else "failed"] += 1
        except TimeoutError:
            outcome["hung"] += 1
        except aiohttp.ClientError:
            outcome["failed"] += 1

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            first = RouterRuntime(config, env={})
            try:
                await first.start()
                status, headers, _ = await post_json(session, first.url + "/v1/chat/completions",
                                                     chat(prefix))
                assert status == 200
                home = headers["x-kvroute-replica"]
                assert first.app is not None
                admission = first.app.router.admission
                tasks = [asyncio.create_task(stream(session, first.url)) for _ in range(6)]
                await wait_for(lambda: admission.in_flight == 6, what="six streams in flight")
            finally:
                await first.stop()  # lets the answers in flight end (grace), then stops
            await asyncio.gather(*tasks)
            assert outcome == {"ok": 6, "failed": 0, "hung": 0}

            again = dataclasses.replace(
                config, listen=dataclasses.replace(config.listen, port=first.port))
            async with RouterRuntime(again, env={}) as rt:
                assert rt.core.index.stats().num_entries == 0
                for engine in fleet.replicas:
                    sub = rt.subscribers[ReplicaId(engine.name)]
                    # The engine publishes again (live traffic would); the new subscriber
                    # sees the sequence and replays what it missed. A batch sent before
                    # the SUB is connected is lost (ZMQ's slow joiner): send until one lands.
                    for _ in range(10):
                        await direct(session, engine, words(rng, 20, "d"))
                        try:
                            await wait_for(lambda s=sub: s.stats.replayed_batches > 0,
                                           timeout_s=1.0)
                            break
                        except AssertionError:
                            continue
                    history = await engine_history(engine.kv_replay)  # type: ignore[arg-type]
                    truth = PrefixIndex(clock=ManualClock())
                    for batch in history:
                        truth.apply_batch(ReplicaId(engine.name), batch)
                    want = truth.stats().num_entries_by_replica[ReplicaId(engine.name)]
                    await wait_for(lambda e=engine.name, w=want: entries(rt, e) == w,
                                   timeout_s=10.0, what=f"{engine.name}'s index rebuilt")
                status, headers, _ = await post_json(session, rt.url + "/v1/chat/completions",
                                                     chat(prefix + " " + words(rng, 3)))
                assert status == 200 and headers["x-kvroute-replica"] == home
                assert int(headers["x-kvroute-cached-tokens"]) >= 192

    run(main())
