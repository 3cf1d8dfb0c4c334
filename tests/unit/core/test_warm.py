"""Warm-ahead planner: every guard, cooldown expiry at explicit times, the LRU bound, and
two router processes sharing one cooldown store."""

from __future__ import annotations

import itertools

import pytest

from kvroute.core.errors import ConfigError
from kvroute.core.tiers import TierPool
from kvroute.core.warm import (
    CooldownStore,
    MemoryCooldownStore,
    WarmFire,
    WarmPlanner,
    WarmSkip,
    WarmSkipReason,
    chunk_bounds,
    cooldown_key,
)

SMALL = TierPool("small", 16_384, 0.0, served_model="qwen3-8b")
LARGE = TierPool("large", 131_072, 0.0, served_model="qwen3-27b")
POOLS = (SMALL, LARGE)
OVER = 10_000  # >= 0.6 * 16384 = 9830.4


def skip(reason: WarmSkipReason) -> WarmSkip:
    return WarmSkip(reason)


def test_fires_at_the_threshold_with_the_log_line() -> None:
    planner = WarmPlanner()
    assert planner.consider("s1", 9_830, POOLS, 0, 0.0) == skip(WarmSkipReason.BELOW_THRESHOLD)
    fire = planner.consider("s1", 9_831, POOLS, 0, 0.0)
    assert fire == WarmFire("s1", 1, "large", "qwen3-27b",
                            "[CONTEXT-ROUTE] warm-ahead: est≈9831tok ≥ 0.6 × window 16384 of "
                            "'small' (stage 0) → warm 'large'")  # fmt: skip


@pytest.mark.parametrize(
    ("planner", "session", "pools", "current", "reason"),
    [(WarmPlanner(enabled=False), "s", POOLS, 0, WarmSkipReason.DISABLED),
     (WarmPlanner(), None, POOLS, 0, WarmSkipReason.NO_SESSION),
     (WarmPlanner(), "", POOLS, 0, WarmSkipReason.NO_SESSION),
     (WarmPlanner(), "s", POOLS, 1, WarmSkipReason.NO_LARGER_POOL),
     (WarmPlanner(), "s", (SMALL,), 0, WarmSkipReason.NO_LARGER_POOL),
     (WarmPlanner(), "s", (SMALL, TierPool("cloud", 10**6, 0.0, external=True,
                                           catalog=frozenset({"x"}), served_model="y")),
      0, WarmSkipReason.NO_LARGER_POOL),
     (WarmPlanner(), "s", (TierPool("small"), LARGE), 0, WarmSkipReason.WINDOW_UNKNOWN),
     (WarmPlanner(), "s", (SMALL, TierPool("large", 131_072, 0.0)), 0,
      WarmSkipReason.TARGET_MODEL_UNKNOWN)],
)  # fmt: skip
def test_each_skip_reason(planner: WarmPlanner, session: str | None,
                          pools: tuple[TierPool, ...], current: int,
                          reason: WarmSkipReason) -> None:  # fmt: skip
    assert planner.consider(session, OVER, pools, current, 0.0) == skip(reason)
    assert len(planner.memory) == 0  # a skip never claims the cooldown


def test_below_threshold_with_a_custom_fraction() -> None:
    planner = WarmPlanner(fraction=0.9)
    assert planner.consider("s", OVER, POOLS, 0, 0.0) == skip(WarmSkipReason.BELOW_THRESHOLD)
    assert isinstance(planner.consider("s", 14_746, POOLS, 0, 0.0), WarmFire)


def test_cooldown_expires_at_exactly_cooldown_seconds() -> None:
    planner = WarmPlanner(cooldown_s=300.0)
    assert isinstance(planner.consider("s", OVER, POOLS, 0, 100.0), WarmFire)
    assert planner.consider("s", OVER, POOLS, 0, 100.0) == skip(WarmSkipReason.COOLDOWN)
    assert planner.consider("s", OVER, POOLS, 0, 399.9) == skip(WarmSkipReason.COOLDOWN)
    assert isinstance(planner.consider("other", OVER, POOLS, 0, 399.9), WarmFire)
    assert isinstance(planner.consider("s", OVER, POOLS, 0, 400.0), WarmFire)
    assert planner.consider("s", OVER, POOLS, 0, 400.0) == skip(WarmSkipReason.COOLDOWN)


def test_cooldown_map_is_a_bounded_lru() -> None:
    # rewarm_fraction 1.0: one stage, so each session holds two keys (stage claim + target).
    planner = WarmPlanner(max_sessions=2, rewarm_fraction=1.0)
    for i, session in enumerate(("a", "b", "c")):
        assert isinstance(planner.consider(session, OVER, POOLS, 0, float(i)), WarmFire)
    assert len(planner.memory) == 2 * 2
    assert cooldown_key("a", 0) not in planner.memory  # oldest evicted: it may warm again
    assert planner.consider("c", OVER, POOLS, 0, 3.0) == skip(WarmSkipReason.COOLDOWN)
    assert isinstance(planner.consider("a", OVER, POOLS, 0, 3.0), WarmFire)
    assert cooldown_key("b", 0) not in planner.memory and len(planner.memory) == 2 * 2


def test_a_growing_session_is_rewarmed_once_per_stage() -> None:
    """Each tenth of the window past 0.6 is one stage; one warm-up per stage per cooldown."""
    planner = WarmPlanner()
    window = 16_384
    fired = []
    for turn, est in enumerate(range(9_831, window, 400)):  # 400 tokens more a turn
        decision = planner.consider("s", est, POOLS, 0, float(turn))
        if isinstance(decision, WarmFire):
            fired.append(decision.stage)
        else:
            assert decision == skip(WarmSkipReason.COOLDOWN)
    assert fired == [0, 1, 2, 3]
    assert planner.warmed_target("s", 20.0) == 1


def test_expired_claims_are_dropped_on_lookup() -> None:
    store = MemoryCooldownStore(max_sessions=4)
    assert store.try_claim("s", 0.0, 10.0)
    assert not store.try_claim("s", 9.0, 10.0)
    assert store.is_cooling("s", 9.99)
    assert not store.is_cooling("s", 10.0)
    assert len(store) == 0
    assert store.try_claim("s", 10.0, 10.0)


def test_warmed_target_for_the_hit_metric() -> None:
    planner = WarmPlanner(cooldown_s=300.0)
    assert planner.warmed_target("s", 0.0) is None
    planner.consider("s", OVER, POOLS, 0, 0.0)
    assert planner.warmed_target("s", 299.0) == 1
    assert planner.warmed_target("s", 300.0) is None


def test_two_routers_share_one_store_like_redis_set_nx_px() -> None:
    """The Redis path: consider(claim=False), claim in the shared store, then mark_fired."""
    shared: CooldownStore = MemoryCooldownStore()  # stands in for Redis (same rule)
    router_a, router_b = WarmPlanner(), WarmPlanner()
    fire_a = router_a.consider("s", OVER, POOLS, 0, 0.0, claim=False)
    fire_b = router_b.consider("s", OVER, POOLS, 0, 0.5, claim=False)
    assert isinstance(fire_a, WarmFire) and isinstance(fire_b, WarmFire)
    assert len(router_a.memory) == len(router_b.memory) == 0  # claim=False records nothing
    assert shared.try_claim(cooldown_key("s"), 0.0, 300.0)
    router_a.mark_fired("s", 0.0, target_pool_index=fire_a.target_pool_index)
    assert not shared.try_claim(cooldown_key("s"), 0.5, 300.0)  # b lost: it does not fire
    router_b.mark_fired("s", 0.5, expires_at_s=300.0)  # the shared claim's expiry
    assert router_b.consider("s", OVER, POOLS, 0, 299.0) == skip(WarmSkipReason.COOLDOWN)
    assert isinstance(router_b.consider("s", OVER, POOLS, 0, 300.0, claim=False), WarmFire)
    assert cooldown_key("s") == "kvroute:warm:s"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [({"fraction": 0.0}, "warm_ahead.fraction"), ({"fraction": 1.5}, "warm_ahead.fraction"),
     ({"cooldown_s": -1.0}, "warm_ahead.cooldown_s"),
     ({"max_sessions": 0}, "warm_ahead.max_sessions")],
)  # fmt: skip
def test_bad_settings_name_the_key(kwargs: dict[str, float], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        WarmPlanner(**kwargs)  # type: ignore[arg-type]


# -- chunk_bounds: how a long warm-up is cut into growing prefixes ----------------------------


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "chunk_tokens", "cached", "expected"),
    [
        # The docstring's worked example: 2,700 tokens in 3 equal chunks of whole blocks.
        (2700, 16, 1024, 0, [912, 1824, 2700]),
        # A later growth stage: 2,000 already cached, 700 new fit one chunk.
        (2700, 16, 1024, 2000, [2700]),
        # Cached part not block-aligned: cut where the cached blocks end (1,984 = 124 blocks).
        (3500, 16, 1024, 1990, [2752, 3500]),
        (2700, 16, 0, 0, [2700]),  # off
        (1024, 16, 1024, 0, [1024]),  # exactly one chunk
        (1025, 16, 1024, 0, [528, 1025]),  # not 1,024 and a 1-token tail
        (4096, 16, 1024, 0, [1024, 2048, 3072, 4096]),
        (5000, 128, 1024, 0, [1024, 2048, 3072, 4096, 5000]),  # CPU backend's blocks
        (5000, 128, 1000, 0, [896, 1792, 2688, 3584, 4480, 5000]),  # chunk rounded down
        (100, 16, 5, 0, [16, 32, 48, 64, 80, 96, 100]),  # at least one block per chunk
        (40, 16, 16, 40, [40]),  # all cached: one request (it recomputes the last block)
        (1, 16, 1024, 0, [1]),
    ],
)
def test_chunk_bounds(num_tokens: int, block_size: int, chunk_tokens: int, cached: int,
                      expected: list[int]) -> None:
    assert chunk_bounds(num_tokens, block_size, chunk_tokens, cached) == expected


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 1000, 1023, 1024, 1025, 2700, 9999])
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("chunk_tokens", [1, 100, 1024])
@pytest.mark.parametrize("cached", [0, 7, 512, 5000])
def test_chunk_bounds_invariants(num_tokens: int, block_size: int, chunk_tokens: int,
                                 cached: int) -> None:
    """Increasing, ending at the prompt, whole blocks before the end, no chunk computing
    more than ``chunk_tokens`` (whole blocks, at least one) beyond the cached blocks, and no
    more chunks than needed."""
    ends = chunk_bounds(num_tokens, block_size, chunk_tokens, cached)
    step = max(block_size, chunk_tokens // block_size * block_size)
    start = min(cached, num_tokens - 1) // block_size * block_size
    assert ends[-1] == num_tokens
    assert all(a < b for a, b in itertools.pairwise([start, *ends]))
    assert all(end % block_size == 0 for end in ends[:-1])
    sizes = [b - a for a, b in itertools.pairwise([start, *ends])]
    assert max(sizes) <= step
    assert len(ends) == max(1, -(-(num_tokens - start) // step))


@pytest.mark.parametrize(("args", "fragment"), [
    ((0, 16, 1024, 0), "num_tokens >= 1"),
    ((100, 0, 1024, 0), "block_size >= 1"),
    ((100, 16, -1, 0), "chunk_tokens >= 0"),
    ((100, 16, 1024, -5), "cached_tokens >= 0"),
])
def test_chunk_bounds_rejects_impossible_arguments(args: tuple[int, int, int, int],
                                                   fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        chunk_bounds(*args)
