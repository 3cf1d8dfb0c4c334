"""The request walk: one request's way from its prompt to its last byte, as a state machine.

This module holds every decision of the walk (docs/architecture.md, "The request walk") and
performs none of its I/O. It is driven by two drivers that run the *same* steps:

* ``shell/forward.py`` (the live router) with awaits: tokenizer calls, HTTP to the engines;
* ``sim/fleet.py`` (the simulator) with virtual delays on an event heap.

So a benchmark of the simulator measures the decisions that serve production traffic: tiers,
exact-count rechecks, session pins, tenancy scope, warm-ahead guards, retries after a failed
replica and reactive recovery from an engine's overflow rejection.

Theory of operation (h11's shape: facts in, the next action out)
----------------------------------------------------------------

A driver makes a :class:`RequestWalk` with :meth:`Walker.start` from what it knows when the
request arrives (:class:`WalkRequest`: route, tenant, session, body, client ``max_tokens``),
the route's pools as discovery sees them now (``core/tiers.TierPool``) and the session's
:class:`~kvroute.core.session.SessionRecord`. It then loops::

    action = walk.begin()
    while True:
        NeedTokens(pool)  -> get the prompt's token ids for that pool; action = walk.tokens(...)
        Send(decision)    -> a split (decision.prefill_replica set): first the prefill half
                             there, then walk.prefill_answered() or, when it failed,
                             action = walk.prefill_failed(...) (colocated: a new Send);
                             forward to decision.replica; then exactly one of:
                               walk.overflowed(numbers)  (the engine rejected it as too long)
                               walk.failed(...)          (no answer before the first byte)
                               walk.answered()           (first byte / first token)
                             the first two return the next action
        Refuse(...)       -> answer the client with that status; the walk has ended
        Fail(...)         -> answer with the engine's error or a 502/504; the walk has ended
    walk.end(finish_reasons, usage) -> the session record to write, if any

``end`` is idempotent and must be called on every exit path (it releases the load the walk
opened on ``RouterCore``). Everything a driver should count or log is queued as a *note*
(:class:`Decided`, :class:`Escalated`, :class:`WindowLearned`, ...) and drained with
:meth:`RequestWalk.take_notes` (vLLM's ``take_events`` pattern): the live router turns notes
into Prometheus series and log lines, the simulator into counters.

The steps, in order (each names the pure module that owns the decision):

1. **Estimate** (``core/tokens.py``): from the session's last ``usage`` when known, else
   from the body.
2. **Tier** (``core/tiers.plan_tier``): the first pool at or above the session's tier whose
   window holds the prompt and the output floor; ``NeedExactCount`` becomes
   :class:`NeedTokens` with ``for_count=True``; a placement decided on an estimate is
   re-checked on the exact count when the pool's tokens can be had (they are needed for the
   block hashes anyway). ``proactive: false`` routes skip the estimate.
3. **Warm-ahead** (``core/warm.WarmPlanner``): decided on the first placement, carried on
   the first :class:`Send` as ``warm``; the driver sends it in the background.
4. **Route** (``core/router.RouterCore.route``): exact tokens for the pool, or text
   (approximate), in the tenant's ``TenantScope``, the session's pin as
   ``preferred_replica`` when it is in the pool; an external provider's least-loaded
   endpoint (:class:`ExternalChooser`).
5. **Recover**: an overflow goes to ``core/tiers.plan_recovery`` (clamp and retry on the
   same replica, escalate, or give up with a 400); any other failure before the first byte
   moves to the next replica of the ranking (``RouterCore.reroute``), at most
   ``max_retries`` times.
6. **Account**: first token and completion on ``RouterCore``; a cut-short answer noted; the
   session's record (pin, tier, usage) returned for the driver to write once; when the
   session now rests beside others on a crowded replica, a spread-ahead copy to an idle
   one is asked for (``core/spread.py``, a ``ShadowWarm`` of scenario ``spread``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Final, Literal, TypeVar

from kvroute.core.clock import Clock
from kvroute.core.errors import NoEligibleReplica
from kvroute.core.index import TenantScope
from kvroute.core.router import RouterCore, RouteRequest, RoutingDecision
from kvroute.core.scenarios import (
    NO_SCENARIOS,
    HotSession,
    RouteScenarios,
    ScenarioState,
    UpgradeProgress,
    UpgradeSettings,
    choose_arm,
    primary_usable,
    recompute_bill,
    version_salt,
)
from kvroute.core.session import EMPTY_RECORD, SessionRecord, SessionUsage, session_key
from kvroute.core.spread import SpreadCopy, SpreadPlanner, SpreadSettings
from kvroute.core.tiers import (
    LOG_TAG,
    OVERFLOW_ERROR_CODE,
    OVERFLOW_ERROR_PARAM,
    OVERFLOW_ERROR_TYPE,
    AttemptState,
    CutShort,
    Escalate,
    GiveUp,
    NeedExactCount,
    NoFit,
    NoPool,
    OverflowNumbers,
    Place,
    PlaceReason,
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
from kvroute.core.tokens import (
    DEFAULT_ESTIMATE_CONFIG,
    EstimateConfig,
    EstimateSource,
    MalformedBodyError,
    TokenEstimate,
    estimate_request,
    from_session,
)
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName, WireHash
from kvroute.core.verdict_book import GateRefusal, salt_version
from kvroute.core.versions import GroupChoice, choose_group
from kvroute.core.warm import WarmFire, WarmPlanner, WarmSkip

__all__ = [
    "DEFAULT_EXPECTED_OUTPUT_TOKENS",
    "MIN_OUTPUT_PAIRS",
    "ArmServed",
    "Decided",
    "Escalated",
    "ExternalChooser",
    "Fail",
    "FailReason",
    "GateRefused",
    "LogLine",
    "NeedTokens",
    "Note",
    "OutputLengths",
    "Recovered",
    "Refuse",
    "ReplicaUnreachable",
    "RequestWalk",
    "ScenarioMove",
    "Send",
    "SessionWrite",
    "ShadowWarm",
    "StaleWindows",
    "UpstreamFailed",
    "WalkAction",
    "WalkRequest",
    "WalkRoute",
    "WalkSettings",
    "Walker",
    "WarmNote",
    "WindowLearned",
]

DEFAULT_EXPECTED_OUTPUT_TOKENS: Final = 256
"""The output budget charged to a replica's load when the client set no ``max_tokens``."""


# --- what the driver tells the walk -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WalkRoute:
    """The route's settings the walk reads (``config.RouteConfig`` holds more)."""

    name: str
    proactive: bool = True
    output_floor: int = 256
    tokenize_margin: float = 0.2
    estimate: EstimateConfig = DEFAULT_ESTIMATE_CONFIG


@dataclass(frozen=True, slots=True)
class WalkSettings:
    """Router-wide settings of the walk.

    Attributes:
        max_retries: failures before the first byte retried on another replica.
        window_ttl_s: age past which a pool's window is stale (re-read, and an estimate that
            straddles it asks for an exact count).
        policy_needs_text: the routing policy reads the prompt's text (text-matching
            peers), so it is passed even when exact tokens are known.
    """

    max_retries: int = 2
    window_ttl_s: float = 900.0
    policy_needs_text: bool = False


@dataclass(frozen=True, slots=True)
class WalkRequest:
    """A request as the walk needs it, parsed and validated by the driver.

    Attributes:
        request_id: unique id.
        route: the route's settings.
        tenant: the authenticated tenant (every index lookup is scoped to it).
        session_id: the client's session id, if any.
        endpoint: ``"chat"`` or ``"completions"``.
        model: the model the client asked for (the external-catalog rule).
        body: the request body (for the estimate).
        max_tokens: the client's output budget (``None``: absent).
        n: choices asked for.
        num_messages: messages in a chat body (``None`` for completions).
        prompt_token_ids: token ids the body already holds (a completions prompt of ids).
        prompt_block_hashes: their block hashes in wire form, when the driver already has
            them (the simulator hashes each prompt once for router and engine).
        routing_text: renders the prompt as text (called only when needed).
        cache_salt: the salt the engines hash into block 0 (tenant salt resolved).
        exclude: replicas the request must not go to (a gateway's candidate subset, as
            the Endpoint Picker driver receives it, leaves the others out).
        adapter: the LoRA adapter the client named as its ``model`` (vLLM's way), or None
            for the route's base model; hashed with the path the pool's engines list.
        shadow_payload: what a shadow warm-up of this session would resend (the driver's
            own: the parsed request live, the workload request in the simulator).
        thinking_tokens: the thinking the engine is allowed for this request (a reasoning
            route's ``thinking_token_budget`` with thinking on; 0: none or unbounded), a
            floor of the predicted output (``OutputLengths.predict``).
    """

    request_id: RequestId
    route: WalkRoute
    tenant: TenantName
    session_id: str | None
    endpoint: Literal["chat", "completions"]
    model: str
    body: Mapping[str, Any]
    max_tokens: int | None = None
    n: int = 1
    num_messages: int | None = None
    prompt_token_ids: Sequence[int] | None = None
    prompt_block_hashes: Sequence[WireHash] | None = None
    routing_text: Callable[[], str] = field(default=lambda: "", repr=False, compare=False)
    cache_salt: str | None = None
    exclude: frozenset[ReplicaId] = frozenset()
    adapter: str | None = None
    shadow_payload: Any = field(default=None, repr=False, compare=False)
    thinking_tokens: int = 0


# --- what the walk tells the driver: actions -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class NeedTokens:
    """Get the prompt's token ids as ``pool``'s engines will see them, then call
    :meth:`RequestWalk.tokens`. ``for_count``: the tier plan needs an exact count (a
    ``/tokenize`` round trip the simulator charges); otherwise they are for routing."""

    pool: PoolName
    for_count: bool


@dataclass(frozen=True, slots=True)
class Send:
    """Forward the request as ``decision`` says, with ``max_tokens`` (``None``: the
    client's value unchanged). ``warm``: a warm-ahead to send in the background."""

    decision: RoutingDecision
    pool_index: int
    max_tokens: int | None
    external: bool
    attempt: int
    warm: WarmFire | None = None


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer ``status`` with an OpenAI-shaped error; the walk has ended.

    ``decision`` is the attempt the refusal follows, if any (its headers are stamped).
    """

    status: int
    message: str
    outcome: str
    type: str | None = None
    param: str | None = None
    code: str | int | None = None
    pool: PoolName | None = None
    decision: RoutingDecision | None = None


class FailReason(enum.StrEnum):
    """Why a failure before the first byte was not tried elsewhere."""

    NOT_RETRYABLE = "not_retryable"
    RETRIES_SPENT = "retries_spent"
    NO_REPLICA_LEFT = "no_replica_left"


@dataclass(frozen=True, slots=True)
class Fail:
    """The failure the driver just reported is final: answer with it (the engine's own
    error answer as it is, or a 502/504 saying why). The walk has ended."""

    decision: RoutingDecision
    reason: FailReason
    retries: int
    max_retries: int


WalkAction = NeedTokens | Send | Refuse | Fail


@dataclass(frozen=True, slots=True)
class SessionWrite:
    """The session record to write back, once, when the walk ends."""

    key: str
    record: SessionRecord


# --- what the walk tells the driver: notes -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Decided:
    """A replica was chosen (``routing_s``: time spent in ``RouterCore.route``)."""

    decision: RoutingDecision
    num_prompt_tokens: int
    exact: bool
    routing_s: float


@dataclass(frozen=True, slots=True)
class Escalated:
    """The request moved to a larger pool (``how``: ``proactive`` or ``reactive``)."""

    from_pool: str
    to_pool: str
    how: str


@dataclass(frozen=True, slots=True)
class Recovered:
    """An overflow rejection was planned: ``plan`` is ``retry``, ``escalate`` or
    ``give_up``; ``line`` the ``[CONTEXT-ROUTE]`` log line."""

    replica: ReplicaId
    plan: str
    line: str


@dataclass(frozen=True, slots=True)
class WindowLearned:
    """An engine stated a window other than the one believed (``previous``; None when none
    was known): the pool's view must adopt it and discovery re-read it."""

    pool: PoolName
    window: int
    previous: int | None
    replica: ReplicaId
    now_s: float


@dataclass(frozen=True, slots=True)
class StaleWindows:
    """These pools' windows are stale or unknown: discovery should re-read them."""

    pools: tuple[PoolName, ...]


@dataclass(frozen=True, slots=True)
class WarmNote:
    """A warm-ahead outcome to count: ``outcome`` ``hit`` or ``skipped`` (with ``reason``)."""

    outcome: str
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class UpstreamFailed:
    """An attempt failed before its first byte (``kind`` as the transport says it)."""

    replica: ReplicaId
    kind: str
    retried: bool


@dataclass(frozen=True, slots=True)
class ReplicaUnreachable:
    """The replica refused the connection: take it out of routing until it answers."""

    replica: ReplicaId
    detail: str


@dataclass(frozen=True, slots=True)
class CutShortNote:
    """An answer ended below the output the client asked for."""

    pool: PoolName
    why: CutShort


@dataclass(frozen=True, slots=True)
class ScenarioMove:
    """A session moved because of a scenario (``upgrade``, ``version``: its version's
    replicas changed weights or left, ``ab``, ``failover``) and re-prefills ``tokens``
    it had cached where it was (``core/scenarios.recompute_bill``)."""

    route: str
    scenario: str
    from_place: str
    to_place: str
    tokens: int


@dataclass(frozen=True, slots=True)
class GateRefused:
    """The verdict book refused a path that serves state other weights computed
    (``core/verdict_book.py``): the request recomputes instead."""

    route: str
    refusal: GateRefusal


@dataclass(frozen=True, slots=True)
class ArmServed:
    """A request of an A/B route was routed to ``arm`` (a pool)."""

    route: str
    arm: str
    num_prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class ShadowWarm:
    """Warm ``pool`` in shadow with ``items`` (``max_tokens: 1`` copies of sessions' latest
    prompts; build each with :meth:`Walker.shadow_request`, tell :meth:`Walker.shadow_done`
    when it answered or failed). ``scenario`` is ``upgrade`` (then only replicas of
    ``version`` are warmed) or ``failover`` (the backup)."""

    route: str
    scenario: str
    pool: PoolName
    version: str | None
    items: tuple[HotSession, ...]
    replicas: frozenset[ReplicaId] | None = None
    """The replicas to warm (None: any of ``version``'s, or of the pool)."""


@dataclass(frozen=True, slots=True)
class LogLine:
    """A decision line to log at ``level`` (``debug``, ``info``, ``warning``)."""

    level: str
    text: str


Note = (Decided | Escalated | Recovered | WindowLearned | StaleWindows | WarmNote
        | UpstreamFailed | ReplicaUnreachable | CutShortNote | LogLine | ScenarioMove
        | ArmServed | ShadowWarm | GateRefused)


def describe(step: WalkAction | str) -> str:
    """A step of a walk as one line of text: the decisions in it, not their timing (the
    pool, the replica, the output budget, the attempt, the warm-up's target)."""
    if isinstance(step, str):
        return step
    if isinstance(step, NeedTokens):
        return f"need_tokens {step.pool}{' for_count' if step.for_count else ''}"
    if isinstance(step, Send):
        d = step.decision
        warm = "" if step.warm is None else f" warm={step.warm.target_pool_name}"
        split = "" if d.prefill_replica is None else f" prefill={d.prefill_replica}"
        return (f"send {d.request.pool} {d.replica} max_tokens={step.max_tokens} "
                f"attempt={step.attempt}{warm}{split}")
    if isinstance(step, Refuse):
        return f"refuse {step.status} {step.outcome}"
    return f"fail {step.reason.value}"


# --- router-wide pieces ----------------------------------------------------------------------------


class ExternalChooser:
    """Picks an external provider's endpoint: fewest requests in flight, ties to the one
    chosen least recently (never list order, which would pile every tie on the first)."""

    __slots__ = ("_chosen", "_num_chosen")

    def __init__(self) -> None:
        self._chosen: dict[ReplicaId, int] = {}
        self._num_chosen = 0

    def choose(self, in_flight: Mapping[ReplicaId, int]) -> ReplicaId | None:
        """The endpoint to use among ``in_flight`` (each healthy endpoint's load)."""
        if not in_flight:
            return None
        best = min(in_flight, key=lambda r: (in_flight[r], self._chosen.get(r, -1)))
        self._num_chosen += 1
        self._chosen[best] = self._num_chosen
        return best


MIN_OUTPUT_PAIRS = 32
"""Pairs of consecutive answers a route's sessions must have given before their slope is
trusted (``OutputLengths``)."""


class OutputLengths:
    """What the walk predicts a request will output: from the session's last answer when
    known, else the route's recent mean, else ``DEFAULT_EXPECTED_OUTPUT_TOKENS``, never above
    the request's own budget. The cost policy prices a request's decode with it.

    The route's mean is an exponentially weighted average of the answers' ``usage``
    (``alpha`` per answer), so it follows a route whose traffic changes.

    A session's last answer predicts its next one only in part, so the prediction is the
    route's least-squares line through the pairs (last answer, next answer) of its sessions:
    ``mean + slope · (last − mean)``, with ``slope`` = their covariance over the last
    answers' variance (exponentially weighted, ``pair_alpha`` per pair), kept in [0, 1].
    Until ``MIN_OUTPUT_PAIRS`` pairs were seen the slope is 1 (the last answer itself).
    Why: on the Claude Code agentic trace consecutive answers of a session correlate at
    0.18; a session whose last answer was under 150 tokens answers 274 on average next, so
    taking the last answer as it is priced most decodes at a third of their length, and kept
    sessions on replicas whose batch slows their long answers (docs/benchmarks.md, "The
    whole turn"). The mean of the next answer given the last is what the decode term needs.

    Reasoning: vLLM counts the thinking in ``completion_tokens``, so the learned lengths
    hold it once a route has answers. A request allowed ``thinking`` tokens (its budget,
    thinking on) is predicted at least that much: a session whose last turn did not think,
    or a route whose mean is of answers without thinking, would otherwise price a long
    decode as a short one; with nothing learned it is ``thinking`` plus the default answer.
    """

    __slots__ = ("_alpha", "_means", "_pair_alpha", "_pairs")

    def __init__(self, alpha: float = 0.05, pair_alpha: float = 0.02) -> None:
        if not 0.0 < alpha <= 1.0 or not 0.0 < pair_alpha <= 1.0:
            raise ValueError(f"OutputLengths alpha and pair_alpha must be in (0, 1], got "
                             f"{alpha} and {pair_alpha}")
        self._alpha = alpha
        self._pair_alpha = pair_alpha
        self._means: dict[str, float] = {}
        self._pairs: dict[str, list[float]] = {}
        """route -> [pairs seen, mean last, mean next, E[last·next], E[last²]] (weighted)."""

    def slope(self, route: str) -> float:
        """How much of a session's last answer carries to its next one on ``route``, in
        [0, 1] (class docstring); 1 until ``MIN_OUTPUT_PAIRS`` pairs were seen."""
        pairs = self._pairs.get(route)
        if pairs is None or pairs[0] < MIN_OUTPUT_PAIRS:
            return 1.0
        _, mean_x, mean_y, mean_xy, mean_xx = pairs
        var = mean_xx - mean_x * mean_x
        if var <= 0.0:
            return 1.0
        return min(1.0, max(0.0, (mean_xy - mean_x * mean_y) / var))

    def predict(self, route: str, session_last: int | None, budget: int | None,
                thinking: int = 0) -> int:
        """The output tokens to expect (at least 1); ``thinking``: the thinking allowed."""
        mean = self._means.get(route)
        if session_last is not None:
            last = float(session_last)
            if mean is not None:
                last = mean + self.slope(route) * (last - mean)
            guess = max(last, float(thinking))
        elif mean is not None:
            guess = max(mean, float(thinking))
        else:
            guess = float(DEFAULT_EXPECTED_OUTPUT_TOKENS + thinking)
        if budget is not None:
            guess = min(guess, float(budget))
        return max(1, round(guess))

    def observe(self, route: str, output_tokens: int, previous: int | None = None) -> None:
        """An answer of ``route`` produced ``output_tokens``; ``previous``: the session's
        answer before it, if any (a pair for the slope)."""
        mean = self._means.get(route)
        self._means[route] = float(output_tokens) if mean is None else (
            mean + self._alpha * (output_tokens - mean))
        if previous is None:
            return
        x, y = float(previous), float(output_tokens)
        pairs = self._pairs.get(route)
        if pairs is None:
            self._pairs[route] = [1.0, x, y, x * y, x * x]
            return
        a = self._pair_alpha
        pairs[0] += 1.0
        pairs[1] += a * (x - pairs[1])
        pairs[2] += a * (y - pairs[2])
        pairs[3] += a * (x * y - pairs[3])
        pairs[4] += a * (x * x - pairs[4])


def _zero() -> float:
    return 0.0


class Walker:
    """What every walk of one router shares: the core, the warm planner, the external
    chooser and the settings. One per router process (or simulation).

    Args:
        core: the router core (index, load, policies).
        planner: the warm-ahead planner (its cooldown view is router-wide).
        settings: router-wide settings.
        clock: monotonic seconds (window ages, warm cooldowns).
        timer: measures time spent routing (``Decided.routing_s``); none by default.
        recorder: told each walk's steps as text (tests; None in production).
    """

    __slots__ = ("clock", "core", "external", "outputs", "planner", "recorder", "scenarios",
                 "settings", "spread", "timer")

    def __init__(self, core: RouterCore, planner: WarmPlanner, settings: WalkSettings,
                 clock: Clock, timer: Callable[[], float] = _zero,
                 recorder: Callable[[RequestId, str], None] | None = None) -> None:
        self.core = core
        self.planner = planner
        self.settings = settings
        self.clock = clock
        self.timer = timer
        self.external = ExternalChooser()
        self.outputs = OutputLengths()
        self.recorder = recorder
        """Told every step of every walk (``describe``), when set: both drivers of one
        scenario must tell the same story (``tests/integration/test_walk_parity.py``)."""
        self.scenarios: dict[str, ScenarioState] = {}
        """Route name → its model-bound cache scenarios' state (``core/scenarios.py``)."""
        self.spread = SpreadPlanner()
        """Spread-ahead's router-wide budget (``core/spread.py``)."""

    def observe_failover(self, route: str, state: ScenarioState,
                         now: float) -> tuple[bool, LogLine | None]:
        """The failover switch of ``route`` told the primary's state now (healthy replicas,
        engine queues): whether the backup takes the route, and the log line of a switch.
        Called by each walk before its tier plan and by :meth:`observe_failovers` between
        requests, so the hysteresis counts from when the primary became usable, not from
        the next request (docs/model-bound-caches.md, failover)."""
        failover, switch = state.settings.failover, state.failover
        if failover is None or switch is None:
            return False, None
        core = self.core
        primary = failover.primary
        healthy = [rep.name for rep in core.pool(primary).replicas if core.is_healthy(rep.name)]
        waiting = {r: core.load.snapshot(r, now).engine_waiting for r in healthy}
        before = switch.switches
        active = switch.update(now, primary_usable(healthy, waiting, failover.saturated_waiting))
        if switch.switches == before:
            return active, None
        return active, LogLine("warning", (
            f"{LOG_TAG} failover of route {route!r}: "
            + (f"{primary!r} unusable ({len(healthy)} healthy) → backup {failover.backup!r}"
               if active else f"{primary!r} usable for {failover.back_after_s:g}s → back")))

    def observe_failovers(self, now: float) -> list[tuple[str, bool, LogLine | None]]:
        """Every failover route's switch told the primary's state now (a driver calls it
        after each health round): ``(route, backup active, log line of a switch)``."""
        out: list[tuple[str, bool, LogLine | None]] = []
        for route, state in self.scenarios.items():
            if state.failover is not None:
                active, line = self.observe_failover(route, state, now)
                out.append((route, active, line))
        return out

    def set_scenarios(self, route: str, settings: RouteScenarios) -> ScenarioState | None:
        """Give ``route`` its scenarios (upgrade, A/B split, failover, version salt)."""
        if not settings.any:
            self.scenarios.pop(route, None)
            return None
        state = self.scenarios[route] = ScenarioState(settings)
        return state

    def start(self, request: WalkRequest, pools: Sequence[TierPool],
              session: SessionRecord | None, *,
              alternates: Mapping[PoolName, TierPool] | None = None) -> RequestWalk:
        """A new walk for ``request`` over the route's ``pools`` (smallest window first).
        ``alternates``: the pools the route's scenarios may put in place of one of them
        (A/B arms, a failover backup), as the tier logic sees them now."""
        return RequestWalk(self, request, pools, session, alternates or {})

    def shadow_request(self, warm: ShadowWarm, item: HotSession,
                       request_id: RequestId) -> RouteRequest:
        """The ``RouteRequest`` of one shadow warm-up (``max_tokens: 1``): to the warmed
        version's replicas only, with the version's salt when the route salts, with the
        session's token ids when they are valid for the warmed pool (else routed on
        predictions alone: the engine still caches what it is sent)."""
        core = self.core
        state = self.scenarios.get(warm.route)
        settings = state.settings if state is not None else NO_SCENARIOS
        ids = item.token_ids
        if ids is not None and item.pool != warm.pool and (state is None or not (
                state.ids_shareable(item.pool, warm.pool) or core.versions.same_tokenizer(
                    [r.name for r in core.pool(item.pool).replicas],
                    [r.name for r in core.pool(warm.pool).replicas]))):
            ids = None
        exclude: frozenset[ReplicaId] = frozenset()
        if warm.version is not None or warm.replicas is not None:
            exclude = frozenset(
                rep.name for rep in core.pool(warm.pool).replicas
                if (warm.version is not None and core.versions.version(rep.name) != warm.version)
                or (warm.replicas is not None and rep.name not in warm.replicas))
        salt = item.tenant_salt
        if settings.version_salt and warm.version is not None:
            salted_as, _ = salt_version(warm.version, core.versions, core.verdicts)
            salt = version_salt(salted_as, item.tenant_salt)
        return RouteRequest(
            request_id=request_id, pool=warm.pool, scope=TenantScope(TenantName(item.tenant)),
            num_prompt_tokens=item.tokens if ids is None else len(ids), prompt_token_ids=ids,
            cache_salt=salt, session_id=None, expected_output_tokens=1,
            predicted_output_tokens=1, exclude=exclude)

    def shadow_done(self, warm: ShadowWarm) -> None:
        """One shadow warm-up of ``warm`` answered or failed (an upgrade counts them down
        to ready)."""
        state = self.scenarios.get(warm.route)
        if state is not None and warm.version is not None:
            state.warm_finished(warm.pool, warm.version)


# --- one walk ------------------------------------------------------------------------------------


class _Phase(enum.Enum):
    NEW = "new"
    PLANNING = "planning"  # waiting for tokens the tier plan asked for
    ROUTING = "routing"  # waiting for tokens to route with
    SENT = "sent"  # an attempt is out
    ANSWERED = "answered"  # the attempt answered; load open until end()
    ENDED = "ended"


_A = TypeVar("_A", NeedTokens, Send, Refuse, Fail, WalkAction, str)

_NO_PLACE: Final = Place(0, "", None, PlaceReason.FITS, partial(str, ""), 0)


class RequestWalk:
    """One request's walk (module docstring). Not thread-safe; one driver task owns it.

    Attributes (read by drivers for logs and headers):
        estimate: the prompt's estimate (exact once tokens were counted).
        place: the tier placement of the first attempt.
        state: the attempt state (pool of the last attempt, ``max_tokens`` it sent).
        decision: the last routing decision, if any.
        num_overflows: overflow rejections met.
        retries: attempts after the first (overflow re-plans and failover).
        outcome: ``ok`` or why the walk ended otherwise.
        num_prompt_tokens / exact / routing_s: of the last routing decision.
    """

    def __init__(self, walker: Walker, request: WalkRequest, pools: Sequence[TierPool],
                 session: SessionRecord | None,
                 alternates: Mapping[PoolName, TierPool] | None = None) -> None:
        if not pools:
            raise ValueError(f"route {request.route.name!r} has no pools")
        self._walker = walker
        self.request = request
        self.pools = list(pools)
        self.session = session if session is not None else EMPTY_RECORD
        self.key = (None if request.session_id is None
                    else session_key(request.tenant, request.route.name, request.session_id))
        self.estimate = TokenEstimate(0, 0)
        self.place = _NO_PLACE
        self.state = AttemptState(0, request.max_tokens, request.max_tokens, 0)
        self.decision: RoutingDecision | None = None
        self.num_overflows = 0
        self.retries = 0
        self.outcome = "ok"
        self.num_prompt_tokens = 0
        self.exact = False
        self.routing_s = 0.0
        self._phase = _Phase.NEW
        self._tier = self.session.tier
        self._token_ids: dict[PoolName, Sequence[int] | None] = {}
        self._hashes: dict[PoolName, Sequence[WireHash] | None] = {}
        self._exact_available = True
        self._plan_rounds = 0
        self._prefer: ReplicaId | None = None
        self._warm_checked = False
        self._warm_hit = False
        self._load_open: ReplicaId | None = None
        self._prefill_open = False
        self._notes: list[Note] = []
        self._closed = False
        self._alternates = alternates or {}
        self._scenario = walker.scenarios.get(request.route.name)
        self.arm: PoolName | None = None
        """The A/B arm (a pool) this request was given, on a split route."""
        self.version: str | None = None
        """The model version of the group the last attempt was routed in."""
        self._groups: dict[PoolName, GroupChoice | None] = {}
        self._salt_refused: set[str] = set()  # versions whose salt refusal is noted

    # -- the driver's calls ---------------------------------------------------------------------

    @property
    def pool_index(self) -> int:
        return self.state.pool_index

    @property
    def pool_name(self) -> PoolName:
        return PoolName(self.pools[self.state.pool_index].name)

    @property
    def max_tokens(self) -> int | None:
        """The ``max_tokens`` the current attempt sends, or None for the client's own."""
        sent = self.state.max_tokens
        return None if sent is None or sent == self.request.max_tokens else sent

    @property
    def ended(self) -> bool:
        return self._phase is _Phase.ENDED

    def take_notes(self) -> list[Note]:
        """What happened since the last call, in order (module docstring)."""
        notes, self._notes = self._notes, []
        return notes

    def begin(self) -> WalkAction:
        """Steps 1-2: estimate and place the request; the first action."""
        self._expect(_Phase.NEW, "begin")
        if self._scenario is not None:
            self._apply_scenarios(self._scenario)
        self.estimate = self._estimate()
        self.state = AttemptState(0, self.request.max_tokens, self.request.max_tokens,
                                  self.estimate.high)
        self._record("begin")
        if not self.request.route.proactive:
            return self._record(self._reactive_only())
        self._phase = _Phase.PLANNING
        return self._record(self._plan())

    def tokens(self, pool: PoolName, token_ids: Sequence[int] | None,
               block_hashes: Sequence[WireHash] | None = None) -> WalkAction:
        """The answer to :class:`NeedTokens`: ``pool``'s token ids (None: none can be had,
        the pool is then routed approximately), and their block hashes if the driver has
        them already."""
        if self._phase not in (_Phase.PLANNING, _Phase.ROUTING):
            raise RuntimeError(f"tokens() in phase {self._phase.value}: no NeedTokens is open")
        self._token_ids[pool] = token_ids
        self._hashes[pool] = block_hashes
        self._record(f"tokens {pool} {'none' if token_ids is None else len(token_ids)}")
        if self._phase is _Phase.PLANNING:
            return self._record(self._plan())
        return self._record(self._route())

    def overflowed(self, numbers: OverflowNumbers, *, detail: str = "") -> WalkAction:
        """Step 5: the current attempt's engine rejected the request as too long.

        Args:
            numbers: the engine's numbers (``wire.overflow`` parses every engine's wording).
            detail: added to the log line (the wording's style).
        """
        decision = self._sent("overflowed")
        self._record(f"overflowed {decision.replica}")
        self._release()
        self.num_overflows += 1
        before = self.state.pool_index
        plan = plan_recovery(self.state, numbers, self.pools, request_model=self.request.model,
                             output_floor=self.request.route.output_floor)
        if plan.learned_window is not None:
            self._learn(before, plan.learned_window, decision.replica)
        suffix = f" (replica {decision.replica}{', ' + detail if detail else ''})"
        kind = ("retry" if isinstance(plan, Retry) else "escalate"
                if isinstance(plan, Escalate) else "give_up")
        self._notes.append(Recovered(decision.replica, kind, plan.log_line + suffix))
        if isinstance(plan, GiveUp):
            later = (eligibility(self.pools[j], j, self.request.model)
                     for j in range(before + 1, len(self.pools)))
            self._external_skips([s for s in later if s is not None], "no larger local pool → 400")
            return self._record(self._finish_refused(Refuse(
                400, plan.message, f"overflow_{plan.reason.value}", type=OVERFLOW_ERROR_TYPE,
                param=OVERFLOW_ERROR_PARAM, code=OVERFLOW_ERROR_CODE, pool=self.pool_name,
                decision=decision)))
        self.state = plan.state
        self.retries += 1
        self._prefer = decision.replica if isinstance(plan, Retry) else None
        if isinstance(plan, Escalate):
            self._notes.append(Escalated(self.pools[before].name, self.pool_name, "reactive"))
            self._tier = max(self._tier, self.state.pool_index)
            self._check_warm_hit()
        return self._record(self._route())

    def failed(self, kind: str, *, retryable: bool, unreachable: bool = False,
               detail: str = "") -> WalkAction:
        """Step 5: the current attempt got no answer before its first byte (not an overflow).

        Args:
            kind: the transport's word for it (``connect``, ``timeout``, ``status``...).
            retryable: the request may be sent again (the engine cannot have run it).
            unreachable: the replica refused the connection (or the connect timed out).
            detail: the error, for the failure hook.
        """
        decision = self._sent("failed")
        self._record(f"failed {decision.replica} {kind}")
        if self._prefill_open:  # a split's decode half failed before its prefill ended
            self._walker.core.prefill_done(decision)
            self._prefill_open = False
        if unreachable:
            self._notes.append(ReplicaUnreachable(decision.replica, detail))
        limit = self._walker.settings.max_retries
        if retryable and self.retries >= limit and self._fail_over_now():
            self._release()  # retries on the primary are spent: its backup gets one attempt
            self._notes.append(UpstreamFailed(decision.replica, kind, retried=True))
            self.retries += 1
            return self._record(self._route())
        if not retryable or self.retries >= limit:
            self._notes.append(UpstreamFailed(decision.replica, kind, retried=False))
            why = FailReason.NOT_RETRYABLE if not retryable else FailReason.RETRIES_SPENT
            return self._record(self._finish_failed(decision, why, kind))
        moved = self._walker.core.reroute(decision, decision.replica)  # releases its load
        self._load_open = None
        if moved is None:
            if self._fail_over_now():  # the primary has no replica left: the backup takes it
                self._notes.append(UpstreamFailed(decision.replica, kind, retried=True))
                self.retries += 1
                return self._record(self._route())
            self._notes.append(UpstreamFailed(decision.replica, kind, retried=False))
            return self._record(self._finish_failed(decision, FailReason.NO_REPLICA_LEFT, kind))
        self._notes.append(UpstreamFailed(decision.replica, kind, retried=True))
        self.retries += 1
        return self._record(self._send(moved))

    def prefill_answered(self) -> None:
        """The prefill half of a split (``decision.prefill_replica``) answered with the KV's
        ``kv_transfer_params``: its load is released there (its first token teaches the
        prefill replica's rate); the driver now sends the decode half to ``replica``."""
        decision = self._sent("prefill_answered")
        prefill = decision.prefill_replica
        if prefill is None or not self._prefill_open:
            raise RuntimeError("prefill_answered() without an open prefill half")
        core = self._walker.core
        core.on_first_token(prefill, decision.prefill_request_id)
        core.prefill_done(decision)
        self._prefill_open = False
        self._record(f"prefilled {prefill}")

    def prefill_failed(self, kind: str, *, unreachable: bool = False,
                       detail: str = "") -> WalkAction:
        """The prefill half of a split failed: the request is colocated on its decode replica
        (which prefills it itself); the failure does not count against ``max_retries``."""
        decision = self._sent("prefill_failed")
        prefill = decision.prefill_replica
        if prefill is None or not self._prefill_open:
            raise RuntimeError("prefill_failed() without an open prefill half")
        self._record(f"prefill failed {prefill} {kind}")
        if unreachable:
            self._notes.append(ReplicaUnreachable(prefill, detail))
        self._notes.append(UpstreamFailed(prefill, kind, retried=True))
        self._prefill_open = False
        moved = self._walker.core.colocate(decision)
        return self._record(self._send(moved))

    def answered(self) -> None:
        """The current attempt answered (its first byte, or the engine's first token):
        the replica's load moves from prefill to decode, and the session is pinned to it."""
        decision = self._sent("answered")
        # A split's decode half waited for the prefill replica and the transfer: its time
        # to first token says nothing of the decode replica's prefill rate.
        self._walker.core.on_first_token(decision.replica, self.request.request_id,
                                         learn=decision.prefill_replica is None)
        self._phase = _Phase.ANSWERED
        self._record(f"answered {decision.replica}")

    def end(self, finish_reasons: Sequence[str | None] = (),
            usage: Mapping[str, Any] | None = None) -> SessionWrite | None:
        """Step 6: the walk is over, on any exit path (idempotent: a second call is a no-op
        returning None).

        Releases the load still open, notes a cut-short answer and returns the session's
        record to write (pin, tier, usage), or None when there is no session or nothing
        changed.

        Args:
            finish_reasons: each choice's ``finish_reason`` as read from the answer.
            usage: the answer's ``usage``, when the engine sent one.
        """
        if self._closed:
            return None
        self._closed = True
        answered = self._phase is _Phase.ANSWERED
        output_tokens = _count(usage, "completion_tokens") if answered else None
        if output_tokens is not None and self.request.n == 1:
            before = self.session.usage
            self._walker.outputs.observe(self.request.route.name, output_tokens,
                                         None if before is None else before.completion_tokens)
        self._release(output_tokens if self.request.n == 1 else None)
        if answered and self.key is not None:
            self._consider_spread(output_tokens)
        self._phase = _Phase.ENDED
        usage_record = self._usage(finish_reasons, usage) if answered else None
        if self.key is None:
            self._record(f"end {self.outcome}")
            return None
        old = self.session
        pin = self.decision.replica if answered and self.decision is not None else old.pin
        served = answered and self.decision is not None
        new = SessionRecord(pin=pin, tier=max(old.tier, self._tier),
                            usage=usage_record if usage_record is not None else old.usage,
                            version=self.version if served else old.version,
                            arm=self.arm if self.arm is not None else old.arm,
                            prompt_tokens=self.num_prompt_tokens if served else old.prompt_tokens)
        if served and self._scenario is not None:
            self._remember_hot(self.key)
        self._record(f"end {self.outcome} pin={new.pin} tier={new.tier}")
        if new == old and not answered:
            return None
        return SessionWrite(self.key, new)

    # -- steps -----------------------------------------------------------------------------------

    def _estimate(self) -> TokenEstimate:
        request = self.request
        if request.prompt_token_ids is not None:  # the body's own token ids: exact
            return TokenEstimate.exact_count(len(request.prompt_token_ids),
                                             EstimateSource.TOKEN_IDS)
        usage = self.session.usage
        try:
            if usage is not None and request.endpoint == "chat":
                return from_session(usage.prompt_tokens, usage.completion_tokens,
                                    usage.num_messages, request.body,
                                    config=request.route.estimate)
            return estimate_request(request.body, endpoint=request.endpoint,
                                    config=request.route.estimate)
        except MalformedBodyError as exc:  # the driver validated the body: a bug if here
            raise AssertionError(f"a validated body could not be estimated: {exc}") from exc

    def _plan(self) -> WalkAction:
        """Step 2, resumed after every token answer. Bounded: each round either asks one
        pool for tokens (at most once per pool: then the estimate is exact) or ends."""
        request, route = self.request, self.request.route
        now = self._walker.clock.now()
        min_index = min(self._tier, len(self.pools) - 1)
        estimate = self.estimate
        while True:
            self._plan_rounds += 1
            last_round = self._plan_rounds > len(self.pools) + 2
            plan = plan_tier(
                self.pools, estimate, request.max_tokens, now_s=now, request_model=request.model,
                output_floor=route.output_floor, tokenize_margin=route.tokenize_margin,
                window_ttl_s=self._walker.settings.window_ttl_s,
                exact_count_available=self._exact_available and not last_round,
                min_pool_index=min_index,
            )
            if isinstance(plan, NeedExactCount):
                pool = PoolName(plan.pool_name)
                self._notes.append(LogLine("debug", plan.log_line))
                if pool not in self._token_ids and not self.pools[plan.pool_index].external:
                    return NeedTokens(pool, for_count=True)
                ids = self._token_ids.get(pool)
                if ids is None:
                    self._exact_available = False
                else:
                    estimate = self.estimate = TokenEstimate.exact_count(len(ids))
                continue
            if isinstance(plan, Place) and self._should_recheck(plan, estimate, last_round):
                pool = PoolName(plan.pool_name)
                if pool not in self._token_ids:
                    return NeedTokens(pool, for_count=False)
                ids = self._token_ids[pool]
                if ids is not None:
                    estimate = self.estimate = TokenEstimate.exact_count(len(ids))
                    continue  # check the fit on the exact count
            return self._placed(plan)

    def _should_recheck(self, plan: Place, estimate: TokenEstimate, last_round: bool) -> bool:
        """A placement decided on an estimate is checked against the exact count when the
        placed pool's tokens can be had: routing needs them anyway (block hashes), so a fit
        decided on an exact count costs no extra call and cannot fail at the engine."""
        if estimate.exact or not self._exact_available or last_round:
            return False
        if self.pools[plan.pool_index].external:
            return False
        return self._token_ids.get(PoolName(plan.pool_name), ()) is not None

    def _placed(self, plan: Place | NoFit | NoPool) -> WalkAction:
        stale = getattr(plan, "stale_pools", ())
        local_stale = tuple(PoolName(self.pools[i].name) for i in stale
                            if not self.pools[i].external)
        if local_stale:
            self._notes.append(StaleWindows(local_stale))
        skipped: Sequence[Skip] = getattr(plan, "skipped", ())
        if isinstance(plan, NoFit | NoPool):
            self._notes.append(LogLine("warning", plan.log_line))
            self._external_skips(skipped, "no local pool holds it → 400")
            return self._finish_refused(Refuse(
                400, plan.message, "no_fit", type=OVERFLOW_ERROR_TYPE,
                param=OVERFLOW_ERROR_PARAM,
                code=OVERFLOW_ERROR_CODE if isinstance(plan, NoFit) else "model_not_found"))
        notable = (plan.reason is not PlaceReason.FITS or plan.clamped_max_tokens is not None
                   or plan.skipped or plan.stale_pools)
        self._notes.append(LogLine("info" if notable else "debug", plan.log_line))
        self._external_skips(skipped, f"placed on {plan.pool_name!r}")
        self.place = plan
        self.state = AttemptState.first(plan, self.estimate, self.request.max_tokens)
        if plan.escalated:
            first_small = next(s for s in plan.skipped if s.reason is SkipReason.TOO_SMALL)
            self._notes.append(Escalated(first_small.pool_name, plan.pool_name, "proactive"))
            self._check_warm_hit()
        self._tier = max(self._tier, plan.pool_index)
        return self._route()

    def _reactive_only(self) -> WalkAction:
        """``proactive: false``: the first eligible pool from the session's tier, the
        client's ``max_tokens``; the reactive path alone escalates."""
        request, pools = self.request, self.pools
        skipped: list[Skip] = []
        for i in range(min(self._tier, len(pools) - 1), len(pools)):
            skip = eligibility(pools[i], i, request.model)
            if skip is None:
                line = f"{LOG_TAG} reactive-only: → {pools[i].name!r} (proactive off)"
                self._notes.append(LogLine("debug", line))
                self.place = Place(i, pools[i].name, None, PlaceReason.FITS, partial(str, line),
                                   self.estimate.low, tuple(skipped))
                self.state = AttemptState.first(self.place, self.estimate, request.max_tokens)
                return self._route()
            skipped.append(skip)
        self._external_skips(skipped, "no pool of the route may serve it → 400")
        message = (f"No pool of this route can serve model {request.model!r}: "
                   + "; ".join(s.detail for s in skipped))
        return self._finish_refused(Refuse(400, message, "no_fit", type=OVERFLOW_ERROR_TYPE,
                                           param=OVERFLOW_ERROR_PARAM, code="model_not_found"))

    def _route(self) -> WalkAction:
        """Step 4 for the current pool (and step 3 on the first placement)."""
        self._phase = _Phase.ROUTING
        pool_index = self.state.pool_index
        pool = PoolName(self.pools[pool_index].name)
        core = self._walker.core
        if self.pools[pool_index].external:
            route_request = self._external_request(pool)
        else:
            ids = self.request.prompt_token_ids
            hashes = self.request.prompt_block_hashes
            if ids is None:
                if pool not in self._token_ids:
                    return NeedTokens(pool, for_count=False)
                ids, hashes = self._token_ids[pool], self._hashes.get(pool)
            adapter = self.request.adapter
            if adapter is not None and core.lora_key(pool, adapter) is None:
                return self._finish_refused(Refuse(
                    503, f"no replica of pool {pool!r} lists LoRA adapter {adapter!r} on "
                    "/v1/models; load it there (--lora-modules or /v1/load_lora_adapter)",
                    "no_replica", pool=pool))
            route_request = self.route_request(pool, self.request.request_id, ids, hashes)
            if self._prefer is not None:
                route_request = replace(route_request, preferred_replica=self._prefer)
        started = self._walker.timer()
        try:
            decision = core.route(route_request)
        except NoEligibleReplica as exc:
            if self._fail_over_now():
                return self._route()
            return self._finish_refused(Refuse(503, str(exc), "no_replica", pool=pool))
        routing_s = self.routing_s = self._walker.timer() - started
        self.num_prompt_tokens = route_request.num_prompt_tokens
        self.exact = route_request.prompt_token_ids is not None
        self._notes.append(Decided(decision, self.num_prompt_tokens, self.exact, routing_s))
        if decision.gate_refusal is not None:
            self._notes.append(GateRefused(self.request.route.name, decision.gate_refusal))
        self._bill(decision)
        warm = None
        if not self._warm_checked:
            self._warm_checked = True
            warm = self._consider_warm()
        return self._send(decision, warm)

    def _send(self, decision: RoutingDecision, warm: WarmFire | None = None) -> Send:
        self.decision = decision
        self._load_open = decision.replica
        self._prefill_open = decision.prefill_replica is not None
        self._phase = _Phase.SENT
        return Send(decision, self.state.pool_index, self.max_tokens,
                    self.pools[self.state.pool_index].external, self.retries + 1, warm)

    # -- building route requests -----------------------------------------------------------------

    def route_request(self, pool: PoolName, request_id: RequestId,
                      token_ids: Sequence[int] | None,
                      block_hashes: Sequence[WireHash] | None = None, *,
                      expected_output_tokens: int | None = None) -> RouteRequest:
        """The ``RouteRequest`` for a local ``pool``: exact tokens when known (else the text,
        routed approximately), the tenant's scope and salt, the session's pin when it is a
        replica of ``pool``. Also builds a warm-up's request (``expected_output_tokens=1``).
        """
        request = self.request
        needs_text = self._walker.settings.policy_needs_text
        text = request.routing_text() if token_ids is None or needs_text else ""
        num_tokens = len(token_ids) if token_ids is not None else max(1, self.estimate.low)
        pin = self.session.pin
        preferred = pin if pin is not None and any(
            rep.name == pin for rep in self._walker.core.pool(pool).replicas) else None
        exclude: frozenset[ReplicaId] = frozenset()
        salt = request.cache_salt
        group = self._group(pool)
        if group is not None and group.replicas:  # empty: every replica of the pool
            exclude = frozenset(rep.name for rep in self._walker.core.pool(pool).replicas
                                if rep.name not in group.replicas)
            if preferred is not None and preferred in exclude:
                preferred = None
        if (group is not None and group.version and self._scenario is not None
                and self._scenario.settings.version_salt):
            salt = self._version_salt(group, expected_output_tokens is None)
        predicted = 1
        if expected_output_tokens is None:
            sent = self.state.max_tokens
            expected_output_tokens = sent if sent is not None else DEFAULT_EXPECTED_OUTPUT_TOKENS
            usage = self.session.usage
            predicted = self._walker.outputs.predict(
                request.route.name, None if usage is None else usage.completion_tokens, sent,
                request.thinking_tokens)
        return RouteRequest(
            request_id=request_id,
            pool=pool,
            scope=TenantScope(request.tenant),
            num_prompt_tokens=num_tokens,
            prompt_token_ids=token_ids,
            block_hashes=(block_hashes if token_ids is not None and salt == request.cache_salt
                          else None),  # a version salt changes every block's hash
            routing_text=text,
            cache_salt=salt,
            lora=(None if request.adapter is None
                  else self._walker.core.lora_key(pool, request.adapter)),
            session_id=request.session_id,
            expected_output_tokens=expected_output_tokens,
            predicted_output_tokens=min(predicted, expected_output_tokens),
            exclude=exclude | request.exclude,
            preferred_replica=preferred,
        )

    def _version_salt(self, group: GroupChoice, note: bool) -> str:
        """The salt of a request served by ``group``'s version: an older version's when the
        verdict book lets the two share one (``core/verdict_book.salt_version``), else its
        own. A refusal is noted (``note``: a request, not a warm-up) when the refused version
        still runs or the session comes from it: only then is there state it gives up."""
        core = self._walker.core
        salted_as, refusal = salt_version(group.version, core.versions, core.verdicts)
        if (note and refusal is not None and refusal.serving not in self._salt_refused
                and (refusal.source in core.versions.running()
                     or refusal.source == group.moved_from)):
            self._salt_refused.add(refusal.serving)
            self._notes.append(GateRefused(self.request.route.name, refusal))
        return version_salt(salted_as, self.request.cache_salt)

    def _external_request(self, pool: PoolName) -> RouteRequest:
        """An external provider's ``RouteRequest``: no tokens and no text (no index entry),
        every endpoint but the least-loaded healthy one excluded, so the core only keeps
        its load accounting."""
        core = self._walker.core
        names = [rep.name for rep in core.pool(pool).replicas]
        best = self._walker.external.choose({name: core.load.snapshot(name).num_in_flight
                                             for name in names if core.is_healthy(name)})
        sent = self.state.max_tokens
        return RouteRequest(
            request_id=self.request.request_id, pool=pool, scope=TenantScope(self.request.tenant),
            num_prompt_tokens=max(1, self.estimate.low), session_id=self.request.session_id,
            expected_output_tokens=sent if sent is not None else DEFAULT_EXPECTED_OUTPUT_TOKENS,
            exclude=frozenset(name for name in names if name != best),
        )

    # -- model-bound cache scenarios (core/scenarios.py) ------------------------------------------

    def _apply_scenarios(self, state: ScenarioState) -> None:
        """Before the tier plan: the A/B arm and the failover switch put their pool in
        place of the route's; a due shadow warm-up of the backup is asked for."""
        settings, now = state.settings, self._walker.clock.now()
        split = settings.ab_split
        if split is not None:
            control = PoolName(self.pools[0].name)
            arms = {arm.pool: arm for arm in split.arms}
            remembered = self.session.arm
            if split.sticky and remembered is not None and remembered in arms:
                arm = PoolName(remembered)
            else:
                key = self.key if split.sticky and self.key is not None else \
                    str(self.request.request_id)
                arm = choose_arm(split, key).pool
            if (self.request.prompt_token_ids is not None
                    and not self._ids_shareable(state, control, arm)):
                arm = control  # the client's token ids are valid for the control's tokenizer
            self._substitute(control, arm)
            self.arm = arm
        failover = settings.failover
        if failover is None or state.failover is None:
            return
        active, line = self._walker.observe_failover(self.request.route.name, state, now)
        if line is not None:
            self._notes.append(line)
        primary = failover.primary
        if active:
            self._substitute(primary, failover.backup)
        elif (failover.warm_budget_tokens > 0 and failover.backup in self._alternates
              and not self._alternates[failover.backup].external
              and now - state.last_backup_warm_s >= failover.warm_interval_s):
            items = state.hot.hottest(failover.warm_budget_tokens, pool=primary,
                                      since_s=state.last_backup_warm_s)
            state.last_backup_warm_s = now
            if items:
                self._notes.append(ShadowWarm(self.request.route.name, "failover",
                                              failover.backup, None, tuple(items)))

    def _ids_shareable(self, state: ScenarioState, a: PoolName, b: PoolName) -> bool:
        """Token ids of pool ``a`` are valid for pool ``b``: declared by the driver, or
        proven by every replica's tokenizer fingerprint (``ReplicaVersions.same_tokenizer``)."""
        if state.ids_shareable(a, b):
            return True
        core = self._walker.core
        return core.versions.same_tokenizer([r.name for r in core.pool(a).replicas],
                                            [r.name for r in core.pool(b).replicas])

    def _substitute(self, pool: PoolName, by: PoolName) -> None:
        """Put ``by`` (an alternate) where ``pool`` stands in the route's pools."""
        if pool == by:
            return
        alternate = self._alternates.get(by)
        if alternate is None:
            raise ValueError(f"route {self.request.route.name!r}: pool {by!r} is not among "
                             "the alternates the driver passed (A/B arms, failover backup)")
        for i, entry in enumerate(self.pools):
            if entry.name == pool:
                self.pools[i] = alternate

    def _fail_over_now(self) -> bool:
        """The primary of a failover route has no replica left for this request: switch
        to the backup now and route there (before any byte was sent: nothing is lost)."""
        state = self._scenario
        failover = None if state is None else state.settings.failover
        if (state is None or failover is None or state.failover is None
                or self.pool_name != failover.primary
                or failover.backup not in self._alternates):
            return False
        state.failover.force(self._walker.clock.now())
        self._notes.append(LogLine("warning", (
            f"{LOG_TAG} failover of route {self.request.route.name!r}: no replica of "
            f"{failover.primary!r} left for this request → backup {failover.backup!r}")))
        self._substitute(failover.primary, failover.backup)
        self._prefer = None
        return True

    def _group(self, pool: PoolName) -> GroupChoice | None:
        """The version group this walk routes in within ``pool`` (``core/versions.py``),
        chosen once per pool; None when the pool's replicas agree (or are unknown)."""
        if pool in self._groups:
            return self._groups[pool]
        core, now = self._walker.core, self._walker.clock.now()
        versions = core.versions
        if not versions.known:
            self._groups[pool] = None
            return None
        pin = self.session.pin
        same_pool = pin is not None and core.knows(pin) and core.pool_of(pin) == pool
        only = core.single_version(pool)
        if only is not None:  # the common case, without looking at every replica
            was = self.session.version if same_pool else None
            moved = was if was is not None and was != only else None
            single = GroupChoice(only, frozenset(), moved, "only" if moved is None else "gone")
            self._groups[pool] = single
            return single
        healthy = [rep.name for rep in core.pool(pool).replicas if core.is_healthy(rep.name)]
        groups = versions.groups(healthy)
        state = self._scenario
        upgrade = None if state is None else state.settings.upgrade
        preferred: str | None = None
        move = False
        if upgrade is not None and state is not None and len(groups) > 1:
            newest = versions.newest(groups)
            assert newest is not None
            progress = state.upgrade_target(pool, newest, now)
            self._warm_joined(state, upgrade, progress, pool, groups[newest], now)
            if not progress.ready and progress.pending == 0 and (
                    len(groups[newest]) >= upgrade.ready_share * len(healthy)):
                progress.ready = True
            if progress.ready:
                preferred, move = newest, upgrade.move_sessions
            else:  # warming in shadow: the new version takes no traffic yet
                groups = {v: g for v, g in groups.items() if v != newest}
        salted = state is not None and state.settings.version_salt
        choice = choose_group(groups, self.session.version if same_pool else None,
                              preferred=preferred, move_sessions=move,
                              first_seen={v: versions.first_seen(v) for v in groups},
                              pick_for_new=salted)
        if choice is not None and choice.version == "" and choice.moved_from is None:
            choice = None  # no group imposed, and no session moved: nothing to keep
        self._groups[pool] = choice
        return choice

    def _warm_joined(self, state: ScenarioState, upgrade: UpgradeSettings,
                     progress: UpgradeProgress, pool: PoolName, members: Sequence[ReplicaId],
                     now: float) -> None:
        """Each replica that joined the new version since the last round is warmed in
        shadow with the hottest sessions not warmed yet, within its budget."""
        joined = [r for r in members if r not in progress.warmed_replicas]
        if not joined:
            return
        progress.warmed_replicas.update(joined)
        if upgrade.warm_budget_tokens <= 0:
            return
        for replica in joined:
            chosen = state.hot.hottest(upgrade.warm_budget_tokens, pool=pool,
                                       skip=progress.warmed_sessions)
            if not chosen:
                continue
            progress.warmed_sessions.update(item.key for item in chosen)
            progress.pending += len(chosen)
            progress.round_s = now
            progress.warm_tokens += sum(item.tokens for item in chosen)
            self._notes.append(ShadowWarm(self.request.route.name, "upgrade", pool,
                                          progress.version, tuple(chosen),
                                          frozenset((replica,))))

    def _bill(self, decision: RoutingDecision) -> None:
        """Notes an A/B arm's request and a scenario's move with its recompute bill."""
        state = self._scenario
        route, pool = self.request.route.name, PoolName(decision.request.pool)
        external = self.pools[self.state.pool_index].external
        group = None if external else self._groups.get(pool)
        self.version = None if external else self._walker.core.versions.version(decision.replica)
        if state is None and (group is None or group.moved_from is None):
            return  # nothing to bill: no scenario, no version change
        settings = NO_SCENARIOS if state is None else state.settings
        core, session = self._walker.core, self.session
        if self.arm is not None:
            self._notes.append(ArmServed(route, self.arm, self.num_prompt_tokens,
                                         decision.expected_cached_tokens))
        pin = session.pin
        if pin is None or not core.knows(pin):
            return
        before = core.pool_of(pin)
        scenario, place = None, str(before)
        failover = settings.failover
        if self.arm is not None and session.arm is not None and session.arm != self.arm:
            scenario, place = "ab", str(session.arm)
        elif (before != pool and failover is not None
              and {before, pool} <= {failover.primary, failover.backup}):
            scenario = "failover"
        elif before == pool and group is not None and group.moved_from is not None:
            scenario = "upgrade" if settings.upgrade is not None else "version"
            place = group.moved_from
        if scenario is None:
            return
        block = core.pool(before).block_size
        tokens = recompute_bill(session.prompt_tokens, self.num_prompt_tokens, block,
                                decision.expected_cached_tokens)
        to_place = self.version if scenario in ("upgrade", "version") and self.version else pool
        self._notes.append(ScenarioMove(route, scenario, place, str(to_place), tokens))

    def _remember_hot(self, key: str | None) -> None:
        """The session's latest prompt, for a later shadow warm-up (only when a scenario of
        the route warms in shadow)."""
        state, decision = self._scenario, self.decision
        if state is None or key is None or decision is None:
            return
        settings = state.settings
        warms = ((settings.upgrade is not None and settings.upgrade.warm_budget_tokens > 0)
                 or (settings.failover is not None and settings.failover.warm_budget_tokens > 0))
        if not warms or self.pools[self.state.pool_index].external:
            return
        request = decision.request
        state.hot.touch(HotSession(
            key=key, pool=request.pool, tokens=request.num_prompt_tokens,
            token_ids=request.prompt_token_ids, tenant=self.request.tenant,
            tenant_salt=self.request.cache_salt, payload=self.request.shadow_payload,
            last_seen_s=self._walker.clock.now()))

    # -- spread-ahead ----------------------------------------------------------------------------

    def _consider_spread(self, answer_tokens: int | None) -> None:
        """Step 6b: the session now rests where it was served; when that replica is crowded
        with other resting sessions, a copy of its prompt to an idle replica with KV room is
        asked for (``core/spread.py``), as a ``ShadowWarm`` of scenario ``spread`` under the
        session's own tenant scope and salt, and the session rests on the copy's target from
        then on (``SpreadSettings.rest_on_copy``). Not for routes with model-bound cache scenarios
        (their versions and salts move sessions themselves), LoRA adapters, external pools
        or split prefills."""
        decision = self.decision
        if (decision is None or self._scenario is not None or self.request.adapter is not None
                or self.pools[self.state.pool_index].external
                or decision.prefill_replica is not None):
            return
        core = self._walker.core
        request = decision.request
        pool = PoolName(request.pool)
        settings = getattr(core.policy_of(pool), "spread", None)
        if not isinstance(settings, SpreadSettings) or not settings.enabled:
            return
        home = decision.replica
        spec = core.pool(pool)
        roles = {rep.name: rep.role for rep in spec.replicas}
        version = core.versions.version(home)
        targets = {
            rep.name: core.load_beside(rep.name, request) for rep in spec.replicas
            if rep.name != home and rep.role == roles.get(home) and core.is_healthy(rep.name)
            and core.versions.version(rep.name) == version}
        answer = (answer_tokens if answer_tokens is not None
                  else request.predicted_output_tokens or request.expected_output_tokens)
        plan = self._walker.spread.plan(
            settings, tokens=request.num_prompt_tokens, answer_tokens=answer,
            home=core.load_beside(home, request), targets=targets, timing=spec.decode_timing,
            now_s=self._walker.clock.now())
        if not isinstance(plan, SpreadCopy):
            return
        if settings.rest_on_copy:
            core.rest_on_copy(request, plan.target)
        self._notes.append(ShadowWarm(self.request.route.name, "spread", pool, None, (HotSession(
            key=self.key or "", pool=pool, tokens=request.num_prompt_tokens,
            token_ids=request.prompt_token_ids, tenant=self.request.tenant,
            tenant_salt=self.request.cache_salt, payload=self.request.shadow_payload,
            last_seen_s=self._walker.clock.now()),), frozenset({plan.target})))
        self._notes.append(LogLine("debug", (
            f"{LOG_TAG} spread-ahead: session {self.request.session_id!r} rests on {home} "
            f"beside others (overlap {plan.overlap:.2f}); copying {plan.tokens} tokens to "
            f"{plan.target}")))

    # -- warm-ahead ------------------------------------------------------------------------------

    def _consider_warm(self) -> WarmFire | None:
        """Step 3: the pure warm-ahead decision. A fire is recorded in this router's cooldown
        view at once (a concurrent request of the session does not fire again at the same
        stage); the shared claim is the sender's, off the request path."""
        if self.request.adapter is not None:
            # The warm copy would name the target pool's base model, not the adapter: its
            # blocks would not carry the adapter's extra key.
            self._notes.append(WarmNote("skipped", "lora_adapter"))
            return None
        planner, now = self._walker.planner, self._walker.clock.now()
        decision = planner.consider(self.key, self.estimate.low, self.pools, self.pool_index,
                                    now, request_model=self.request.model, claim=False)
        if isinstance(decision, WarmSkip):
            self._notes.append(WarmNote("skipped", decision.reason.value))
            return None
        if self.pools[decision.target_pool_index].external:
            self._notes.append(WarmNote("skipped", "external"))  # a provider's cache is not ours
            return None
        planner.mark_fired(decision.session_id, now, stage=decision.stage,
                           target_pool_index=decision.target_pool_index)
        self._notes.append(LogLine("info", decision.log_line))
        return decision

    def _check_warm_hit(self) -> None:
        if self.key is None or self._warm_hit:
            return
        if self._walker.planner.warmed_target(self.key, self._walker.clock.now()) \
                == self.state.pool_index:
            self._warm_hit = True
            self._notes.append(WarmNote("hit"))

    # -- endings ---------------------------------------------------------------------------------

    def _usage(self, finish_reasons: Sequence[str | None],
               usage: Mapping[str, Any] | None) -> SessionUsage | None:
        """Notes a cut-short answer; the session's new usage, if the answer gave one."""
        request = self.request
        completion = _count(usage, "completion_tokens")
        if request.n == 1 and len(finish_reasons) == 1 and completion is not None:
            sent = self.state.max_tokens
            clamped = sent if sent != request.max_tokens else None
            why = was_cut_short(request.max_tokens, clamped, finish_reasons[0], completion)
            if why is not None:
                self._notes.append(CutShortNote(self.pool_name, why))
        prompt = _count(usage, "prompt_tokens")
        if (request.num_messages is None or prompt is None or completion is None
                or request.n != 1):
            return None
        return SessionUsage(prompt, completion, request.num_messages)

    def _finish_refused(self, refuse: Refuse) -> Refuse:
        self.outcome = refuse.outcome
        self._phase = _Phase.ENDED
        return refuse

    def _finish_failed(self, decision: RoutingDecision, why: FailReason, kind: str) -> Fail:
        self.outcome = f"upstream_{kind}"
        self._phase = _Phase.ENDED
        return Fail(decision, why, self.retries, self._walker.settings.max_retries)

    def _record(self, step: _A) -> _A:
        recorder = self._walker.recorder
        if recorder is not None:
            recorder(self.request.request_id, describe(step))
        return step

    def _release(self, output_tokens: int | None = None) -> None:
        if self._prefill_open and self.decision is not None:
            self._walker.core.prefill_done(self.decision)
            self._prefill_open = False
        if self._load_open is not None:
            self._walker.core.on_complete(self._load_open, self.request.request_id,
                                          output_tokens=output_tokens)
            self._load_open = None

    # -- helpers ---------------------------------------------------------------------------------

    def _learn(self, index: int, window: int, replica: ReplicaId) -> None:
        pool = self.pools[index]
        now = self._walker.clock.now()
        self._notes.append(WindowLearned(PoolName(pool.name), window, pool.window, replica, now))
        self.pools[index] = learn_window(pool, window, now)

    def _external_skips(self, skipped: Sequence[Skip], outcome: str) -> None:
        for skip in skipped:
            if skip.reason in (SkipReason.NOT_IN_CATALOG, SkipReason.CATALOG_UNKNOWN,
                               SkipReason.NO_MODEL):
                self._notes.append(LogLine("info", (
                    f"{LOG_TAG} external pool {skip.pool_name!r} not used for model "
                    f"{self.request.model!r}: {skip.detail}; the request stays local: {outcome}")))

    def _sent(self, call: str) -> RoutingDecision:
        if self._phase is not _Phase.SENT or self.decision is None:
            raise RuntimeError(f"{call}() in phase {self._phase.value}: no attempt is out")
        return self.decision

    def _expect(self, phase: _Phase, call: str) -> None:
        if self._phase is not phase:
            raise RuntimeError(f"{call}() in phase {self._phase.value}, expected {phase.value}")


def _count(usage: Mapping[str, Any] | None, key: str) -> int | None:
    if usage is None:
        return None
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
