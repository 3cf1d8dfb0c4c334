"""The durable KV-event stream on real NATS JetStream, real ZMQ and real routers (loopback).

A simulated engine's publisher (``sim.kv_publisher.KVEventPublisher``, vLLM's framing and its
10,000-batch replay buffer) publishes more batches than its buffer holds while no router
runs; a relay (``kvroute events relay``'s ``StandaloneRelay``) mirrors them into JetStream.
A router started afterwards must hold exactly the engine's blocks; one without the stream
must not (it can only replay the buffer's tail), which is what makes the first assertion
able to fail. NATS away at start: the router logs it and follows ZMQ alone.

Needs NATS with JetStream on 127.0.0.1:4222 (skipped without, failed under CI:
``tests/required.py``). Each test uses its own stream and bucket, deleted at the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml
from private_nats import PrivateNats
from required import NATS_URL, require_nats

from kvroute.config import RouterConfig, parse_config
from kvroute.core.errors import ConfigError
from kvroute.core.events import BlockRemoved, BlockStored, EventBatch, KVEvent
from kvroute.core.index import AdminCapability
from kvroute.core.types import ReplicaId
from kvroute.shell.kv_relay import StandaloneRelay
from kvroute.shell.kv_stream import KvStream
from kvroute.shell.kv_stream_reader import rebuild
from kvroute.shell.kv_stream_relay import KvStreamRelay
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.kv_publisher import KVEventPublisher
from kvroute.sim.launcher import inprocess_fleet
from kvroute.sim.server import SimServer, SimServerConfig

pytestmark = pytest.mark.integration

REPLICA = ReplicaId("s0")
BUFFER = 10_000  # vLLM's buffer_steps default, kept as is: the test goes beyond it
TOTAL = 12_000  # batches published while no router runs


@pytest.fixture
def nats_reachable() -> None:
    require_nats(NATS_URL)


def run(coro: Any, timeout_s: float = 120.0) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(timeout_s):
            await coro
    asyncio.run(bounded())


class Engine:
    """One engine's publisher and its truth: the hashes it holds now, as it published them.

    Batch ``i`` stores block ``i + 1`` (chained to ``i``); every third batch also removes the
    block stored just before it, so the truth keeps blocks from the first batches (the ones a
    replay of the last 10,000 can never bring back) and loses some on the way. A restart
    starts a new publisher on the same endpoints, counting from 0 again, with an empty cache
    and other hashes.
    """

    def __init__(self) -> None:
        self.pub = KVEventPublisher(replay_endpoint="tcp://127.0.0.1:0", buffer_steps=BUFFER)
        self.held: set[int] = set()
        self.ever: set[int] = set()
        self.next_seq = 0
        self.offset = 0

    def publish(self, n: int, *, lose: bool = False) -> None:
        """``n`` batches; with ``lose`` they are numbered and buffered for replay but not
        sent (what a subscriber sees when messages are lost: ``KVEventPublisher``)."""
        for _ in range(n):
            i = self.next_seq
            h = self.offset + i + 1
            events: list[KVEvent] = [BlockStored((h,), (h - 1) if i else None, (), 16)]
            self.held.add(h)
            self.ever.add(h)
            if i % 3 == 2:
                events.append(BlockRemoved((h - 1,)))
                self.held.discard(h - 1)
            self.pub.publish(events, skip_send=lose)
            self.next_seq += 1
        self.pub.wait_sent(timeout=30.0)

    def probe(self) -> None:
        """One batch that changes nothing the engine holds (it removes a block it never
        stored), for waiting on a subscriber that may lose its first messages."""
        self.pub.publish([BlockRemoved((0,))])
        self.pub.wait_sent(timeout=30.0)
        self.next_seq += 1

    def restart(self) -> None:
        endpoint, replay = self.pub.endpoint, self.pub.replay_endpoint
        self.pub.close()
        self.pub = KVEventPublisher(endpoint, replay_endpoint=replay, buffer_steps=BUFFER)
        self.pub.start()
        self.held = set()
        self.next_seq = 0
        self.offset += 1_000_000


def index_of(rt: RouterRuntime, engine: Engine) -> tuple[int, set[int]]:
    """(entries the index holds for the replica, the engine hashes it holds)."""
    scope = AdminCapability().fleet_scope()
    held = {h for h in engine.ever if rt.core.index.match([h], scope).get(REPLICA) is not None}
    return rt.core.index.stats().num_entries_by_replica.get(REPLICA, 0), held


def config(sim: SimServer, engine: Engine, stream: dict[str, Any] | None) -> RouterConfig:
    return parse_config(config_data(sim, engine, stream), env={})


def config_data(sim: SimServer, engine: Engine, stream: dict[str, Any] | None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"small": {"model": "sim-model", "replicas": [{
            "name": REPLICA, "url": sim.url, "kv_events": engine.pub.endpoint,
            "kv_replay": engine.pub.replay_endpoint, "kv_topic": "kv"}]}},
        "routes": {"assistant": {"pools": ["small"]}},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5,
                      "models_interval_s": 5, "timeout_s": 1.0},
        "log_level": "warning",
    }
    if stream is not None:
        data["kv_stream"] = stream
    return data


@asynccontextmanager
async def fixtures(snapshot_every: int = 5_000) -> AsyncIterator[tuple[SimServer, Engine,
                                                                        dict[str, Any]]]:
    """A simulated engine's HTTP side, its publisher, and a fresh stream (deleted after)."""
    name = f"KVTEST_{uuid.uuid4().hex[:10]}"
    stream = {"url": NATS_URL, "name": name, "subject_prefix": f"kvtest.{name}",
              "max_bytes": 64 << 20, "max_age_s": 600, "snapshot_every": snapshot_every}
    engine = Engine()
    engine.pub.start()
    try:
        async with inprocess_fleet([SimServerConfig(kv_events=None)]) as (sim,):
            yield sim, engine, stream
    finally:
        engine.pub.close()
        nc = await nats.connect(NATS_URL)
        js = nc.jetstream()
        for drop in (js.delete_stream(name), js.delete_object_store(f"{name}_SNAPSHOTS")):
            try:
                await drop
            except nats.js.errors.NotFoundError:
                pass
        await nc.close()


async def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)
    assert predicate(), what


async def live_until_following(engine: Engine, routers: list[RouterRuntime],
                               limit: int = 100) -> None:
    """Publish one batch at a time until every router's subscriber has delivered it (ZMQ's
    late joiner loses the first messages; a bounded number of probes)."""
    await wait_for(lambda: all(REPLICA in rt.subscribers for rt in routers), "subscribed")
    for _ in range(limit):
        engine.publish(1)
        last = engine.next_seq - 1
        for _ in range(20):
            if all(rt.subscribers[REPLICA].stats.last_seq == last for rt in routers):
                return
            await asyncio.sleep(0.02)
    raise AssertionError(f"routers not following after {limit} live batches")


def test_restarted_router_catches_up_from_the_stream_beyond_the_replay_buffer(
        nats_reachable: None) -> None:
    async def test() -> None:
        async with fixtures() as (sim, engine, stream), \
                StandaloneRelay(config(sim, engine, stream)) as relay:
            assert relay.relay is not None
            relay_stats = relay.relay
            # A first router runs for a while, then goes away.
            async with RouterRuntime(config(sim, engine, stream)) as first:
                await live_until_following(engine, [first])
                engine.publish(500)
                await wait_for(lambda: first.subscribers[REPLICA].stats.last_seq
                               == engine.next_seq - 1, "the first router follows")
            # More than the engine's replay buffer while no router runs.
            engine.publish(TOTAL - engine.next_seq)
            await wait_for(lambda: relay_stats.stats.last_seq.get(REPLICA)
                           == engine.next_seq - 1, "relayed everything")
            await relay_stats.idle()
            assert relay_stats.stats.failed == 0 and relay_stats.stats.dropped == 0
            assert relay_stats.stats.snapshots >= 2
            # Restarted, with the stream; and one without it, as the control.
            async with RouterRuntime(config(sim, engine, stream)) as restarted, \
                    RouterRuntime(config(sim, engine, None)) as without:
                await live_until_following(engine, [restarted, without])
                engine.publish(50)  # live batches after the catch-up: no gap, no repeat
                gaps_before = restarted.subscribers[REPLICA].stats.gaps
                engine.publish(3, lose=True)  # the gap detection still works after resuming
                engine.publish(10)
                last = engine.next_seq - 1
                await wait_for(lambda: restarted.subscribers[REPLICA].stats.last_seq == last
                               and without.subscribers[REPLICA].stats.last_seq == last,
                               "both follow the live feed")
                assert engine.next_seq > BUFFER + 1000
                entries, held = index_of(restarted, engine)
                assert held == engine.held
                assert entries == len(engine.held)
                position = restarted.stream_positions[REPLICA]
                # bounded: a snapshot (9,999, or 4,999 if writing the last one failed) + tail
                assert position.snapshot_seq in (4_999, 9_999)
                assert position.batches == TOTAL - 1 - position.snapshot_seq
                sub = restarted.subscribers[REPLICA].stats
                assert sub.resets == 0 and sub.gaps == gaps_before + 1
                assert sub.replayed_batches < 200  # the tail after the stream, not 10,000
                # Without the stream, the blocks older than the buffer are missing.
                entries_without, held_without = index_of(without, engine)
                missing = engine.held - held_without
                assert missing, "a router without the stream rebuilt everything"
                assert max(missing) < engine.next_seq - BUFFER
                assert entries_without == len(engine.held) - len(missing)
    run(test())


def test_a_router_that_relays_rebuilds_from_its_own_stream(nats_reachable: None) -> None:
    async def test() -> None:
        async with fixtures(snapshot_every=150) as (sim, engine, stream):
            relaying = {**stream, "relay": True}
            async with RouterRuntime(config(sim, engine, relaying)) as first:
                await live_until_following(engine, [first])
                engine.publish(400)
                await wait_for(lambda: first.relay is not None and first.relay.stats.last_seq
                               .get(REPLICA) == engine.next_seq - 1, "relayed by the router")
                first.sync_metrics()
                assert first.metrics.value("kvroute_kv_stream_up") == 1
                assert (first.metrics.value("kvroute_kv_stream_relay", {"stat": "published"})
                        or 0) >= 400
            async with RouterRuntime(config(sim, engine, relaying)) as second:
                await wait_for(lambda: REPLICA in second.stream_positions, "rebuilt")
                position = second.stream_positions[REPLICA]
                assert position.last_seq == engine.next_seq - 1
                assert position.snapshot_seq is not None
                assert position.batches < 150
                entries, held = index_of(second, engine)
                assert held == engine.held and entries == len(engine.held)
                await live_until_following(engine, [second])
                assert second.subscribers[REPLICA].stats.resets == 0
                entries, held = index_of(second, engine)
                assert held == engine.held and entries == len(engine.held)
    run(test())


def test_an_engine_restart_relayed_as_a_reset_leaves_no_stale_block(
        nats_reachable: None) -> None:
    async def test() -> None:
        async with fixtures() as (sim, engine, stream), \
                StandaloneRelay(config(sim, engine, stream)) as relay:
            assert relay.relay is not None
            relayed = relay.relay
            follower = relay.subscribers[REPLICA]
            for _ in range(100):  # until the relay's subscriber has joined
                engine.publish(1)
                await asyncio.sleep(0.02)
                if follower.stats.last_seq == engine.next_seq - 1:
                    break
            engine.publish(300)
            await wait_for(lambda: follower.stats.last_seq == engine.next_seq - 1, "relayed")
            engine.restart()
            for _ in range(100):  # until the relay's subscriber has seen the new publisher
                engine.probe()
                await asyncio.sleep(0.02)
                if follower.stats.resets:
                    break
            engine.publish(200)
            await wait_for(lambda: relayed.stats.last_seq.get(REPLICA) == engine.next_seq - 1,
                           "the restarted engine relayed")
            await relayed.idle()
            assert relayed.stats.resets == 1
            async with RouterRuntime(config(sim, engine, stream)) as rt:
                await wait_for(lambda: REPLICA in rt.stream_positions, "rebuilt")
                position = rt.stream_positions[REPLICA]
                assert position.last_seq == engine.next_seq - 1 and position.epoch == 1
                entries, held = index_of(rt, engine)
                assert held == engine.held  # nothing of the engine's first life
                assert entries == len(engine.held)
    run(test())


def test_the_relay_command_relays_until_sigterm(nats_reachable: None, tmp_path: Path) -> None:
    async def test() -> None:
        async with fixtures() as (sim, engine, stream):
            path = tmp_path / "kvroute.yaml"
            path.write_text(yaml.safe_dump(config_data(sim, engine, stream)))
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvroute.cli", "events", "relay", "-c", str(path),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            try:
                assert proc.stdout is not None
                line = await asyncio.wait_for(proc.stdout.readline(), 30)
                assert json.loads(line) == {"ready": True, "replicas": [REPLICA]}
                parsed = config(sim, engine, stream)
                assert parsed.kv_stream is not None
                reader = await KvStream.open(parsed.kv_stream)
                assert reader is not None
                try:
                    position = None
                    for _ in range(100):  # until the relay has joined and written the probe
                        engine.publish(1)
                        await asyncio.sleep(0.05)
                        position = await rebuild(reader, REPLICA, None, None, census=True)
                        if position.last_seq == engine.next_seq - 1:
                            break
                    engine.publish(300)
                    for _ in range(100):
                        position = await rebuild(reader, REPLICA, None, None, census=True)
                        if position.last_seq == engine.next_seq - 1:
                            break
                        await asyncio.sleep(0.1)
                    assert position is not None and position.census is not None
                    assert position.last_seq == engine.next_seq - 1
                    # every block the engine holds and was relayed (the first probes may be
                    # lost to ZMQ's late join) is in the stream's census, none it dropped
                    assert position.census.hashes() <= engine.held
                    assert {h for h in engine.held if h > engine.next_seq - 300} \
                        <= position.census.hashes()
                finally:
                    await reader.close()
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(proc.wait(), 30) == 0
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    run(test())


def test_the_relay_command_refuses_a_config_without_kv_stream(tmp_path: Path) -> None:
    path = tmp_path / "kvroute.yaml"
    path.write_text(yaml.safe_dump({
        "pools": {"p": {"model": "m", "replicas": [{"name": "a", "url": "http://127.0.0.1:1",
                                                    "kv_events": "tcp://127.0.0.1:2"}]}},
        "routes": {"r": {"pools": ["p"]}}}))
    done = subprocess.run([sys.executable, "-m", "kvroute.cli", "events", "relay", "-c",
                           str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "kv_stream: missing" in done.stderr


def test_a_foreign_message_in_the_stream_ends_the_rebuild_there_with_a_warning(
        nats_reachable: None, caplog: pytest.LogCaptureFixture) -> None:
    async def test() -> None:
        async with fixtures() as (sim, engine, stream):
            parsed = config(sim, engine, stream)
            assert parsed.kv_stream is not None
            kv = await KvStream.open(parsed.kv_stream)
            assert kv is not None
            try:
                relay = KvStreamRelay(kv)
                relay.start()
                for seq in range(5):
                    relay.on_batch(REPLICA, EventBatch(seq, 0.0, (BlockStored((seq + 1,), None,
                                                                              (), 16),)))
                await relay.idle()
                await kv._js.publish(kv.subject(REPLICA), b"not a batch")
                relay.on_batch(REPLICA, EventBatch(5, 0.0, (BlockStored((6,), None, (), 16),)))
                await relay.idle()
                await relay.stop()
                with caplog.at_level(logging.WARNING, logger="kvroute.shell"):
                    position = await rebuild(kv, REPLICA, None, None, census=True)
                assert position.last_seq == 4 and position.census is not None
                assert position.census.hashes() == {1, 2, 3, 4, 5}
                assert any("stopped early" in r.getMessage() and "only kvroute's relay" in
                           r.getMessage() for r in caplog.records)
            finally:
                await kv.close()
            async with RouterRuntime(parsed) as rt:  # resumes after batch 4; follows ZMQ
                await live_until_following(engine, [rt])
                assert rt.stream_positions[REPLICA].last_seq == 4
    run(test())


def test_nats_killed_and_restarted_under_a_relaying_router(tmp_path: Path) -> None:
    nats_server = PrivateNats(tmp_path / "js")

    async def test() -> None:
        engine = Engine()
        engine.pub.start()
        nats_server.start()
        stream = {"url": nats_server.url, "relay": True, "snapshot_every": 1_000_000,
                  "connect_timeout_s": 5}
        try:
            async with inprocess_fleet([SimServerConfig(kv_events=None)]) as (sim,):
                async with RouterRuntime(config(sim, engine, stream)) as rt:
                    await wait_for(lambda: rt.relay is not None, "connected to NATS")
                    relay = rt.relay
                    assert relay is not None
                    await live_until_following(engine, [rt])
                    engine.publish(2_000)
                    # Killed in the middle of the burst: publishes on their way are lost.
                    await wait_for(lambda: relay.stats.last_seq.get(REPLICA, 0) >= 500,
                                   "relaying the burst")
                    nats_server.kill()
                    for _ in range(20):  # 200 batches over 2 s with NATS away
                        engine.publish(10)
                        await asyncio.sleep(0.1)
                    await wait_for(lambda: rt.subscribers[REPLICA].stats.last_seq
                                   == engine.next_seq - 1, "follows ZMQ while NATS is away")
                    entries, held = index_of(rt, engine)
                    assert held == engine.held and entries == len(engine.held)
                    nats_server.start()
                    back = time.monotonic()
                    # Until every publish is settled: acknowledged, or failed and covered
                    # by a snapshot written after NATS came back (bounded: 60 probes).
                    for _ in range(60):
                        engine.probe()
                        await asyncio.sleep(0.5)
                        stats = relay.stats
                        if stats.last_seq.get(REPLICA) == engine.next_seq - 1 and (
                                rt.kv_stream is not None and rt.kv_stream.pending() == 0) and (
                                stats.failed == 0 or stats.snapshots > 0):
                            break
                    recovered_s = time.monotonic() - back
                    stats = relay.stats
                    assert stats.failed == 0 or stats.snapshots > 0, stats
                logging.getLogger(__name__).info("NATS outage: %s, settled %.1f s after restart",
                                                 stats, recovered_s)
                async with RouterRuntime(config(sim, engine, {**stream, "relay": False})) as rt:
                    await wait_for(lambda: REPLICA in rt.stream_positions, "rebuilt")
                    assert rt.stream_positions[REPLICA].last_seq == engine.next_seq - 1
                    entries, held = index_of(rt, engine)
                    assert held == engine.held and entries == len(engine.held)
        finally:
            engine.pub.close()
            nats_server.kill()
    run(test(), timeout_s=120.0)


def test_nats_away_at_start_degrades_to_zmq_only(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    away = {"url": f"nats://127.0.0.1:{port}", "connect_timeout_s": 0.5}

    async def test() -> None:
        engine = Engine()
        engine.pub.start()
        try:
            async with inprocess_fleet([SimServerConfig(kv_events=None)]) as (sim,):
                with caplog.at_level(logging.WARNING, logger="kvroute.shell"):
                    async with RouterRuntime(config(sim, engine, away)) as rt:
                        await live_until_following(engine, [rt])
                        engine.publish(30)
                        await wait_for(lambda: rt.subscribers[REPLICA].stats.last_seq
                                       == engine.next_seq - 1, "follows ZMQ")
                        entries, held = index_of(rt, engine)
                        assert held == engine.held and entries == len(engine.held)
                        assert rt.kv_stream is None and rt.relay is None
                        rt.sync_metrics()
                        assert rt.metrics.value("kvroute_kv_stream_up") == 0
                    with pytest.raises(ConfigError, match="cannot be reached"):
                        async with StandaloneRelay(config(sim, engine, away)):
                            pass
        finally:
            engine.pub.close()
        assert any("running on the engines' ZMQ feeds only" in r.getMessage()
                   for r in caplog.records)
    run(test(), timeout_s=60.0)


def test_a_relaying_router_started_while_nats_is_down_relays_once_it_is_up(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """NATS holds an older history of the replica, goes away, and a relaying router starts
    without it; the engine moves on (stores and removals) while NATS is down. Once NATS is
    back the router relays without a restart, and a router started afterwards rebuilds
    exactly the engine's blocks from the stream: the relay resumed from the census counted
    meanwhile (a plain new epoch would leave only the blocks published after NATS came back,
    and the old history without the reset would leave removed blocks in)."""
    nats_server = PrivateNats(tmp_path / "js")

    async def test() -> None:
        engine = Engine()
        engine.pub.start()
        nats_server.start()
        stream = {"url": nats_server.url, "relay": True, "snapshot_every": 1_000_000,
                  "connect_timeout_s": 1}
        try:
            async with inprocess_fleet([SimServerConfig(kv_events=None)]) as (sim,):
                async with RouterRuntime(config(sim, engine, stream)) as rt:
                    await wait_for(lambda: rt.relay is not None, "connected to NATS")
                    relay = rt.relay
                    assert relay is not None
                    await live_until_following(engine, [rt])
                    engine.publish(150)
                    await wait_for(lambda: relay.stats.last_seq.get(REPLICA)
                                   == engine.next_seq - 1, "the history relayed")
                    await wait_for(lambda: rt.kv_stream is not None
                                   and rt.kv_stream.pending() == 0, "acknowledged")
                nats_server.kill()
                with caplog.at_level(logging.DEBUG, logger="kvroute.shell"):
                    async with RouterRuntime(config(sim, engine, stream)) as rt:
                        await live_until_following(engine, [rt])
                        engine.publish(200)  # removes a third of what it stores
                        await wait_for(lambda: rt.subscribers[REPLICA].stats.last_seq
                                       == engine.next_seq - 1, "follows ZMQ while NATS is away")
                        assert rt.kv_stream is None and rt.relay is None
                        rt.sync_metrics()
                        assert rt.metrics.value("kvroute_kv_stream_up") == 0
                        await asyncio.sleep(1.5)  # at least one quiet retry has failed
                        nats_server.start()
                        back = time.monotonic()
                        await wait_for(lambda: rt.relay is not None, "relaying after NATS came "
                                       "back, without a restart", timeout_s=45.0)
                        logging.getLogger(__name__).warning(
                            "relaying %.2f s after NATS came back", time.monotonic() - back)
                        relay = rt.relay
                        assert relay is not None
                        for _ in range(3):
                            engine.publish(10)
                            await asyncio.sleep(0.1)
                        await wait_for(lambda: relay.stats.last_seq.get(REPLICA)
                                       == engine.next_seq - 1 and relay.stats.snapshots >= 1
                                       and rt.kv_stream is not None
                                       and rt.kv_stream.pending() == 0, "relayed and snapshot")
                        assert relay.stats.failed == 0 and relay.stats.resets == 1
                        rt.sync_metrics()
                        assert rt.metrics.value("kvroute_kv_stream_up") == 1
                    unavailable = [r for r in caplog.records if r.levelno >= logging.WARNING
                                   and "KV-event stream unavailable" in r.getMessage()]
                    assert len(unavailable) == 1, "the outage is logged once, not per retry"
                async with RouterRuntime(config(sim, engine, {**stream, "relay": False})) as rt:
                    await wait_for(lambda: REPLICA in rt.stream_positions, "rebuilt")
                    assert rt.stream_positions[REPLICA].last_seq == engine.next_seq - 1
                    entries, held = index_of(rt, engine)
                    assert held == engine.held and entries == len(engine.held)
        finally:
            engine.pub.close()
            nats_server.kill()
    run(test(), timeout_s=120.0)
