"""A relay process: the engines' KV events into the durable stream, without routing.

Owns one ``EventSubscriber`` per configured replica with ``kv_events`` and the
``KvStreamRelay`` they feed (``shell/kv_stream_relay.py``), nothing else: no index, no HTTP.
``kvroute events relay -c kvroute.yaml`` runs it beside the routers, so that the stream keeps
growing while every router is down: a router restarted after an engine published more than
its replay buffer then finds the whole history in the stream (docs/architecture.md, "The
durable KV-event stream"). A router with ``kv_stream.relay: true`` does the same job from
inside ``kvroute serve``; run one relay per fleet.

Per replica, the relay first reads the replica's history back (``kv_stream_reader.rebuild``, census
only) to continue its epoch and census, then subscribes resuming after its last batch, so a
relay restarted within the engine's replay buffer leaves no hole, and one restarted later
writes a reset (the engine can no longer say what happened meanwhile).

Replicas found through Kubernetes (``pools.*.kubernetes``) are not followed here: their
membership lives in the routers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvroute.config import ReplicaConfig, RouterConfig
from kvroute.core.errors import ConfigError
from kvroute.shell.kv_stream import KvStream
from kvroute.shell.kv_stream_reader import rebuild
from kvroute.shell.kv_stream_relay import KvStreamRelay
from kvroute.shell.lifecycle import Service
from kvroute.shell.zmq_events import EventSubscriber

__all__ = ["StandaloneRelay"]

log = logging.getLogger(__name__)


class StandaloneRelay(Service):
    """``async with StandaloneRelay(config) as relay:`` mirrors the engines until exit.

    Raises (from ``__aenter__``):
        ConfigError: no ``kv_stream`` section, no replica with ``kv_events``, a replica the
            router must bind for (``kv_events_bind``), or NATS unreachable (a relay without
            its stream has nothing to do, so it does not start).
    """

    def __init__(self, config: RouterConfig) -> None:
        if config.kv_stream is None:
            raise ConfigError("kv_stream: missing. The relay writes into the stream this "
                              'section names; add e.g. kv_stream: {url: "nats://127.0.0.1:4222"}.')
        self.config = config
        self.replicas: list[ReplicaConfig] = [rep for _, rep in config.replicas()
                                              if rep.kv_events is not None]
        if not self.replicas:
            raise ConfigError("pools: no replica has kv_events, so there is nothing to relay. "
                              "Set kv_events (and kv_replay) on the replicas.")
        for rep in self.replicas:
            if rep.kv_events_bind:
                raise ConfigError(
                    f"replica {rep.name}: kv_events_bind is set, so the engine connects to one "
                    "subscriber (the router) and a relay process cannot also receive its "
                    "events. Relay from that router instead: kv_stream: {relay: true}.")
        self.stream: KvStream | None = None
        self.relay: KvStreamRelay | None = None
        self.subscribers: dict[str, EventSubscriber] = {}
        self._turns = asyncio.Lock()

    async def start(self) -> None:
        """Connect, read each replica's history back, subscribe. Returns once all follow."""
        assert self.config.kv_stream is not None
        stream = await KvStream.open(self.config.kv_stream)
        if stream is None:
            raise ConfigError(f"kv_stream.url: NATS at {self.config.kv_stream.url} cannot be "
                              "reached (the log says why). Start NATS with JetStream (-js) "
                              "or fix the URL.")
        self.stream = stream
        self.relay = relay = KvStreamRelay(stream)
        relay.start()
        for rep in self.replicas:
            position = await rebuild(stream, rep.name, None, None, census=True)
            relay.adopt(rep.name, position)
            assert rep.kv_events is not None
            sub = EventSubscriber(
                rep.name, rep.kv_events, on_batch=relay.on_batch, on_reset=relay.on_reset,
                replay_endpoint=rep.kv_replay, topic=rep.kv_topic, token_ids=False,
                catch_up_turns=self._turns, resume_after=position.last_seq)
            self.subscribers[rep.name] = sub
            sub.start().add_done_callback(_subscriber_ended)
            log.info("relaying replica %s from %s (stream history up to batch %s)", rep.name,
                     rep.kv_events, position.last_seq)

    async def stop(self) -> None:
        """Stop the subscribers, publish what is queued, close. Idempotent."""
        for sub in self.subscribers.values():
            with contextlib.suppress(Exception):  # its error was logged when it ended
                await sub.stop()
        self.subscribers.clear()
        if self.relay is not None:
            await self.relay.stop()
            self.relay = None
        if self.stream is not None:
            await self.stream.close()
            self.stream = None


def _subscriber_ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("KV-event subscriber %s ended with an error; that replica is no longer "
                  "relayed", task.get_name(), exc_info=task.exception())
