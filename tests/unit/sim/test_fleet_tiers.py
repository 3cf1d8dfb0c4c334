"""Context-window tiers in the virtual-time fleet: reactive, proactive and warm-ahead modes."""

from __future__ import annotations

from collections import Counter

import pytest

from kvroute.bench import workloads as W
from kvroute.core.errors import ConfigError
from kvroute.core.tiers import OverflowPart
from kvroute.engine.model import Rejection, RejectionKind
from kvroute.sim.fleet import (
    FleetConfig,
    FleetResult,
    SimPool,
    TierMode,
    _overflow_numbers,
    simulate,
)
from kvroute.sim.profiles import get_profile

SMALL_W, LARGE_W = 2048, 8192
SMALL = SimPool("small", get_profile("llama-3.1-8b-h100"), 2, max_model_len=SMALL_W,
                num_gpu_blocks=4000)
LARGE = SimPool("large", get_profile("llama-3.1-70b-h100-tp4"), 2, max_model_len=LARGE_W,
                num_gpu_blocks=4000)
BLOCK = 16


def sessions(n: int = 6, *, with_messages: bool = True, **kw: object) -> list[W.WorkloadRequest]:
    return W.growing_sessions(num_sessions=n, window_tokens=SMALL_W, think_time_s=5.0,
                              with_messages=with_messages, **kw)  # type: ignore[arg-type]


def run(workload: list[W.WorkloadRequest], mode: TierMode, **kw: object) -> FleetResult:
    return simulate(workload, FleetConfig.tiered([SMALL, LARGE], tier_mode=mode, **kw))


def by_session(result: FleetResult) -> dict[str, list]:  # type: ignore[type-arg]
    out: dict[str, list] = {}  # type: ignore[type-arg]
    for r in result.records:
        out.setdefault(r.session_id, []).append(r)
    return out


@pytest.mark.parametrize("mode", [TierMode.PROACTIVE, TierMode.PROACTIVE_WARM])
@pytest.mark.parametrize("with_messages", [True, False])
def test_sessions_crossing_the_window_never_fail_in_proactive_modes(
    mode: TierMode, with_messages: bool
) -> None:
    wl = sessions(with_messages=with_messages)
    result = run(wl, mode)
    assert all(r.finish_s is not None and r.rejected is None for r in result.records)
    assert len(result.records) == len(wl)
    assert result.counters.get("doomed_attempts", 0) == 0
    assert result.counters.get("give_ups", 0) == 0
    assert result.counters.get("cut_short_engine_clamp", 0) == 0
    for turns in by_session(result).values():
        landed = [r for r in turns if r.first_on_larger]
        assert len(landed) == 1 and landed[0].escalated
        first = turns.index(landed[0])
        # Once escalated, the session stays on the large pool (pinned), and before that every
        # turn fit the small window with its whole requested output.
        assert all(r.pool == "large" for r in turns[first:])
        assert all(r.pool == "small" and r.num_prompt_tokens + r.requested_max_tokens <= SMALL_W
                   for r in turns[:first])
    assert result.counters["escalations"] == len(by_session(result))


def test_reactive_makes_exactly_one_doomed_attempt_per_crossing_and_recovers() -> None:
    wl = sessions()
    rtt = 0.01
    result = run(wl, TierMode.REACTIVE, overflow_rtt_s=rtt)
    assert all(r.finish_s is not None and r.rejected is None for r in result.records)
    for turns in by_session(result).values():
        last = turns[-1]
        # growing_sessions ends each session with its first prompt over the small window.
        assert last.num_prompt_tokens > SMALL_W
        assert last.num_doomed_attempts == 1 and last.escalated and last.pool == "large"
        assert last.first_on_larger
        assert last.ttft_s is not None and last.ttft_s >= rtt
        assert all(r.num_doomed_attempts == 0 and r.pool == "small" for r in turns[:-1])
    num_sessions = len(by_session(result))
    assert result.counters["doomed_attempts"] == num_sessions
    assert result.counters["escalations"] == num_sessions
    assert result.counters.get("give_ups", 0) == 0
    # Turns whose prompt fits but prompt + max_tokens does not are silently clamped by the
    # engine (vLLM >= 0.32) and counted as cut short.
    clamped = [r for r in result.records if r.pool == "small"
               and r.num_prompt_tokens + r.requested_max_tokens > SMALL_W]
    assert clamped, "the workload should contain the clamp case"
    assert result.counters["cut_short_engine_clamp"] == len(clamped)
    assert all(r.cut_short == "engine_clamp" for r in clamped)


def test_reactive_gives_up_when_no_pool_can_hold_the_prompt() -> None:
    prompt = tuple(range(100, 100 + LARGE_W + 500))
    wl = [W.WorkloadRequest(0.0, "huge", prompt, output_tokens=16)]
    result = run(wl, TierMode.REACTIVE)
    (record,) = result.records
    # Token ids: the small engine reports the exact count, which rules out the large pool.
    assert record.num_doomed_attempts == 1
    assert record.rejected == "overflow_no_larger_pool"
    assert result.counters == {"doomed_attempts": 1, "give_ups": 1}
    proactive = run(wl, TierMode.PROACTIVE)
    assert proactive.records[0].rejected == "no_fit"
    assert proactive.counters == {"no_fit": 1}
    assert proactive.prefix_cache_queries == 0  # no engine ever saw it


def test_overflow_numbers_are_read_from_vllm_032_wording() -> None:
    rej = Rejection(RejectionKind.PROMPT_TOO_LONG, "x", 2048, 2300, 128, "input_tokens")
    text = _overflow_numbers(rej, prompt_is_text=True)
    assert text is not None and text.part is OverflowPart.PROMPT
    assert (text.window, text.prompt_tokens, text.prompt_is_lower_bound) == (2048, 2049, True)
    ids = _overflow_numbers(rej, prompt_is_text=False)
    assert ids is not None
    assert (ids.window, ids.prompt_tokens, ids.prompt_is_lower_bound) == (2048, 2300, False)
    empty = Rejection(RejectionKind.EMPTY_PROMPT, "x", 2048, 0, 128, "prompt")
    assert _overflow_numbers(empty, prompt_is_text=False) is None


def test_warm_ahead_makes_the_escalated_prefill_a_cache_hit() -> None:
    wl = sessions(shared_system_prompt=False)
    cold = run(wl, TierMode.PROACTIVE)
    warm = run(wl, TierMode.PROACTIVE_WARM)
    assert {w.session_id for w in warm.warm_records} == set(by_session(warm))
    for session, turns in by_session(warm).items():
        (landed,) = [r for r in turns if r.first_on_larger]
        # the last warm-up of the session before it escalated (one per growth stage)
        w = max((x for x in warm.warm_records if x.session_id == session
                 and x.arrival_s <= landed.arrival_s), key=lambda x: x.arrival_s)
        assert w.finish_s is not None and w.finish_s <= landed.arrival_s
        assert w.num_prompt_tokens >= 0.5 * SMALL_W  # warmed once the 0.6 threshold is near
        # The engine's own counter: every full block of the warmed prompt is a hit.
        assert landed.num_cached_tokens == w.num_prompt_tokens // BLOCK * BLOCK
        assert landed.num_cached_tokens >= 0.5 * landed.num_prompt_tokens
        assert landed.ttft_s is not None and landed.cold_ttft_s is not None
        assert landed.ttft_s < landed.cold_ttft_s
    for turns in by_session(cold).values():
        (landed,) = [r for r in turns if r.first_on_larger]
        assert landed.num_cached_tokens == 0  # no shared prefix, nothing warmed
    _, warm_hits = warm.pool_prefix_cache["large"]
    _, cold_hits = cold.pool_prefix_cache["large"]
    assert cold_hits < warm_hits
    last_warm = {w.session_id: w for w in sorted(warm.warm_records, key=lambda x: x.arrival_s)}
    assert warm_hits >= sum(w.num_prompt_tokens // BLOCK * BLOCK for w in last_warm.values())


def test_cold_ttft_is_the_idle_large_engines_ttft() -> None:
    wl = sessions(1, shared_system_prompt=False)
    result = run(wl, TierMode.PROACTIVE, tokenize_rtt_s=0.0)
    (landed,) = [r for r in result.records if r.first_on_larger]
    # One session: the large pool is idle and cold when the escalated turn arrives.
    assert landed.num_cached_tokens == 0
    assert landed.ttft_s == pytest.approx(landed.cold_ttft_s, rel=1e-9)


def test_warm_ahead_never_delays_the_small_pool() -> None:
    wl = sessions(8)
    cold = run(wl, TierMode.PROACTIVE)
    warm = run(wl, TierMode.PROACTIVE_WARM)
    small_cold = {r.request_id: r.ttft_s for r in cold.records if r.pool == "small"}
    small_warm = {r.request_id: r.ttft_s for r in warm.records if r.pool == "small"}
    assert small_cold == small_warm


@pytest.mark.parametrize("cooldown_s", [300.0, 0.0])
def test_cooldown_bounds_warms_per_session(cooldown_s: float) -> None:
    wl = sessions()
    result = run(wl, TierMode.PROACTIVE_WARM, warm_cooldown_s=cooldown_s)
    per_session = Counter(w.session_id for w in result.warm_records)
    assert set(per_session) == set(by_session(result))
    assert result.counters["warms_fired"] == sum(per_session.values())
    # Every placement consulted the planner exactly once.
    consulted = result.counters["warms_fired"] + sum(result.warm_skips.values())
    assert consulted == len(result.records)
    if cooldown_s >= 300.0:  # longer than any session: one warm-up per growth stage
        assert 1 <= min(per_session.values()) and max(per_session.values()) <= 4
        assert result.warm_skips["cooldown"] > 0
    else:
        assert max(per_session.values()) > 1
        assert "cooldown" not in result.warm_skips


def test_one_warm_per_cooldown_without_growth_stages() -> None:
    result = run(sessions(), TierMode.PROACTIVE_WARM, warm_rewarm_fraction=1.0)
    per_session = Counter(w.session_id for w in result.warm_records)
    assert set(per_session.values()) == {1}


def test_disabled_warm_ahead_fires_none() -> None:
    wl = sessions()
    result = run(wl, TierMode.PROACTIVE)
    assert result.counters.get("warms_fired", 0) == 0
    assert result.warm_records == []
    assert result.warm_skips == {"disabled": len(wl)}


def test_no_tier_mode_walks_pool_0_alone_and_gives_up_on_what_it_cannot_hold() -> None:
    """Without tiers the route is pool 0 alone, reactive only: an over-long prompt is
    rejected by the engine once, and the walk, with no larger pool, gives up."""
    wl = sessions(2)
    result = run(wl, TierMode.NONE)
    assert {r.replica.split("-")[0] for r in result.records if r.replica} == {"small"}
    over = [r for r in result.records if r.num_prompt_tokens > SMALL_W]
    assert over and all(r.rejected == "overflow_no_larger_pool" for r in over)
    assert all(r.num_doomed_attempts == 1 for r in over)
    assert result.counters == {"doomed_attempts": len(over), "give_ups": len(over)}
    assert result.warm_skips == {"disabled": len(wl)}


def test_tiered_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="FleetConfig.tiered"):
        FleetConfig(num_replicas=3, profile=SMALL.profile, pools=(SMALL, LARGE))
    with pytest.raises(ConfigError, match="unique"):
        FleetConfig.tiered([SMALL, SMALL])
    cpu = SimPool("cpu", get_profile("vllm-cpu-tiny"), 1)
    with pytest.raises(ConfigError, match="block_size"):
        FleetConfig.tiered([SMALL, cpu])
    with pytest.raises(ConfigError, match="num_replicas"):
        SimPool("x", SMALL.profile, 0)
    with pytest.raises(ConfigError, match="at least one SimPool"):
        FleetConfig.tiered([])
    with pytest.raises(ConfigError, match="'sideways' is not a tier mode"):
        FleetConfig.tiered([SMALL], tier_mode="sideways")
    with pytest.raises(ConfigError, match="'sideways' is not a tier mode"):
        FleetConfig(num_replicas=1, profile=SMALL.profile, tier_mode="sideways")  # type: ignore[arg-type]


def test_tier_runs_are_deterministic() -> None:
    wl = sessions(4)
    a = run(wl, TierMode.PROACTIVE_WARM, seed=3)
    b = run(wl, TierMode.PROACTIVE_WARM, seed=3)
    assert a.summary() == b.summary() and a.counters == b.counters
    assert [r.ttft_s for r in a.records] == [r.ttft_s for r in b.records]
