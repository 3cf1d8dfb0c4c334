"""The route's pools as the tier decisions see them: windows, served models, provider catalogs.

Owns the live router's view that ``core/walk.py`` plans over (``core/tiers.TierPool``), built
from discovery (``shell/discovery.py``) and kept fresh:

* a **local pool**'s window is the smallest ``max_model_len`` its healthy replicas report
  (discovery's ``pool_window``), with the age of the read; its served model is known once a
  healthy replica lists the configured model;
* a **window learned from an engine's own overflow numbers** (a ``WindowLearned`` note of
  the walk) overrides discovery's until discovery reads the engines again; a window that
  contradicts a known one is a *stale* window, logged as an error and counted
  (``kvroute_discovery_total{outcome="stale_window"}``), never silent;
* an **external pool** (``pools.<name>.external``, an OpenAI-compatible provider) enters the
  plan with ``external=True``, its catalog (the configured mapping, or the provider's
  ``/v1/models`` as discovery last read it) and ``served_model``, the provider's name for
  this route's model, so ``core/tiers.eligibility`` lets a request escalate there only when
  its model maps into the catalog. A provider gets no exact count, no window refresh (its
  catalog has its own schedule) and no warm-ahead.

Snapshots are reused for ``POOLS_CACHE_S``: discovery changes them every few seconds at most,
and rebuilding them per request costs a copy of every replica's record.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final, Protocol

from kvroute.config import RouteConfig, RouterConfig
from kvroute.core.clock import Clock
from kvroute.core.tiers import TierPool
from kvroute.core.types import PoolName, ReplicaId
from kvroute.core.walk import WindowLearned
from kvroute.shell.metrics import RouterMetrics

__all__ = ["POOLS_CACHE_S", "TierPools", "TierView"]

log = logging.getLogger("kvroute.tiers")

POOLS_CACHE_S: Final = 0.25
"""How long one snapshot of a route's pools (windows, served models) is reused."""


class _Info(Protocol):
    served_model: str | None
    models_fetched_at_s: float | None


class _Catalog(Protocol):
    models: frozenset[str]
    windows: Mapping[str, int]
    fetched_at_s: float


class TierView(Protocol):
    """What the tier logic reads from discovery (``shell/discovery.py`` implements it).

    ``external_catalog(pool)`` (an external provider's ``/v1/models``) is read when the
    view has it; a view without it knows no provider catalogs.
    """

    def pool_window(self, pool: str) -> int | None: ...

    def healthy_replicas(self, pool: str) -> list[ReplicaId]: ...

    def replica_info(self, replica: str) -> _Info: ...

    def invalidate_window(self, pool: str) -> None: ...



class TierPools:
    """The route's pools as the walk plans over them (module docstring).

    Args:
        config: the router config (pools, models, external providers).
        discovery: windows, served models, window invalidation; None = windows unknown.
        metrics: stale and learned windows, pool windows.
        clock: monotonic seconds, the same clock discovery stamps windows with.
    """

    def __init__(self, config: RouterConfig, *, discovery: TierView | None,
                 metrics: RouterMetrics, clock: Clock) -> None:
        self._config = config
        self._discovery = discovery
        self._metrics = metrics
        self._clock = clock
        # Windows the engines themselves stated in an overflow, newer than discovery's read.
        self._learned: dict[str, tuple[int, float]] = {}
        self._pools_cache: dict[str, tuple[float, tuple[TierPool, ...]]] = {}

    # -- windows --------------------------------------------------------------------------

    def tier_pools(self, route: RouteConfig) -> tuple[TierPool, ...]:
        """The route's pools as ``core/tiers.py`` sees them now (cached ``POOLS_CACHE_S``;
        immutable: a walk takes its own copy to learn windows into)."""
        now = self._clock.now()
        cached = self._pools_cache.get(route.name)
        if cached is not None and now - cached[0] < POOLS_CACHE_S:
            return cached[1]
        pools = tuple(self._external_pool(name, route.name) if self.is_external(name)
                      else self._tier_pool(name, now) for name in route.pools)
        self._pools_cache[route.name] = (now, pools)
        return pools

    def alternates(self, route: RouteConfig) -> dict[PoolName, TierPool]:
        """The pools the route's scenarios may put in place of one of its own (A/B arms,
        a failover backup), as the tier logic sees them now (docs/model-bound-caches.md)."""
        scenarios = route.scenarios
        names: list[PoolName] = []
        if scenarios.ab_split is not None:
            names += [arm.pool for arm in scenarios.ab_split.arms]
        if scenarios.failover is not None:
            names.append(scenarios.failover.backup)
        now = self._clock.now()
        return {name: (self._external_pool(name, route.name) if self.is_external(name)
                       else self._tier_pool(name, now))
                for name in names if name not in route.pools}

    def _tier_pool(self, name: PoolName, now: float) -> TierPool:
        disc = self._discovery
        model = self._config.pools[name].model
        if disc is None:
            return TierPool(name)
        window = disc.pool_window(name)
        fetched: float | None = None
        served: str | None = None
        for replica in disc.healthy_replicas(name):
            info = disc.replica_info(replica)
            if info.served_model == model:
                served = model
            if info.models_fetched_at_s is not None:
                fetched = max(fetched or info.models_fetched_at_s, info.models_fetched_at_s)
        learned = self._learned.get(name)
        if learned is not None:
            if fetched is None or fetched <= learned[1]:
                window, fetched = learned
            else:
                del self._learned[name]  # discovery has read the engines since
        if window is None:
            fetched = None
        return TierPool(name, window=window, window_fetched_at_s=fetched, served_model=served)

    # -- external pools -------------------------------------------------------------------

    def is_external(self, pool: str) -> bool:
        """True when ``pool`` is an external OpenAI-compatible provider."""
        return self._config.pools[PoolName(pool)].external is not None

    def _provider_catalog(self, pool: PoolName) -> _Catalog | None:
        read = getattr(self._discovery, "external_catalog", None)
        catalog: _Catalog | None = None if read is None else read(pool)
        return catalog

    def _external_pool(self, name: PoolName, route_model: str) -> TierPool:
        """The provider as ``core/tiers.py`` sees it for requests of ``route_model``.

        ``catalog`` is what the provider serves as far as the router knows (the configured
        mapping's provider models, or the ``/v1/models`` list when ``catalog_from_models``;
        ``None`` while that list is unknown); ``served_model`` the provider's name for
        ``route_model`` (``None`` without a configured mapping: the model keeps its name).
        A route the configured mapping leaves out gets an empty catalog, so it is never
        sent under a name the operator did not map.
        """
        ext = self._config.pools[name].external
        assert ext is not None, f"pool {name!r} is not external"
        served: str | None = None
        catalog: frozenset[str] | None
        if ext.catalog is not None:
            served = ext.catalog.get(route_model)
            catalog = frozenset(ext.catalog.values()) if served is not None else frozenset()
        else:
            catalog = None
        window: int | None = None
        fetched: float | None = None
        if ext.catalog_from_models:
            provider = self._provider_catalog(name)
            if provider is None:
                catalog = None if served is not None or ext.catalog is None else catalog
            else:
                listed = provider.models
                catalog = listed if ext.catalog is None else (catalog or frozenset()) & listed
                window = provider.windows.get(served or route_model)
                fetched = provider.fetched_at_s if window is not None else None
        return TierPool(name, window=window, window_fetched_at_s=fetched, external=True,
                        catalog=catalog, served_model=served)

    def upstream_model(self, route: RouteConfig, pool: PoolName) -> str:
        """The ``model`` to send to ``pool``: the engines' served name, or for a provider the
        catalog's name for the route (the route's own name without a configured mapping)."""
        config = self._config.pools[pool]
        if config.external is None:
            return config.model
        if config.external.catalog is not None:
            return config.external.catalog.get(route.name, route.name)
        return route.name

    def learn(self, note: WindowLearned) -> None:
        """An engine stated its pool's window (a walk's ``WindowLearned``): adopt it, say
        so, and have discovery re-read the engines.

        A window that differs from a known one is a *stale* window (the engine was restarted
        with another ``--max-model-len``, or a swap slot changed model): logged as an error
        and counted as ``kvroute_discovery_total{outcome="stale_window"}``; a window learned
        where none was known is counted as ``window_learned``.
        """
        if note.previous is not None:
            log.error("[CONTEXT-ROUTE] stale window: pool %r was believed to hold %d tokens, "
                      "but replica %s says %d; using %d and re-reading /v1/models", note.pool,
                      note.previous, note.replica, note.window, note.window)
            self._metrics.discovery(note.replica, "stale_window")
        else:
            log.warning("[CONTEXT-ROUTE] window of pool %r learned from replica %s: %d tokens",
                        note.pool, note.replica, note.window)
            self._metrics.discovery(note.replica, "window_learned")
        self._learned[note.pool] = (note.window, note.now_s)
        self._pools_cache.clear()
        self._metrics.set_pool_window(note.pool, note.window)
        if self._discovery is not None:
            self._discovery.invalidate_window(note.pool)

    def refresh(self, pools: tuple[PoolName, ...]) -> None:
        """Ask discovery to re-read these pools' windows (stale or unknown)."""
        if self._discovery is not None:
            for pool in pools:
                self._discovery.invalidate_window(pool)
