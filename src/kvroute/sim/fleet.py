"""Virtual-time fleet simulation: N engine models behind one ``RouterCore``.

The simulation runs the production decision code (the request walk of ``core/walk.py`` over
``core.router.RouterCore`` with any policy of ``core.policy``/``core.peer_policies``) against
``engine.model.EngineModel`` engines on a virtual clock, with no sleeps and no asyncio, so a
benchmark of the simulator measures the code that routes production traffic.

Theory of operation (a discrete-event loop over a heap of timed events):

* ``ARRIVE``: a workload request starts its walk (below): it is placed, routed (the router
  hashes it, looks it up in its index, scores replicas) and added to the chosen engine. An
  idle engine starts a step at once. ``TOKENS`` and ``RESEND`` resume a walk after a
  ``/tokenize`` round trip or a rejected attempt.
* ``STEP_DONE``: an engine finished the step it started ``duration_s`` earlier. Its outputs
  become visible now: first tokens (TTFT), further tokens (inter-token gaps), finished
  requests (which release closed-loop follow-up turns after their think time). Its KV events
  are delivered to the router ``event_latency_s`` later (engines publish after the step; the
  router applies them a little after), its metrics are scraped, and the engine starts its next
  step if it has work.
* ``EVENTS``: a KV-event batch reaches the router's index.
* ``SAMPLE``: every ``sample_interval_s``, each replica's running + waiting count is recorded
  (load imbalance over time, and the per-replica load plot).

Everything random is seeded: the policy's ``random.Random(seed)`` and the workload's own seed.
Two runs with the same inputs give identical results.

Prompt block digests are computed once per request (``DigestCache``) and shared by the router
and the engine, and across the policies of one benchmark: they are the same vLLM hashes either
way, and hashing a long trace is the most expensive part of a run.

The request walk (``core/walk.py``)
---------------------------------

Every request walks the same state machine as in the live router (``shell/forward.py``):
estimate, tier plan with its exact-count recheck, warm-ahead, routing with the session's pin
(``SessionRecord``, kept in a ``SessionTable``) and the tenant's scope, reactive recovery
from an engine's overflow rejection, and the session record written when the request ends.
This module only carries out the walk's actions in virtual time:

* ``NeedTokens`` is answered with the prompt's ids; when the tier plan asked for an exact
  count it costs ``tokenize_rtt_s`` (the ``/tokenize`` round trip), otherwise nothing (the
  tokens for routing come with the request);
* ``Send`` adds the request to the chosen engine; an overflow rejection is rendered exactly
  as vLLM 0.32 words it (``wire.overflow_styles.check_overflow``), parsed back
  (``wire.overflow``) and reported to the walk; its next attempt is sent ``overflow_rtt_s``
  later (the doomed round trip). A rejection that is not about the window is a failure the
  walk does not retry;
* a ``Send`` carrying a warm-ahead adds a ``max_tokens: 1`` copy of the prompt to the target
  pool, routed by the same policy through the walk's ``route_request``, in the same instant
  (warm-ups are kept out of the workload's records: ``FleetResult.warm_records``);
* the engine's first token is ``answered()``, its end is ``end()`` with the answer's usage.

Context-window tiers (``FleetConfig.pools`` and ``tier_mode``): ``NONE`` routes over pool
0 alone with the reactive path only (an over-long prompt is rejected by the engine and the
walk gives up); ``REACTIVE`` over every pool, reactive only (no estimate: the session's tier,
else pool 0, first); ``PROACTIVE`` with the estimate and tier plan; ``PROACTIVE_WARM`` also
with warm-ahead.

The first request of each session that lands on a larger pool than pool 0 is marked
``first_on_larger`` and gets ``cold_ttft_s``: the TTFT the same prompt would have on an idle
engine of that pool with an empty cache, measured by running a private probe engine of the
same configuration (same step-time model, same chunking) in the same run.
"""

from __future__ import annotations

import enum
import heapq
import math
import random
import time
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, cast

from kvroute.core.clock import ManualClock
from kvroute.core.disagg import DisaggSpec, Role
from kvroute.core.errors import ConfigError, NoEligibleReplica
from kvroute.core.events import BlockRemoved, BlockStored, EventBatch, KVEvent
from kvroute.core.hashing import BlockHasher
from kvroute.core.load import DecodeTiming
from kvroute.core.model_identity import ModelIdentity
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore
from kvroute.core.scenarios import RouteScenarios
from kvroute.core.session import SessionTable, session_key
from kvroute.core.stats import mean, percentile
from kvroute.core.tiers import DEFAULT_OUTPUT_FLOOR, OverflowNumbers, TierPool, learn_window
from kvroute.core.types import BlockHash, PoolName, ReplicaId, RequestId, TenantName, WireHash
from kvroute.core.walk import (
    ArmServed,
    CutShortNote,
    Escalated,
    Fail,
    GateRefused,
    NeedTokens,
    Recovered,
    Refuse,
    ReplicaUnreachable,
    RequestWalk,
    ScenarioMove,
    Send,
    ShadowWarm,
    WalkAction,
    Walker,
    WalkRequest,
    WalkRoute,
    WalkSettings,
    WarmNote,
    WindowLearned,
)
from kvroute.core.warm import (
    DEFAULT_COOLDOWN_S,
    DEFAULT_FRACTION,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_REWARM_FRACTION,
    WarmFire,
    WarmPlanner,
)
from kvroute.engine.model import (
    EngineConfig,
    EngineModel,
    EngineRequest,
    Rejection,
    StepResult,
)
from kvroute.engine.offload import MEDIUM_STORAGE, OffloadTier
from kvroute.sim.profiles import TimingProfile
from kvroute.sim.workload import WorkloadRequest
from kvroute.wire.overflow import overflow_numbers, parse_overflow
from kvroute.wire.overflow_styles import check_overflow

POOL = PoolName("sim")
DEFAULT_TENANT = TenantName("default")

(_ARRIVE, _STEP_DONE, _EVENTS, _SAMPLE, _TOKENS, _RESEND, _HEAL, _RESET,
 _RESTART) = range(9)
ROUTE = "sim"
"""The simulated fleet's one route (the session records' key names it)."""

WARM_SUFFIX = "#warm"
"""Appended to a request id to name its warm-up copy."""
SHADOW_PREFIX = "shadow-"
"""Starts the id of a shadow warm-up (``core/scenarios.py``)."""
FIRST_VERSION = "v1"
"""The model version every replica runs at the start of a run with versions."""
SIM_TOKENIZER = "t:sim-vocab"
"""The tokenizer fingerprint of every simulated pool (one vocabulary: ids are shared)."""
OVERFLOW_STYLE = "vllm-0.32"
"""The engines' error wording: the engine model implements vLLM 0.32's admission checks."""

# One character per token for text-matching peers (SGLang's char radix tree, production-
# stack's 128-char chunks): the text then has exactly the token stream's prefix structure.
# CJK ideographs are used so that Python stores the text at 2 bytes per character and
# distinct tokens rarely share a character.
_TEXT_BASE = 0x4E00
_TEXT_SPAN = 20_000
_TEXT_CHARS = [chr(_TEXT_BASE + i) for i in range(_TEXT_SPAN)]


def tokens_as_text(tokens: Sequence[int]) -> str:
    """The routing text a text-matching peer sees for ``tokens`` (one char per token)."""
    chars = _TEXT_CHARS
    return "".join([chars[t % _TEXT_SPAN] for t in tokens])


class DigestCache:
    """Prompt block hashes per (request id, salt), computed once and shared across runs.

    Holds both forms: the raw digests the engine keys its cache by, and the 64-bit wire form
    the router's index is keyed by.
    """

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        self._hashes: dict[tuple[str, str | None], tuple[list[BlockHash], tuple[WireHash, ...]]] = {}

    def get(
        self, request: WorkloadRequest, salt: str | None
    ) -> tuple[list[BlockHash], tuple[WireHash, ...]]:
        key = (request.request_id, salt)
        found = self._hashes.get(key)
        if found is None:
            digests = self.hasher.hash_blocks(request.prompt_token_ids, cache_salt=salt)
            from_bytes = int.from_bytes
            wire = tuple([WireHash(from_bytes(d[-8:], "big")) for d in digests])
            found = (digests, wire)
            self._hashes[key] = found
        return found


class TierMode(enum.StrEnum):
    """How a multi-pool fleet chooses the pool (module docstring, "Context-window tiers")."""

    NONE = "none"
    """No tier logic: every request goes to pool 0; an over-long prompt is rejected."""
    REACTIVE = "reactive"
    """Pool 0 first; an overflow rejection is parsed and recovered from (``plan_recovery``)."""
    PROACTIVE = "proactive"
    """``plan_tier`` chooses the pool before sending; the reactive path stays as backstop."""
    PROACTIVE_WARM = "proactive+warm"
    """As ``PROACTIVE``, plus warm-ahead of the next larger pool (``WarmPlanner``)."""


@dataclass(frozen=True, slots=True)
class SimPool:
    """One pool of identical simulated engines (one model, one window).

    Attributes:
        name: the pool's name (the router's ``PoolName``; replica names derive from it).
        profile: timing and engine shape.
        num_replicas: engines in the pool.
        max_model_len: the window, overriding the profile's.
        num_gpu_blocks: KV capacity, overriding the profile's.
        served_model: the model name the pool serves (warm-ahead names it); defaults to the
            profile's ``model``.
    """

    name: str
    profile: TimingProfile
    num_replicas: int
    max_model_len: int | None = None
    num_gpu_blocks: int | None = None
    served_model: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("SimPool.name must be a non-empty pool name")
        if self.num_replicas < 1:
            raise ConfigError(
                f"pool {self.name!r}: num_replicas must be >= 1, got {self.num_replicas}"
            )
        self.engine_config()  # validates the window against the KV capacity

    def engine_config(self) -> EngineConfig:
        """The engines' configuration (the profile's shape with this pool's overrides)."""
        return self.profile.engine_config(
            max_model_len=self.max_model_len, num_gpu_blocks=self.num_gpu_blocks
        )


@dataclass(frozen=True, slots=True)
class Outage:
    """A replica that refuses connections from ``start_s`` until ``end_s`` (virtual time).

    An attempt sent to it fails before its first byte, as a refused connection does live:
    the walk retries elsewhere and takes the replica out of routing (discovery's job in the
    live router) until ``end_s``, when it is healthy again.
    """

    replica: str
    start_s: float
    end_s: float = math.inf

    def __post_init__(self) -> None:
        if not 0 <= self.start_s < self.end_s:
            raise ConfigError(f"outage of {self.replica!r}: need 0 <= start_s < end_s, got "
                              f"{self.start_s}..{self.end_s}")

    def covers(self, replica: str, now_s: float) -> bool:
        return replica == self.replica and self.start_s <= now_s < self.end_s


@dataclass(frozen=True, slots=True)
class Restart:
    """A replica restarted on other weights (``version``) at ``at_s`` (virtual time).

    It leaves routing at ``at_s``, finishes what it runs (a graceful drain), drops its prefix
    cache, and is back ``down_s`` after the drain with its new identity: the router then
    learns the new version (``RouterCore.set_identity``), as discovery does live.
    """

    replica: str
    at_s: float
    version: str
    down_s: float = 5.0

    def __post_init__(self) -> None:
        if not (self.at_s >= 0 and self.down_s >= 0 and self.version):
            raise ConfigError(f"restart of {self.replica!r}: need at_s >= 0, down_s >= 0 and a "
                              f"version, got {self.at_s}, {self.down_s}, {self.version!r}")


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """One simulated fleet and how to drive it.

    A single-pool fleet is ``num_replicas`` engines of ``profile``. A tiered fleet lists its
    ``pools`` smallest window first; build it with :meth:`tiered`, which fills
    ``num_replicas`` (their sum) and ``profile`` (pool 0's) so that the two never disagree.

    Attributes:
        num_replicas: engines in the pool (with ``pools``: in all pools together).
        profile: timing and engine shape (block size, KV capacity, window, batch limits).
        policy: the routing policy's name; ``policy_params`` overrides its defaults.
        seed: seeds the policy's random choices.
        event_latency_s: delay between an engine step's end and its events reaching the index.
        ttft_slo_s: the TTFT objective for goodput.
        itl_slo_s: the objective for a request's mean inter-token latency: with ``ttft_slo_s``,
            what SLO goodput counts (``FleetResult.summary``).
        sample_interval_s: period of the per-replica load samples.
        metrics_interval_s: how often the router scrapes each engine's metrics (running,
            waiting, KV usage): at most once per interval, at the end of a step.
        hash_algo: the engines' prefix-caching hash algorithm.
        salt_tenants: give each tenant its own ``cache_salt`` (tenant isolation on).
        max_virtual_s: stop the run at this virtual time (requests still open are counted
            as unfinished).
        pools: the tiers, smallest window first (empty: one pool of ``profile``).
        tier_mode: how the pool is chosen (:class:`TierMode`).
        output_floor: the least output a placement leaves room for (``plan_tier``).
        warm_fraction / warm_cooldown_s / warm_max_sessions / warm_rewarm_fraction: the
            ``WarmPlanner``'s settings
            (used by ``PROACTIVE_WARM``; the other modes consult a disabled planner).
        tokenize_rtt_s: the ``/tokenize`` round trip a ``NeedExactCount`` costs before the
            request is planned again with its exact count.
        overflow_rtt_s: the round trip of a request an engine rejects as too long (vLLM
            rejects in its HTTP frontend, before scheduling: no engine time is used).
        outages: replicas that refuse connections for a while (:class:`Outage`).
        report_hits: every request carries vLLM's ``kv_cache_report_mode: "full"``, so the
            engines also publish the blocks of every prefix hit (``docs/visible-hits.md``).
        track_recency: the router keeps each replica's LRU order (``core/recency.py``).
        index_reset_at_s: at this virtual time the router forgets its whole index, as a
            restarted router (or one whose event streams had unrecoverable gaps) would.
        shared_store_blocks / shared_load_s_per_block: a store every engine of the fleet
            reads and writes (LMCache-like; ``engine/offload.py``), announced with medium
            ``STORAGE`` under every replica; 0 blocks: none.
        scenarios: the route's model-bound cache scenarios (``core/scenarios.py``); the
            route is pool 0 (with tiers: the tiers), every other pool is an alternate (an
            A/B arm, a failover backup).
        restarts: replicas restarted on other weights (:class:`Restart`). With restarts or
            scenarios every replica starts with version ``v1`` (``FIRST_VERSION``).
        data_parallel_size: engine ranks per replica (vLLM ``--data-parallel-size``): every
            replica is that many engines ``<name>.dp<r>``, each with the pool's full KV and
            batch, behind one API server. The fleet then has ``num_replicas`` x this many
            engines.
        rank_blind: with ``data_parallel_size`` > 1, the router sees one target per replica
            (its ranks' capacity and prefill rate summed, every rank's events under the
            replica's name) and the API server picks the rank as vLLM's ``DPLBAsyncMPClient``
            does (lowest ``4 x waiting + running``, first rank on ties; read at once, where
            vLLM reads counts up to 100 ms old), not the router. False: the router routes
            to each rank as its own target and names it (``X-data-parallel-rank``).
        roles: each replica's role in a disaggregated pool (``core/disagg.py``: ``both``,
            ``prefill``, ``decode``), in order (single-pool fleets only); empty: all
            ``both``. Needs ``disagg``.
        disagg: prefill/decode disaggregation of the pool: the split mode and the link's
            seconds per token of KV; a split sends the prompt to the prefill replica with
            ``max_tokens: 1``, then the decode replica pulls the blocks it lacks at that
            rate (``EngineRequest.kv_transfer_s_per_token``) while its batch runs on.
    """

    num_replicas: int
    profile: TimingProfile
    policy: str = "kvroute"
    policy_params: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    event_latency_s: float = 0.005
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.030
    sample_interval_s: float = 1.0
    metrics_interval_s: float = 0.05
    hash_algo: str = "sha256"
    salt_tenants: bool = False
    max_virtual_s: float = 7 * 24 * 3600.0
    pools: tuple[SimPool, ...] = ()
    tier_mode: TierMode = TierMode.NONE
    output_floor: int = DEFAULT_OUTPUT_FLOOR
    warm_fraction: float = DEFAULT_FRACTION
    warm_cooldown_s: float = DEFAULT_COOLDOWN_S
    warm_rewarm_fraction: float = DEFAULT_REWARM_FRACTION
    warm_max_sessions: int = DEFAULT_MAX_SESSIONS
    tokenize_rtt_s: float = 0.002
    overflow_rtt_s: float = 0.01
    outages: tuple[Outage, ...] = ()
    report_hits: bool = False
    track_recency: bool = False
    index_reset_at_s: float | None = None
    shared_store_blocks: int = 0
    shared_load_s_per_block: float = 0.0
    scenarios: RouteScenarios | None = None
    restarts: tuple[Restart, ...] = ()
    data_parallel_size: int = 1
    rank_blind: bool = False
    roles: tuple[Role, ...] = ()
    disagg: DisaggSpec | None = None

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.rank_blind and (self.restarts or self.outages or self.scenarios is not None):
            raise ConfigError("rank_blind fleets take no restarts, outages or scenarios: "
                              "those name engines, and a rank-blind router sees replicas")
        if self.roles and self.data_parallel_size > 1:
            raise ConfigError("FleetConfig.roles with data_parallel_size > 1 is not modelled; "
                              "lay out prefill/decode roles on replicas without ranks")
        if self.roles and (len(self.roles) != self.num_replicas or self.pools):
            raise ConfigError(
                f"FleetConfig.roles lists {len(self.roles)} roles for {self.num_replicas} "
                "replicas; give one role per replica of a single-pool fleet")
        if any(role != "both" for role in self.roles) and self.disagg is None:
            raise ConfigError("FleetConfig.roles other than 'both' need FleetConfig.disagg")
        if self.shared_store_blocks < 0 or not self.shared_load_s_per_block >= 0:
            raise ConfigError(
                f"FleetConfig.shared_store_blocks={self.shared_store_blocks} and "
                f"shared_load_s_per_block={self.shared_load_s_per_block} must be >= 0")
        if self.num_replicas < 1:
            raise ConfigError(f"num_replicas must be >= 1, got {self.num_replicas}")
        for name in ("event_latency_s", "ttft_slo_s", "itl_slo_s", "sample_interval_s",
                     "max_virtual_s", "tokenize_rtt_s", "overflow_rtt_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ConfigError(f"FleetConfig.{name} must be >= 0, got {value!r}")
        if self.sample_interval_s <= 0:
            raise ConfigError("FleetConfig.sample_interval_s must be > 0")
        if self.tier_mode not in TierMode.__members__.values():
            raise ConfigError(
                f"FleetConfig.tier_mode={self.tier_mode!r} is not a tier mode; use one of "
                f"{', '.join(m.value for m in TierMode)}"
            )
        if self.pools:
            total = sum(p.num_replicas for p in self.pools)
            if self.num_replicas != total or self.profile != self.pools[0].profile:
                raise ConfigError(
                    f"FleetConfig with pools needs num_replicas={total} (the pools' sum, got "
                    f"{self.num_replicas}) and profile = pool 0's profile; build it with "
                    "FleetConfig.tiered(pools, ...)"
                )
            names = [p.name for p in self.pools]
            if len(set(names)) != len(names):
                raise ConfigError(f"pool names must be unique, got {names}")
            sizes = {p.profile.block_size for p in self.pools}
            if len(sizes) > 1:
                raise ConfigError(
                    f"pools have block sizes {sorted(sizes)}; the simulator shares one digest "
                    "cache between pools, so give every pool the same block_size"
                )

    @classmethod
    def tiered(cls, pools: Sequence[SimPool], *, tier_mode: TierMode | str = TierMode.PROACTIVE,
               **kwargs: Any) -> FleetConfig:
        """A fleet of ``pools`` (smallest window first); ``kwargs`` are the other fields.

        Raises:
            ConfigError: no pools, or an invalid field.
        """
        if not pools:
            raise ConfigError("FleetConfig.tiered needs at least one SimPool")
        if tier_mode not in TierMode.__members__.values():
            raise ConfigError(f"tier_mode={tier_mode!r} is not a tier mode; use one of "
                              f"{', '.join(m.value for m in TierMode)}")  # fmt: skip
        return cls(num_replicas=sum(p.num_replicas for p in pools), profile=pools[0].profile,
                   pools=tuple(pools), tier_mode=TierMode(tier_mode), **kwargs)

    def sim_pools(self) -> tuple[SimPool, ...]:
        """The pools, smallest window first (one pool named ``sim`` without ``pools``)."""
        return self.pools or (SimPool(POOL, self.profile, self.num_replicas),)


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request.

    ``itl_sum_s`` / ``num_itl_tokens``: the request's own token gaps after its first token
    (a step that emits ``k`` tokens counts its gap once in the sum and ``k`` times in the
    count, as the fleet's ITL sample splits it), so ``itl_mean_s`` is the mean inter-token
    latency this request's user saw.
    """

    request_id: str
    arrival_s: float
    replica: str = ""
    num_prompt_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    last_token_s: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    expected_cached_tokens: int = 0
    finish_reason: str | None = None
    rejected: str | None = None
    session_id: str | None = None
    pool: str = ""
    pool_index: int = 0
    requested_max_tokens: int | None = None
    clamped_max_tokens: int | None = None
    num_doomed_attempts: int = 0
    escalated: bool = False
    first_on_larger: bool = False
    cold_ttft_s: float | None = None
    cut_short: str | None = None
    itl_sum_s: float = 0.0
    num_itl_tokens: int = 0
    arm: str | None = None
    version: str | None = None
    prefill_replica: str | None = None
    """A split request's prefill replica (``replica`` decoded it)."""
    recompute_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        """Arrival to last token; ``None`` until the request finished."""
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def itl_mean_s(self) -> float | None:
        """The mean gap between this request's tokens; ``None`` with fewer than two tokens."""
        return self.itl_sum_s / self.num_itl_tokens if self.num_itl_tokens else None

    def meets_slo(self, ttft_slo_s: float, itl_slo_s: float) -> bool:
        """Finished, first token within ``ttft_slo_s`` and mean gap within ``itl_slo_s`` (a
        one-token answer has no gap, so only its TTFT is judged)."""
        ttft, itl = self.ttft_s, self.itl_mean_s
        return (self.finish_s is not None and not self.rejected and ttft is not None
                and ttft <= ttft_slo_s and (itl is None or itl <= itl_slo_s))


@dataclass(slots=True)
class FleetResult:
    """Per-request records and per-replica series of one run, with derived metrics."""

    config: FleetConfig
    records: list[RequestRecord]
    itl_s: array  # type: ignore[type-arg]
    load_samples: list[tuple[float, tuple[int, ...]]]
    replica_names: tuple[str, ...]
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    end_s: float
    pool_of: dict[str, str] = field(default_factory=dict)
    """Replica name → pool name."""
    pool_prefix_cache: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Pool name → the engines' own (prefix-cache queries, hits) counters, in tokens."""
    counters: dict[str, int] = field(default_factory=dict)
    """Tier events: ``doomed_attempts``, ``escalations``, ``clamp_retries``, ``give_ups``,
    ``no_fit``, ``exact_counts``, ``warms_fired``, ``warms_rejected``, ``cut_short_<why>``;
    scenarios: ``recompute_tokens_<scenario>``, ``moves_<scenario>``,
    ``shadow_warms_<scenario>``, ``shadow_warm_tokens_<scenario>``, ``restarts``."""
    event_counts: dict[str, int] = field(default_factory=dict)
    """KV events delivered to the router (``events_stored``, ``hashes_stored``,
    ``events_removed``, ``hashes_removed``) and the thread CPU the router spent applying
    them (``event_apply_ns``: machine-dependent, unlike everything else here)."""
    warm_skips: dict[str, int] = field(default_factory=dict)
    """``WarmSkipReason`` value → count."""
    warm_records: list[RequestRecord] = field(default_factory=list)
    external_prefix_cache_hits: int = 0
    """Prompt tokens loaded from an offload tier (CPU tier or shared store)."""

    def summary(self) -> dict[str, float | int | dict[str, int]]:
        """The benchmark's metrics (keys as ``kvroute bench sim --json`` writes them).

        ``itl_*`` pool every token gap of every request; ``itl_request_*`` take each finished
        request's own mean gap (``RequestRecord.itl_mean_s``) and summarise those, so a few
        long answers cannot hide many slow ones. ``goodput_rps`` counts first tokens within
        ``ttft_slo_s``; ``slo_goodput_*`` count finished requests within both ``ttft_slo_s``
        and ``itl_slo_s`` (``RequestRecord.meets_slo``), per second of the run and as a
        fraction of all requests. ``idle_while_overloaded`` is the fraction of load samples
        (one per ``sample_interval_s``, running + waiting per replica) in which a replica
        sat idle while another ran more than twice the fleet's mean load.
        ``spread_copies`` / ``spread_copy_tokens``: spread-ahead's copies (``core/spread.py``)
        and the prompt tokens they sent, its bill in extra prefill, beside ``prompt_tokens``
        (the workload's own); ``spread_copies_used``: the session's next turn went to the
        replica its copy went to.
        """
        done = [r for r in self.records if r.finish_s is not None]
        ttfts = sorted(r.ttft_s for r in self.records if r.ttft_s is not None)
        e2e = sorted(r.finish_s - r.arrival_s for r in done)  # type: ignore[operator]
        itl = sorted(self.itl_s)
        start = min((r.arrival_s for r in self.records), default=0.0)
        span = max(self.end_s - start, 1e-9)
        good = sum(1 for t in ttfts if t <= self.config.ttft_slo_s)
        request_itl = sorted(x for r in done if (x := r.itl_mean_s) is not None)
        slo_good = sum(
            1 for r in self.records if r.meets_slo(self.config.ttft_slo_s, self.config.itl_slo_s)
        )
        per_replica: dict[str, int] = {name: 0 for name in self.replica_names}
        for r in self.records:
            if r.replica:
                per_replica[r.replica] += 1
        ratios = []
        idle_overloaded = 0
        for _, loads in self.load_samples:
            total = sum(loads)
            if total > 0:
                ratios.append(max(loads) / (total / len(loads)))
                if min(loads) == 0 and max(loads) > 2 * total / len(loads):
                    idle_overloaded += 1
        return {
            "requests": len(self.records),
            "completed": len(done),
            "rejected": sum(1 for r in self.records if r.rejected),
            "unfinished": sum(1 for r in self.records if r.finish_s is None and not r.rejected),
            "ttft_mean_s": mean(ttfts, 0.0),
            "ttft_p50_s": percentile(ttfts, 50, 0.0),
            "ttft_p90_s": percentile(ttfts, 90, 0.0),
            "ttft_p99_s": percentile(ttfts, 99, 0.0),
            "itl_mean_s": mean(itl, 0.0),
            "itl_p50_s": percentile(itl, 50, 0.0),
            "itl_p90_s": percentile(itl, 90, 0.0),
            "itl_p99_s": percentile(itl, 99, 0.0),
            "itl_request_mean_s": mean(request_itl, 0.0),
            "itl_request_p99_s": percentile(request_itl, 99, 0.0),
            "e2e_mean_s": mean(e2e, 0.0),
            "e2e_p99_s": percentile(e2e, 99, 0.0),
            "token_hit_rate": (
                self.prefix_cache_hits / self.prefix_cache_queries
                if self.prefix_cache_queries else 0.0
            ),
            "tier_hit_rate": (
                self.external_prefix_cache_hits / self.prefix_cache_queries
                if self.prefix_cache_queries else 0.0
            ),
            "router_expected_hit_rate": (
                sum(r.expected_cached_tokens for r in done)
                / max(1, sum(r.num_prompt_tokens for r in done))
            ),
            "goodput_rps": good / span,
            "slo_goodput_rps": slo_good / span,
            "slo_goodput_fraction": slo_good / len(self.records) if self.records else 0.0,
            "throughput_rps": len(done) / span,
            "output_tokens_per_s": sum(r.num_output_tokens for r in done) / span,
            "preemptions": self.preemptions,
            "load_imbalance_mean": mean(ratios, 1.0),
            "idle_while_overloaded": idle_overloaded / max(1, len(self.load_samples)),
            "requests_per_replica": per_replica,
            "split_fraction": (sum(1 for r in done if r.prefill_replica is not None)
                               / len(done) if done else 0.0),
            "makespan_s": span,
            "spread_copies": self.counters.get("shadow_warms_spread", 0),
            "spread_copy_tokens": self.counters.get("shadow_warm_tokens_spread", 0),
            "spread_copies_used": self.counters.get("spread_copies_used", 0),
            "prompt_tokens": sum(r.num_prompt_tokens for r in self.records),
        }


@dataclass(slots=True)
class _Flight:
    """One workload request while its walk runs."""

    request: WorkloadRequest
    record: RequestRecord
    walk: RequestWalk
    digests: list[BlockHash]
    wire: tuple[WireHash, ...]
    salt: str | None
    walker: Walker
    """The router this request reached (its walker; ``walker.core`` routes it)."""
    rejection: str | None = None
    """The engine's own word for a rejection the walk does not retry."""


class FleetSimulation:
    """One run of a workload through a simulated fleet (see the module docstring)."""

    def __init__(
        self,
        config: FleetConfig,
        workload: Sequence[WorkloadRequest],
        *,
        digests: DigestCache | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        profile = config.profile
        self.config = config
        self.clock = ManualClock()
        self.hasher = BlockHasher(config.hash_algo, profile.block_size)
        if digests is not None and (
            digests.hasher.block_size != profile.block_size or digests.hasher.algo != config.hash_algo
        ):
            raise ConfigError("the digest cache was built for another block size or algorithm")
        self.digests = digests or DigestCache(self.hasher)
        self.pools = config.sim_pools()
        self.pool_names = tuple(PoolName(p.name) for p in self.pools)
        specs: list[PoolSpec] = []
        self.engines: dict[ReplicaId, EngineModel] = {}
        """Every engine (one per DP rank), by name; ``pool_of`` and the records use these."""
        self.pool_of: dict[ReplicaId, PoolName] = {}
        self._router_name: dict[ReplicaId, ReplicaId] = {}
        """Engine -> the target the router knows it as (itself, or its replica when blind)."""
        self._ranks: dict[ReplicaId, tuple[ReplicaId, ...]] = {}
        """Router target -> the engines behind it, in rank order."""
        dp = config.data_parallel_size
        blind = config.rank_blind and dp > 1
        self.shared_tier = (
            OffloadTier(config.shared_store_blocks, profile.block_size, medium=MEDIUM_STORAGE,
                        load_s_per_block=config.shared_load_s_per_block)
            if config.shared_store_blocks else None)
        for pool in self.pools:
            engine_config = pool.engine_config()
            prefix = "r" if not config.pools else f"{pool.name}-r"
            replicas = tuple(ReplicaId(f"{prefix}{i}") for i in range(pool.num_replicas))
            names: list[ReplicaId] = []  # the router's targets
            for replica in replicas:
                ranks = (replica,) if dp == 1 else tuple(
                    ReplicaId(f"{replica}.dp{r}") for r in range(dp))
                for name in ranks:
                    self.engines[name] = EngineModel(engine_config, hasher=self.hasher,
                                                     shared_tier=self.shared_tier)
                    self.pool_of[name] = PoolName(pool.name)
                    self._router_name[name] = replica if blind else name
                if blind:
                    self._ranks[replica] = ranks
                    names.append(replica)
                else:
                    self._ranks.update({name: (name,) for name in ranks})
                    names.extend(ranks)
            per_target = dp if blind else 1  # a blind router's target is all its ranks
            rate = _profile_prefill_rate(pool.profile) * per_target
            timing = pool.profile.timing
            # The engine's KV capacity, as its vllm:cache_config_info would report it (less
            # the null block).
            capacity = (engine_config.num_gpu_blocks - 1) * engine_config.block_size * per_target
            both: tuple[Role, ...] = ("both",)
            roles = config.roles or both * len(names)
            specs.append(PoolSpec(PoolName(pool.name),
                                  tuple(ReplicaSpec(n, rate, capacity, role)
                                        for n, role in zip(names, roles, strict=True)),
                                  disagg=config.disagg,
                                  block_size=engine_config.block_size, hash_algo=config.hash_algo,
                                  decode_timing=DecodeTiming(timing.fixed_s, timing.decode_seq_s,
                                                             timing.context_token_s)))
        self.names = tuple(self.engines)
        self.router_names = tuple(self._ranks)
        self._specs = specs
        self.router = self._new_router(random.Random(config.seed))
        needs_text = self.router._pools[self.pool_names[0]].policy.needs_text
        self.workload = list(workload)
        self._progress = progress
        self._heap: list[tuple[float, int, int, object]] = []
        self._counter = 0
        self._busy: set[ReplicaId] = set()
        self._event_seq: dict[ReplicaId, int] = defaultdict(int)
        self._scraped_at: dict[ReplicaId, float] = {}
        self._records: dict[str, RequestRecord] = {}
        self._flights: dict[str, _Flight] = {}
        self._dependents: dict[str, list[WorkloadRequest]] = defaultdict(list)
        self._itl = array("d")
        self._samples: list[tuple[float, tuple[int, ...]]] = []
        # The walk: the route's pools (pool 0 alone without tiers), its settings, sessions.
        self._mode = TierMode(config.tier_mode)
        pools = self.pools if self._mode is not TierMode.NONE else self.pools[:1]
        self._tier_pools = [
            TierPool(p.name, window=p.engine_config().max_model_len, window_fetched_at_s=0.0,
                     served_model=p.served_model or p.profile.model)
            for p in pools
        ]
        self._model = self._tier_pools[0].served_model or ""
        routed = {p.name for p in pools}
        self._alternates = {
            PoolName(p.name): TierPool(p.name, window=p.engine_config().max_model_len,
                                       window_fetched_at_s=0.0,
                                       served_model=p.served_model or p.profile.model)
            for p in self.pools if p.name not in routed}
        self._route = WalkRoute(
            ROUTE, proactive=self._mode in (TierMode.PROACTIVE, TierMode.PROACTIVE_WARM),
            output_floor=config.output_floor)
        self.planner = WarmPlanner(
            config.warm_fraction, config.warm_cooldown_s, config.warm_max_sessions,
            enabled=self._mode is TierMode.PROACTIVE_WARM,
            rewarm_fraction=config.warm_rewarm_fraction,
        )
        self._walk_settings = WalkSettings(window_ttl_s=math.inf, policy_needs_text=needs_text)
        self.walker = self._new_walker(self.router)
        self.walkers: list[Walker] = [self.walker]
        """Every router of the fleet (its walker and, as ``walker.core``, its core): one here;
        several with ``sim/routers.py``. Each sees every engine's KV events and metrics."""
        self._sessions = SessionTable(ttl_s=math.inf)
        """The session records, shared by every router (as Redis shares them live)."""
        self._shadow: dict[str, ShadowWarm] = {}
        self._spread_to: dict[str, ReplicaId] = {}
        """Session → the engine its last spread-ahead copy went to (``spread_copies_used``)."""
        self._counters: Counter[str] = Counter()
        self._event_counts: Counter[str] = Counter()
        self._warm_skips: Counter[str] = Counter()
        self._warm: dict[str, RequestRecord] = {}
        self._copy_walker: dict[str, Walker] = {}
        """Warm-up and shadow copies in flight → the router that placed them."""
        self._landed: set[str] = set()
        self._probes: dict[int, EngineModel] = {}
        self._prefills: dict[str, tuple[_Flight, Send]] = {}
        """Split requests whose prefill half runs, by the prefill's engine request id."""

    def _new_router(self, rng: random.Random) -> RouterCore:
        """A router core over the fleet's pools, its policy drawing on ``rng``."""
        config = self.config
        router = RouterCore(
            self._specs,
            lambda: make_policy(config.policy, rng, **config.policy_params),
            clock=self.clock,
            track_recency=config.track_recency,
        )
        if config.report_hits:
            for name in self.router_names:
                router.set_hit_reports(name, True)
        if config.scenarios is not None or config.restarts:
            for name, pool_name in self.pool_of.items():
                router.set_identity(name, self._identity(pool_name, FIRST_VERSION))
        return router

    def _new_walker(self, router: RouterCore) -> Walker:
        """The walker of ``router``'s requests (one per router, as live)."""
        walker = Walker(router, self.planner, self._walk_settings, self.clock)
        if self.config.scenarios is not None:
            walker.set_scenarios(ROUTE, self.config.scenarios)
        return walker

    def _walker_for(self, request: WorkloadRequest) -> Walker:
        """The router a new request reaches (one router here; ``sim/routers.py``'s front
        chooses among several)."""
        return self.walker

    def _routers(self) -> list[RouterCore]:
        return [walker.core for walker in self.walkers]

    def _on_event(self, kind: int, data: object) -> None:
        """An event of a kind this module does not define (``sim/routers.py`` adds its
        bus)."""
        raise AssertionError(f"unknown simulation event kind {kind}")

    # -- driving ----------------------------------------------------------------------

    def _identity(self, pool: PoolName, version: str) -> ModelIdentity:
        sim_pool = self.pools[self.pool_names.index(pool)]
        return ModelIdentity(sim_pool.served_model or sim_pool.profile.model, None,
                             f"{pool}:{version}", SIM_TOKENIZER)

    def run(self) -> FleetResult:
        for restart in self.config.restarts:
            if ReplicaId(restart.replica) not in self.engines:
                raise ConfigError(f"restart of unknown replica {restart.replica!r}; replicas: "
                                  f"{', '.join(self.names)}")
            self._push(restart.at_s, _RESTART, (restart, 0))
        for request in self.workload:
            if request.depends_on is None:
                self._push(request.arrival_s, _ARRIVE, request)
            else:
                self._dependents[request.depends_on].append(request)
        if self._heap:
            self._push(self._heap[0][0], _SAMPLE, None)
        if self.config.index_reset_at_s is not None:
            self._push(self.config.index_reset_at_s, _RESET, None)
        open_requests = len(self.workload)
        done = 0
        while self._heap:
            when, _, kind, data = heapq.heappop(self._heap)
            if when > self.config.max_virtual_s:
                break
            self.clock.set(max(when, self.clock.now()))
            if kind == _ARRIVE:
                self._arrive(data)  # type: ignore[arg-type]
            elif kind == _TOKENS:
                flight, pool = cast("tuple[_Flight, PoolName]", data)
                self._act(flight, flight.walk.tokens(pool, flight.request.prompt_token_ids,
                                                     flight.wire))
            elif kind == _RESEND:
                flight, send = cast("tuple[_Flight, Send]", data)
                self._act(flight, send)
            elif kind == _HEAL:
                for router in self._routers():
                    router.set_healthy(cast("ReplicaId", data), True)
                self._observe_failovers()
            elif kind == _RESTART:
                self._restart(*cast("tuple[Restart, int]", data))
                self._observe_failovers()
            elif kind == _STEP_DONE:
                replica, result = cast("tuple[ReplicaId, StepResult]", data)
                finished = self._step_done(replica, result)
                done += finished
                if finished and self._progress is not None:
                    self._progress(finished)
            elif kind == _EVENTS:
                replica, batch = cast("tuple[ReplicaId, EventBatch]", data)
                self._count_events(batch)
                started = time.thread_time_ns()
                for router in self._routers():
                    router.apply_events(replica, batch)
                self._event_counts["event_apply_ns"] += time.thread_time_ns() - started
            elif kind == _RESET:
                for router in self._routers():
                    for name in self.router_names:
                        router.reset_replica_index(name)
            elif kind == _SAMPLE:
                self._sample()
                if done + self._num_rejected() < open_requests:
                    self._push(when + self.config.sample_interval_s, _SAMPLE, None)
            else:
                self._on_event(kind, data)
        by_replica = {name: engine.metrics() for name, engine in self.engines.items()}
        metrics = list(by_replica.values())
        per_pool: dict[str, tuple[int, int]] = {}
        for name, m in by_replica.items():
            queries, hits = per_pool.get(self.pool_of[name], (0, 0))
            per_pool[self.pool_of[name]] = (queries + m.prefix_cache_queries_total,
                                            hits + m.prefix_cache_hits_total)
        return FleetResult(
            config=self.config,
            records=[self._records[r.request_id] for r in self.workload if r.request_id in self._records],
            itl_s=self._itl,
            load_samples=self._samples,
            replica_names=tuple(self.names),
            prefix_cache_queries=sum(m.prefix_cache_queries_total for m in metrics),
            prefix_cache_hits=sum(m.prefix_cache_hits_total for m in metrics),
            external_prefix_cache_hits=sum(m.external_prefix_cache_hits_total for m in metrics),
            preemptions=sum(m.num_preemptions_total for m in metrics),
            end_s=self.clock.now(),
            pool_of={str(k): str(v) for k, v in self.pool_of.items()},
            pool_prefix_cache=per_pool,
            counters=dict(self._counters),
            event_counts=dict(self._event_counts),
            warm_skips=dict(self._warm_skips),
            warm_records=list(self._warm.values()),
        )

    def _count_events(self, batch: EventBatch) -> None:
        """Events and block hashes delivered to the router, by kind."""
        counters = self._event_counts
        for event in batch.events:
            if isinstance(event, BlockStored):
                counters["events_stored"] += 1
                counters["hashes_stored"] += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                counters["events_removed"] += 1
                counters["hashes_removed"] += len(event.block_hashes)

    def _num_rejected(self) -> int:
        return sum(1 for r in self._records.values() if r.rejected)

    def _push(self, when: float, kind: int, data: object) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (when, self._counter, kind, data))

    def _arrive(self, request: WorkloadRequest) -> None:
        """A workload request starts its walk (module docstring, "The request walk")."""
        now = self.clock.now()
        rid = request.request_id
        tokens = request.prompt_token_ids
        record = RequestRecord(rid, now, num_prompt_tokens=len(tokens),
                               session_id=request.session_id,
                               requested_max_tokens=request.output_tokens)
        self._records[rid] = record
        tenant = TenantName(request.tenant) if request.tenant else DEFAULT_TENANT
        salt = f"salt-{tenant}" if self.config.salt_tenants and request.tenant else None
        digests, wire = self.digests.get(request, salt)
        session = request.session_id
        stored = None
        if session is not None:
            stored = self._sessions.get(session_key(tenant, ROUTE, session), now)
        chat = request.messages is not None
        walker = self._walker_for(request)
        walk = walker.start(WalkRequest(
            request_id=RequestId(rid), route=self._route, tenant=tenant, session_id=session,
            endpoint="chat" if chat else "completions", model=self._model,
            body={"messages": request.messages, "max_tokens": request.output_tokens}
            if chat else {}, max_tokens=request.output_tokens,
            num_messages=len(request.messages) if request.messages is not None else None,
            prompt_token_ids=None if chat else tokens,
            prompt_block_hashes=None if chat else wire,
            routing_text=partial(tokens_as_text, tokens), cache_salt=salt,
            shadow_payload=request,
        ), self._tier_pools, stored, alternates=self._alternates)
        flight = _Flight(request, record, walk, digests, wire, salt, walker)
        self._flights[rid] = flight
        self._act(flight, walk.begin())

    def _act(self, flight: _Flight, action: WalkAction) -> None:
        """Carry out one of the walk's actions in virtual time (module docstring)."""
        walk, record = flight.walk, flight.record
        now = self.clock.now()
        self._drain(flight)
        if isinstance(action, NeedTokens):
            if action.for_count:  # the /tokenize round trip of an exact count
                self._counters["exact_counts"] += 1
                self._push(now + self.config.tokenize_rtt_s, _TOKENS, (flight, action.pool))
            else:
                self._act(flight, walk.tokens(action.pool, flight.request.prompt_token_ids,
                                              flight.wire))
            return
        if isinstance(action, Refuse):
            record.rejected = action.outcome
            if action.outcome == "no_fit":
                self._counters["no_fit"] += 1
            rtt = self.config.overflow_rtt_s if action.outcome.startswith("overflow_") else 0.0
            self._end(flight, now + rtt)
            return
        if isinstance(action, Fail):
            record.rejected = flight.rejection or action.reason.value
            self._end(flight, now)
            return
        self._send(flight, action)

    def _send_prefill(self, flight: _Flight, send: Send) -> None:
        """A split's first step: the prompt to the prefill replica with ``max_tokens: 1``
        (vLLM's ``do_remote_decode``); the decode half follows its answer."""
        now = self.clock.now()
        request, walk = flight.request, flight.walk
        decision = send.decision
        prefill = decision.prefill_replica
        assert prefill is not None
        if send.warm is not None:
            self._fire_warm(flight, send.warm)
        if any(outage.covers(prefill, now) for outage in self.config.outages):
            self._counters["prefill_failures"] += 1
            self._act(flight, walk.prefill_failed("connect", unreachable=True,
                                                  detail="simulated outage"))
            return
        pid = decision.prefill_request_id
        admission = self.engines[prefill].add_request(EngineRequest(
            request_id=pid, prompt_token_ids=request.prompt_token_ids, max_tokens=1,
            output_length=1, cache_salt=decision.request.cache_salt,
            prompt_block_hashes=flight.digests if decision.request.cache_salt == flight.salt
            else self.digests.get(request, decision.request.cache_salt)[0],
            arrival_s=now, report_full=self.config.report_hits))
        if isinstance(admission, Rejection):
            self._counters["prefill_failures"] += 1
            self._act(flight, walk.prefill_failed("status"))
            return
        self._counters["splits"] += 1
        flight.record.prefill_replica = prefill
        self._prefills[pid] = (flight, send)
        if prefill not in self._busy:
            self._start_step(prefill)

    def _prefilled(self, pid: str) -> None:
        """The prefill half answered: the decode half goes to its replica, which pulls the
        KV it lacks over the link."""
        flight, send = self._prefills.pop(pid)
        if flight.walk.ended:
            return
        flight.walk.prefill_answered()
        self._drain(flight)
        self._send(flight, replace(send, warm=None), remote=True)

    def _send(self, flight: _Flight, send: Send, *, remote: bool = False) -> None:
        """One attempt: the chosen engine admits the request or rejects it."""
        now = self.clock.now()
        request, record, walk = flight.request, flight.record, flight.walk
        decision = send.decision
        if decision.prefill_replica is not None and not remote:
            self._send_prefill(flight, send)
            return
        replica = decision.replica
        if send.warm is not None:
            self._fire_warm(flight, send.warm)
        if any(outage.covers(replica, now) for outage in self.config.outages):
            self._act(flight, walk.failed("connect", retryable=True, unreachable=True,
                                          detail="simulated outage"))
            return
        salt, digests = flight.salt, flight.digests
        if decision.request.cache_salt != salt:  # a version salt (core/scenarios.py)
            salt = decision.request.cache_salt
            digests = self.digests.get(request, salt)[0]
        engine = self._engine_for(replica)
        admission = self.engines[engine].add_request(EngineRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            max_tokens=send.max_tokens if send.max_tokens is not None else request.output_tokens,
            output_length=request.output_tokens,
            cache_salt=salt,
            prompt_block_hashes=digests,
            arrival_s=now,
            report_full=self.config.report_hits,
            kv_transfer_s_per_token=(self.config.disagg.link_s_per_token
                                     if remote and self.config.disagg is not None else None),
        ))
        if isinstance(admission, Rejection):
            numbers = _overflow_numbers(admission, prompt_is_text=request.messages is not None)
            if numbers is None:  # not a window problem (an empty prompt): not retried
                flight.rejection = admission.kind.value
                self._act(flight, walk.failed("status", retryable=False))
                return
            record.num_doomed_attempts += 1
            self._counters["doomed_attempts"] += 1
            nxt = walk.overflowed(numbers)
            if isinstance(nxt, Send | NeedTokens):
                self._drain(flight)
                self._push(now + self.config.overflow_rtt_s, _RESEND, (flight, nxt))
            else:
                self._act(flight, nxt)
            return
        pool_index = send.pool_index
        copied_to = self._spread_to.pop(request.session_id, None) \
            if request.session_id is not None else None
        if copied_to is not None and copied_to == engine:
            self._counters["spread_copies_used"] += 1  # the turn went to its copy
        record.replica = engine
        record.expected_cached_tokens = decision.expected_cached_tokens
        record.pool = decision.request.pool
        record.pool_index = pool_index
        record.clamped_max_tokens = send.max_tokens
        record.version = walk.version
        session = request.session_id
        if pool_index > 0 and (session is None or session not in self._landed):
            if session is not None:
                self._landed.add(session)
            record.first_on_larger = True
            record.cold_ttft_s = self._cold_ttft(pool_index, request, flight.digests)
        if engine not in self._busy:
            self._start_step(engine)

    def _drain(self, flight: _Flight) -> None:
        """The walk's notes into the run's counters and the request's record."""
        record = flight.record
        for note in flight.walk.take_notes():
            if isinstance(note, Escalated):
                self._counters["escalations"] += 1
                record.escalated = True
            elif isinstance(note, Recovered):
                if note.plan == "retry":
                    self._counters["clamp_retries"] += 1
                elif note.plan == "give_up":
                    self._counters["give_ups"] += 1
            elif isinstance(note, WarmNote):
                if note.outcome == "skipped" and note.reason is not None:
                    self._warm_skips[note.reason] += 1
            elif isinstance(note, WindowLearned):
                for i, pool in enumerate(self._tier_pools):
                    if pool.name == note.pool:
                        self._tier_pools[i] = learn_window(pool, note.window, note.now_s)
            elif isinstance(note, CutShortNote):
                record.cut_short = note.why.value
                self._counters[f"cut_short_{note.why.value}"] += 1
            elif isinstance(note, ReplicaUnreachable):
                self._take_out(note.replica)
            elif isinstance(note, ScenarioMove):
                self._counters[f"recompute_tokens_{note.scenario}"] += note.tokens
                self._counters[f"moves_{note.scenario}"] += 1
                record.recompute_tokens += note.tokens
            elif isinstance(note, GateRefused):
                refusal = note.refusal
                self._counters[f"gate_refusals_{refusal.path}_{refusal.status}"] += 1
                self._counters["recompute_tokens_gate"] += refusal.recomputed_tokens
                record.recompute_tokens += refusal.recomputed_tokens
            elif isinstance(note, ArmServed):
                record.arm = note.arm
            elif isinstance(note, ShadowWarm):
                self._shadow_warm(note, flight.walker)

    def _shadow_warm(self, warm: ShadowWarm, walker: Walker) -> None:
        """Each ``max_tokens: 1`` copy of a session's latest prompt to the warmed pool's
        chosen replica, at once (kept out of the workload's records, like warm-ahead), by
        the router (``walker``) whose walk asked for it."""
        now = self.clock.now()
        for item in warm.items:
            request = cast("WorkloadRequest", item.payload)
            wid = f"{SHADOW_PREFIX}{warm.scenario}-{self._counter}-{request.request_id}"
            self._counter += 1
            try:
                decision = walker.core.route(walker.shadow_request(warm, item,
                                                                   RequestId(wid)))
            except NoEligibleReplica:
                walker.shadow_done(warm)
                self._counters[f"shadow_warms_failed_{warm.scenario}"] += 1
                continue
            salt = decision.request.cache_salt
            digests = self.digests.get(request, salt)[0]
            replica = decision.replica
            engine = self._engine_for(replica)
            admission = self.engines[engine].add_request(EngineRequest(
                request_id=wid, prompt_token_ids=request.prompt_token_ids, max_tokens=1,
                output_length=1, cache_salt=salt, prompt_block_hashes=digests, arrival_s=now))
            if isinstance(admission, Rejection):
                walker.core.on_complete(replica, RequestId(wid))
                walker.shadow_done(warm)
                self._counters[f"shadow_warms_failed_{warm.scenario}"] += 1
                continue
            self._counters[f"shadow_warms_{warm.scenario}"] += 1
            self._counters[f"shadow_warm_tokens_{warm.scenario}"] += item.tokens
            self._shadow[wid] = warm
            self._copy_walker[wid] = walker
            if warm.scenario == "spread" and request.session_id is not None:
                self._spread_to[request.session_id] = engine
            self._warm[wid] = RequestRecord(
                wid, now, replica=engine, num_prompt_tokens=item.tokens,
                session_id=request.session_id, pool=warm.pool, requested_max_tokens=1)
            if engine not in self._busy:
                self._start_step(engine)

    def _restart(self, restart: Restart, phase: int) -> None:
        """A replica's restart on other weights (:class:`Restart`): out of routing, drained,
        cache dropped, back with its new identity ``down_s`` later."""
        replica, now = ReplicaId(restart.replica), self.clock.now()
        engine = self.engines[replica]
        if phase == 0:
            self._counters["restarts"] += 1
            for router in self._routers():
                router.set_healthy(replica, False)
            phase = 1
        if phase == 1:
            if engine.has_work() or not engine.reset_prefix_cache():
                self._push(now + 0.05, _RESTART, (restart, 1))  # still draining
                return
            engine.take_events()  # its old blocks are gone with the process
            self._push(now + restart.down_s, _RESTART, (restart, 2))
            return
        for router in self._routers():
            router.set_identity(replica, self._identity(self.pool_of[replica], restart.version))
            router.set_healthy(replica, True)

    def _observe_failovers(self) -> None:
        """A replica's health changed: the failover switches see it now, as the live
        router's do after each health round (``Walker.observe_failovers``)."""
        for walker in self.walkers:
            walker.observe_failovers(self.clock.now())

    def _take_out(self, replica: ReplicaId) -> None:
        """A replica refused a connection: out of routing until its outage ends (what the
        live router's discovery does until ``/health`` answers again)."""
        now = self.clock.now()
        self._counters["replicas_taken_out"] += 1
        for router in self._routers():  # each router's discovery sees the replica go
            router.set_healthy(replica, False)
        self._observe_failovers()
        ends = [o.end_s for o in self.config.outages if o.covers(replica, now)]
        if ends and math.isfinite(max(ends)):
            self._push(max(ends), _HEAL, replica)

    def _end(self, flight: _Flight, release_at: float,
             finish_reason: str | None = None, usage: dict[str, int] | None = None) -> None:
        """The walk's last step: its session record written, its followers released."""
        rid = flight.request.request_id
        write = flight.walk.end([finish_reason] if finish_reason is not None else (), usage)
        self._drain(flight)
        if write is not None:
            self._sessions.put(write.key, write.record, self.clock.now())
        del self._flights[rid]
        self._release_dependents(rid, release_at)

    def _fire_warm(self, flight: _Flight, fire: WarmFire) -> None:
        """Fire-and-forget ``max_tokens: 1`` copy of the prompt to the warm-up's pool."""
        now = self.clock.now()
        request = flight.request
        wid = request.request_id + WARM_SUFFIX  # a request is placed (and warmed) once
        route_request = flight.walk.route_request(
            PoolName(fire.target_pool_name), RequestId(wid), request.prompt_token_ids,
            flight.wire, expected_output_tokens=1)
        router = flight.walker.core
        decision = router.route(route_request)
        replica = decision.replica
        engine = self._engine_for(replica)
        admission = self.engines[engine].add_request(EngineRequest(
            request_id=wid, prompt_token_ids=request.prompt_token_ids, max_tokens=1,
            output_length=1, cache_salt=flight.salt, prompt_block_hashes=flight.digests,
            arrival_s=now,
        ))
        if isinstance(admission, Rejection):
            router.on_complete(replica, RequestId(wid))
            self._counters["warms_rejected"] += 1
            return
        self._copy_walker[wid] = flight.walker
        self._counters["warms_fired"] += 1
        self._warm[wid] = RequestRecord(
            wid, now, replica=engine, num_prompt_tokens=len(request.prompt_token_ids),
            session_id=request.session_id, pool=fire.target_pool_name,
            pool_index=fire.target_pool_index, requested_max_tokens=1,
        )
        if engine not in self._busy:
            self._start_step(engine)

    def _cold_ttft(self, pool_index: int, request: WorkloadRequest,
                   digests: Sequence[BlockHash]) -> float:  # fmt: skip
        """TTFT of ``request``'s prompt on an idle engine of ``pools[pool_index]`` with an
        empty cache: a private probe engine runs it alone, step by step."""
        engine = self._probes.get(pool_index)
        if engine is None:
            engine = EngineModel(self.pools[pool_index].engine_config(), hasher=self.hasher)
            self._probes[pool_index] = engine
        tokens = request.prompt_token_ids
        admission = engine.add_request(EngineRequest(
            "cold-probe", tokens, max_tokens=1, output_length=1, prompt_block_hashes=digests,
        ))
        assert not isinstance(admission, Rejection), (
            f"the cold probe of pool {pool_index} rejected a prompt its pool admitted: {admission}"
        )
        elapsed = 0.0
        budget = engine.config.max_num_batched_tokens
        for _ in range(len(tokens) // budget + 2):
            step = engine.step()
            elapsed += step.duration_s
            if any(out.first_token for out in step.outputs):
                break
        else:
            raise AssertionError("the cold probe produced no first token within its step bound")
        if engine.has_work() or not engine.reset_prefix_cache():
            raise AssertionError("the cold probe engine is not idle after its only request")
        engine.take_events()
        return elapsed

    def _start_step(self, replica: ReplicaId) -> None:
        engine = self.engines[replica]
        if not engine.has_work():
            self._busy.discard(replica)
            return
        self._busy.add(replica)
        result = engine.step()
        self._push(self.clock.now() + result.duration_s, _STEP_DONE, (replica, result))

    def _engine_for(self, replica: ReplicaId) -> ReplicaId:
        """The engine that runs a request the router sent to ``replica``: the target itself,
        or, for a rank-blind router, the rank vLLM's API server picks (``FleetConfig``)."""
        ranks = self._ranks[replica]
        if len(ranks) == 1:
            return ranks[0]
        scores = []
        for name in ranks:
            m = self.engines[name].metrics()
            scores.append(4 * m.num_requests_waiting + m.num_requests_running)
        return ranks[scores.index(min(scores))]

    def _step_done(self, engine: ReplicaId, result: StepResult) -> int:
        now = self.clock.now()
        replica = self._router_name[engine]
        finished = 0
        records = self._records
        prefills = self._prefills
        for out in result.outputs:
            if out.request_id in prefills:
                if out.finished:  # max_tokens 1: its first token ends it
                    self._prefilled(out.request_id)
                continue
            found = records.get(out.request_id)
            warm = found is None
            record = self._warm[out.request_id] if found is None else found
            if out.new_token_ids:
                if out.first_token:
                    record.first_token_s = now
                    record.num_cached_tokens = out.num_cached_tokens
                    if warm:
                        self._copy_walker[out.request_id].core.on_first_token(
                            replica, RequestId(out.request_id))
                    else:
                        self._flights[out.request_id].walk.answered()
                elif record.last_token_s is not None:
                    gap = now - record.last_token_s
                    for _ in out.new_token_ids:
                        self._itl.append(gap / len(out.new_token_ids))
                    record.itl_sum_s += gap
                    record.num_itl_tokens += len(out.new_token_ids)
                record.last_token_s = now
            record.num_output_tokens = out.num_output_tokens
            if out.finished:
                record.finish_s = now
                record.finish_reason = out.finish_reason
                if warm:
                    walker = self._copy_walker.pop(out.request_id)
                    walker.core.on_complete(replica, RequestId(out.request_id))
                    shadow = self._shadow.pop(out.request_id, None)
                    if shadow is not None:
                        walker.shadow_done(shadow)
                    continue
                self._end(self._flights[out.request_id], now, out.finish_reason,
                          {"prompt_tokens": out.num_prompt_tokens,
                           "completion_tokens": out.num_output_tokens})
                finished += 1
        if result.events:
            self._publish(replica, result.events, now)
        if self.shared_tier is not None:
            shared = self.shared_tier.take_events()
            if shared:  # the store's events, under every replica that can load from it
                for name in self.router_names:
                    self._publish(name, shared, now)
        if now - self._scraped_at.get(replica, -1e18) >= self.config.metrics_interval_s:
            self._scraped_at[replica] = now
            # one rank's series, or (rank-blind) the server's: summed, usage the mean
            ranks = [self.engines[name].metrics() for name in self._ranks[replica]]
            for router in self._routers():
                router.on_engine_metrics(
                    replica, running=sum(m.num_requests_running for m in ranks),
                    waiting=sum(m.num_requests_waiting for m in ranks),
                    kv_usage=sum(m.kv_cache_usage_perc for m in ranks) / len(ranks),
                )
        self._start_step(engine)
        return finished

    def _publish(self, replica: ReplicaId, events: Sequence[KVEvent], now: float) -> None:
        seq = self._event_seq[replica]
        self._event_seq[replica] = seq + 1
        batch = EventBatch(seq=seq, ts=now, events=tuple(events), data_parallel_rank=0)
        self._push(now + self.config.event_latency_s, _EVENTS, (replica, batch))

    def _release_dependents(self, request_id: str, now: float) -> None:
        for follower in self._dependents.pop(request_id, ()):
            self._push(now + (follower.think_time_s or 0.0), _ARRIVE, follower)

    def _sample(self) -> None:
        loads = []
        for name in self.names:
            m = self.engines[name].metrics()
            loads.append(m.num_requests_running + m.num_requests_waiting)
        self._samples.append((self.clock.now(), tuple(loads)))


def _overflow_numbers(rejection: Rejection, *, prompt_is_text: bool) -> OverflowNumbers | None:
    """The engine's rejection as the shell sees it: vLLM 0.32's error body for these numbers,
    parsed back by ``wire.overflow`` (so the reactive path reads what a real engine says,
    including the "at least" lower bound of a truncated text prompt). ``None`` when the
    rejection is not about the window."""
    response = check_overflow(
        OVERFLOW_STYLE, window=rejection.max_model_len, prompt_tokens=rejection.prompt_tokens,
        max_tokens=rejection.max_tokens, prompt_is_text=prompt_is_text,
    )
    if response is None:
        return None
    overflow = parse_overflow(response.status, response.body)
    return None if overflow is None else overflow_numbers(overflow)


def _profile_prefill_rate(profile: TimingProfile) -> float:
    """The prefill rate (tokens/s) a profile implies for a full-budget chunk: the router's
    starting point before it learns each replica's real rate."""
    t = profile.timing
    chunk = profile.max_num_batched_tokens
    step = t.fixed_s + t.prefill_token_s * chunk + t.context_token_s * chunk
    return chunk / step if step > 0 else 1e9


def simulate(
    workload: Sequence[WorkloadRequest],
    config: FleetConfig,
    *,
    digests: DigestCache | None = None,
) -> FleetResult:
    """Run ``workload`` through a fleet built from ``config`` and return the result."""
    return FleetSimulation(config, workload, digests=digests).run()
