"""Context-window tiers in the live router: estimate, pick the tier, recover from overflows.

Owns the shell half of DESIGN.md steps 2-4 and 7 for one request, around the pure decisions
of ``core/tokens.py``, ``core/tiers.py`` and ``core/warm.py``:

* the **estimate**: ``from_session`` when the session's last ``usage`` is known (kept here
  in a bounded LRU, fed from the answers' ``usage``), else ``estimate_request``;
* the **tier plan**: ``plan_tier`` over the route's pools with windows from discovery (or
  learned from an engine's own overflow numbers), asking the pool's ``PromptTokenizer`` for
  an exact count when the plan needs one;
* the **reactive plan**: an engine's overflow rejection (``wire.overflow.parse_overflow``)
  becomes ``plan_recovery``'s clamp-retry, escalation or give-up, and a window the engine
  contradicts is learned, logged and counted (a stale window is never silent);
* the **warm-ahead decision** (``WarmPlanner.consider``, pure); ``shell/warm.py`` sends it;
* the **completion**: cut-short answers counted, the session's usage recorded.

It never sends an inference request and never calls ``RouterCore``: ``shell/app.py`` routes
and forwards (choosing the tier is separate from choosing the replica and from sending).

Why the placed pool's exact count is used to re-plan: routing needs the prompt's token ids
anyway (block hashes), so once they are known the tier decision is checked against the exact
count instead of the heuristic band, at no extra call. A fit decided on an estimate can only
fail at the engine; a fit decided on an exact count cannot. Token counts from one pool's
tokenizer are taken as exact for the route's other pools (tiers of one route serve one model
family); a difference shows up as one reactive round trip, never as a failure.

External pools (``pools.<name>.external``, an OpenAI-compatible provider) enter the plan as
``TierPool(external=True, catalog=..., served_model=...)``: the catalog is the configured
mapping, or the provider's ``/v1/models`` as discovery last read it, and ``served_model`` the
provider's name for this route's model, so ``core/tiers.eligibility`` lets a request escalate
there only when its model maps into the catalog. When the plan passes the provider over for
that reason, one ``[CONTEXT-ROUTE]`` line says the request stays local and why. A provider
gets no exact count (no ``/tokenize``), no window refresh (its catalog has its own schedule)
and no warm-ahead (a provider's prefix cache, if any, is not ours to fill); the shell sends
to its least-loaded endpoint (``least_loaded``) under the provider's model name
(``upstream_model``).

``routes.<name>.proactive: false`` is the reactive-only switch: no estimate decides the tier;
the request goes to the first eligible pool at or above its session's tier, with the
client's ``max_tokens``, and only the reactive path below moves it.

Session state kept here (per tenant, route and session id, LRU-bounded by
``state.max_pins``): the last ``usage`` and the tier the session escalated to, so a session
does not flap back to a pool that lacks its prefix. It is per process; with several routers a
session's first request on another process starts from the heuristic estimate and tier 0,
which costs at most one proactive re-escalation.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, Protocol

from kvroute.config import RouteConfig, RouterConfig
from kvroute.core.clock import Clock
from kvroute.core.tiers import (
    LOG_TAG,
    OVERFLOW_ERROR_CODE,
    OVERFLOW_ERROR_PARAM,
    OVERFLOW_ERROR_TYPE,
    AttemptState,
    Escalate,
    GiveUp,
    NeedExactCount,
    NoFit,
    NoPool,
    OverflowNumbers,
    OverflowPart,
    Place,
    PlaceReason,
    RecoveryPlan,
    Retry,
    Skip,
    SkipReason,
    TierPool,
    eligibility,
    learn_window,
    plan_recovery,
    plan_tier,
    was_cut_short,
)
from kvroute.core.tokens import MalformedBodyError, TokenEstimate, estimate_request, from_session
from kvroute.core.types import PoolName, ReplicaId
from kvroute.core.warm import WarmFire, WarmPlanner, WarmSkip
from kvroute.shell.metrics import RouterMetrics
from kvroute.tokenize.prompt import PromptTokenizer
from kvroute.wire.openai import ParsedRequest, error_body
from kvroute.wire.overflow import Overflow

__all__ = [
    "POOLS_CACHE_S",
    "SessionUsage",
    "TierRefused",
    "TierView",
    "TierWalk",
    "Tiering",
    "overflow_numbers",
    "session_key",
]

log = logging.getLogger("kvroute.tiers")

POOLS_CACHE_S: Final = 0.25
"""How long one snapshot of a route's pools (windows, served models) is reused: discovery
changes them every few seconds at most, and rebuilding them per request costs a copy of
every replica's record."""


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


def session_key(tenant: str, route: str, session: str | None) -> str | None:
    """The key of a session's tier state: sessions never cross tenants or routes."""
    return None if session is None else f"{tenant}\x1f{route}\x1f{session}"


@dataclass(frozen=True, slots=True)
class SessionUsage:
    """A session's last answer as the engine counted it (its ``usage``)."""

    prompt_tokens: int
    completion_tokens: int
    num_messages: int


@dataclass(slots=True)
class _Session:
    usage: SessionUsage | None = None
    tier: int = 0


class TierRefused(Exception):
    """No pool of the route can take the request: answer ``status`` with ``body`` (OpenAI's
    overflow wording and numbers). Not a ``RouterError``: it is a normal outcome turned into
    an HTTP answer by ``shell/app.py``, never raised past it."""

    def __init__(self, status: int, body: bytes, log_line: str) -> None:
        super().__init__(log_line)
        self.status = status
        self.body = body
        self.log_line = log_line


@dataclass(slots=True)
class TierWalk:
    """One request's way through the tiers: the plan, the attempts, what was learned.

    Invariant: ``state.pool_index`` is the pool of the last attempt (``pool_name``), and
    ``max_tokens`` is what that attempt sent (``None``: the client's value unchanged).
    """

    route: RouteConfig
    parsed: ParsedRequest
    session_key: str | None
    pools: list[TierPool]
    estimate: TokenEstimate
    place: Place
    state: AttemptState
    token_ids: dict[PoolName, Sequence[int] | None] = field(default_factory=dict)
    num_overflows: int = 0
    warm_hit: bool = False

    @property
    def pool_index(self) -> int:
        return self.state.pool_index

    @property
    def pool_name(self) -> PoolName:
        return PoolName(self.pools[self.state.pool_index].name)

    @property
    def max_tokens(self) -> int | None:
        """The ``max_tokens`` to send now, or None to leave the client's untouched."""
        sent = self.state.max_tokens
        return None if sent is None or sent == self.parsed.max_tokens else sent


def overflow_numbers(overflow: Overflow) -> OverflowNumbers:
    """``wire.overflow.Overflow`` → the pure ``OverflowNumbers`` (same part values)."""
    return OverflowNumbers(
        part=OverflowPart(overflow.kind.value),
        window=overflow.window,
        prompt_tokens=overflow.prompt_tokens,
        prompt_is_lower_bound=overflow.prompt_is_lower_bound,
        requested_output_tokens=overflow.requested_output_tokens,
    )


class Tiering:
    """The tier decisions of the live router (module docstring).

    Args:
        config: the router config (routes, warm-ahead, discovery TTL, state bounds).
        discovery: windows, served models, window invalidation; None = windows unknown.
        tokenizers: each pool's prompt tokenizer (exact counts and routing tokens).
        metrics: escalations, warm-ahead skips and hits, cut-short answers.
        clock: monotonic seconds, the same clock discovery stamps windows with.
    """

    def __init__(self, config: RouterConfig, *, discovery: TierView | None,
                 tokenizers: Mapping[str, PromptTokenizer], metrics: RouterMetrics,
                 clock: Clock) -> None:  # fmt: skip
        self._config = config
        self._discovery = discovery
        self._tokenizers = tokenizers
        self._metrics = metrics
        self._clock = clock
        warm = config.warm_ahead
        self.planner = WarmPlanner(fraction=warm.fraction, cooldown_s=warm.cooldown_s,
                                   max_sessions=config.state.max_warm, enabled=warm.enabled,
                                   rewarm_fraction=warm.rewarm_fraction)
        self._window_ttl_s = config.discovery.window_ttl_s
        self._max_sessions = config.state.max_pins
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        # Windows the engines themselves stated in an overflow, newer than discovery's read.
        self._learned: dict[str, tuple[int, float]] = {}
        self._pools_cache: dict[str, tuple[float, tuple[TierPool, ...]]] = {}
        # External endpoints' last choice (a counter), for least-recently-chosen ties.
        self._chosen: dict[ReplicaId, int] = {}
        self._num_chosen = 0

    # -- windows --------------------------------------------------------------------------

    def tier_pools(self, route: RouteConfig) -> list[TierPool]:
        """The route's pools as ``core/tiers.py`` sees them now (cached ``POOLS_CACHE_S``)."""
        now = self._clock.now()
        cached = self._pools_cache.get(route.name)
        if cached is not None and now - cached[0] < POOLS_CACHE_S:
            return list(cached[1])
        pools = tuple(self._external_pool(name, route.name) if self.is_external(name)
                      else self._tier_pool(name, now) for name in route.pools)
        self._pools_cache[route.name] = (now, pools)
        return list(pools)

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

    def least_loaded(self, candidates: Mapping[ReplicaId, int]) -> ReplicaId | None:
        """The external endpoint to use: fewest requests in flight, ties to the one chosen
        least recently (never list order, which would pile every tie on the first).

        Args:
            candidates: each healthy endpoint's requests in flight.
        """
        if not candidates:
            return None
        best = min(candidates, key=lambda r: (candidates[r], self._chosen.get(r, -1)))
        self._num_chosen += 1
        self._chosen[best] = self._num_chosen
        return best

    def _log_external_skips(self, skipped: Sequence[Skip], model: str, outcome: str) -> None:
        for skip in skipped:
            if skip.reason in (SkipReason.NOT_IN_CATALOG, SkipReason.CATALOG_UNKNOWN,
                               SkipReason.NO_MODEL):  # fmt: skip
                log.info("%s external pool %r not used for model %r: %s; the request stays "
                         "local: %s", LOG_TAG,
                         skip.pool_name, model, skip.detail, outcome)

    def learn(self, walk: TierWalk, index: int, window: int, replica: ReplicaId) -> None:
        """An engine of ``walk.pools[index]`` stated its window: adopt it, say so, re-read.

        A window that differs from a known one is a *stale* window (the engine was restarted
        with another ``--max-model-len``, or a swap slot changed model): logged as an error
        and counted as ``kvroute_discovery_total{outcome="stale_window"}``; a window learned
        where none was known is counted as ``window_learned``.
        """
        pool = walk.pools[index]
        now = self._clock.now()
        if pool.window is not None:
            log.error("[CONTEXT-ROUTE] stale window: pool %r was believed to hold %d tokens, "
                      "but replica %s says %d; using %d and re-reading /v1/models", pool.name,
                      pool.window, replica, window, window)
            self._metrics.discovery(replica, "stale_window")
        else:
            log.warning("[CONTEXT-ROUTE] window of pool %r learned from replica %s: %d tokens",
                        pool.name, replica, window)
            self._metrics.discovery(replica, "window_learned")
        walk.pools[index] = learn_window(pool, window, now)
        self._learned[pool.name] = (window, now)
        self._pools_cache.clear()
        self._metrics.set_pool_window(pool.name, window)
        if self._discovery is not None:
            self._discovery.invalidate_window(pool.name)

    # -- sessions -------------------------------------------------------------------------

    def _session(self, key: str | None, *, create: bool) -> _Session | None:
        if key is None:
            return None
        entry = self._sessions.get(key)
        if entry is None:
            if not create:
                return None
            entry = self._sessions[key] = _Session()
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(key)
        return entry

    def session_usage(self, key: str | None) -> SessionUsage | None:
        entry = self._session(key, create=False)
        return None if entry is None else entry.usage

    def session_tier(self, key: str | None) -> int:
        entry = self._session(key, create=False)
        return 0 if entry is None else entry.tier

    def _raise_tier(self, key: str | None, index: int) -> None:
        entry = self._session(key, create=index > 0)
        if entry is not None and index > entry.tier:
            entry.tier = index

    # -- the proactive plan ---------------------------------------------------------------

    def estimate(self, parsed: ParsedRequest, key: str | None) -> TokenEstimate:
        """The prompt's estimate: from the session's last usage when known (chat only)."""
        usage = self.session_usage(key)
        try:
            if usage is not None and parsed.endpoint == "chat":
                return from_session(usage.prompt_tokens, usage.completion_tokens,
                                    usage.num_messages, parsed.body)  # fmt: skip
            return estimate_request(parsed.body, endpoint=parsed.endpoint)
        except MalformedBodyError as exc:  # parse_request validated the body: a bug if here
            raise AssertionError(f"a validated body could not be estimated: {exc}") from exc

    async def tokens(self, walk: TierWalk, pool: PoolName) -> Sequence[int] | None:
        """The prompt's token ids for ``pool`` (its tokenizer), asked at most once per walk: a
        list or an ``array('I')`` (``PromptTokenizer.token_ids``)."""
        if pool in walk.token_ids:
            return walk.token_ids[pool]
        if self.is_external(pool):  # a provider has no /tokenize and no index to hash for
            walk.token_ids[pool] = None
            return None
        tokenizer = self._tokenizers.get(pool)
        ids = None if tokenizer is None else await tokenizer.token_ids(walk.parsed)
        walk.token_ids[pool] = ids
        return ids

    async def plan(self, route: RouteConfig, parsed: ParsedRequest, key: str | None) -> TierWalk:
        """Choose the tier for a request (DESIGN.md steps 2-3).

        Raises:
            TierRefused: no pool can hold the prompt and the output floor (400 with OpenAI's
                wording and the numbers), or no pool may serve the model.
        """
        pools = self.tier_pools(route)
        estimate = self.estimate(parsed, key)
        walk = TierWalk(route, parsed, key, pools, estimate, _NO_PLACE,
                        AttemptState(0, parsed.max_tokens, parsed.max_tokens, estimate.high))
        min_index = min(self.session_tier(key), len(pools) - 1)
        if not route.proactive:
            return self._reactive_only(walk, min_index)
        exact_available = True
        now = self._clock.now()
        # Bounded: each round either asks one pool for an exact count (at most once per pool,
        # then the estimate is exact and no round asks again) or ends.
        for _ in range(len(pools) + 2):
            plan = plan_tier(
                pools, estimate, parsed.max_tokens, now_s=now, request_model=parsed.model,
                output_floor=route.output_floor, tokenize_margin=route.tokenize_margin,
                window_ttl_s=self._window_ttl_s, exact_count_available=exact_available,
                min_pool_index=min_index,
            )
            if isinstance(plan, NeedExactCount):
                log.debug("%s", plan.log_line)
                ids = await self.tokens(walk, PoolName(plan.pool_name))
                if ids is None:
                    exact_available = False
                else:
                    estimate = TokenEstimate.exact_count(len(ids))
                continue
            if isinstance(plan, Place) and not estimate.exact and exact_available:
                ids = await self.tokens(walk, PoolName(plan.pool_name))
                if ids is not None:
                    estimate = TokenEstimate.exact_count(len(ids))
                    continue  # check the fit on the exact count
            break
        else:
            plan = plan_tier(pools, estimate, parsed.max_tokens, now_s=now,
                             request_model=parsed.model, output_floor=route.output_floor,
                             exact_count_available=False, min_pool_index=min_index)
        self._refresh(pools, getattr(plan, "stale_pools", ()))
        skipped: Sequence[Skip] = getattr(plan, "skipped", ())
        if isinstance(plan, NoFit | NoPool):
            log.warning("%s", plan.log_line)
            self._log_external_skips(skipped, parsed.model, "no local pool holds it → 400")
            message = plan.message
            raise TierRefused(400, error_body(
                message, status=400, type=OVERFLOW_ERROR_TYPE, param=OVERFLOW_ERROR_PARAM,
                code=OVERFLOW_ERROR_CODE if isinstance(plan, NoFit) else "model_not_found",
            ), plan.log_line)
        assert isinstance(plan, Place), f"plan_tier returned {type(plan).__name__}"
        notable = (plan.reason is not PlaceReason.FITS or plan.clamped_max_tokens is not None
                   or plan.skipped or plan.stale_pools)  # fmt: skip
        level = logging.INFO if notable else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(level, "%s", plan.log_line)
        self._log_external_skips(skipped, parsed.model, f"placed on {plan.pool_name!r}")
        walk.estimate = estimate
        walk.place = plan
        walk.state = AttemptState.first(plan, estimate, parsed.max_tokens)
        if plan.escalated:
            first_small = next(s for s in plan.skipped if s.reason is SkipReason.TOO_SMALL)
            self._metrics.escalation(first_small.pool_name, plan.pool_name, "proactive")
            self._warm_hit(walk)
        self._raise_tier(key, plan.pool_index)
        return walk

    def _reactive_only(self, walk: TierWalk, min_index: int) -> TierWalk:
        """``proactive: false``: the first eligible pool from the session's tier, untouched
        ``max_tokens``; the reactive path alone escalates (module docstring).

        Raises:
            TierRefused: no pool of the route may serve the model (catalog rule).
        """
        parsed, pools = walk.parsed, walk.pools
        skipped: list[Skip] = []
        for i in range(min_index, len(pools)):
            skip = eligibility(pools[i], i, parsed.model)
            if skip is None:
                line = f"{LOG_TAG} reactive-only: → {pools[i].name!r} (proactive off)"
                log.debug("%s", line)
                walk.place = Place(i, pools[i].name, None, PlaceReason.FITS,
                                   partial(str, line), walk.estimate.low, tuple(skipped))
                walk.state = AttemptState.first(walk.place, walk.estimate, parsed.max_tokens)
                return walk
            skipped.append(skip)
        line = f"{LOG_TAG} reactive-only: no eligible pool → 400"
        self._log_external_skips(skipped, parsed.model, "no pool of the route may serve it → 400")
        message = ("No pool of this route can serve model "
                   f"{parsed.model!r}: " + "; ".join(s.detail for s in skipped))
        raise TierRefused(400, error_body(message, status=400, type=OVERFLOW_ERROR_TYPE,
                                          param=OVERFLOW_ERROR_PARAM, code="model_not_found"),
                          line)

    def _refresh(self, pools: Sequence[TierPool], stale: Sequence[int]) -> None:
        if self._discovery is None:
            return
        for i in stale:
            if not pools[i].external:  # a provider's catalog is re-read on its own schedule
                self._discovery.invalidate_window(pools[i].name)

    def _warm_hit(self, walk: TierWalk) -> None:
        key = walk.session_key
        if key is None or walk.warm_hit:
            return
        if self.planner.warmed_target(key, self._clock.now()) == walk.pool_index:
            walk.warm_hit = True
            self._metrics.warm("hit")

    # -- the reactive plan ----------------------------------------------------------------

    def recover(self, walk: TierWalk, overflow: Overflow, replica: ReplicaId) -> RecoveryPlan:
        """An engine of the walk's current pool rejected the request as too long.

        Applies a window the engine contradicts (``learn``), logs the plan's line, and moves
        the walk to the next attempt (``Retry`` / ``Escalate``); ``GiveUp`` leaves it.
        """
        walk.num_overflows += 1
        before = walk.state.pool_index
        plan = plan_recovery(walk.state, overflow_numbers(overflow), walk.pools,
                             request_model=walk.parsed.model,
                             output_floor=walk.route.output_floor)  # fmt: skip
        if plan.learned_window is not None:
            self.learn(walk, before, plan.learned_window, replica)
        log.warning("%s (replica %s, style %s)", plan.log_line, replica, overflow.style)
        if isinstance(plan, GiveUp):
            later = (eligibility(walk.pools[j], j, walk.parsed.model)
                     for j in range(before + 1, len(walk.pools)))
            self._log_external_skips([s for s in later if s is not None], walk.parsed.model,
                                     "no larger local pool → 400")
        if isinstance(plan, Retry | Escalate):
            walk.state = plan.state
        if isinstance(plan, Escalate):
            self._metrics.escalation(walk.pools[before].name, walk.pool_name, "reactive")
            self._raise_tier(walk.session_key, walk.pool_index)
            self._warm_hit(walk)
        return plan

    @staticmethod
    def give_up_body(plan: GiveUp) -> bytes:
        """The 400 for a request no pool could take, in OpenAI's overflow shape."""
        return error_body(plan.message, status=400, type=OVERFLOW_ERROR_TYPE,
                          param=OVERFLOW_ERROR_PARAM, code=OVERFLOW_ERROR_CODE)

    # -- warm-ahead -----------------------------------------------------------------------

    def consider_warm(self, walk: TierWalk) -> WarmFire | None:
        """The pure warm-ahead decision for this request; counts skips by reason.

        A fire is recorded in this process's cooldown view at once (so a concurrent request
        of the same session does not fire again at the same growth stage); the shared claim
        (``try_start_warm`` on ``fire.claim_key``) is made by the background sender, off the
        request path.
        """
        now = self._clock.now()
        decision = self.planner.consider(walk.session_key, walk.estimate.low, walk.pools,
                                         walk.pool_index, now, request_model=walk.parsed.model,
                                         claim=False)  # fmt: skip
        if isinstance(decision, WarmSkip):
            self._metrics.warm("skipped", decision.reason.value)
            return None
        if walk.pools[decision.target_pool_index].external:
            self._metrics.warm("skipped", "external")  # a provider's cache is not ours to fill
            return None
        self.planner.mark_fired(decision.session_id, now, stage=decision.stage,
                                target_pool_index=decision.target_pool_index)
        log.info("%s", decision.log_line)
        return decision

    # -- completion -----------------------------------------------------------------------

    def on_complete(self, walk: TierWalk, finish_reasons: Sequence[str | None],
                    usage: Mapping[str, Any] | None) -> None:  # fmt: skip
        """Count a cut-short answer and remember the session's usage.

        Args:
            finish_reasons: each choice's ``finish_reason`` (empty when unknown).
            usage: the answer's ``usage`` object, when the engine sent one.
        """
        parsed = walk.parsed
        completion = _count(usage, "completion_tokens")
        if parsed.n == 1 and len(finish_reasons) == 1 and completion is not None:
            sent = walk.state.max_tokens
            clamped = sent if sent != parsed.max_tokens else None
            if was_cut_short(parsed.max_tokens, clamped, finish_reasons[0], completion):
                self._metrics.cut_short(walk.pool_name)
        prompt = _count(usage, "prompt_tokens")
        if (walk.session_key is None or parsed.messages is None or prompt is None
                or completion is None or parsed.n != 1):  # fmt: skip
            return
        entry = self._session(walk.session_key, create=True)
        assert entry is not None, "a session key always has an entry once created"
        entry.usage = SessionUsage(prompt, completion, len(parsed.messages))


def _count(usage: Mapping[str, Any] | None, key: str) -> int | None:
    if usage is None:
        return None
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


_NO_PLACE: Final = Place(0, "", None, PlaceReason.FITS, partial(str, ""), 0)
"""Placeholder of a walk under construction (replaced before ``plan`` returns it)."""
