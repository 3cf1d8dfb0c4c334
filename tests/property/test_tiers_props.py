"""Tier planning against a naive reference, and the reactive path's bound under any sequence
of overflow answers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvroute.core.tiers import (
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
    Retry,
    TierPlan,
    TierPool,
    max_attempts,
    plan_recovery,
    plan_tier,
)
from kvroute.core.tokens import TokenEstimate

MODEL = "m"
FLOOR = 256


@st.composite
def pool_lists(draw: st.DrawFn, allow_unknown: bool = True) -> tuple[TierPool, ...]:
    windows = sorted(draw(st.lists(st.integers(1, 200_000), min_size=1, max_size=4)))
    pools = []
    for i, window in enumerate(windows):
        known = not allow_unknown or draw(st.booleans()) or i > 0
        external = draw(st.booleans()) and i > 0
        catalog = draw(st.sampled_from([None, frozenset({MODEL}), frozenset({"other"})]))
        pools.append(TierPool(f"p{i}", window if known else None, 0.0, external=external,
                              catalog=catalog, served_model=None))  # fmt: skip
    return tuple(pools)


def eligible(pool: TierPool) -> bool:
    return not pool.external or (pool.catalog is not None and MODEL in pool.catalog)


def reference_index(pools: tuple[TierPool, ...], n: int, requested: int | None) -> int | None:
    """The naive rule for an exact count: the first eligible pool that holds it."""
    floor = FLOOR if requested is None else min(FLOOR, requested)
    for i, pool in enumerate(pools):
        if not eligible(pool):
            continue
        if pool.window is None or n + floor <= pool.window:
            return i
    return None


def plan(pools: tuple[TierPool, ...], est: TokenEstimate, requested: int | None,
         **kw: bool) -> TierPlan:  # fmt: skip
    return plan_tier(pools, est, requested, now_s=0.0, request_model=MODEL, **kw)


requested_tokens = st.one_of(st.none(), st.integers(1, 40_000))


def near_a_window(pools: tuple[TierPool, ...]) -> st.SearchStrategy[int]:
    """Counts anywhere, and counts within a few thousand tokens of some window."""
    windows = [p.window for p in pools if p.window is not None]
    near = st.sampled_from(windows).flatmap(
        lambda w: st.integers(max(0, w - 6_000), w + 300)) if windows else st.nothing()
    return st.one_of(st.integers(0, 250_000), near)


@given(pool_lists(), requested_tokens, st.data())
def test_exact_counts_match_the_reference(
    pools: tuple[TierPool, ...], requested: int | None, data: st.DataObject
) -> None:
    n = data.draw(near_a_window(pools))
    result = plan(pools, TokenEstimate.exact_count(n), requested)
    expected = reference_index(pools, n, requested)
    if expected is None:
        assert isinstance(result, NoFit | NoPool)
        if isinstance(result, NoFit):
            assert result.message.lower().startswith("this model's maximum context length is")
        return
    assert isinstance(result, Place)
    assert result.pool_index == expected
    window = pools[expected].window
    if window is None:
        assert result.clamped_max_tokens is None
    elif requested is not None and requested > window - n:
        assert result.clamped_max_tokens == window - n
    else:
        assert result.clamped_max_tokens is None


@given(pool_lists(allow_unknown=False), st.integers(0, 150_000), st.integers(0, 150_000),
       requested_tokens)  # fmt: skip
def test_exact_counts_are_monotonic(
    pools: tuple[TierPool, ...], a: int, b: int, requested: int | None
) -> None:
    def index(n: int) -> int:
        result = plan(pools, TokenEstimate.exact_count(n), requested)
        return result.pool_index if isinstance(result, Place) else len(pools)

    small, large = sorted((a, b))
    assert index(small) <= index(large)


@given(pool_lists(), st.integers(0, 150_000), st.floats(1.0, 1.6), requested_tokens,
       st.floats(0.6, 1.4))  # fmt: skip
def test_heuristic_then_exact_never_asks_twice_and_clamps_safely(
    pools: tuple[TierPool, ...], low: int, spread: float, requested: int | None, truth: float
) -> None:
    est = TokenEstimate(low=low, high=int(low * spread))
    floor = FLOOR if requested is None else min(FLOOR, requested)
    first = plan(pools, est, requested)
    if isinstance(first, NeedExactCount):
        second = plan(pools, TokenEstimate.exact_count(int(low * truth)), requested)
        assert not isinstance(second, NeedExactCount)
        fallback = plan(pools, est, requested, exact_count_available=False)
        assert not isinstance(fallback, NeedExactCount)
        return
    if isinstance(first, Place) and first.reason in (PlaceReason.FITS, PlaceReason.ESCALATED):
        window = pools[first.pool_index].window
        assert window is not None
        assert est.high + floor <= window
        if first.clamped_max_tokens is not None:
            assert est.high + first.clamped_max_tokens == window
            assert requested is not None and first.clamped_max_tokens < requested
    if isinstance(first, NoFit):
        assert all(est.low + floor > p.window for p in pools if eligible(p) and p.window)


overflow_numbers = st.builds(
    OverflowNumbers,
    part=st.sampled_from(list(OverflowPart)),
    window=st.one_of(st.none(), st.integers(1, 200_000)),
    prompt_tokens=st.one_of(st.none(), st.integers(0, 250_000)),
    prompt_is_lower_bound=st.booleans(),
    requested_output_tokens=st.one_of(st.none(), st.integers(0, 40_000)),
)


@given(pool_lists(), requested_tokens, st.integers(0, 200_000), st.data())
def test_any_sequence_of_overflows_ends_within_the_bound(
    pools: tuple[TierPool, ...], requested: int | None, high: int, data: st.DataObject
) -> None:
    start = next((i for i, p in enumerate(pools) if eligible(p)), 0)
    state = AttemptState(start, requested, requested, high)
    bound = max_attempts(len(pools))
    floor = FLOOR if requested is None else min(FLOOR, requested)
    retried: set[int] = set()
    last_index, plans = start, 0
    while True:
        result = plan_recovery(state, data.draw(overflow_numbers), pools, request_model=MODEL)
        plans += 1
        assert plans <= bound, "recovery did not stop within 2 * len(pools) attempts"
        if isinstance(result, GiveUp):
            assert "maximum context length is" in result.message
            break
        assert result.state.num_attempts == state.num_attempts + 1 <= bound
        if isinstance(result, Retry):
            assert result.pool_index == last_index and result.pool_index not in retried
            assert result.max_tokens >= floor
            assert state.max_tokens is None or result.max_tokens < state.max_tokens
            retried.add(result.pool_index)
        else:
            assert isinstance(result, Escalate)
            assert result.pool_index > last_index and eligible(pools[result.pool_index])
        last_index = result.pool_index
        state = result.state
