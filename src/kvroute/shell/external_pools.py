"""External pools (an OpenAI-compatible provider, ``pools.<name>.external``): catalog and health.

A provider has no ``/health``, no vLLM ``/metrics``, no KV events and no block hashing, so
none of what discovery does for engines applies to it. ``ExternalPools`` keeps two things
about each instead, and ``shell/discovery.py``'s ``Discovery`` hands them on (it polls these
pools in the same rounds as the engines):

* its **catalog**: when ``catalog_from_models`` is on, ``GET /v1/models`` with the provider's
  key as ``Authorization: Bearer`` (first healthy endpoint), read at start and again once it
  is ``max(window_ttl_s - models_interval_s, window_ttl_s / 2)`` old (so the new read lands
  before the old one expires), trusted for ``window_ttl_s`` (the window TTL, as for
  engines' windows: a provider's catalog changes too). A failed read is retried
  after ``models_interval_s``; an expired catalog is *unknown*, so requests stay local and
  the log says so, rather than escalating on a list nobody has confirmed for a long time.
  ``catalog`` hands it to the tier logic (``core.polling.CatalogSchedule``);
* its **endpoints' health**: in routing from the start (a provider is judged by its
  answers, not by probes); a refused connection reported by the proxy takes the endpoint out
  (``report_refused``), and an authenticated ``GET /v1/models`` every ``health_interval_s``
  brings it back (``core.health.EndpointHealth``).

It changes ``RouterCore`` only through ``set_healthy``, from discovery's round task or from
``report_refused`` on the same event loop (``Discovery``'s invariant).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from kvroute.config import PoolConfig, ReplicaConfig, RouterConfig, resolve_provider_keys
from kvroute.core.clock import Clock
from kvroute.core.health import EndpointHealth
from kvroute.core.polling import CatalogSchedule, PollIntervals
from kvroute.core.router import RouterCore
from kvroute.core.types import PoolName, ReplicaId
from kvroute.shell.http_probe import ProbeError, probe_get, probed_model_cards
from kvroute.shell.metrics import RouterMetrics
from kvroute.wire.model_list import card_window

__all__ = ["ExternalCatalog", "ExternalEndpoint", "ExternalPools"]

# NOTE: discovery's logger, not this module's: these lines were discovery's before the
# external pools moved here, and operators filter on its name.
log = logging.getLogger("kvroute.shell.discovery")


@dataclass(frozen=True, slots=True)
class ExternalCatalog:
    """An external provider's ``/v1/models`` as last read.

    Attributes:
        models: the model ids it lists.
        windows: ``max_model_len`` of the models whose cards give one (vLLM-based
            providers do; most clouds do not).
        fetched_at_s: clock time of the read.
    """

    models: frozenset[str]
    windows: Mapping[str, int]
    fetched_at_s: float


@dataclass(slots=True)
class _ExternalPool:
    pool: PoolConfig
    key: str | None
    schedule: CatalogSchedule
    catalog: ExternalCatalog | None = None
    last_error: str | None = None


@dataclass(slots=True)
class ExternalEndpoint:
    """One endpoint (a ``replicas`` entry) of an external pool; changed only by
    ``ExternalPools``, read by ``Discovery``.

    Attributes:
        config: the endpoint's config entry (name, url).
        pool: the external pool it belongs to.
        health: in routing or not, and when its next ``/v1/models`` probe is due.
        last_error: the last refusal or failed probe, for ``/admin/state``; None after a
            good probe.
    """

    config: ReplicaConfig
    pool: PoolName
    health: EndpointHealth
    last_error: str | None = None


class ExternalPools:
    """Every external pool's catalog and endpoints' health (see the module docstring).

    Args:
        config: the router config; its pools with ``external`` set are the ones kept.
        core: the router core, told when an endpoint goes out of routing or comes back.
        session: the shared aiohttp client session (never closed here).
        metrics: where probe outcomes and endpoint health are exported.
        clock: monotonic seconds.
        intervals: discovery's polling intervals and window TTL.
        timeout: the bound on each probe (``discovery.timeout_s``).
        provider_keys: API keys by pool (``Secrets.provider_keys``); read from
            ``os.environ`` through ``config.resolve_provider_keys`` when None.
    """

    def __init__(
        self,
        config: RouterConfig,
        core: RouterCore,
        session: aiohttp.ClientSession,
        metrics: RouterMetrics,
        *,
        clock: Clock,
        intervals: PollIntervals,
        timeout: aiohttp.ClientTimeout,
        provider_keys: Mapping[PoolName, str] | None,
    ) -> None:
        self._core = core
        self._session = session
        self._metrics = metrics
        self._clock = clock
        self._timeout = timeout
        keys: Mapping[PoolName, str] | None = provider_keys
        if keys is None and any(p.external is not None for p in config.pools.values()):
            keys = resolve_provider_keys(config)
        self._pools: dict[PoolName, _ExternalPool] = {}
        self._endpoints: dict[ReplicaId, ExternalEndpoint] = {}
        for pool in config.pools.values():
            if pool.external is None:
                continue
            self._pools[pool.name] = _ExternalPool(
                pool, (keys or {}).get(pool.name), CatalogSchedule(intervals))
            for rep in pool.replicas:
                self._endpoints[rep.name] = ExternalEndpoint(
                    rep, pool.name, EndpointHealth(intervals.health_s))

    # -- queries --------------------------------------------------------------------------

    def has_pool(self, pool: str) -> bool:
        """True when ``pool`` is an external pool."""
        return pool in self._pools

    def endpoint(self, replica: str) -> ExternalEndpoint | None:
        """The endpoint named ``replica``, or None when it is not an external pool's."""
        return self._endpoints.get(ReplicaId(replica))

    def healthy_endpoints(self, pool: str) -> list[ReplicaId]:
        """The pool's endpoints currently in routing, in config order."""
        return [e.config.name for e in self._endpoints.values()
                if e.pool == pool and e.health.healthy]

    def catalog(self, pool: str) -> ExternalCatalog | None:
        """An external pool's catalog from its ``/v1/models``; None when ``pool`` is not
        external, does not read its catalog, has not been read yet, or the last read is
        older than ``window_ttl_s``."""
        ext = self._pools.get(PoolName(pool))
        if ext is None or ext.catalog is None:
            return None
        if not ext.schedule.is_fresh(ext.catalog.fetched_at_s, self._clock.now()):
            return None
        return ext.catalog

    # -- changes --------------------------------------------------------------------------

    def report_refused(self, replica: str, reason: str) -> bool:
        """The proxy could not connect to ``replica``: take it out of routing until its
        ``/v1/models`` answers again. False (and nothing done) when ``replica`` is not an
        external pool's endpoint."""
        endpoint = self._endpoints.get(ReplicaId(replica))
        if endpoint is None:
            return False
        endpoint.last_error = f"connect_error: {reason}"
        was_in = endpoint.health.on_refused(self._clock.now())
        self._metrics.discovery(replica, "connect_error")
        if was_in:
            self._core.set_healthy(endpoint.config.name, False)
            self._metrics.set_replica_healthy(replica, False)
            log.error("external endpoint %s (%s) refused a connection (%s); taken out of "
                      "routing until its /v1/models answers again", replica,
                      endpoint.config.url, reason)
        return True

    async def probe(self, *, force: bool) -> None:
        """Probe every external pool at once: endpoints due a health probe, and the catalog
        when due (every catalog when ``force``)."""
        await asyncio.gather(*(self._probe_pool(ext, force) for ext in self._pools.values()))

    # -- probes ---------------------------------------------------------------------------

    async def _get(self, url: str, key: str | None) -> bytes:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        return await probe_get(self._session, url, what="catalog", timeout=self._timeout,
                               headers=headers, auth_hint=True)

    async def _probe_pool(self, ext: _ExternalPool, force: bool) -> None:
        """Bring endpoints back that answer ``/v1/models``; refresh the catalog when due."""
        now = self._clock.now()
        endpoints = [e for e in self._endpoints.values() if e.pool == ext.pool.name]
        for endpoint in endpoints:
            if not endpoint.health.claim_probe(now):
                continue
            try:
                await self._get(endpoint.config.url + "/v1/models", ext.key)
            except ProbeError as exc:
                endpoint.last_error = str(exc)
                self._metrics.discovery(endpoint.config.name, exc.outcome)
                continue
            endpoint.health.on_probe_ok()
            endpoint.last_error = None
            self._core.set_healthy(endpoint.config.name, True)
            self._metrics.set_replica_healthy(endpoint.config.name, True)
            log.warning("external endpoint %s answers again; back in routing",
                        endpoint.config.name)
        assert ext.pool.external is not None, "an _ExternalPool always wraps an external pool"
        if not ext.pool.external.catalog_from_models or not ext.schedule.is_due(now, force=force):
            return
        source = next((e for e in endpoints if e.health.healthy), None)
        if source is None:
            return
        ext.schedule.on_attempt(now)
        try:
            cards = probed_model_cards(
                await self._get(source.config.url + "/v1/models", ext.key))
        except ProbeError as exc:
            ext.last_error = str(exc)
            self._metrics.discovery(source.config.name, exc.outcome)
            log.warning("external pool %s: cannot read its catalog: %s", ext.pool.name, exc)
            return
        windows = {model: window for model, card in cards.items()
                   if (window := card_window(card)) is not None}
        catalog = ExternalCatalog(frozenset(cards), windows, now)
        if ext.catalog is None or ext.catalog.models != catalog.models:
            log.info("external pool %s: catalog from /v1/models: %s", ext.pool.name,
                     ", ".join(sorted(catalog.models)) or "(empty)")
        ext.catalog = catalog
        ext.last_error = None
        ext.schedule.on_read(now)
        self._metrics.discovery(source.config.name, "catalog_ok")
