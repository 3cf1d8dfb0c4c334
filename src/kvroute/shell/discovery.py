"""Discovery: what the router knows about each replica, read from the replica itself.

Owns the polling of every replica's ``/health``, ``/v1/models`` and ``/metrics``, and the
conclusions drawn from them:

* **health** -> ``RouterCore.set_healthy`` (out of routing and out of the index, or back in);
* **context windows** (``max_model_len`` of the pool's model on ``/v1/models``), cached with a
  TTL because a swap slot can change the model behind a URL;
* **block hashing** (``block_size`` and ``prefix_caching_hash_algo`` of
  ``vllm:cache_config_info``) -> ``RouterCore.set_pool_hashing``;
* **engine load** (``vllm:num_requests_running``/``waiting``, ``kv_cache_usage_perc``) ->
  ``RouterCore.on_engine_metrics``;
* **LoRA adapters**: the cards of ``/v1/models`` whose ``parent`` is the pool's model (name
  and ``root``, the path vLLM hashes) -> ``RouterCore.set_replica_adapters``, and the adapter
  slots of ``vllm:lora_requests_info`` -> ``RouterCore.set_adapter_slots``;
* **data-parallel ranks**: the ``engine`` labels of ``/metrics`` give the engine's rank count;
  a replica configured without ``data_parallel_size`` is expanded into its ranks, or folded
  back, between rounds (``shell/dp_discovery.py``: the decision and ``apply_resize``), a
  membership change like a Kubernetes one;
  a fixed count the engine contradicts is logged;
* **model identity** (``shell/identity_reads.py``, with the served model, window and
  adapters of the same cards: served name, the card's ``root``, and the weights and tokenizer
  fingerprints of that directory when it is on this host, ``shell/model_files.py``) ->
  ``RouterCore.set_identity``, read with every ``/v1/models`` and again as soon as a
  replica comes back from a failed probe (a restart may have brought other weights). A
  changed identity drops the replica's index entries and learned rates
  (docs/model-bound-caches.md).

It changes core state only through those public ``RouterCore`` methods, and is their only
caller (with the two helpers it owns, ``shell/hashing_settlement.py`` and
``shell/external_pools.py``) besides the composition root (which builds the core with every
pool approximate until discovery has read the engines). A data-parallel resize also calls
``RouterCore.add_replica``/``remove_replica`` (as ``shell/k8s_members.py`` does for
Kubernetes members) and tells ``members_hooks`` (the runtime's subscriptions, the picker).

Theory of operation
-------------------

One task runs rounds. A round probes every replica that is due, concurrently; each probe is
bounded by ``discovery.timeout_s``. The start-up round probes them all; after it their
schedules are staggered over the interval (``core.polling.stagger``) and the task ticks as often
as that needs, so a round usually handles one replica and never stalls the event loop on the
whole fleet's answers at once. When each probe is due is ``core.polling.ProbeSchedule``'s
decision. Per replica, in order:

1. ``GET /health`` when due (every ``health_interval_s``); on failure the round stops here
   for that replica;
2. ``GET /v1/models`` when due (every ``models_interval_s``, or soon after
   ``invalidate_window``);
3. ``GET /metrics`` when due (every ``metrics_interval_s``), read for the pool's model.

After the probes, pools are settled from the records (single writer: only the round task
touches ``RouterCore``). The decisions are pure and live in ``core/``; this module probes,
feeds them the results, applies what they decide to ``RouterCore``, and logs and counts it:

* Health is a small state machine per replica (``core.health.ReplicaHealth``). A replica
  never seen healthy is out at its first failure (nothing says it ever worked); a replica
  that was in goes out after ``unhealthy_after`` consecutive failures (default 2: one lost
  probe is not an outage) and comes back after ``healthy_after`` consecutive successes
  (default 1).
* A pool's hashing is never assumed: ``shell/hashing_settlement.py`` adopts it (config
  overrides, else what the engines report; until then the pool routes in the declared
  approximate mode) and says which replicas disagree.
* A replica whose hashing differs from its pool's, or that does not serve the pool's model,
  is kept out of routing (its entries would poison the pool's index, or its requests would
  404), with an error in the log and a ``discovery_total`` count, until it reports correctly.
* A window is trusted for ``window_ttl_s`` after the last successful ``/v1/models``; after
  that it is dropped (None) rather than trusted forever (``core.polling.is_fresh``).

``replica_info`` and ``pool_window`` read the records and never block.

External pools (an OpenAI-compatible provider, ``pools.<name>.external``) have no
``/health``, ``/metrics`` or block hashing: their catalogs and endpoints' health are
``shell/external_pools.py``'s, polled in the same rounds and handed on by ``Discovery``.
Every probe reads through ``shell/http_probe.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Final

import aiohttp

from kvroute.config import PoolConfig, ReplicaConfig, RouterConfig
from kvroute.core.clock import Clock
from kvroute.core.health import DEFAULT_HEALTHY_AFTER, HealthTransition, ReplicaHealth
from kvroute.core.polling import PollIntervals, ProbeSchedule, is_fresh, stagger
from kvroute.core.router import AdapterSlots, RouterCore
from kvroute.core.types import PoolName, ReplicaId
from kvroute.shell.discovery_records import ReplicaInfo, ReplicaRecord
from kvroute.shell.dp_discovery import DpRankWatch, MembershipHook, apply_resize, routed_names
from kvroute.shell.external_pools import ExternalCatalog, ExternalPools
from kvroute.shell.hashing_settlement import HashingSettlement
from kvroute.shell.http_probe import ProbeError, probe_get, probed_model_cards
from kvroute.shell.identity_reads import ModelReads
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.state import MonotonicClock
from kvroute.wire.prom import VllmMetrics, parse_vllm_metrics

__all__ = ["DEFAULT_HEALTHY_AFTER", "Discovery", "MembershipHook", "ReplicaInfo"]

log = logging.getLogger(__name__)

_LOOP_BACKOFF_S: Final = 1.0


_MAX_RESIZE_ROUNDS: Final = 2
"""Extra forced rounds ``refresh_now`` runs for ranks found in its round (their first
``/health``), so a DP engine is routed by rank from the first request."""


class _Removed(Exception):
    """The replica a probe was for left the pool while the probe was out."""


class Discovery:
    """Polls the fleet and keeps ``RouterCore`` told about health, hashing, windows and load.

    Invariant: ``RouterCore`` is only changed from the task that runs rounds (or from
    ``refresh_now`` before that task starts), or synchronously by ``report_failure`` on the
    same event loop, so every change is serialised by the loop and the core needs no locks.

    Args:
        config: the router config (pools, replicas, ``discovery`` intervals).
        core: the router core to keep informed.
        session: the shared aiohttp client session (discovery never closes it).
        metrics: where probes, health, windows and approximate mode are exported.
        clock: monotonic seconds; ``time.monotonic`` when None (tests pass a ``ManualClock``).
        provider_keys: external pools' API keys by pool (``Secrets.provider_keys``); read
            from ``os.environ`` through ``config.resolve_provider_keys`` when None.
        on_engine_metrics: told every parsed ``/metrics`` reading (the engines' cache
            counters and ``cache_config_info``: ``shell/cache_feedback.py``).
        on_replica_left: told when a replica leaves the fleet (``remove_replica``), so
            what keeps per-replica readings beside discovery drops them too.
        members_hook: told of the entries a data-parallel resize adds and removes (the
            runtime follows their KV events); the core and discovery are changed here.
    """

    def __init__(
        self,
        config: RouterConfig,
        core: RouterCore,
        session: aiohttp.ClientSession,
        metrics: RouterMetrics,
        *,
        clock: Clock | None = None,
        provider_keys: Mapping[PoolName, str] | None = None,
        on_engine_metrics: Callable[[ReplicaId, VllmMetrics], None] | None = None,
        on_replica_left: Callable[[ReplicaId], None] | None = None,
        members_hook: MembershipHook | None = None,
    ) -> None:
        self._config = config
        self._on_engine_metrics = on_engine_metrics
        self._on_replica_left = on_replica_left
        self._core = core
        self._session = session
        self._metrics = metrics
        self._clock: Clock = clock or MonotonicClock()
        d = config.discovery
        self._intervals = PollIntervals(
            health_s=d.health_interval_s, metrics_s=d.metrics_interval_s,
            models_s=d.models_interval_s, window_ttl_s=d.window_ttl_s,
        )
        healthy_after = int(getattr(d, "healthy_after", DEFAULT_HEALTHY_AFTER))
        self._timeout = aiohttp.ClientTimeout(total=d.timeout_s)
        self._replicas: dict[ReplicaId, ReplicaRecord] = {}
        self._pools: dict[PoolName, PoolConfig] = {
            name: pool for name, pool in config.pools.items() if pool.external is None
        }
        self._unhealthy_after = d.unhealthy_after
        self._healthy_after = healthy_after
        for pool in self._pools.values():
            for rep in pool.replicas:
                self._replicas[rep.name] = self._record(rep, pool)
        self._external = ExternalPools(
            config, core, session, metrics, clock=self._clock, intervals=self._intervals,
            timeout=self._timeout, provider_keys=provider_keys,
        )
        self._hashing = HashingSettlement(self._pools.values(), core, metrics)
        self._dp = DpRankWatch(self._pools.values(), metrics)
        self._models = ModelReads(core, metrics)
        self.members_hooks: list[MembershipHook] = [] if members_hook is None else [members_hook]
        """Told, in order, of every entry a data-parallel resize removes and adds (the
        runtime's subscriptions; ``kvroute epp``'s picker appends itself)."""
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._started = False
        self.num_rounds = 0
        self.round_observers: list[Callable[[], None]] = []
        """Called after every probe round, in order (the runtime's failover switches: they
        must see a primary come back between requests, not at the next one)."""
        self.num_loop_errors = 0

    def _record(self, rep: ReplicaConfig, pool: PoolConfig) -> ReplicaRecord:
        return ReplicaRecord(
            config=rep, pool=pool,
            health=ReplicaHealth(unhealthy_after=self._unhealthy_after,
                                 healthy_after=self._healthy_after),
            schedule=ProbeSchedule(self._intervals),
        )

    # -- membership at run time (Kubernetes discovery) ------------------------------------

    def add_replica(self, pool: PoolName, rep: ReplicaConfig) -> None:
        """Start probing ``rep``, a new member of ``pool`` (already added to the core, out
        of routing): its first ``/health`` is due at once, and the loop is woken."""
        if rep.name in self._replicas:
            raise ValueError(f"replica {rep.name!r} is already known to discovery")
        self._replicas[rep.name] = self._record(rep, self._pools[pool])
        self._wake.set()

    def remove_replica(self, replica: ReplicaId) -> None:
        """Stop probing ``replica`` (it left); a probe in flight for it is dropped."""
        if self._replicas.pop(replica, None) is not None:
            self._metrics.forget_replica(replica)
            if self._on_replica_left is not None:
                self._on_replica_left(replica)

    def members(self) -> list[tuple[PoolName, ReplicaConfig]]:
        """Every replica probed now, with its pool (configured, data-parallel ranks found,
        Kubernetes members); external pools' endpoints are not probed here."""
        return [(rep.pool.name, rep.config) for rep in self._replicas.values()]

    def dp_size(self, replica: str) -> int | None:
        """How many ranks the ``dp_auto`` replica ``replica`` is routed as now, or None when
        its rank count is not read from the engine."""
        return self._dp.size(replica)

    def replica_names(self, pool: str) -> list[ReplicaId]:
        """The pool's replicas now (configured or discovered), healthy or not."""
        if self._external.has_pool(pool):
            return [rep.name for rep in self._config.pools[PoolName(pool)].replicas]
        return [name for name, rep in self._replicas.items() if rep.pool.name == pool]

    # -- lifecycle ------------------------------------------------------------------------

    async def refresh_now(self) -> None:
        """Run one full round now (every probe, due or not) and settle the pools.

        Awaited at start-up before serving, so the first request already sees health,
        windows and hashing. Never raises for an unreachable replica: that is a result.
        """
        self._init_pools()
        resized = await self._round(force=True)
        for _ in range(_MAX_RESIZE_ROUNDS):
            if not resized:
                break
            resized = await self._round(force=True)  # the new ranks' first probes
        # A forced round probes every replica at once: spread their next probes over the
        # interval so later rounds each parse about one replica's answers (core.polling).
        stagger([rep.schedule for rep in self._replicas.values()])

    async def start(self) -> None:
        """Start the polling task (runs ``refresh_now`` first if it never ran)."""
        if self._task is not None:
            return
        if not self._started:
            await self.refresh_now()
        self._task = asyncio.create_task(self._run(), name="kvroute-discovery")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    # -- queries --------------------------------------------------------------------------

    def replica_info(self, replica: str) -> ReplicaInfo:
        """A copy of what is known about ``replica``.

        Raises:
            KeyError: ``replica`` is not in the config.
        """
        endpoint = self._external.endpoint(replica)
        if endpoint is not None:
            return ReplicaInfo(healthy=endpoint.health.healthy, last_error=endpoint.last_error)
        rep = self._replicas[ReplicaId(replica)]
        health = rep.health
        info = dataclasses.replace(
            rep.info, last_ok_s=health.last_ok_s,
            consecutive_failures=health.consecutive_failures,
            consecutive_successes=health.consecutive_successes,
            models_fetched_at_s=rep.schedule.models_read_s, adapters=dict(rep.info.adapters),
        )
        if not self._window_valid(rep):
            info.max_model_len = None
        return info

    def replica_url(self, replica: str) -> str:
        endpoint = self._external.endpoint(replica)
        if endpoint is not None:
            return endpoint.config.url
        return self._replicas[ReplicaId(replica)].config.url

    def member_url(self, replica: str) -> str | None:
        """``replica``'s base URL, or None when it is not (or no longer) a member."""
        try:
            return self.replica_url(replica)
        except KeyError:
            return None

    def healthy_replicas(self, pool: str) -> list[ReplicaId]:
        """The pool's replicas currently in routing, in config order."""
        if self._external.has_pool(pool):
            return self._external.healthy_endpoints(pool)
        return [
            rep.config.name for rep in self._replicas.values()
            if rep.pool.name == pool and rep.info.healthy
        ]

    def pool_window(self, pool: str) -> int | None:
        """The smallest ``max_model_len`` among the pool's healthy replicas with a fresh window.

        None when no healthy replica has a window younger than ``window_ttl_s``.
        """
        windows = [
            rep.info.max_model_len for rep in self._replicas.values()
            if rep.pool.name == pool and rep.info.healthy and rep.info.max_model_len is not None
            and self._window_valid(rep)
        ]
        return min(windows) if windows else None

    def external_catalog(self, pool: str) -> ExternalCatalog | None:
        """An external pool's catalog from its ``/v1/models``; None when ``pool`` is not
        external, does not read its catalog, has not been read yet, or the last read is
        older than ``window_ttl_s``."""
        return self._external.catalog(pool)

    def pool_hashing(self, pool: str) -> tuple[int, str] | None:
        """The pool's adopted ``(block_size, hash_algo)``, or None while still unknown."""
        return self._hashing.adopted(pool)

    def pool_approximate(self, pool: str) -> bool:
        """True while ``pool`` routes approximately (hashing unknown, or no tokenizer)."""
        return self._hashing.approximate(pool)

    def invalidate_window(self, pool: str) -> None:
        """A reactive overflow said the pool's window changed: re-read ``/v1/models`` soon.

        The known window stays in use until the new one is read (the reactive path covers
        the gap); the polling task is woken so that happens within one probe.
        """
        for rep in self._replicas.values():
            if rep.pool.name == pool:
                rep.schedule.invalidate_models()
        self._wake.set()

    def report_failure(self, replica: str, reason: str) -> None:
        """The proxy could not connect to ``replica`` (refused, or connect timeout).

        Counts as a failed health probe, and, because nothing answering on the port is a
        stronger sign than one lost probe, takes the replica out of routing at once instead
        of after ``unhealthy_after`` probes: requests stop going to a dead engine now, not at
        the next probe. Its next ``/health`` probe is made due, so a replica that was only
        restarting comes back after ``healthy_after`` good probes as usual. Unknown replica
        names are ignored (the caller may hold a name from an older config).

        Safe from any task on this loop: it changes ``RouterCore`` synchronously, between
        awaits, like the round task does.

        An external endpoint is taken out the same way and comes back after an
        authenticated ``/v1/models`` answers (probed every ``health_interval_s``).
        """
        if self._external.report_refused(replica, reason):
            self._wake.set()
            return
        rep = self._replicas.get(ReplicaId(replica))
        if rep is None:
            return
        refusal = rep.health.on_refused()
        self._health_failed(rep, refusal.counted, f"connect_error: {reason}")
        rep.schedule.health_due_now(self._clock.now())
        if refusal.took_out:
            log.error("replica %s refused a connection (%s); taken out of routing until its "
                      "/health answers again", replica, reason)
        self._settle_replica(rep)
        self._wake.set()

    # -- the loop -------------------------------------------------------------------------

    @property
    def _tick_s(self) -> float:
        """How often the loop looks for due probes (``core.polling.PollIntervals.tick_s``)."""
        return self._intervals.tick_s(len(self._replicas))

    async def _run(self) -> None:
        tick = self._tick_s
        while True:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick)
            try:
                await self._round(force=False)
            except asyncio.CancelledError:
                raise
            except Exception:
                # NOTE: top of a long-lived loop (house rule 14): a bug in one round must not
                # end discovery for the router's lifetime; it is logged, counted, backed off.
                self.num_loop_errors += 1
                self._metrics.discovery("*", "loop_error")
                log.exception("discovery round failed; retrying in %.1fs", _LOOP_BACKOFF_S)
                await asyncio.sleep(_LOOP_BACKOFF_S)

    def _init_pools(self) -> None:
        if self._started:
            return
        self._started = True
        for pool in self._pools.values():
            self._hashing.start(pool)

    async def _round(self, *, force: bool) -> bool:
        """One round; True when it changed the fleet (data-parallel ranks)."""
        await asyncio.gather(*(self._probe(rep, force) for rep in self._replicas.values()),
                             self._external.probe(force=force))
        resizes = self._dp.take_resizes(frozenset(routed_names(self._core)))
        for resize in resizes:
            apply_resize(resize, self._core, self, self.members_hooks)
        for pool in self._pools.values():
            self._settle_pool(pool)
        self.num_rounds += 1
        for observe in self.round_observers:
            observe()
        return bool(resizes)

    # -- probes ---------------------------------------------------------------------------

    async def _probe(self, rep: ReplicaRecord, force: bool) -> None:
        with contextlib.suppress(_Removed):
            await self._probe_member(rep, force)

    async def _probe_member(self, rep: ReplicaRecord, force: bool) -> None:
        now = self._clock.now()
        schedule = rep.schedule
        answered = False
        if schedule.claim_health(now, force=force):
            try:
                await self._get(rep, "/health", "health")
            except ProbeError as exc:
                self._health_failed(rep, rep.health.on_failure(), str(exc))
                return
            self._health_ok(rep)
            answered = True
        if not answered and rep.health.up is not True:
            return  # down, and its next health probe is not due yet
        if schedule.wants_models(now, force=force):
            await self._probe_models(rep)
        if schedule.claim_metrics(now, force=force):
            await self._probe_metrics(rep)

    async def _get(self, rep: ReplicaRecord, path: str, what: str) -> bytes:
        try:
            return await probe_get(self._session, rep.config.url + path, what=what,
                                   timeout=self._timeout)
        finally:
            if self._replicas.get(rep.config.name) is not rep:
                raise _Removed  # it left while the probe was out: nothing to apply

    def _health_ok(self, rep: ReplicaRecord) -> None:
        """``/health`` answered: count it, and say so when it brings the replica back."""
        name = rep.config.name
        transition = rep.health.on_success(self._clock.now())
        self._metrics.discovery(name, "health_ok")
        if transition is HealthTransition.CAME_BACK:
            log.warning("replica %s is healthy again after %d good probe(s)",
                        name, rep.health.consecutive_successes)
            rep.schedule.invalidate_models()  # a restart may have brought other weights

    def _health_failed(self, rep: ReplicaRecord, transition: HealthTransition, error: str) -> None:
        """Record, count and log a failure ``rep.health`` has already counted as
        ``transition`` (a failed probe, or a refused connection)."""
        info = rep.info
        name = rep.config.name
        info.last_error = error
        outcome = error.split(":", 1)[0] if error else "health_error"
        self._metrics.discovery(name, outcome)
        if transition is HealthTransition.FIRST_DOWN:
            log.error("replica %s is unreachable at start-up (%s); kept out of routing", name,
                      error)
        elif transition is HealthTransition.WENT_DOWN:
            log.error("replica %s failed %d health probes in a row (%s); taking it out of "
                      "routing", name, rep.health.consecutive_failures, error)
        else:
            log.warning("replica %s health probe failed (%s; %d in a row)", name, error,
                        rep.health.consecutive_failures)

    async def _probe_models(self, rep: ReplicaRecord) -> None:
        name = rep.config.name
        try:
            body = await self._get(rep, "/v1/models", "models")
            cards = probed_model_cards(body)
        except ProbeError as exc:
            rep.info.last_error = str(exc)
            self._metrics.discovery(name, exc.outcome)
            log.warning("replica %s: %s", name, exc)
            return
        now = self._clock.now()
        rep.schedule.on_models_read(now)
        await self._models.on_cards(rep, cards, now)

    async def _probe_metrics(self, rep: ReplicaRecord) -> None:
        name = rep.config.name
        try:
            body = await self._get(rep, "/metrics", "metrics")
        except ProbeError as exc:
            rep.info.last_error = str(exc)
            self._metrics.discovery(name, exc.outcome)
            log.warning("replica %s: %s", name, exc)
            return
        rank = rep.config.dp_rank  # a DP rank reads its own engine label's series
        parsed = parse_vllm_metrics(body.decode("utf-8", errors="replace"), rep.pool.model,
                                    engine=None if rank is None else str(rank))
        info = rep.info
        if parsed.found:
            info.running = _as_int(parsed.num_requests_running)
            info.waiting = _as_int(parsed.num_requests_waiting)
            info.kv_usage = parsed.kv_cache_usage_perc
            self._core.on_engine_metrics(
                rep.config.name, running=info.running, waiting=info.waiting,
                kv_usage=info.kv_usage, kv_capacity_tokens=_kv_capacity_tokens(parsed),
            )
            self._metrics.discovery(name, "metrics_ok")
        else:
            self._metrics.discovery(name, "metrics_unusable")
            log.warning("replica %s: /metrics has no vllm:num_requests_running/waiting for "
                        "model %r (models seen: %s)", name, rep.pool.model,
                        list(parsed.model_names))
        info.block_size = parsed.block_size
        info.hash_algo = parsed.prefix_caching_hash_algo
        self._core.verdicts.observe_cache(name, parsed.cache_config)
        self._dp.observe(rep.config, parsed.engines)
        if self._on_engine_metrics is not None:
            self._on_engine_metrics(rep.config.name, parsed)
        if parsed.lora_max is not None:
            info.lora_running, info.lora_max = parsed.lora_running, parsed.lora_max
            self._core.set_adapter_slots(name, AdapterSlots(
                running=frozenset(parsed.lora_running), waiting=frozenset(parsed.lora_waiting),
                max_lora=parsed.lora_max))
        if parsed.num_malformed:
            self._metrics.discovery(name, "metrics_malformed_lines")

    # -- settling -------------------------------------------------------------------------

    def _settle_pool(self, pool: PoolConfig) -> None:
        members = [rep for rep in self._replicas.values() if rep.pool.name == pool.name]
        reports = {
            rep.config.name: self._hashing.reported(
                pool, rep.config.name, block_size=rep.info.block_size,
                hash_algo=rep.info.hash_algo,
            ) if rep.health.up else None
            for rep in members
        }
        self._hashing.settle(pool, reports)
        for rep in members:
            self._settle_replica(rep)
        window = self.pool_window(pool.name)
        self._metrics.set_pool_window(pool.name, window)

    def _settle_replica(self, rep: ReplicaRecord) -> None:
        info = rep.info
        info.excluded_reason = (self._hashing.problem(rep.pool.name, rep.config.name)
                                or rep.model_problem)
        info.healthy = bool(rep.health.up) and info.excluded_reason is None
        if rep.core_healthy is not info.healthy:
            rep.core_healthy = info.healthy
            self._core.set_healthy(rep.config.name, info.healthy)
            self._metrics.set_replica_healthy(rep.config.name, info.healthy)

    def _window_valid(self, rep: ReplicaRecord) -> bool:
        return is_fresh(rep.window_read_s, self._clock.now(), self._intervals.window_ttl_s)


def _as_int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _kv_capacity_tokens(parsed: VllmMetrics) -> int | None:
    """The engine's KV capacity in tokens (``num_gpu_blocks`` less the null block, times
    ``block_size``, of ``vllm:cache_config_info``), or None when it does not say."""
    blocks = parsed.cache_config.get("num_gpu_blocks", "")
    if parsed.block_size is None or not blocks.isdigit() or int(blocks) < 2:
        return None
    return (int(blocks) - 1) * parsed.block_size
