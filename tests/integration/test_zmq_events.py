"""KVEventPublisher → EventSubscriber over real ZMQ on loopback.

Gaps are made deterministically with ``publish(..., skip_send=True)`` (buffered for replay,
never sent), restarts by closing a publisher and binding a new one on the same ports, and
malformed traffic with a bare PUB socket. The slow-joiner window of PUB/SUB is closed by
probing until the subscriber has received something, bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal

import pytest
import zmq
import zmq.asyncio

from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from kvroute.core.types import ReplicaId, WireHash
from kvroute.shell.zmq_events import _REPLAY_PER_TURN, _TAKE_PER_TURN, EventSubscriber, OnBatch
from kvroute.sim.kv_publisher import KVEventPublisher
from kvroute.wire.vllm_events import (
    ReplayBatch,
    decode_replay_reply,
    decode_replay_request,
    encode_payload,
    encode_replay_end,
    encode_replay_reply,
    encode_replay_request,
    encode_seq,
)

pytestmark = pytest.mark.integration

R = ReplicaId("r0")
TEST_SECONDS = 5.0
TEST_SECONDS_SLOW = 60.0
"""Bound of a test whose work grows with the machine's slowness (whole catch-ups): it only
stops a hung test, so it is far above what any machine needs."""


def events_for(i: int) -> tuple[KVEvent, ...]:
    stored = BlockStored(
        (WireHash(i * 2 + 1), WireHash(i * 2 + 2)), None, tuple(range(32)), 16, group_idx=0
    )
    return (stored, BlockRemoved((WireHash(i * 2 + 1),), group_idx=0))


class Sink:
    """Records what the subscriber delivers, as the index owner would see it."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []
        self.resets: list[str] = []
        self.log: list[tuple[str, int | str]] = []

    def on_batch(self, replica: ReplicaId, batch: EventBatch) -> None:
        assert replica == R
        self.batches.append(batch)
        self.log.append(("batch", batch.seq))

    def on_reset(self, replica: ReplicaId, reason: str) -> None:
        assert replica == R
        self.resets.append(reason)
        self.log.append(("reset", reason))

    @property
    def seqs(self) -> list[int]:
        return [b.seq for b in self.batches]


def run(test: Callable[[zmq.asyncio.Context], Coroutine[Any, Any, None]],
        seconds: float = TEST_SECONDS) -> None:
    ctx = zmq.asyncio.Context()
    try:
        asyncio.run(asyncio.wait_for(test(ctx), seconds))
    finally:
        ctx.term()


async def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def probe(publish: Callable[[], Any], done: Callable[[], bool], limit: int = 200) -> Any:
    """Publish until the subscriber has something (PUB drops until SUB has subscribed).

    Returns what the last ``publish()`` returned (the last probe's seq for a publisher):
    earlier probes may still be in flight when ``done()`` first holds.
    """
    for _ in range(limit):
        last = publish()
        for _ in range(4):
            await asyncio.sleep(0.005)
            if done():
                return last
    raise AssertionError(f"subscriber received nothing after {limit} probes")


def raw_pub(ctx: zmq.asyncio.Context) -> tuple[zmq.asyncio.Socket, str]:
    """A bare PUB socket on a free loopback port (to send frames no publisher would), and
    its endpoint."""
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind("tcp://127.0.0.1:0")
    return raw, raw.getsockopt_string(zmq.LAST_ENDPOINT)


async def past_probes(pub: KVEventPublisher, sub: EventSubscriber, sink: Sink) -> int:
    """Publish until the subscriber receives (the SUB socket joins late), then wait until it
    has taken every probe; returns the last probe's sequence number."""
    first: int = await probe(
        lambda: pub.publish(events_for(0), ts=0.0), lambda: bool(sink.batches)
    )
    await wait_until(lambda: sub.stats.last_seq == first, "the probes")
    return first


def make_sub(
    ctx: zmq.asyncio.Context, pub: KVEventPublisher | str, sink: Sink, **kw: Any
) -> EventSubscriber:
    if isinstance(pub, KVEventPublisher):
        kw.setdefault("replay_endpoint", pub.replay_endpoint)
        endpoint = pub.endpoint
    else:
        endpoint = pub
    return EventSubscriber(
        R, endpoint, on_batch=sink.on_batch, on_reset=sink.on_reset, context=ctx, topic="kv", **kw
    )


async def with_sub(sub: EventSubscriber, body: Callable[[], Awaitable[None]]) -> None:
    sub.start()
    await sub.wait_connected()
    try:
        await body()
    finally:
        await sub.stop()


def test_round_trip_in_order() -> None:
    async def test(ctx: zmq.asyncio.Context) -> None:
        sink = Sink()
        published: dict[int, tuple[KVEvent, ...]] = {}
        with KVEventPublisher() as pub:

            def send(i: int) -> None:
                seq = pub.publish(events_for(i), ts=1000.0 + i)
                published[seq] = events_for(i)

            sub = make_sub(ctx, pub, sink)

            async def body() -> None:
                await probe(lambda: send(len(published)), lambda: bool(sink.batches))
                for _ in range(50):
                    send(len(published))
                last = len(published) - 1
                await wait_until(lambda: sub.stats.last_seq == last, "the last batch")

            await with_sub(sub, body)
        assert sink.seqs == list(range(len(published)))
        assert sink.batches == [
            EventBatch(seq, 1000.0 + seq, published[seq], 0) for seq in sorted(published)
        ]
        stats = sub.stats
        assert (stats.gaps, stats.resets, stats.malformed) == (0, 0, 0)
        assert stats.batches == len(published)
        assert stats.events == 2 * len(published)

    run(test)


def test_late_joiner_catches_up_from_replay() -> None:
    async def test(ctx: zmq.asyncio.Context) -> None:
        sink = Sink()
        with KVEventPublisher() as pub:
            for i in range(5):  # nobody is listening yet
                pub.publish(events_for(i), ts=float(i))
            pub.wait_sent()
            sub = make_sub(ctx, pub, sink)

            async def body() -> None:
                await probe(lambda: pub.publish(events_for(9), ts=9.0), lambda: bool(sink.batches))
                await wait_until(lambda: len(sink.batches) >= 6, "catch-up")

            await with_sub(sub, body)
        assert sink.seqs == list(range(len(sink.seqs)))
        assert sink.batches[0] == EventBatch(0, 0.0, events_for(0), 0)
        assert sink.resets == []
        assert sub.stats.replays == 1
        assert sub.stats.replayed_batches >= 5

    run(test)


def test_a_long_catch_up_shares_the_loop_and_says_it_is_replaying() -> None:
    """A late joiner beside an engine with a full buffer: every buffered batch arrives in
    order, and other tasks run while the replay is received and while it is delivered (it
    yields every few batches instead of holding the loop for the whole buffer)."""
    buffered = 40 * _REPLAY_PER_TURN

    async def test(ctx: zmq.asyncio.Context) -> None:
        sink = Sink()
        with KVEventPublisher(buffer_steps=buffered + 500) as pub:
            for i in range(buffered):  # nobody is listening yet
                pub.publish(events_for(i), ts=float(i))
            pub.wait_sent()
            sub = make_sub(ctx, pub, sink, token_ids=False)
            seen: list[tuple[bool, int]] = []  # (replaying, batches delivered) per turn

            async def watch() -> None:
                while True:
                    seen.append((sub.stats.replaying, len(sink.batches)))
                    await asyncio.sleep(0)

            async def body() -> None:
                watcher = asyncio.create_task(watch())
                try:
                    last = await probe(lambda: pub.publish(events_for(9), ts=9.0),
                                       lambda: bool(sink.batches))
                    await wait_until(lambda: sub.stats.last_seq == last, "the catch-up")
                finally:
                    watcher.cancel()

            await with_sub(sub, body)
        assert sink.seqs == list(range(len(sink.seqs)))
        assert len(sink.seqs) > buffered and sink.resets == []
        # Replayed batches decode without token ids, as the live ones do.
        assert sink.batches[0] == EventBatch(0, 0.0, tuple(
            BlockStored(e.block_hashes, e.parent_block_hash, (), e.block_size, group_idx=0)
            if isinstance(e, BlockStored) else e for e in events_for(0)), 0)
        receiving = [n for replaying, n in seen if replaying and n == 0]
        delivering = [n for replaying, n in seen if replaying and 0 < n < buffered]
        assert len(receiving) >= 10, "nothing else ran while the replay was received"
        assert len(set(delivering)) >= 10, "nothing else ran while the replay was delivered"
        assert not sub.stats.replaying and seen[-1][0] is False

    run(test)


class GatedEngine:
    """An engine whose catch-up answers the test releases: a bare PUB whose live stream
    starts at ``buffered`` (everything before was published before anyone listened) and a
    replay ROUTER, served on the test's loop, that holds every answer until ``answer`` is
    set and then replays everything from the requested start.

    Why not ``KVEventPublisher``: a catch-up that ends when the engine is done makes "were
    both replaying at once" a matter of how fast each side runs, and its thread competes
    with the test's loop for the GIL. Holding the answers makes the overlap (or its absence)
    a consequence of the subscriber's logic alone.
    """

    def __init__(self, ctx: zmq.asyncio.Context, buffered: int,
                 on_request: Callable[[], None]) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.SNDHWM, 0)  # an answer held back is sent whole, not dropped
        for sock in (self.pub, self.router):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.answer = asyncio.Event()
        self.last = buffered - 1
        """Sequence number of the last batch published (sent live or not)."""
        self._on_request = on_request
        self._server = asyncio.get_running_loop().create_task(self._serve())

    @staticmethod
    def payload(seq: int) -> bytes:
        return encode_payload(EventBatch(seq, float(seq), events_for(seq), 0))

    def send_next(self) -> int:
        """Send the next batch live; returns its number."""
        self.last += 1
        self.pub.send_multipart([b"kv", encode_seq(self.last), self.payload(self.last)])
        return self.last

    async def _serve(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            start = decode_replay_request(frames)
            self._on_request()
            await self.answer.wait()
            for seq in range(start, self.last + 1):
                await self.router.send_multipart(
                    [frames[0], *encode_replay_reply("kv", seq, self.payload(seq))])
            await self.router.send_multipart([frames[0], *encode_replay_end()])

    async def close(self) -> None:
        self._server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._server
        self.pub.close(linger=0)
        self.router.close(linger=0)


class TurnsLock(asyncio.Lock):
    """A ``catch_up_turns`` lock that counts the subscribers that asked for a turn."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    async def acquire(self) -> Literal[True]:
        self.asked += 1
        return await super().acquire()


@pytest.mark.parametrize("shared", [True, False])
def test_subscribers_sharing_turns_catch_up_one_at_a_time(shared: bool) -> None:
    """Two late joiners beside full buffers: with one ``catch_up_turns`` lock their catch-ups
    never run at the same time, and each delivers its whole catch-up before the other
    starts; without it (the control) they do run at once.

    The engines hold their answers until both subscribers want to catch up (each has sent its
    replay request or asked for its turn), so without turns both catch-ups are under way at
    that moment whatever the machine's speed. Whether both are catching up is sampled at
    every delivery and every replay request, never by spinning the loop.
    """
    buffered = 40 * _REPLAY_PER_TURN

    async def test(ctx: zmq.asyncio.Context) -> None:
        turns = TurnsLock() if shared else None
        both: list[bool] = []  # per delivery and per replay request: both catching up?
        subs: list[EventSubscriber] = []
        sinks = [Sink(), Sink()]

        def catching_up(sub: EventSubscriber) -> bool:
            """Says it is replaying, or has asked for its replay and not yet delivered the
            first live batch after it (the engines answer from 0, so until then the last
            delivered seq is below the count of replayed batches)."""
            stats = sub.stats
            done = stats.last_seq is not None and stats.last_seq >= stats.replayed_batches
            return stats.replaying or (stats.replays > 0 and not done)

        def sample() -> None:
            both.append(all(catching_up(s) for s in subs))

        def on_batch(i: int) -> OnBatch:
            def deliver(replica: ReplicaId, batch: EventBatch) -> None:
                sinks[i].on_batch(replica, batch)
                sample()
            return deliver

        engines = [GatedEngine(ctx, buffered, sample) for _ in range(2)]
        try:
            subs.extend(
                EventSubscriber(R, e.endpoint, on_batch=on_batch(i), on_reset=sinks[i].on_reset,
                                replay_endpoint=e.replay_endpoint, context=ctx, topic="kv",
                                catch_up_turns=turns, replay_timeout=TEST_SECONDS_SLOW)
                for i, e in enumerate(engines))
            for sub in subs:
                sub.start()
            try:
                for sub in subs:
                    await sub.wait_connected()

                def both_want_to_catch_up() -> bool:
                    asked = turns is not None and turns.asked == 2
                    return asked or all(s.stats.replays for s in subs)

                # Live messages until each subscriber has its first one (PUB drops until SUB
                # has subscribed); each then catches up or waits for its turn.
                await probe(lambda: [e.send_next() for e in engines], both_want_to_catch_up)
                sample()
                for e in engines:
                    e.answer.set()
                await wait_until(lambda: all(s.stats.last_seq == e.last
                                             for s, e in zip(subs, engines, strict=True)),
                                 "both catch-ups", timeout=TEST_SECONDS_SLOW)
            finally:
                for sub in subs:
                    await sub.stop()
        finally:
            for e in engines:
                await e.close()
        for sub, sink, e in zip(subs, sinks, engines, strict=True):
            assert sink.seqs == list(range(e.last + 1)) and sink.resets == []
            assert sub.stats.replays == 1 and sub.stats.replayed_batches >= buffered
        if shared:
            assert not any(both), "the catch-ups overlapped"
        else:
            assert any(both), "the control did not overlap: the test shows nothing"

    run(test, TEST_SECONDS_SLOW)


def test_dropped_messages_recovered_through_replay() -> None:
    async def test(ctx: zmq.asyncio.Context) -> None:
        sink = Sink()
        with KVEventPublisher() as pub:
            sub = make_sub(ctx, pub, sink, catch_up=False)

            async def body() -> None:
                first = await past_probes(pub, sub, sink)
                before = sub.stats
                for i in range(5):
                    pub.publish(events_for(i), ts=1.0, skip_send=True)
                last = pub.publish(events_for(99), ts=2.0)
                await wait_until(lambda: sub.stats.last_seq == last, "the batch after the gap")
                after = sub.stats
                assert after.gaps - before.gaps == 1
                assert after.replays - before.replays == 1
                assert after.replayed_batches - before.replayed_batches == 5
                assert sink.seqs[sink.seqs.index(first) :] == list(range(first, last + 1))

            await with_sub(sub, body)
        assert sink.resets == []
        assert sink.seqs == sorted(set(sink.seqs))

    run(test)


def test_gap_beyond_replay_buffer_resets_then_applies_the_tail() -> None:
    async def test(ctx: zmq.asyncio.Context) -> None:
        sink = Sink()
        with KVEventPublisher(buffer_steps=3) as pub:
            sub = make_sub(ctx, pub, sink, catch_up=False)

            async def body() -> None:
                k = await probe(lambda: pub.publish(events_for(0)), lambda: bool(sink.batches))
                await wait_until(lambda: sub.stats.last_seq == k, "the probes")
                for i in range(6):
                    pub.publish(events_for(i), skip_send=True)
                last = pub.publish(events_for(7))
                assert last == k + 7
                await wait_until(lambda: sub.stats.last_seq == last, "the batch after the gap")

            await with_sub(sub, body)
        assert len(sink.resets) == 1
        assert "no longer holds batch" in sink.resets[0]
        reset_at = sink.log.index(("reset", sink.resets[0]))
        # Buffer of 3 held k+5, k+6 (and k+7, sent live): the tail is applied after the reset.
        after = [entry[1] for entry in sink.log[reset_at + 1 :]]
        k = sink.seqs[-1] - 7
        assert after == [k + 5, k + 6, k + 7]
        assert sink.seqs == sorted(set(sink.seqs))
        assert sub.stats.resets == 1

    run(test)


def test_gap_without_replay_endpoint_resets() -> None:
    async def test(ctx: zmq.asyncio.Context) -> None:
        sink = Sink()
        with KVEventPublisher(replay_endpoint=None) as pub:
            assert pub.replay_endpoint is None
            sub = make_sub(ctx, pub, sink)

            async def body() -> None:
                await probe(lambda: pub.publish(events_for(0)), lambda: bool(sink.batches))
                pub.publish(events_for(1), skip_send=True)
                last = pub.publish(events_for(2))
                await wait_until(lambda: sub.stats.last_seq == last, "the batch after the gap")

            await with_sub(sub, body)
        assert len(sink.resets) == 1 and "no replay endpoint" in sink.resets[0]
        assert sub.stats.gaps == 1 and sub.stats.replays == 0

    run(test)


def test_publisher_restart_resets() -> None:
    async def test(ctx: zmq.asyncio.Context) -> None:
        sink = Sink()
        first = KVEventPublisher()
        first.start()
        endpoint, replay = first.endpoint, first.replay_endpoint
        sub = make_sub(ctx, first, sink)

        async def body() -> None:
            await probe(lambda: first.publish(events_for(0)), lambda: bool(sink.batches))
            for i in range(300):
                last = first.publish(events_for(i))
            await wait_until(lambda: sub.stats.last_seq == last, "first publisher")
            first.close()
            second = KVEventPublisher(endpoint, replay_endpoint=replay)
            second.start()
            try:
                await probe(lambda: second.publish(events_for(1)), lambda: bool(sink.resets))
            finally:
                second.close()

        await with_sub(sub, body)
        assert len(sink.resets) == 1
        assert "restarted" in sink.resets[0]
        reset_at = sink.log.index(("reset", sink.resets[0]))
        restarted_seq = sink.log[reset_at + 1][1]
        assert isinstance(restarted_seq, int) and restarted_seq < 300

    run(test)


def test_malformed_frames_are_counted_and_skipped() -> None:
    async def test(ctx: zmq.asyncio.Context) -> None:
        sink = Sink()
        raw, endpoint = raw_pub(ctx)
        sub = make_sub(ctx, endpoint, sink)

        def good(seq: int) -> list[bytes]:
            return [
                b"kv",
                encode_seq(seq),
                encode_payload(EventBatch(seq, 1.0, events_for(seq), 0)),
            ]

        async def body() -> None:
            await probe(
                lambda: raw.send_multipart([b"kv", b"short", b""]), lambda: sub.stats.malformed > 0
            )
            await raw.send_multipart(good(0))
            await wait_until(lambda: sub.stats.last_seq == 0, "the first good batch")
            m0 = sub.stats.malformed
            await raw.send_multipart(good(1))
            await raw.send_multipart([b"kv", encode_seq(2)])  # two frames
            await raw.send_multipart([b"kv", encode_seq(2), b"\xc1"])  # bad msgpack
            await raw.send_multipart(
                [b"kv", encode_seq(2), b"\x92\xcb" + b"\x00" * 8 + b"\x91\x05"]
            )
            await raw.send_multipart([b"kv", encode_seq(2), good(2)[2], b"extra"])
            await raw.send_multipart(good(2))
            await wait_until(lambda: sub.stats.last_seq == 2, "the good batch after the bad ones")
            assert sub.stats.malformed - m0 == 4

        try:
            await with_sub(sub, body)
        finally:
            raw.close(linger=0)
        assert sink.seqs == [0, 1, 2]
        assert sink.batches[2] == EventBatch(2, 1.0, events_for(2), 0)
        assert sink.resets == []

    run(test)


class SilentReplay:
    """A bare PUB sending empty batches in sequence, and a replay ROUTER that accepts
    requests and never answers (a replay then waits out its timeout)."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.raw = ctx.socket(zmq.PUB)
        self.silent = ctx.socket(zmq.ROUTER)
        for sock in (self.raw, self.silent):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.raw.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay = self.silent.getsockopt_string(zmq.LAST_ENDPOINT)
        self._last = -1

    @staticmethod
    def good(seq: int) -> list[bytes]:
        return [b"kv", encode_seq(seq), encode_payload(EventBatch(seq, 1.0, (), 0))]

    def send_next(self) -> int:
        """Send the next batch in sequence; returns its number."""
        self._last += 1
        self.raw.send_multipart(self.good(self._last))
        return self._last

    def subscriber(self, ctx: zmq.asyncio.Context, sink: Sink, *,
                   replay_timeout: float) -> EventSubscriber:
        return make_sub(ctx, self.endpoint, sink, replay_endpoint=self.replay,
                        replay_timeout=replay_timeout)

    def close(self) -> None:
        self.raw.close(linger=0)
        self.silent.close(linger=0)


def test_replay_timeout_resets_and_stop_is_prompt() -> None:
    async def test(ctx: zmq.asyncio.Context) -> None:
        sink = Sink()
        pub = SilentReplay(ctx)
        raw, good, send_next = pub.raw, pub.good, pub.send_next
        try:
            sub = pub.subscriber(ctx, sink, replay_timeout=0.3)

            async def body() -> None:
                start = await probe(send_next, lambda: bool(sink.batches))
                await wait_until(lambda: sub.stats.last_seq == start, "the probes")
                await raw.send_multipart(good(start + 3))
                await wait_until(lambda: bool(sink.resets), "the reset after the timeout")
                assert "did not finish within 0.3s" in sink.resets[0]
                assert sink.seqs[-1] == start + 3

            await with_sub(sub, body)

            # A subscriber stuck in a long replay stops promptly.
            sink2 = Sink()
            stuck = pub.subscriber(ctx, sink2, replay_timeout=30)
            stuck.start()
            await stuck.wait_connected()
            # Its first message is not seq 0, so it starts a catch-up replay that cannot end.
            await probe(send_next, lambda: stuck.stats.replays == 1)
            loop = asyncio.get_running_loop()
            began = loop.time()
            await stuck.stop()
            assert loop.time() - began < 0.5
            await stuck.stop()  # idempotent
        finally:
            pub.close()

    run(test)


def test_messages_queued_during_a_replay_wait_without_spinning_then_follow_in_order() -> None:
    """While the task waits for a replay, the descriptor's callback stands down (reading
    ``ZMQ_EVENTS`` so the loop's poll stops reporting it); afterwards the task drains what
    queued, in order."""

    async def test(ctx: zmq.asyncio.Context) -> None:
        sink = Sink()
        pub = SilentReplay(ctx)
        raw, good, send_next = pub.raw, pub.good, pub.send_next
        try:
            sub = pub.subscriber(ctx, sink, replay_timeout=0.6)
            calls = [0]
            on_readable = sub._on_readable

            def counting() -> None:
                calls[0] += 1
                on_readable()

            sub._on_readable = counting  # type: ignore[method-assign]

            async def body() -> None:
                start = await probe(send_next, lambda: bool(sink.batches))
                await wait_until(lambda: sub.stats.last_seq == start, "the probes")
                gap = start + 3
                await raw.send_multipart(good(gap))  # a gap: the replay waits 0.6 s
                await wait_until(lambda: sub.stats.replays == 1, "the replay request")
                calls_before = calls[0]
                for seq in range(gap + 1, gap + 11):  # queue behind the replay
                    await raw.send_multipart(good(seq))
                await asyncio.sleep(0.3)
                assert sub.stats.last_seq == start  # nothing overtook the replay
                # One callback per message at most; a level-triggered spin would be thousands.
                assert calls[0] - calls_before <= 12
                await wait_until(lambda: sub.stats.last_seq == gap + 10, "the queued tail")
                assert sink.seqs[-11:] == list(range(gap, gap + 11))
                assert len(sink.resets) == 1 and "did not finish within 0.6s" in sink.resets[0]

            await with_sub(sub, body)
        finally:
            pub.close()

    run(test)


def test_callback_errors_propagate_out_of_the_subscriber() -> None:
    async def test(ctx: zmq.asyncio.Context) -> None:
        with KVEventPublisher() as pub:

            def explode(replica: ReplicaId, batch: EventBatch) -> None:
                raise ValueError("owner bug")

            sub = EventSubscriber(
                R, pub.endpoint, on_batch=explode, on_reset=Sink().on_reset, context=ctx
            )
            task = sub.start()
            await sub.wait_connected()
            await probe(lambda: pub.publish(events_for(0)), task.done)
            with pytest.raises(ValueError, match="owner bug"):
                await sub.stop()

    run(test)


def test_publisher_replay_socket_speaks_vllms_protocol() -> None:
    """Frames at a DEALER are exactly vLLM's; a malformed request gets no answer."""
    with KVEventPublisher(topic="kv@test", buffer_steps=4) as pub:
        batches = [
            EventBatch(i, float(i), events_for(i) + (AllBlocksCleared(),), 0) for i in range(6)
        ]
        for b in batches:
            assert pub.publish(b.events, ts=b.ts, skip_send=b.seq % 2 == 0) == b.seq
        pub.wait_sent()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVTIMEO, 2000)
            assert pub.replay_endpoint is not None
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", encode_seq(1), b"extra"])  # 4 frames at the ROUTER
            dealer.send_multipart(encode_replay_request(3))
            replies = [dealer.recv_multipart() for _ in range(4)]
            assert dealer.poll(100) == 0
        finally:
            dealer.close(linger=0)
            ctx.term()
        assert replies[:3] == [
            [b"", b"kv@test", encode_seq(i), encode_payload(batches[i])] for i in (3, 4, 5)
        ]
        assert replies[3] == encode_replay_end()
        replayed = decode_replay_reply(replies[0])
        assert isinstance(replayed, ReplayBatch) and replayed.batch == batches[3]
        assert pub.invalid_replay_requests == 1


def test_events_tail_cli_prints_json_lines() -> None:
    import json
    import threading

    from typer.testing import CliRunner

    from kvroute.commands.events import events_app

    with KVEventPublisher(topic="kv") as pub:
        stop = threading.Event()

        def publish_until_stopped() -> None:
            for i in range(250):  # bounded: 250 batches, 20 ms apart
                if stop.wait(0.02):
                    return
                pub.publish(events_for(i) + (AllBlocksCleared(),), ts=float(i))

        feeder = threading.Thread(target=publish_until_stopped, daemon=True)
        feeder.start()
        try:
            result = CliRunner().invoke(
                events_app,
                ["tail", pub.endpoint, "--topic", "kv", "--count", "4", "--timeout", "4"],
            )
        finally:
            stop.set()
            feeder.join(2)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 4
    first = lines[0]
    i = first["seq"]
    assert first == {
        "seq": i,
        "ts": float(i),
        "type": "BlockStored",
        "block_hashes": [i * 2 + 1, i * 2 + 2],
        "parent_block_hash": None,
        "block_size": 16,
        "medium": "GPU",
        "group_idx": 0,
        "num_tokens": 32,
        "data_parallel_rank": 0,
    }
    assert lines[1] == {
        "seq": i,
        "ts": float(i),
        "type": "BlockRemoved",
        "block_hashes": [i * 2 + 1],
        "medium": "GPU",
        "group_idx": 0,
        "data_parallel_rank": 0,
    }
    assert lines[2] == {
        "seq": i,
        "ts": float(i),
        "type": "AllBlocksCleared",
        "data_parallel_rank": 0,
    }
    assert lines[3]["seq"] == i + 1 and lines[3]["type"] == "BlockStored"


def test_events_tail_cli_times_out_and_rejects_bad_endpoints() -> None:
    from typer.testing import CliRunner

    from kvroute.commands.events import events_app

    with KVEventPublisher() as pub:
        result = CliRunner().invoke(
            events_app, ["tail", pub.endpoint, "--count", "1", "--timeout", "0.2"]
        )
    assert result.exit_code == 0
    assert result.stdout == ""
    assert "timed out after 0.2s with 0 of 1 events" in result.stderr
    bad = CliRunner().invoke(events_app, ["tail", "nonsense", "--timeout", "0.1"])
    assert bad.exit_code == 2
    assert "cannot connect to 'nonsense'" in bad.output


def test_subscriber_binds_for_an_engine_that_connects() -> None:
    """vLLM given ``tcp://127.0.0.1:PORT`` connects its PUB socket: the router binds."""
    asyncio.run(asyncio.wait_for(_bind_mode(), 10.0))


async def _bind_mode() -> None:
    import socket as _socket

    from kvroute.sim.kv_publisher import KVEventPublisher, vllm_pub_binds

    assert vllm_pub_binds("tcp://*:5557") and vllm_pub_binds("ipc:///tmp/x")
    assert not vllm_pub_binds("tcp://127.0.0.1:5601")
    with _socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    got: list[int] = []
    sub = EventSubscriber(ReplicaId("r"), endpoint, on_batch=lambda r, b: got.append(b.seq),
                          on_reset=lambda r, why: None, topic="kv", bind=True)
    sub.start()
    await sub.wait_connected()
    with KVEventPublisher(endpoint, replay_endpoint=None, socket_mode="vllm") as pub:
        deadline = asyncio.get_running_loop().time() + 5.0
        while not got and asyncio.get_running_loop().time() < deadline:
            pub.publish([AllBlocksCleared()])
            await asyncio.sleep(0.05)
    await sub.stop()
    # The first sends may precede the subscription (ZMQ's slow joiner); what arrives is in order.
    assert got and got == sorted(got)


def test_a_binding_subscriber_waits_for_its_address_to_be_released() -> None:
    """A socket of this process still holds the endpoint when the subscriber starts (libzmq
    releases a closed listener later): the subscriber binds once it is free, within its
    bound, and still fails loudly if it never is."""

    async def test(ctx: zmq.asyncio.Context) -> None:
        holder = ctx.socket(zmq.PUB)
        holder.setsockopt(zmq.LINGER, 0)
        holder.bind("tcp://127.0.0.1:0")
        endpoint = holder.getsockopt_string(zmq.LAST_ENDPOINT)
        sub = EventSubscriber(R, endpoint, on_batch=Sink().on_batch, on_reset=Sink().on_reset,
                              context=ctx, topic="kv", bind=True)
        task = sub.start()
        await asyncio.sleep(0.2)
        assert not task.done()  # still waiting for the address, not failed
        holder.close(linger=0)
        await asyncio.wait_for(sub.wait_connected(), 3.0)
        await sub.stop()

        still = ctx.socket(zmq.PUB)
        still.setsockopt(zmq.LINGER, 0)
        still.bind("tcp://127.0.0.1:0")
        try:
            stuck = EventSubscriber(R, still.getsockopt_string(zmq.LAST_ENDPOINT),
                                    on_batch=Sink().on_batch, on_reset=Sink().on_reset,
                                    context=ctx, topic="kv", bind=True)
            with pytest.raises(zmq.ZMQError) as failed:
                await asyncio.wait_for(stuck.run(), 4.0)
            assert failed.value.errno == zmq.EADDRINUSE
        finally:
            still.close(linger=0)

    run(test)


# ---------------------------------------------------------------- draining queued bursts


def count_sub_recvs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count awaited ``recv_multipart`` calls on SUB sockets (one future each)."""
    calls = [0]
    original = zmq.asyncio.Socket.recv_multipart

    def counting(self: zmq.asyncio.Socket, *args: Any, **kwargs: Any) -> Any:
        if self.get(zmq.TYPE) == zmq.SUB:
            calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(zmq.asyncio.Socket, "recv_multipart", counting)
    return calls


def block_loop(seconds: float = 0.3) -> None:
    """Called from a coroutine: keeps the event loop busy, so what is sent queues at the SUB."""
    time.sleep(seconds)


class Turns:
    """Samples ``len(sink.batches)`` once per event-loop iteration, from its own task."""

    def __init__(self, sink: Sink) -> None:
        self.marks: list[int] = []
        self._sink = sink
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.marks.append(len(self._sink.batches))
            await asyncio.sleep(0)

    async def stop(self) -> int:
        """Stop sampling; the most batches delivered between two samples."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        return max(b - a for a, b in zip(self.marks, self.marks[1:], strict=False))


def test_queued_burst_is_drained_in_order_and_yields_every_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recvs = count_sub_recvs(monkeypatch)
    n = 10 * _TAKE_PER_TURN + 7

    async def test(ctx: zmq.asyncio.Context) -> None:
        sink = Sink()
        with KVEventPublisher() as pub:
            sub = make_sub(ctx, pub, sink, catch_up=False)

            async def body() -> None:
                first = await past_probes(pub, sub, sink)
                before, recvs_before = sub.stats, recvs[0]
                turns = Turns(sink)
                for i in range(n):
                    last = pub.publish(events_for(i), ts=float(i))
                pub.wait_sent()
                block_loop()
                await wait_until(lambda: sub.stats.last_seq == last, "the end of the burst")
                most_per_turn = await turns.stop()
                after = sub.stats
                assert after.batches - before.batches == n
                assert after.events - before.events == 2 * n
                assert (after.gaps, after.replays, after.resets, after.malformed) == (0, 0, 0, 0)
                burst = sink.batches[sink.seqs.index(first) + 1 :]
                assert burst == [
                    EventBatch(first + 1 + i, float(i), events_for(i), 0) for i in range(n)
                ]
                # Queued messages were taken without a future each (the loop watches the
                # socket's descriptor), in turns of at most _TAKE_PER_TURN.
                assert recvs[0] - recvs_before == 0
                assert 1 < most_per_turn <= _TAKE_PER_TURN

            await with_sub(sub, body)
        assert sink.seqs == list(range(sink.seqs[0], sink.seqs[-1] + 1))
        assert sink.resets == []

    run(test)


def test_gaps_inside_a_drained_burst_are_replayed_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each replay finishes before the next queued message is taken; nothing is reordered."""
    recvs = count_sub_recvs(monkeypatch)
    n = 3 * _TAKE_PER_TURN + 5
    skipped = set(range(100, 105)) | {150, 151}

    async def test(ctx: zmq.asyncio.Context) -> None:
        sink = Sink()
        with KVEventPublisher() as pub:
            sub = make_sub(ctx, pub, sink, catch_up=False)

            async def body() -> None:
                first = await past_probes(pub, sub, sink)
                before, recvs_before = sub.stats, recvs[0]
                for i in range(n):
                    last = pub.publish(events_for(i), ts=float(i), skip_send=i in skipped)
                pub.wait_sent()
                block_loop()
                await wait_until(lambda: sub.stats.last_seq == last, "the end of the burst")
                after = sub.stats
                assert after.batches - before.batches == n
                assert (after.gaps - before.gaps, after.replays - before.replays) == (2, 2)
                assert after.replayed_batches - before.replayed_batches == len(skipped)
                assert recvs[0] - recvs_before == 0  # the replays were mid-drain
                burst = sink.batches[sink.seqs.index(first) + 1 :]
                assert burst == [
                    EventBatch(first + 1 + i, float(i), events_for(i), 0) for i in range(n)
                ]

            await with_sub(sub, body)
        assert sink.resets == []
        assert sink.seqs == list(range(sink.seqs[0], sink.seqs[-1] + 1))

    run(test)


def test_malformed_messages_inside_a_drained_burst_are_counted_and_skipped() -> None:
    n = 2 * _TAKE_PER_TURN + 3

    async def test(ctx: zmq.asyncio.Context) -> None:
        sink = Sink()
        raw, endpoint = raw_pub(ctx)
        sub = make_sub(ctx, endpoint, sink)

        def good(seq: int) -> list[bytes]:
            return [b"kv", encode_seq(seq), encode_payload(EventBatch(seq, 1.0, (), 0))]

        async def body() -> None:
            await probe(
                lambda: raw.send_multipart([b"kv", b"short", b""]), lambda: sub.stats.malformed > 0
            )
            m0 = sub.stats.malformed
            for seq in range(n):
                await raw.send_multipart(good(seq))  # completes at once: no HWM reached
                if seq % 50 == 25:
                    await raw.send_multipart([b"kv", encode_seq(seq + 1), b"\xc1"])
            block_loop()
            await wait_until(lambda: sub.stats.last_seq == n - 1, "the end of the burst")
            assert sub.stats.malformed - m0 == len(range(25, n, 50))

        try:
            await with_sub(sub, body)
        finally:
            raw.close(linger=0)
        assert sink.seqs == list(range(n))
        assert sink.resets == [] and sub.stats.gaps == 0

    run(test)
