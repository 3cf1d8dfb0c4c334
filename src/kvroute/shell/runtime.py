"""Start and stop a whole router: core, client pool, discovery, event subscribers, HTTP server.

Owns the order in which the pieces come up and go down, and nothing else. ``kvroute serve``
and the integration tests use it; ``shell/app.py``'s ``build_app`` stays the composition root
of the HTTP layer and is handed everything built here.

Start-up order (each step needs the previous one):

1. ``RouterCore`` from the config (pools start in approximate mode until discovery has read
   block size and hash algorithm from the engines, unless the config fixes both);
2. one ``aiohttp.ClientSession`` (keep-alive pool, TCP_NODELAY) for discovery, and one
   ``EngineClient`` (``http/client.py``) for what every request sends: forwarded
   requests, warm-ups and engine ``/tokenize`` calls;
3. ``Discovery.refresh_now()`` — health, windows, hashing — before the first request;
4. one ``EventSubscriber`` per replica with ``kv_events`` (discovery's members: a DP engine
   whose ranks it found is followed per rank, ``shell/dp_discovery.py``); their callbacks call
   ``core.apply_events`` / ``core.reset_replica_index`` synchronously on this event loop, so
   every ``RouterCore`` call (requests, events, discovery) is serialised by the loop and the
   core needs no locks. With a ``kv_stream`` section, a background task first connects to
   NATS (``shell/kv_stream.py``) and, one replica at a time (the catch-up turns), rebuilds
   the replica's index from the durable stream, then starts its subscriber resuming after
   the last batch read; with ``kv_stream.relay`` every batch the subscribers deliver is also
   mirrored into the stream. NATS unreachable: logged once, the subscribers start as without
   the section, and a background task tries NATS again (``STREAM_RETRY_S`` doubling to
   ``STREAM_RETRY_MAX_S``, cancelled at shutdown). Once it answers the stream is used (the
   next restart rebuilds from it; ``kvroute_kv_stream_up`` goes to 1); a relaying router
   counts each replica's blocks meanwhile and hands that census to the relay
   (``KvStreamRelay.resume``), so the stream continues from a reset plus a snapshot of it;
5. session state, tokenizers (with the background checks of ``local`` and ``auto`` ones,
   ``tokenize/check.py``), then the HTTP server (``http/server.py``; a client that
   disconnects cancels its handler and so its upstream request). A refused connection seen
   by the proxy or a warm-up goes to ``Discovery.report_failure``, which takes that replica out of routing at
   once; the tier logic (``shell/tiering.py``) reads windows and served models from the same
   ``Discovery`` and tells it to re-read a window an engine contradicted.

Shutdown runs the same list backwards; every step runs even if an earlier one failed, and the
first error is raised at the end.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import aiohttp

from kvroute.config import DEFAULT_TENANT, ReplicaConfig, RouterConfig, resolve_secrets
from kvroute.core.block_census import BlockCensus
from kvroute.core.clock import Clock
from kvroute.core.errors import ConfigError
from kvroute.core.events import EventBatch
from kvroute.core.peer_policies import make_policy
from kvroute.core.policy import Policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore
from kvroute.core.types import PoolName, ReplicaId
from kvroute.http.client import EngineClient
from kvroute.shell.app import RouterApp, build_app
from kvroute.shell.cache_feedback import CacheFeedback
from kvroute.shell.cluster import ClusterSharing
from kvroute.shell.discovery import Discovery
from kvroute.shell.gate_store import GateStoreError
from kvroute.shell.heap import watch_gc_pauses, watch_loop_lag
from kvroute.shell.k8s_members import KubernetesMembers, kubernetes_pools
from kvroute.shell.kv_stream import KvStream
from kvroute.shell.kv_stream_reader import StreamPosition, rebuild
from kvroute.shell.kv_stream_relay import KvStreamRelay
from kvroute.shell.lifecycle import Service
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.proxy import Upstream, make_client_session, make_engine_client
from kvroute.shell.state import MonotonicClock, SessionState, build_state
from kvroute.shell.verdict_file import VerdictFile
from kvroute.shell.zmq_events import EventSubscriber, SubscriberStats
from kvroute.tokenize.check import TokenizerCheck
from kvroute.tokenize.prompt import (
    LocalTokenizer,
    PromptTokenizer,
    SwitchingTokenizer,
    build_tokenizers,
)

__all__ = ["RouterRuntime", "build_core"]

log = logging.getLogger(__name__)

STREAM_RETRY_S: Final = 1.0
"""First pause before trying an unreachable KV-event stream's NATS again (then doubled)."""
STREAM_RETRY_MAX_S: Final = 30.0
"""Longest pause between two tries: a NATS back after an outage is used within it."""


def build_core(config: RouterConfig, *, clock: Clock) -> RouterCore:
    """The ``RouterCore`` for ``config``: one ``PoolSpec`` per pool, the configured policy.

    Pools whose config does not fix both ``block_size`` and ``hash_algo`` start approximate;
    discovery switches them to exact hashing once the engines report theirs.
    """
    rng = random.Random(config.policy.seed)
    params = dict(config.policy.params)

    def policy_factory() -> Policy:
        return make_policy(config.policy.name, random.Random(rng.getrandbits(64)), **params)

    def pool_policy_factory(pool: PoolName) -> Policy:
        # A pool's own policy_params over the global ones (config.PoolConfig).
        own = config.pools[pool].policy_params if pool in config.pools else {}
        return make_policy(config.policy.name, random.Random(rng.getrandbits(64)),
                           **{**params, **own})

    pools = []
    for pool in config.pools.values():
        fixed = pool.block_size is not None and pool.hash_algo is not None
        pools.append(PoolSpec(
            name=pool.name,
            replicas=tuple(ReplicaSpec(rep.name, rep.prefill_rate_tps, role=rep.role)
                           for rep in pool.replicas),
            block_size=pool.block_size or 16,
            hash_algo=pool.hash_algo or "sha256",
            hash_seed=pool.hash_seed,
            approximate=pool.tokenizer.mode == "none" or not fixed,
            decode_timing=pool.decode_timing,
            disagg=pool.disaggregation,
        ))
    core = RouterCore(pools, policy_factory, clock=clock, pool_policy_factory=pool_policy_factory,
                      predicted_ttl_s=config.predicted_ttl_s,
                      approx_predicted_ttl_s=config.approx_predicted_ttl_s,
                      track_recency=any(pool.report_hits for pool in config.pools.values()),
                      session_chain_tokens=config.state.max_chain_tokens,
                      dynamic_pools=frozenset(kubernetes_pools(config)))
    for pool in config.pools.values():
        if pool.report_hits:
            for rep in pool.replicas:
                core.set_hit_reports(rep.name, True)
    return core


class RouterRuntime(Service):
    """A running router. ``async with RouterRuntime(config) as rt:`` serves on ``rt.url``.

    Args:
        config: the validated configuration (``listen.port: 0`` picks a free port).
        env: where secrets are read (``os.environ`` when None).
        clock: the core's clock (monotonic when None).
    """

    def __init__(self, config: RouterConfig, *, env: Mapping[str, str] | None = None,
                 clock: Clock | None = None) -> None:
        self.config = config
        self._env = os.environ if env is None else env
        self.clock: Clock = clock or MonotonicClock()
        self.core = build_core(config, clock=self.clock)
        self.metrics = RouterMetrics()
        self.feedback = CacheFeedback(self.core, config.cache_drift, self.metrics.registry)
        self.subscribers: dict[ReplicaId, EventSubscriber] = {}
        self._seen: dict[ReplicaId, SubscriberStats] = {}
        self._dp_rank: dict[ReplicaId, int] = {}
        """The rank each DP rank's subscription must carry (``data_parallel_rank``)."""
        self.wrong_rank_batches: dict[ReplicaId, int] = {}
        """Batches dropped because they named another rank than the subscription's."""
        self.session: aiohttp.ClientSession | None = None
        self.engine_client: EngineClient | None = None
        self.discovery: Discovery | None = None
        self.members: KubernetesMembers | None = None
        """The pools whose engines come from the Kubernetes API (None: there are none)."""
        self._catch_up_turns = asyncio.Lock()  # the subscribers catch up one at a time
        self._following_started = False
        """The configured replicas' events are followed (``joined`` before that: skipped,
        the start-up loop follows discovery's members)."""
        self.kv_stream: KvStream | None = None
        """The durable KV-event stream, once connected (None: not configured, or away)."""
        self.relay: KvStreamRelay | None = None
        """This router's relay into the stream (``kv_stream.relay``)."""
        self._stream_ready: asyncio.Task[KvStream | None] | None = None
        self._stream_retry: asyncio.Task[None] | None = None
        self._standby: dict[ReplicaId, tuple[BlockCensus, int | None]] | None = None
        """Per replica, its blocks and last batch counted while a configured relay waits for
        NATS (None: no relay waiting)."""
        self._following: dict[ReplicaId, asyncio.Task[None]] = {}
        self.stream_positions: dict[ReplicaId, StreamPosition] = {}
        """Where each replica's rebuild from the durable stream ended."""
        self._stopping: set[asyncio.Task[None]] = set()
        self.state: SessionState | None = None
        self.cluster: ClusterSharing | None = None
        """Fresh placements shared with the other routers (None: ``cluster.bus: none``)."""
        self._stop_gc_watch: Callable[[], None] | None = None
        self._loop_lag_task: asyncio.Task[None] | None = None
        self.tokenizers: dict[str, PromptTokenizer] = {}
        self.tokenizer_checks: dict[str, TokenizerCheck] = {}
        self._check_tasks: dict[str, asyncio.Task[None]] = {}
        self.app: RouterApp | None = None
        self.url = ""
        self.port = 0
        self.verdict_file: VerdictFile | None = None
        """The gate's verdict file (``gate.verdicts``), polled after each discovery round."""

    async def start(self) -> None:
        """Bring everything up in order (module docstring) and listen."""
        config = self.config
        secrets = resolve_secrets(config, self._env)
        if config.gate.verdicts is not None:
            self.verdict_file = VerdictFile(Path(config.gate.verdicts), self.core.verdicts,
                                            self.metrics.scenarios)
            try:
                self.verdict_file.load_now()
            except GateStoreError as exc:
                raise ConfigError(f"gate.verdicts: {exc}") from exc
        self.session = make_client_session(config.timeouts)
        self.engine_client = make_engine_client(config.timeouts)
        self.discovery = Discovery(config, self.core, self.session, self.metrics,
                                   provider_keys=secrets.provider_keys,
                                   on_engine_metrics=self.feedback.on_engine_metrics,
                                   on_replica_left=self.feedback.forget_replica,
                                   members_hook=self)
        if self.verdict_file is not None:
            self.discovery.round_observers.append(self.verdict_file.poll)
        await self.discovery.refresh_now()
        await self.discovery.start()
        if config.kv_stream is not None:
            self._stream_ready = asyncio.get_running_loop().create_task(
                self._open_stream(), name="kv-stream-open")
        # discovery's members, not the config's: a DP engine found with ranks is followed
        # per rank (shell/dp_discovery.py); later changes arrive through joined/left
        for _, rep in self.discovery.members():
            self._follow(rep)
        self._following_started = True
        if kubernetes_pools(config):
            self.members = KubernetesMembers(config, self.core, self.discovery, self.session,
                                             hook=self, env=self._env)
            await self.members.start()
        self.state = build_state(config, metrics=self.metrics, secret=secrets.cluster_secret)
        if config.cluster.bus == "nats":
            assert secrets.cluster_secret is not None, "resolve_secrets requires it with nats"
            self.cluster = ClusterSharing(
                config.cluster, self.core, clock=self.clock, secret=secrets.cluster_secret,
                tenants=[t.name for t in config.tenants] or [DEFAULT_TENANT])
            await self.cluster.start()
        self.tokenizers = build_tokenizers(config, self.discovery, self.engine_client, self.metrics)
        self._start_tokenizer_checks()
        self.app = build_app(
            config, core=self.core, upstream=Upstream(self.engine_client, config.timeouts),
            secrets=secrets, metrics=self.metrics, state=self.state, discovery=self.discovery,
            tokenizers=self.tokenizers, extra_state=self._extra_state,
            on_scrape=self.sync_metrics,
            on_replica_failure=self.discovery.report_failure, feedback=self.feedback,
        )
        self.discovery.round_observers.append(self.app.router.forwarder.observe_failovers)
        self._stop_gc_watch = watch_gc_pauses(self.metrics.gc_pause)
        self._loop_lag_task = asyncio.create_task(watch_loop_lag(self.metrics.loop_lag),
                                                  name="kvroute-loop-lag")
        self.port = await self.app.start(config.listen.host, config.listen.port)
        self.url = f"http://{config.listen.host}:{self.port}"
        log.info("kvroute listening on %s (policy %s, %d pools, %d replicas)", self.url,
                 config.policy.name, len(config.pools), len(config.replicas()))

    async def stop(self) -> None:
        """Tear down in reverse order; every step runs; the first error is raised."""
        errors: list[BaseException] = []

        async def step(coro: Any) -> None:
            try:
                await coro
            except Exception as exc:  # noqa: BLE001 - collected, the first is re-raised below
                errors.append(exc)

        if self._stop_gc_watch is not None:
            self._stop_gc_watch()
            self._stop_gc_watch = None
        if self._loop_lag_task is not None:
            self._loop_lag_task.cancel()
            await asyncio.gather(self._loop_lag_task, return_exceptions=True)
            self._loop_lag_task = None
        if self.app is not None:
            await step(self.app.close())
            self.app = None
        for task in self._check_tasks.values():
            task.cancel()
            await step(asyncio.gather(task, return_exceptions=True))
        self._check_tasks.clear()
        for _, local in self._local_tokenizers():
            local.close()
        if self.members is not None:
            await step(self.members.stop())
            self.members = None
        for task in self._following.values():
            task.cancel()
            await step(asyncio.gather(task, return_exceptions=True))
        self._following.clear()
        for sub in self.subscribers.values():
            await step(sub.stop())
        self.subscribers.clear()
        if self._stream_retry is not None:
            self._stream_retry.cancel()
            await step(asyncio.gather(self._stream_retry, return_exceptions=True))
            self._stream_retry = None
        if self._stream_ready is not None:
            self._stream_ready.cancel()
            await step(asyncio.gather(self._stream_ready, return_exceptions=True))
            self._stream_ready = None
        if self.relay is not None:
            await step(self.relay.stop())
            self.relay = None
        if self.kv_stream is not None:
            await step(self.kv_stream.close())
            self.kv_stream = None
        for task in list(self._stopping):
            await step(task)
        if self.cluster is not None:
            await step(self.cluster.stop())
            self.cluster = None
        if self.state is not None:
            await step(self.state.close())
            self.state = None
        if self.discovery is not None:
            await step(self.discovery.stop())
            self.discovery = None
        if self.engine_client is not None:
            await step(self.engine_client.close())
            self.engine_client = None
        if self.session is not None:
            await step(self.session.close())
            self.session = None
        if errors:
            raise errors[0]

    # -- KV-event subscribers, and replicas joining and leaving (shell/k8s_members.py) --------

    def _follow(self, rep: ReplicaConfig) -> None:
        """Start following ``rep``'s events: at once, or after rebuilding its index from the
        durable stream when one is configured (module doc, step 4)."""
        if rep.kv_events is None:
            return
        if self._stream_ready is None:
            self._subscribe(rep)
            return
        task = asyncio.get_running_loop().create_task(self._follow_from_stream(rep),
                                                      name=f"kv-stream-rebuild-{rep.name}")
        self._following[rep.name] = task
        task.add_done_callback(self._subscriber_ended)

    async def _open_stream(self) -> KvStream | None:
        config = self.config.kv_stream
        assert config is not None, "only started with a kv_stream section"
        stream = await KvStream.open(config)
        if stream is not None:
            self.kv_stream = stream
            if config.relay:
                self.relay = KvStreamRelay(stream)
                self.relay.start()
        else:
            if config.relay:
                self._standby = {}
            self._stream_retry = asyncio.get_running_loop().create_task(
                self._retry_stream(), name="kv-stream-retry")
        return stream

    async def _retry_stream(self) -> None:
        """Try NATS again until it answers (module doc, step 4); the outage was logged by
        the first attempt, the retries are quiet."""
        config = self.config.kv_stream
        assert config is not None, "only started with a kv_stream section"
        delay = STREAM_RETRY_S
        attempts = 0
        while True:
            await asyncio.sleep(delay)
            attempts += 1
            stream = await KvStream.open(config, quiet=True)
            if stream is not None:
                break
            delay = min(delay * 2, STREAM_RETRY_MAX_S)
        # No await from here on: no batch slips between the census and the relay.
        self.kv_stream = stream
        standby, self._standby = self._standby, None
        if config.relay:
            relay = self.relay = KvStreamRelay(stream)
            for replica, (census, last_seq) in (standby or {}).items():
                relay.resume(replica, census, last_seq,
                             "relaying resumed after NATS was away: the batches in between "
                             "were not relayed; the snapshot that follows holds the blocks")
            relay.start()
        log.warning("KV-event stream reachable at %s after %d retries: %s", config.url,
                    attempts, "relaying from now on" if config.relay
                    else "a restarted router will rebuild from it")
        self._stream_retry = None

    async def _follow_from_stream(self, rep: ReplicaConfig) -> None:
        assert self._stream_ready is not None
        # A replica that joins after a late connection (``_retry_stream``) uses the stream too.
        stream = await asyncio.shield(self._stream_ready) or self.kv_stream
        resume_after: int | None = None
        if stream is not None:
            try:
                async with self._catch_up_turns:
                    position = await rebuild(stream, rep.name, self._on_stream_batch,
                                                    self._on_stream_reset,
                                                    census=self.relay is not None)
            except Exception:
                log.exception("replica %s: rebuilding its index from the KV-event stream "
                              "failed; following the engine's ZMQ feed from scratch",
                              rep.name)
                self._on_stream_reset(rep.name, "the stream could not be read")
            else:
                self.stream_positions[rep.name] = position
                if self.relay is not None:
                    self.relay.adopt(rep.name, position)
                resume_after = position.last_seq
        self._following.pop(rep.name, None)
        self._subscribe(rep, resume_after=resume_after)

    def _subscribe(self, rep: ReplicaConfig, *, resume_after: int | None = None) -> None:
        if rep.kv_events is None:
            return
        sub = EventSubscriber(
            rep.name, rep.kv_events, on_batch=self._on_batch, on_reset=self._on_reset,
            replay_endpoint=rep.kv_replay, topic=rep.kv_topic, bind=rep.kv_events_bind,
            token_ids=False, catch_up_turns=self._catch_up_turns, resume_after=resume_after,
        )
        self.subscribers[rep.name] = sub
        self._seen[rep.name] = SubscriberStats()
        if rep.dp_rank is not None:
            self._dp_rank[rep.name] = rep.dp_rank
        sub.start().add_done_callback(self._subscriber_ended)

    def joined(self, pool: PoolName, replica: ReplicaConfig) -> None:
        if self._following_started:
            self._follow(replica)

    def left(self, replica: ReplicaId) -> None:
        following = self._following.pop(replica, None)
        if following is not None:
            following.cancel()
        sub = self.subscribers.pop(replica, None)
        self._seen.pop(replica, None)
        if self._standby is not None:
            self._standby.pop(replica, None)
        self._dp_rank.pop(replica, None)
        if sub is not None:
            task = asyncio.create_task(sub.stop(), name=f"kvroute-unsubscribe-{replica}")
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    # -- event callbacks (run on the subscribers' tasks, on this loop) ------------------------

    def _on_batch(self, replica: ReplicaId, batch: EventBatch) -> None:
        expected = self._dp_rank.get(replica)
        if (expected is not None and batch.data_parallel_rank is not None
                and batch.data_parallel_rank != expected):
            # another rank's stream on this rank's port: its blocks are not this rank's
            dropped = self.wrong_rank_batches.get(replica, 0) + 1
            self.wrong_rank_batches[replica] = dropped
            if dropped == 1:
                log.error("replica %s (data-parallel rank %d) receives batches of rank %d on "
                          "%s; they are dropped. Set kv_events to the engine's rank-0 "
                          "endpoint: rank r publishes on its port + r.", replica, expected,
                          batch.data_parallel_rank, self.subscribers[replica].endpoint)
            return
        if self.core.has_replica(replica):  # not one that left while its batch was read
            self.core.apply_events(replica, batch)
            if self.relay is not None:
                self.relay.on_batch(replica, batch)
            elif self._standby is not None:
                census = self._standby.get(replica, (BlockCensus(), None))[0]
                census.apply(batch)
                self._standby[replica] = (census, batch.seq)

    def _on_stream_batch(self, replica: ReplicaId, batch: EventBatch) -> None:
        """A batch read back from the durable stream: applied, never relayed again."""
        if self.core.has_replica(replica):
            self.core.apply_events(replica, batch)

    def _on_reset(self, replica: ReplicaId, reason: str) -> None:
        if self.core.has_replica(replica):
            self.core.reset_replica_index(replica)
            if self.relay is not None:
                self.relay.on_reset(replica, reason)
            elif self._standby is not None:
                self._standby[replica] = (BlockCensus(), None)

    def _on_stream_reset(self, replica: ReplicaId, reason: str) -> None:
        """The durable stream's history of ``replica`` restarts: forget, never relay."""
        if self.core.has_replica(replica):
            self.core.reset_replica_index(replica)

    def _subscriber_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("KV-event subscriber %s ended with an error; that replica's index is "
                      "no longer updated", task.get_name(), exc_info=exc)

    def sync_metrics(self) -> None:
        """Move the subscribers' counters into the Prometheus series (called on scrape)."""
        for replica, sub in self.subscribers.items():
            now = sub.stats
            before = self._seen[replica]
            self.metrics.events(
                replica,
                applied=now.batches - before.batches,
                gaps=now.gaps - before.gaps,
                replays=now.replays - before.replays,
                resets=now.resets - before.resets,
                malformed=now.malformed - before.malformed,
            )
            self.metrics.set_replaying(replica, now.replaying)
            self._seen[replica] = now
        if self._stream_ready is not None and self._stream_ready.done():
            relay = None
            if self.relay is not None:
                stats = self.relay.stats
                relay = {"published": stats.published, "resets": stats.resets,
                         "failed": stats.failed, "dropped": stats.dropped,
                         "snapshots": stats.snapshots,
                         "snapshot_failures": stats.snapshot_failures}
            self.metrics.set_kv_stream(self.kv_stream is not None and self.kv_stream.connected,
                                       relay)
        if self.cluster is not None:
            self.metrics.set_cluster(self.cluster.stats(), router_id=self.cluster.router_id,
                                     peer_seqs=self.cluster.peer_seqs())
        for pool, local in self._local_tokenizers():
            pieces = local.pieces
            self.metrics.set_token_piece_cache(
                pool, enabled=pieces.enabled, hits=pieces.hits, misses=pieces.misses,
                cached_tokens=pieces.cached_tokens, mismatches=pieces.mismatches,
                checks=pieces.checks, checks_dropped=local.piece_check.dropped,
                checks_failed=local.piece_check.failed)

    def _local_tokenizers(self) -> list[tuple[str, LocalTokenizer]]:
        """The pools whose requests a local tokenizer serves now, with it."""
        out = []
        for pool, tokenizer in self.tokenizers.items():
            local = tokenizer.local if isinstance(tokenizer, SwitchingTokenizer) else tokenizer
            if isinstance(local, LocalTokenizer):
                out.append((pool, local))
        return out

    def _start_tokenizer_checks(self) -> None:
        """One background ``TokenizerCheck`` per ``local`` or ``auto`` pool."""
        for pool, tokenizer in self.tokenizers.items():
            if (not isinstance(tokenizer, SwitchingTokenizer) or self.discovery is None
                    or self.engine_client is None):
                continue
            check = TokenizerCheck(
                pool=pool, model=self.config.pools[PoolName(pool)].model,
                target=tokenizer, discovery=self.discovery, client=self.engine_client,
                metrics=self.metrics, load=functools.partial(_load_local, pool, self.metrics),
            )
            task = asyncio.get_running_loop().create_task(check.run(),
                                                          name=f"tokenizer-check-{pool}")
            task.add_done_callback(self._check_ended)
            self.tokenizer_checks[pool] = check
            self._check_tasks[pool] = task

    def _check_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the tokenizer check %s failed and stopped; the pool keeps the tokenizer "
                      "it is on", task.get_name(), exc_info=task.exception())

    def _extra_state(self) -> Mapping[str, Any]:
        subs = {}
        for replica, sub in self.subscribers.items():
            s = sub.stats
            subs[replica] = {"batches": s.batches, "events": s.events, "gaps": s.gaps,
                             "replays": s.replays, "replayed_batches": s.replayed_batches,
                             "resets": s.resets, "malformed": s.malformed,
                             "last_seq": s.last_seq, "replaying": s.replaying}
        windows = {}
        if self.discovery is not None:
            windows = {pool: self.discovery.pool_window(pool) for pool in self.config.pools}
        out: dict[str, Any] = {"kv_events": subs, "windows": windows}
        if self.cluster is not None:
            out["cluster"] = self.cluster.state()
        return out


def _load_local(pool: str, metrics: RouterMetrics, path: str) -> LocalTokenizer:
    """``LocalTokenizer.load`` with the path last, for ``TokenizerCheck``'s ``load``."""
    return LocalTokenizer.load(pool, path, metrics)
