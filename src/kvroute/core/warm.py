"""Warm-ahead: pre-pay the large pool's prefill while the session still fits the small one.

Owns :class:`WarmPlanner` (the decision and its guards), the in-memory cooldown map
(:class:`MemoryCooldownStore`, a bounded LRU) and the :class:`CooldownStore` seam the shell
implements with Redis. Pure: no I/O, no clock reads (``now_s`` is an argument), no
environment: ``KVROUTE_WARM_AHEAD`` is read by the shell's config and arrives as ``enabled``.

Why: KV caches cannot move between different models, but token prefixes can. When a
session's prompt has grown to ``fraction`` (default 0.6) of its current pool's window, the
shell sends the next larger pool the same body with ``max_tokens: 1``
(``wire.openai.warm_request_body``), fire-and-forget, routed by the same policy and with the
same ``cache_salt``; when the session later escalates, its prefill is mostly a cache hit. At
0.9 the warm-up would arrive too late: the next turn already escalates.

Guards, checked in this order (each is a :class:`WarmSkipReason`):

1. ``DISABLED`` — the feature is off (config switch or ``KVROUTE_WARM_AHEAD=0``);
2. ``NO_SESSION`` — without a session id nothing follows that could use the warm prefix;
3. ``NO_LARGER_POOL`` — the request is already on the route's largest eligible pool;
4. ``WINDOW_UNKNOWN`` — the current pool's window is not known, so no threshold exists;
5. ``BELOW_THRESHOLD`` — ``estimate_low < fraction * window``;
6. ``TARGET_MODEL_UNKNOWN`` — the target pool's served model is not known (the warm-up
   would have no ``model`` to name);
7. ``COOLDOWN`` — this session was warmed at its current growth stage less than
   ``cooldown_s`` ago.

Growth stages (re-warming a growing session): one warm-up at 0.6 of the window caches only
what the session held then; when it escalates at 1.0, about 40% of the prompt is still cold,
and the escalated turn pays that share of a cold prefill (``kvroute bench tiers``:
``docs/benchmarks.md#tiers-reactive-proactive-warm-ahead``).
So the cooldown is kept per *stage*: stage ``k`` covers estimates in
``[fraction + k·rewarm_fraction, fraction + (k+1)·rewarm_fraction)`` of the window. A
session is warmed at most once per stage per cooldown: with the defaults (0.6, 0.1) that is
at most four warm-ups per session per cooldown before it leaves the pool, each one
prefilling only the tokens added since the last (the earlier prefix is already cached on the
target), so a chatty session still cannot flood the large pool.

The cooldown is the only guard with state. Its rule lives in one place,
:meth:`CooldownStore.try_claim`: *claim the session's warm slot for ``cooldown_s`` unless a
live claim exists*. :class:`MemoryCooldownStore` implements it over a bounded LRU (oldest
session evicted beyond ``max_sessions``, default 256); the shell's Redis store implements the
same rule as one atomic ``SET <cooldown_key(session)> <now> NX PX <cooldown_ms>``, so every
router process shares it and two routers never both warm one session. The Redis call is
async, so the shell runs :meth:`WarmPlanner.consider` with ``claim=False`` (pure guards
plus this process's own view of the cooldown), then ``await``\\s its claim, then calls
:meth:`WarmPlanner.mark_fired` so the local view skips Redis for the rest of the cooldown.
With the memory store, ``consider(..., claim=True)`` does all of it in one call.

The obvious alternative, a timestamp on the session record, was rejected: it grows without
bound with the number of sessions, and it is not shared between router processes.

Chunked warm-ups (:func:`chunk_bounds`): a session's first warm-up is a long prefill (2,700
tokens on the live bench's large engine, a quarter of a second), and vLLM schedules FCFS with
running prefills keeping their token budget, so an escalation that arrives during it waits for
all of it. Sent as a series of growing prefixes (``prompt[:end_1]``, ``prompt[:end_2]``, ...,
the whole prompt), each request computes only the blocks the previous one did not, and an
escalation waits behind at most one chunk: it enters the engine's queue between chunks.

What this module does not decide: whether a warm-up it fired may be *sent now*. That depends
on the warm-ups in flight (at most one per session, at most
``warm_ahead.max_in_flight_per_replica`` per target replica, later stages coalesced), which
is the state of tasks: ``core/warm_slots.py`` (``WarmSlots``) keeps that bookkeeping and
``shell/warm.py`` drives it.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from kvroute.core.errors import ConfigError
from kvroute.core.tiers import LOG_TAG, TierPool, eligibility

__all__ = [
    "COOLDOWN_KEY_PREFIX",
    "DEFAULT_COOLDOWN_S",
    "DEFAULT_FRACTION",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_REWARM_FRACTION",
    "CooldownStore",
    "MemoryCooldownStore",
    "WarmFire",
    "WarmPlanner",
    "WarmSkip",
    "WarmSkipReason",
    "chunk_bounds",
    "cooldown_key",
]

DEFAULT_FRACTION: Final = 0.6
DEFAULT_COOLDOWN_S: Final = 300.0
DEFAULT_MAX_SESSIONS: Final = 256
DEFAULT_REWARM_FRACTION: Final = 0.1
COOLDOWN_KEY_PREFIX: Final = "kvroute:warm:"


def cooldown_key(session_id: str, stage: int | None = None) -> str:
    """The shared key of a session's warm slot at a growth stage (Redis uses exactly this)."""
    return COOLDOWN_KEY_PREFIX + (session_id if stage is None else f"{session_id}#{stage}")


class WarmSkipReason(enum.StrEnum):
    """Why no warm-up was fired (a counter label)."""

    DISABLED = "disabled"
    NO_SESSION = "no_session"
    NO_LARGER_POOL = "no_larger_pool"
    WINDOW_UNKNOWN = "window_unknown"
    BELOW_THRESHOLD = "below_threshold"
    TARGET_MODEL_UNKNOWN = "target_model_unknown"
    COOLDOWN = "cooldown"


@dataclass(frozen=True, slots=True)
class WarmFire:
    """Send a ``max_tokens: 1`` copy of the request to ``pools[target_pool_index]``.

    ``target_model`` is the ``model`` to name in the warm-up body.
    """

    session_id: str
    target_pool_index: int
    target_pool_name: str
    target_model: str
    log_line: str
    stage: int = 0
    """The growth stage this warm-up covers; ``cooldown_key(session_id, stage)`` is the
    key to claim in a shared store."""

    @property
    def claim_key(self) -> str:
        return cooldown_key(self.session_id, self.stage)


@dataclass(frozen=True, slots=True)
class WarmSkip:
    reason: WarmSkipReason


class CooldownStore(Protocol):
    """The cooldown rule, one claim per session per cooldown (module docstring)."""

    def try_claim(self, session_id: str, now_s: float, cooldown_s: float) -> bool:
        """Claim the session's slot until ``now_s + cooldown_s`` unless a live claim exists.

        Returns True when this call claimed it (the caller fires the warm-up).
        """
        ...

    def is_cooling(self, session_id: str, now_s: float) -> bool:
        """True while a claim for the session is live; never changes the store."""
        ...


@dataclass(slots=True)
class _Claim:
    expires_at_s: float
    target_pool_index: int | None


class MemoryCooldownStore:
    """In-process cooldowns: an LRU of at most ``max_sessions`` live claims.

    Invariant: ``len(self) <= max_sessions``. A claim is dropped when it expires (lazily,
    on lookup) or when it is the least recently claimed beyond the bound; dropping a live
    claim early can only allow one extra warm-up, never block one.
    """

    __slots__ = ("_claims", "_max_sessions")

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if max_sessions < 1:
            raise ConfigError(
                f"warm_ahead.max_sessions must be >= 1, got {max_sessions}; it bounds the "
                "cooldown map (default 256)"
            )
        self._max_sessions = max_sessions
        self._claims: OrderedDict[str, _Claim] = OrderedDict()

    def __len__(self) -> int:
        return len(self._claims)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._claims

    def is_cooling(self, session_id: str, now_s: float) -> bool:
        claim = self._claims.get(session_id)
        if claim is None:
            return False
        if now_s >= claim.expires_at_s:
            del self._claims[session_id]
            return False
        return True

    def try_claim(self, session_id: str, now_s: float, cooldown_s: float) -> bool:
        if self.is_cooling(session_id, now_s):
            return False
        self.record(session_id, now_s + cooldown_s)
        return True

    def record(self, session_id: str, expires_at_s: float, target_pool_index: int | None = None
               ) -> None:  # fmt: skip
        """Store a claim made elsewhere (or here), evicting the oldest beyond the bound."""
        self._claims[session_id] = _Claim(expires_at_s, target_pool_index)
        self._claims.move_to_end(session_id)
        while len(self._claims) > self._max_sessions:
            self._claims.popitem(last=False)

    def target_of(self, session_id: str, now_s: float) -> int | None:
        """The pool a live claim warmed, if recorded (for the warmed-prefix-hit metric)."""
        if not self.is_cooling(session_id, now_s):
            return None
        return self._claims[session_id].target_pool_index


class WarmPlanner:
    """Decides warm-ahead requests; the shell sends them (see the module docstring).

    Args:
        fraction: share of the current window the estimate must reach, in (0, 1].
        cooldown_s: at most one warm-up per session per this many seconds (>= 0).
        max_sessions: bound of the in-memory cooldown map.
        enabled: the config switch (``KVROUTE_WARM_AHEAD`` resolved by the shell).
        rewarm_fraction: width of a growth stage as a share of the window, in (0, 1]; 1
            keeps the original single warm-up per cooldown.

    Raises:
        ConfigError: a value out of range; the message names the key and the fix.
    """

    __slots__ = ("cooldown_s", "enabled", "fraction", "memory", "rewarm_fraction")

    def __init__(
        self,
        fraction: float = DEFAULT_FRACTION,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        enabled: bool = True,
        rewarm_fraction: float = DEFAULT_REWARM_FRACTION,
    ) -> None:
        if not 0.0 < rewarm_fraction <= 1.0:
            raise ConfigError(
                f"warm_ahead.rewarm_fraction must be in (0, 1], got {rewarm_fraction}; 0.1 "
                "re-warms a growing session every tenth of the window"
            )
        if not 0.0 < fraction <= 1.0:
            raise ConfigError(
                f"warm_ahead.fraction must be in (0, 1], got {fraction}; 0.6 warms early "
                "enough for the next turn to find the prefix cached"
            )
        if cooldown_s < 0:
            raise ConfigError(f"warm_ahead.cooldown_s must be >= 0 seconds, got {cooldown_s}")
        self.fraction = fraction
        self.rewarm_fraction = rewarm_fraction
        self.cooldown_s = cooldown_s
        self.enabled = enabled
        # Up to one claim per growth stage plus the session's own record, per session.
        stages = int((1.0 - fraction) / rewarm_fraction) + 2
        self.memory = MemoryCooldownStore(max_sessions * stages)

    def consider(
        self,
        session_id: str | None,
        estimate_low: int,
        pools: Sequence[TierPool],
        current_index: int,
        now_s: float,
        *,
        request_model: str | None = None,
        claim: bool = True,
    ) -> WarmFire | WarmSkip:
        """Decide whether to warm the next larger pool for this request's session.

        Args:
            session_id: the request's session id, if any.
            estimate_low: the prompt's under-estimate (``TokenEstimate.low``).
            pools: the route's pools, smallest first.
            current_index: the pool the request is placed on.
            now_s: the shell's monotonic now.
            request_model: the client's model (the external-catalog rule for targets).
            claim: with True, a :class:`WarmFire` also claims the in-memory cooldown; with
                False (Redis backend) only this process's view is checked, and the caller
                claims in Redis and then calls :meth:`mark_fired`.

        Returns:
            :class:`WarmFire` or :class:`WarmSkip` with the first guard that failed.
        """
        if not self.enabled:
            return WarmSkip(WarmSkipReason.DISABLED)
        if not session_id:
            return WarmSkip(WarmSkipReason.NO_SESSION)
        target = next(
            (j for j in range(current_index + 1, len(pools))
             if eligibility(pools[j], j, request_model) is None),
            None,
        )  # fmt: skip
        if target is None:
            return WarmSkip(WarmSkipReason.NO_LARGER_POOL)
        current = pools[current_index]
        if current.window is None:
            return WarmSkip(WarmSkipReason.WINDOW_UNKNOWN)
        if estimate_low < self.fraction * current.window:
            return WarmSkip(WarmSkipReason.BELOW_THRESHOLD)
        model = pools[target].served_model
        if model is None:
            return WarmSkip(WarmSkipReason.TARGET_MODEL_UNKNOWN)
        stage = int((estimate_low / current.window - self.fraction) / self.rewarm_fraction)
        if self.memory.is_cooling(cooldown_key(session_id, stage), now_s):
            return WarmSkip(WarmSkipReason.COOLDOWN)
        if claim:
            self.mark_fired(session_id, now_s, target_pool_index=target, stage=stage)
        line = (
            f"{LOG_TAG} warm-ahead: est≈{estimate_low}tok ≥ {self.fraction:g} × window "
            f"{current.window} of {current.name!r} (stage {stage}) → warm {pools[target].name!r}"
        )
        return WarmFire(session_id, target, pools[target].name, model, line, stage)

    def mark_fired(
        self,
        session_id: str,
        now_s: float,
        *,
        target_pool_index: int | None = None,
        expires_at_s: float | None = None,
        stage: int = 0,
    ) -> None:
        """Record a warm-up claimed for ``session_id`` at ``stage`` (here, or by the shared
        store).

        ``expires_at_s`` defaults to ``now_s + cooldown_s``; pass the shared store's expiry
        when a claim there failed because another router holds it.
        """
        expiry = now_s + self.cooldown_s if expires_at_s is None else expires_at_s
        self.memory.record(cooldown_key(session_id, stage), expiry, target_pool_index)
        # The session's latest warmed target, for counting warmed-prefix hits.
        self.memory.record(cooldown_key(session_id), expiry, target_pool_index)

    def warmed_target(self, session_id: str, now_s: float) -> int | None:
        """The pool this process warmed for the session within the cooldown, if any.

        An escalated request whose pool equals this counts as a warmed-prefix hit.
        """
        return self.memory.target_of(cooldown_key(session_id), now_s)


def chunk_bounds(num_tokens: int, block_size: int, chunk_tokens: int,
                 cached_tokens: int = 0) -> list[int]:
    """Where to cut a warm-up of ``num_tokens`` prompt tokens into growing prefixes.

    Returns the prefix lengths to send one after the other, strictly increasing, the last
    equal to ``num_tokens``. Invariants: every length but the last is a multiple of
    ``block_size`` (a prefix ending mid-block would leave its last partial block uncached,
    and the next chunk would compute it again); no request computes more than
    ``chunk_tokens`` tokens beyond what the previous one cached (``chunk_tokens`` rounded
    down to whole blocks, at least one block).

    The uncached part, ``num_tokens`` minus ``cached_tokens`` rounded down to whole blocks,
    is split into ``ceil(uncached / chunk)`` chunks of nearly equal size (rounded up to
    whole blocks, so only the last may be shorter) rather than full chunks and a remainder:
    a tail of a few tokens would cost a round trip for nothing, and equal chunks make the
    longest wait shorter. Worked example, blocks of 16, ``chunk_tokens`` 1024: 2,700
    tokens, nothing cached → 3 chunks of ``ceil(2700/3/16)·16 = 912`` → ``[912, 1824,
    2700]``; the same prompt with 2,000 tokens already cached (a later growth stage) →
    ``[2700]``, one request, as without chunking.

    Args:
        num_tokens: the prompt's exact length in tokens (>= 1).
        block_size: the target pool's tokens per block (>= 1).
        chunk_tokens: ``warm_ahead.chunk_tokens``; 0 = one request (no chunking).
        cached_tokens: what the target replica is expected to hold already (the router's
            prefix match); those tokens are not counted in any chunk.

    Raises:
        ValueError: a negative or zero argument where the bounds above require more.
    """
    if num_tokens < 1 or block_size < 1 or chunk_tokens < 0 or cached_tokens < 0:
        raise ValueError(
            f"chunk_bounds needs num_tokens >= 1, block_size >= 1, chunk_tokens >= 0 and "
            f"cached_tokens >= 0; got {num_tokens}, {block_size}, {chunk_tokens}, "
            f"{cached_tokens}")
    if chunk_tokens == 0:
        return [num_tokens]
    step = max(block_size, chunk_tokens // block_size * block_size)
    start = min(cached_tokens, num_tokens - 1) // block_size * block_size
    uncached = num_tokens - start
    chunks = -(-uncached // step)
    if chunks <= 1:
        return [num_tokens]
    size = -(-uncached // (chunks * block_size)) * block_size
    ends = [start + k * size for k in range(1, chunks) if start + k * size < num_tokens]
    return [*ends, num_tokens]
