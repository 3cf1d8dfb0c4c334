"""Context-window tiers: which pool can hold a request, how much output it may ask for, and
what to do when an engine says it did not fit.

Owns the proactive plan (:func:`plan_tier`), the reactive plan (:func:`plan_recovery`), the
window bookkeeping (:class:`TierPool`, :func:`learn_window`), the cut-short classification
(:func:`was_cut_short`) and the ``[CONTEXT-ROUTE]`` log lines. Pure: no I/O, no clock reads
(time arrives as ``now_s``), and no import of ``wire/``: the shell translates
``wire.overflow.Overflow`` into :class:`OverflowNumbers` (``OverflowPart`` uses the same
values as ``OverflowKind``).

Theory of operation — the proactive rule
----------------------------------------

A route lists its pools from small window to large. For a request with estimate band
``[low, high]`` (``core/tokens.py``), requested output ``O`` (``None`` if the client set no
``max_tokens``) and the output floor ``F`` (default 256; ``F_eff = min(F, O)`` when the
client asked for less, so a ``max_tokens: 1`` warm-up needs 1), each eligible pool with a
known window ``W`` is classified, in order:

* ``high + F_eff <= W`` — **fits**. Place here. If ``O > W - high``, clamp ``max_tokens`` to
  ``W - high`` (>= ``F_eff``): the over-estimate protects the output budget, so neither an
  old engine's 400 nor vLLM >= 0.32's silent shortening can happen on our account.
* ``low + F_eff <= W < high + F_eff`` — **straddles**. The under-estimate fits, the
  over-estimate does not. With a non-exact estimate the plan is :class:`NeedExactCount`: the
  shell asks the pool's ``/tokenize`` and plans again with the exact count. When no exact
  count can be had (``exact_count_available=False``), the under-estimate decides: stay
  (borderline interactive turns stay fast), with ``max_tokens`` clamped to
  ``max(W - high, F_eff)``; a miss costs one reactive round trip.
* ``low * (1 - tokenize_margin) + F_eff <= W < low + F_eff`` — **just over**. chars/4
  over-counts prose by up to ~19 %, so the true count may still fit: ask for an exact count
  as above; without one, leave (the under-estimate says it does not fit).
* otherwise — **too small**: leave for the next pool, with no attempt here.

An exact estimate (``low == high``) makes the middle cases empty, so a second call never
asks for an exact count again. A pool with an unknown window is taken optimistically (no
clamp, listed in ``stale_pools`` and said in the log): refusing it could only be a guess,
and an overflow there is learned from (:func:`learn_window`) in one round trip.

Worked example (the issue's seed case): window 16,384, ``max_tokens: 4096``, a prompt of
12,289 tokens. vLLM 0.18-0.31 answers it with "...for a total of at least 16385 tokens",
and vLLM >= 0.32 silently cuts the answer to 4,095 tokens.

* Heuristic estimate of one 48,968-byte message: ``low = 12,250``, ``high = 16,331``
  (bytes / 4 and / 3, plus 8 tokens of framing): ``12,250 + 256 <= 16,384 < 16,331 + 256``
  straddles → ``NeedExactCount(0)``.
* The shell's ``/tokenize`` says 12,289: ``12,289 + 256 <= 16,384`` fits → ``Place(0)``
  with ``max_tokens`` clamped 4096 → 4095, logged, and counted by :func:`was_cut_short` if
  the answer does stop at 4,095. The request no longer fails, and it keeps the fast tier:
  256 tokens of guaranteed output is the configured price of staying interactive. A route
  that must always get the full requested output sets ``output_floor`` to its usual
  ``max_tokens``.
* With 16,200 exact tokens, ``16,200 + 256 > 16,384``: too small → the large pool, logged
  ``[CONTEXT-ROUTE] proactive: exact 16200tok + 256 output floor exceeds window 16384 of
  'small' → 'large'``.

Why not the obvious rule "escalate when ``high + O > W``": clients often send a large
``max_tokens`` by habit (some send the model's maximum), and that rule would move nearly
every turn to the slow tier.

External pools (an OpenAI-compatible provider) are eligible only when the model the request
would be sent as (``served_model``, else the request's model) is in the provider's catalog
(configured, or read from its ``/v1/models``); otherwise they are skipped with the reason in
the plan and the log, and the request stays local.

Theory of operation — the reactive path
---------------------------------------

:func:`plan_recovery` reads the engine's own numbers from a rejection. It clamps and
retries the same pool at most once, escalates only to later pools (never back), skips pools
the engine's numbers already rule out, and stops after ``2 * len(pools)`` attempts in all —
so any sequence of overflow answers ends within that bound (property-tested). A prompt count
that is only a lower bound is never the basis of a clamp on its own: the clamp then uses
``max(lower bound, our over-estimate)``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Final

from kvroute.core.errors import ConfigError
from kvroute.core.tokens import TokenEstimate

__all__ = [
    "DEFAULT_OUTPUT_FLOOR",
    "DEFAULT_TOKENIZE_MARGIN",
    "LOG_TAG",
    "OVERFLOW_ERROR_CODE",
    "OVERFLOW_ERROR_PARAM",
    "OVERFLOW_ERROR_TYPE",
    "WINDOW_TTL_S",
    "AttemptState",
    "CutShort",
    "Escalate",
    "GiveUp",
    "GiveUpReason",
    "NeedExactCount",
    "NoFit",
    "NoPool",
    "OverflowNumbers",
    "OverflowPart",
    "Place",
    "PlaceReason",
    "RecoveryPlan",
    "Retry",
    "Skip",
    "SkipReason",
    "TierPlan",
    "TierPool",
    "eligibility",
    "learn_window",
    "max_attempts",
    "openai_overflow_message",
    "plan_recovery",
    "plan_tier",
    "proactive_log_line",
    "was_cut_short",
]

WINDOW_TTL_S: Final = 900.0
"""Discovered windows are trusted for 15 minutes: a swap slot can serve another model later."""
DEFAULT_OUTPUT_FLOOR: Final = 256
"""The least output a placement must leave room for."""
DEFAULT_TOKENIZE_MARGIN: Final = 0.2
"""How far below the under-estimate a window may lie and still be worth an exact count
(chars/4 over-counted English prose by 19 % in the measured corpora)."""
LOG_TAG: Final = "[CONTEXT-ROUTE]"
OVERFLOW_ERROR_TYPE: Final = "invalid_request_error"
OVERFLOW_ERROR_PARAM: Final = "messages"
OVERFLOW_ERROR_CODE: Final = "context_length_exceeded"
"""OpenAI's fields for a context overflow, to send with :func:`openai_overflow_message`."""


# --- pools ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TierPool:
    """One pool of a route, as the tier logic sees it.

    Attributes:
        name: the pool's name (as in the router's ``PoolSpec``).
        window: ``max_model_len`` reported by its engines; ``None`` until discovered.
        window_fetched_at_s: when ``window`` was learned (the shell's monotonic seconds).
        external: an OpenAI-compatible provider outside the fleet.
        catalog: model names the provider serves (configured, or its ``/v1/models``);
            ``None`` when not known yet. Ignored for local pools.
        served_model: the model name this pool serves / the request is sent as; ``None``
            when not known (warm-ahead skips such targets).

    Invariant: ``window`` is ``None`` or >= 1.
    """

    name: str
    window: int | None = None
    window_fetched_at_s: float | None = None
    external: bool = False
    catalog: frozenset[str] | None = None
    served_model: str | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ConfigError(
                f"pool {self.name!r}: window must be a positive token count, got "
                f"{self.window}; leave it unset to discover max_model_len from /v1/models"
            )

    def window_age_s(self, now_s: float) -> float | None:
        """Seconds since the window was learned; ``None`` if it never was."""
        if self.window is None or self.window_fetched_at_s is None:
            return None
        return now_s - self.window_fetched_at_s

    def is_stale(self, now_s: float, ttl_s: float = WINDOW_TTL_S) -> bool:
        """True when the window is unknown or older than ``ttl_s`` (the shell refreshes it)."""
        age = self.window_age_s(now_s)
        return age is None or age > ttl_s


class SkipReason(enum.StrEnum):
    """Why a pool was passed over."""

    TOO_SMALL = "too_small"
    SESSION_PINNED = "session_pinned"
    """Below the pool the session already escalated to (no flapping back)."""
    NOT_IN_CATALOG = "not_in_catalog"
    CATALOG_UNKNOWN = "catalog_unknown"
    NO_MODEL = "no_model"


@dataclass(frozen=True, slots=True)
class Skip:
    """A pool passed over, and why (``detail`` is the human sentence)."""

    pool_index: int
    pool_name: str
    reason: SkipReason
    detail: str


def eligibility(pool: TierPool, pool_index: int, request_model: str | None) -> Skip | None:
    """``None`` when ``pool`` may serve the request's model, else the :class:`Skip`.

    Local pools are always eligible (the route lists them for this model). An external pool
    needs the model it would be sent as (``served_model``, else ``request_model``) in its
    ``catalog``.
    """
    if not pool.external:
        return None
    model = pool.served_model or request_model
    if model is None:
        return Skip(pool_index, pool.name, SkipReason.NO_MODEL,
                    f"no model mapping for {pool.name!r} (set its served_model)")  # fmt: skip
    if pool.catalog is None:
        detail = f"catalog of {pool.name!r} unknown (configure it or read /v1/models)"
        return Skip(pool_index, pool.name, SkipReason.CATALOG_UNKNOWN, detail)
    if model not in pool.catalog:
        return Skip(pool_index, pool.name, SkipReason.NOT_IN_CATALOG,
                    f"model {model!r} not in the catalog of {pool.name!r}")  # fmt: skip
    return None


def learn_window(pool: TierPool, window_from_error: int, now_s: float) -> TierPool:
    """Correct ``pool``'s window from the engine's own overflow numbers.

    The engine is the authority on its ``max_model_len``: a stale cached window (the slot
    now serves another model) is replaced and its age restarted.

    Raises:
        ValueError: ``window_from_error`` < 1 (never a window; do not pass such a number).
    """
    if window_from_error < 1:
        raise ValueError(f"an engine window must be >= 1 token, got {window_from_error}")
    return replace(pool, window=window_from_error, window_fetched_at_s=now_s)


# --- proactive plan ------------------------------------------------------------------------------


class PlaceReason(enum.StrEnum):
    FITS = "fits"
    """The first eligible pool holds the request."""
    ESCALATED = "escalated"
    """Smaller pools were too small; a larger one holds it."""
    WINDOW_UNKNOWN = "window_unknown"
    """Placed on a pool whose window is not known yet (optimistic, refresh pending)."""
    UNCERTAIN = "uncertain"
    """The band straddles the window and no exact count was available: decided on ``low``."""


@dataclass(frozen=True, slots=True)
class Place:
    """Send the request to ``pools[pool_index]``.

    Attributes:
        clamped_max_tokens: the ``max_tokens`` to send instead of the client's, or ``None``
            to send the body's value unchanged.
        input_tokens: the estimate the fit was decided on (``low``).
        skipped: pools passed over, in order, with their reasons.
        stale_pools: indices of considered pools whose windows are stale or unknown (the
            shell schedules a refresh).
    """

    pool_index: int
    pool_name: str
    clamped_max_tokens: int | None
    reason: PlaceReason
    describe: Callable[[], str] = field(repr=False, compare=False)
    """Renders the decision line; called only when it is logged (every request gets a
    placement, few placements are logged, and the line costs more than the decision)."""
    input_tokens: int = 0
    skipped: tuple[Skip, ...] = ()
    stale_pools: tuple[int, ...] = ()

    @property
    def log_line(self) -> str:
        """The decision line (see ``proactive_log_line``)."""
        return self.describe()

    @property
    def escalated(self) -> bool:
        """True when a smaller pool was passed over for its window (an escalation metric)."""
        return any(s.reason is SkipReason.TOO_SMALL for s in self.skipped)


@dataclass(frozen=True, slots=True)
class NeedExactCount:
    """Ask ``pools[pool_index]``'s ``/tokenize`` and call :func:`plan_tier` again with
    ``TokenEstimate.exact_count(count)`` (or with ``exact_count_available=False``)."""

    pool_index: int
    pool_name: str
    window: int
    log_line: str


@dataclass(frozen=True, slots=True)
class NoFit:
    """Even the largest eligible pool cannot hold the prompt and the output floor.

    ``message`` is OpenAI's wording (LiteLLM's ``context_window_fallbacks`` matches "this
    model's maximum context length is"); send it as a 400 with ``OVERFLOW_ERROR_TYPE``,
    ``OVERFLOW_ERROR_PARAM`` and ``OVERFLOW_ERROR_CODE``.
    """

    largest_window: int
    input_tokens: int
    requested_output_tokens: int
    message: str
    log_line: str
    skipped: tuple[Skip, ...] = ()
    stale_pools: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class NoPool:
    """No pool of the route may serve this model (every one skipped by the catalog rule)."""

    message: str
    log_line: str
    skipped: tuple[Skip, ...]


TierPlan = Place | NeedExactCount | NoFit | NoPool


def openai_overflow_message(window: int, input_tokens: int, requested_output: int) -> str:
    """OpenAI's overflow text with the router's numbers.

    With room for no output at all it is the prompt-only form ("your messages resulted in P
    tokens"); when the prompt fits but not with its output, the prompt + completion form.
    Both start "This model's maximum context length is", which LiteLLM recognises.
    """
    if input_tokens >= window or requested_output <= 0:
        return (
            f"This model's maximum context length is {window} tokens. However, your messages "
            f"resulted in {input_tokens} tokens. Please reduce the length of the messages."
        )
    return (
        f"This model's maximum context length is {window} tokens. However, you requested "
        f"{input_tokens + requested_output} tokens ({input_tokens} in the messages, "
        f"{requested_output} in the completion). Please reduce the length of the messages "
        "or completion."
    )


def _est(estimate: TokenEstimate) -> str:
    return f"exact {estimate.low}tok" if estimate.exact else f"est≈{estimate.low}tok"


def proactive_log_line(
    estimate: TokenEstimate,
    floor: int,
    too_small: Sequence[tuple[str, int]],
    target: str | None,
    *,
    fits: tuple[str, int] | None = None,
    clamp: tuple[int, int] | None = None,
    notes: Sequence[str] = (),
) -> str:
    """The decision line, e.g. ``[CONTEXT-ROUTE] proactive: est≈59863tok + 256 output floor
    exceeds window 16384 of 'small' → 'large'``.

    Args:
        estimate: the estimate decided on (``est≈low`` or ``exact n``).
        floor: the effective output floor.
        too_small: (name, window) of the pools left for their size, in order.
        target: the pool chosen, or ``None`` for "no pool fits" (→ 400).
        fits: (name, window) of the chosen pool when none was left for size.
        clamp: (requested, clamped) ``max_tokens``.
        notes: extra clauses (skips, stale windows), appended after ``"; "``.
    """
    head = f"{LOG_TAG} proactive: {_est(estimate)} + {floor} output floor"
    if too_small:
        windows = ", ".join(f"window {w} of {n!r}" for n, w in too_small)
        line = f"{head} exceeds {windows} → " + (repr(target) if target else "400 (no pool fits)")
    elif fits is not None:
        line = f"{head} fits window {fits[1]} of {fits[0]!r}"
    else:
        line = f"{head} → {target!r}" if target else f"{head} → 400 (no pool fits)"
    if clamp is not None:
        line += f"; max_tokens {clamp[0]} → {clamp[1]}"
    for note in notes:
        line += f"; {note}"
    return line


def _stale_note(pool: TierPool, now_s: float) -> str:
    age = pool.window_age_s(now_s)
    if age is None:
        return f"window of {pool.name!r} unknown, refresh pending"
    return f"window of {pool.name!r} stale ({age:.0f}s old), refresh pending"


def plan_tier(
    pools: Sequence[TierPool],
    estimate: TokenEstimate,
    requested_max_tokens: int | None,
    *,
    now_s: float,
    request_model: str | None = None,
    output_floor: int = DEFAULT_OUTPUT_FLOOR,
    tokenize_margin: float = DEFAULT_TOKENIZE_MARGIN,
    window_ttl_s: float = WINDOW_TTL_S,
    exact_count_available: bool = True,
    min_pool_index: int = 0,
) -> TierPlan:
    """Choose the pool for a request before sending it (rule in the module docstring).

    Args:
        pools: the route's pools, smallest window first.
        estimate: the prompt estimate (``core/tokens.py``) or an exact count.
        requested_max_tokens: the client's output limit, ``None`` if it set none.
        now_s: the shell's monotonic now (for window staleness).
        request_model: the model the client asked for (external catalog rule).
        output_floor: the least output a placement must leave room for.
        tokenize_margin: fraction below ``low`` still worth an exact count.
        window_ttl_s: age after which a window is stale (still used, refresh requested).
        exact_count_available: False when the shell cannot get an exact count (no
            ``/tokenize``, or it already failed): straddling bands are then decided on ``low``.
        min_pool_index: the pool the session escalated to earlier; smaller pools are
            skipped (``SESSION_PINNED``) so a session does not flap back to a pool that
            lacks its prefix.

    Returns:
        :class:`Place`, :class:`NeedExactCount`, :class:`NoFit` or :class:`NoPool`.

    Raises:
        ConfigError: no pools, a negative floor or a margin outside [0, 1).
    """
    if not pools:
        raise ConfigError("a route needs at least one pool; list them under 'routes.<name>.pools'")
    if output_floor < 1:
        raise ConfigError(f"output_floor must be >= 1 token, got {output_floor}")
    if not 0.0 <= tokenize_margin < 1.0:
        raise ConfigError(f"tokenize_margin must be in [0, 1), got {tokenize_margin}")
    floor = output_floor if requested_max_tokens is None else min(output_floor,
                                                                    requested_max_tokens)
    low, high = estimate.low, estimate.high
    skipped: list[Skip] = []
    too_small: list[tuple[str, int]] = []
    stale: list[int] = []
    notes: list[str] = []
    largest: int | None = None

    def clamp_to(room: int) -> int | None:
        if requested_max_tokens is not None and requested_max_tokens > room:
            return room
        return None

    def place(i: int, reason: PlaceReason, clamped: int | None) -> Place:
        pool = pools[i]
        fits = None if too_small or pool.window is None else (pool.name, pool.window)
        clamp = None if clamped is None else (requested_max_tokens or 0, clamped)
        if reason is PlaceReason.UNCERTAIN:
            notes.append(f"band {low}..{high}tok straddles, no exact count: stays on low")
        describe = partial(proactive_log_line, estimate, floor, tuple(too_small), pool.name,
                           fits=fits, clamp=clamp, notes=tuple(notes))
        if reason is PlaceReason.FITS and too_small:
            reason = PlaceReason.ESCALATED
        return Place(i, pool.name, clamped, reason, describe, low, tuple(skipped), tuple(stale))

    for i, pool in enumerate(pools):
        skip = eligibility(pool, i, request_model)
        if skip is None and i < min_pool_index:
            skip = Skip(i, pool.name, SkipReason.SESSION_PINNED, "session pinned to a larger pool")
        if skip is not None:
            skipped.append(skip)
            notes.append(f"skipped {pool.name!r}: {skip.detail}")
            continue
        if pool.is_stale(now_s, window_ttl_s):
            stale.append(i)
            notes.append(_stale_note(pool, now_s))
        window = pool.window
        if window is None:
            return place(i, PlaceReason.WINDOW_UNKNOWN, None)
        largest = window if largest is None else max(largest, window)
        if high + floor <= window:
            return place(i, PlaceReason.FITS, clamp_to(window - high))
        just_over = low * (1.0 - tokenize_margin) + floor <= window
        if just_over and not estimate.exact and exact_count_available:
            line = (f"{LOG_TAG} proactive: est≈{low}..{high}tok + {floor} output floor "
                    f"straddles window {window} of {pool.name!r} → /tokenize")  # fmt: skip
            return NeedExactCount(i, pool.name, window, line)
        if low + floor <= window:  # straddles, no exact count: the under-estimate decides
            return place(i, PlaceReason.UNCERTAIN, clamp_to(max(window - high, floor)))
        too_small.append((pool.name, window))
        skipped.append(Skip(i, pool.name, SkipReason.TOO_SMALL,
                            f"{low}tok + {floor} exceeds window {window}"))  # fmt: skip

    if largest is None:
        line = f"{LOG_TAG} proactive: no eligible pool → 400; " + "; ".join(notes)
        message = (
            f"No pool of this route can serve model {request_model!r}: "
            + "; ".join(s.detail for s in skipped)
            + ". Add the model to the provider's catalog or route it to a local pool."
        )
        return NoPool(message, line, tuple(skipped))
    requested = requested_max_tokens if requested_max_tokens is not None else floor
    line = proactive_log_line(estimate, floor, too_small, None, notes=notes)
    return NoFit(largest, low, requested, openai_overflow_message(largest, low, requested),
                 line, tuple(skipped), tuple(stale))  # fmt: skip


# --- reactive plan -------------------------------------------------------------------------------


class OverflowPart(enum.StrEnum):
    """What did not fit; same values as ``wire.overflow.OverflowKind``."""

    PROMPT = "prompt"
    TOTAL = "total"
    OUTPUT = "output"
    UNSPECIFIED = "unspecified"


@dataclass(frozen=True, slots=True)
class OverflowNumbers:
    """An engine's overflow rejection as plain numbers (the shell fills it from
    ``wire.overflow.Overflow``: ``kind``, ``window``, ``prompt_tokens``,
    ``prompt_is_lower_bound``, ``requested_output_tokens``)."""

    part: OverflowPart = OverflowPart.UNSPECIFIED
    window: int | None = None
    prompt_tokens: int | None = None
    prompt_is_lower_bound: bool = False
    requested_output_tokens: int | None = None


def max_attempts(num_pools: int) -> int:
    """The attempt bound: one first try and one clamp-retry per pool."""
    return 2 * num_pools


@dataclass(frozen=True, slots=True)
class AttemptState:
    """Where a request is in its recovery, carried from one :func:`plan_recovery` to the next.

    Invariants: ``1 <= num_attempts <= max_attempts(len(pools))``; ``pool_index`` only
    grows; each pool appears in ``clamped_pools`` at most once.

    Attributes:
        pool_index: the pool the last attempt went to.
        max_tokens: the ``max_tokens`` the last attempt sent (``None``: the client's absent).
        requested_max_tokens: the client's own ``max_tokens``.
        estimate_high: the router's over-estimate of the prompt (clamps when the engine
            reports only a lower bound).
        num_attempts: attempts made so far, including the last.
        clamped_pools: pools already retried with a clamp.
    """

    pool_index: int
    max_tokens: int | None
    requested_max_tokens: int | None
    estimate_high: int
    num_attempts: int = 1
    clamped_pools: frozenset[int] = frozenset()

    @classmethod
    def first(cls, place: Place, estimate: TokenEstimate,
              requested_max_tokens: int | None) -> AttemptState:  # fmt: skip
        """The state after sending the proactive placement ``place``."""
        sent = place.clamped_max_tokens if place.clamped_max_tokens is not None else (
            requested_max_tokens
        )
        return cls(place.pool_index, sent, requested_max_tokens, estimate.high)


@dataclass(frozen=True, slots=True)
class Retry:
    """Send again to the same pool with ``max_tokens`` clamped."""

    pool_index: int
    max_tokens: int
    state: AttemptState
    log_line: str
    learned_window: int | None = None


@dataclass(frozen=True, slots=True)
class Escalate:
    """Send to a larger pool; ``max_tokens`` is what to send there (``None``: the client's
    absent value, unchanged)."""

    pool_index: int
    max_tokens: int | None
    state: AttemptState
    log_line: str
    learned_window: int | None = None


class GiveUpReason(enum.StrEnum):
    NO_LARGER_POOL = "no_larger_pool"
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Stop: answer 400 with ``message`` (OpenAI's wording, the engine's numbers)."""

    reason: GiveUpReason
    message: str
    log_line: str
    learned_window: int | None = None


RecoveryPlan = Retry | Escalate | GiveUp


def plan_recovery(
    state: AttemptState,
    overflow: OverflowNumbers,
    pools: Sequence[TierPool],
    *,
    request_model: str | None = None,
    output_floor: int = DEFAULT_OUTPUT_FLOOR,
) -> RecoveryPlan:
    """Decide what to do after ``pools[state.pool_index]`` rejected a request as too long.

    Rules, in order:

    1. ``state.num_attempts >= max_attempts(len(pools))`` → :class:`GiveUp`.
    2. The window is the engine's (``overflow.window``) when given, else the cached one;
       a differing engine window is returned as ``learned_window`` (call
       :func:`learn_window`).
    3. Unless the engine blamed the prompt alone (``PROMPT``): with a known window and
       prompt ``P`` (exact, or ``max(lower bound, estimate_high)``), if ``room = W - P`` is
       at least the effective floor, the pool was not clamp-retried yet, and ``room`` is
       below what was sent → :class:`Retry` with ``max_tokens = room``.
    4. Otherwise escalate to the next eligible pool whose window is unknown or larger than
       the engine-confirmed prompt (exact or lower bound) plus the floor; the
       ``max_tokens`` to send there is clamped when the exact prompt is known.
    5. No such pool → :class:`GiveUp` with OpenAI's message.

    Raises:
        ValueError: ``state.pool_index`` is not an index of ``pools``.
    """
    if not 0 <= state.pool_index < len(pools):
        raise ValueError(f"attempt state points at pool {state.pool_index} of {len(pools)}")
    current = pools[state.pool_index]
    window = overflow.window if overflow.window is not None else current.window
    learned = overflow.window if overflow.window not in (None, current.window) else None
    requested = state.requested_max_tokens
    floor = output_floor if requested is None else min(output_floor, requested)
    exact_prompt = None if overflow.prompt_is_lower_bound else overflow.prompt_tokens
    confirmed = overflow.prompt_tokens or 0  # the engine's count, exact or a floor
    prompt = exact_prompt if exact_prompt is not None else max(confirmed, state.estimate_high)
    told = _reactive_head(current.name, overflow, window)

    if state.num_attempts >= max_attempts(len(pools)):
        return GiveUp(GiveUpReason.ATTEMPTS_EXHAUSTED,
                      _give_up_message(window, prompt, requested, floor),
                      f"{told} → 400 (attempt budget {max_attempts(len(pools))} spent)",
                      learned)  # fmt: skip

    if overflow.part is not OverflowPart.PROMPT and window is not None:
        room = window - prompt
        sent = state.max_tokens
        if (room >= floor and state.pool_index not in state.clamped_pools
                and (sent is None or room < sent)):  # fmt: skip
            next_state = replace(state, max_tokens=room, num_attempts=state.num_attempts + 1,
                                 clamped_pools=state.clamped_pools | {state.pool_index})
            line = f"{told} → retry {current.name!r} with max_tokens {room}"
            return Retry(state.pool_index, room, next_state, line, learned)

    for j in range(state.pool_index + 1, len(pools)):
        pool = pools[j]
        if eligibility(pool, j, request_model) is not None:
            continue
        if pool.window is not None and confirmed + floor > pool.window:
            continue
        send = requested
        if exact_prompt is not None and pool.window is not None and requested is not None:
            send = min(requested, pool.window - exact_prompt)
        next_state = replace(state, pool_index=j, max_tokens=send,
                             num_attempts=state.num_attempts + 1)  # fmt: skip
        return Escalate(j, send, next_state, f"{told} → {pool.name!r}", learned)

    return GiveUp(GiveUpReason.NO_LARGER_POOL,
                  _give_up_message(window, prompt, requested, floor),
                  f"{told} → 400 (no larger pool)", learned)  # fmt: skip


def _reactive_head(name: str, overflow: OverflowNumbers, window: int | None) -> str:
    prompt = "?" if overflow.prompt_tokens is None else (
        f"{'≥' if overflow.prompt_is_lower_bound else ''}{overflow.prompt_tokens}"
    )
    out = "" if overflow.requested_output_tokens is None else (
        f" + {overflow.requested_output_tokens}"
    )
    win = "?" if window is None else str(window)
    return f"{LOG_TAG} reactive: {name!r} rejected {prompt}tok{out} > window {win}"


def _give_up_message(window: int | None, prompt: int, requested: int | None, floor: int) -> str:
    output = requested if requested is not None else floor
    if window is None:
        return (
            "This model's maximum context length is smaller than this request needs "
            f"(about {prompt} prompt tokens plus {output} output tokens), and no larger model "
            "is configured for it. Please reduce the length of the messages or completion."
        )
    return openai_overflow_message(window, prompt, output)


# --- cut-short answers -----------------------------------------------------------------------


class CutShort(enum.StrEnum):
    """Why an answer ended before the output the client asked for (a counter label)."""

    ROUTER_CLAMP = "router_clamp"
    """It reached the ``max_tokens`` the router clamped it to."""
    ENGINE_CLAMP = "engine_clamp"
    """It stopped below the request with no router clamp: vLLM >= 0.32 shortened it
    silently (the window or the estimate was wrong)."""


def was_cut_short(
    requested: int | None, clamped: int | None, finish_reason: str | None, completion_tokens: int
) -> CutShort | None:
    """Classify one choice's end for the "answers cut short" counter.

    Only ``finish_reason == "length"`` can be cut short, and only against an explicit client
    request: without ``max_tokens`` there is nothing to fall short of.

    Args:
        requested: the client's ``max_tokens`` (``None`` if absent).
        clamped: the ``max_tokens`` the router sent instead, or ``None``.
        finish_reason: the choice's ``finish_reason``.
        completion_tokens: tokens generated for the choice.
    """
    if finish_reason != "length" or requested is None or completion_tokens >= requested:
        return None
    if clamped is not None and clamped < requested and completion_tokens >= clamped:
        return CutShort.ROUTER_CLAMP
    return CutShort.ENGINE_CLAMP
