"""Spread-ahead (``core/spread.py``): when a resting session's context is copied, where, and
the walk's copy note (``RequestWalk.end`` → ``ShadowWarm`` of scenario ``spread``)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from kvroute.core.clock import ManualClock
from kvroute.core.index import TenantScope
from kvroute.core.load import DEFAULT_DECODE_TIMING, ReplicaLoad
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore
from kvroute.core.spread import SpreadCopy, SpreadPlanner, SpreadSettings, SpreadSkip
from kvroute.core.tiers import TierPool
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName
from kvroute.core.walk import (
    NeedTokens,
    Send,
    ShadowWarm,
    Walker,
    WalkRequest,
    WalkRoute,
    WalkSettings,
)
from kvroute.core.warm import WarmPlanner

ON = SpreadSettings(enabled=True, min_tokens=1_000)
CTX = 40_000
CAPACITY = 400_000
HOME = ReplicaLoad(num_in_flight=0, prefill_rate_tps=25_000.0, kv_capacity_tokens=CAPACITY,
                   resting_session_tokens=3 * CTX, resting_sessions=2,
                   resting_other_tokens=2 * CTX, session_rest_s=16.0)
"""The session's home: two other long sessions rest there beside it."""
IDLE = ReplicaLoad(num_in_flight=0, prefill_rate_tps=25_000.0, kv_capacity_tokens=CAPACITY)


def plan(planner: SpreadPlanner | None = None, settings: SpreadSettings = ON, *,
         home: ReplicaLoad = HOME, targets: dict[str, ReplicaLoad] | None = None,
         now: float = 100.0, tokens: int = CTX, answer: int = 1_000) -> SpreadCopy | SpreadSkip:
    planner = planner if planner is not None else SpreadPlanner()
    return planner.plan(settings, tokens=tokens, answer_tokens=answer, home=home,
                        targets={ReplicaId(k): v for k, v in
                                 (targets if targets is not None else {"r1": IDLE}).items()},
                        timing=DEFAULT_DECODE_TIMING, now_s=now)


def test_two_overlapping_resting_sessions_and_an_idle_replica_plan_a_copy() -> None:
    result = plan()
    assert isinstance(result, SpreadCopy)
    assert result.target == "r1" and result.tokens == CTX
    assert result.overlap >= ON.overlap


def test_no_copy_when_off_short_or_alone() -> None:
    assert plan(settings=SpreadSettings(enabled=False)) == SpreadSkip("off")
    assert plan(tokens=500) == SpreadSkip("short")
    alone = ReplicaLoad(prefill_rate_tps=25_000.0, kv_capacity_tokens=CAPACITY,
                        resting_session_tokens=CTX, session_rest_s=16.0)
    assert plan(home=alone) == SpreadSkip("alone")
    # one other session resting, a short answer: their turns are unlikely to meet
    one = ReplicaLoad(prefill_rate_tps=25_000.0, kv_capacity_tokens=CAPACITY,
                      resting_session_tokens=2 * CTX, resting_sessions=1,
                      resting_other_tokens=CTX, session_rest_s=16.0)
    assert plan(home=one, answer=10) == SpreadSkip("alone")


def test_no_copy_without_kv_room_or_on_a_busy_or_crowded_target() -> None:
    full = ReplicaLoad(prefill_rate_tps=25_000.0, kv_capacity_tokens=CAPACITY,
                       kv_used_tokens=CAPACITY - CTX)  # the copy and its answer do not fit
    assert plan(targets={"r1": full}) == SpreadSkip("no_target")
    resting = ReplicaLoad(prefill_rate_tps=25_000.0, kv_capacity_tokens=CAPACITY,
                          resting_session_tokens=CAPACITY - CTX // 2, resting_sessions=9)
    assert plan(targets={"r1": resting}) == SpreadSkip("no_target")  # would evict them
    unknown = ReplicaLoad(prefill_rate_tps=25_000.0)
    assert plan(targets={"r1": unknown}) == SpreadSkip("no_target")
    busy = ReplicaLoad(num_in_flight=1, prefill_rate_tps=25_000.0, kv_capacity_tokens=CAPACITY)
    assert plan(targets={"r1": busy}) == SpreadSkip("no_target")
    assert plan(targets={}) == SpreadSkip("no_target")


def test_the_lightest_target_wins_whatever_the_order() -> None:
    light = ReplicaLoad(prefill_rate_tps=25_000.0, kv_capacity_tokens=CAPACITY,
                        resting_session_tokens=CTX, resting_sessions=1)
    for order in (("a", "b"), ("b", "a")):
        loads = {"a": light, "b": IDLE}
        result = plan(targets={k: loads[k] for k in order})
        assert isinstance(result, SpreadCopy) and result.target == "b"


def test_the_budget_and_the_rate_cap_stop_copies() -> None:
    planner = SpreadPlanner()
    capped = SpreadSettings(enabled=True, min_tokens=1_000, budget_tokens=CTX * 1.5)
    assert isinstance(plan(planner, capped), SpreadCopy)
    assert plan(planner, capped, now=200.0) == SpreadSkip("budget")
    assert planner.copies == 1 and planner.tokens == CTX
    rated = SpreadSettings(enabled=True, min_tokens=1_000, per_s=0.1, burst=1.0)
    planner = SpreadPlanner()
    assert isinstance(plan(planner, rated, now=0.0), SpreadCopy)
    assert plan(planner, rated, now=5.0) == SpreadSkip("rate")  # half a copy earned
    assert isinstance(plan(planner, rated, now=10.0), SpreadCopy)


def test_settings_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="spread-ahead settings"):
        SpreadSettings(overlap=2.0)
    assert SpreadSettings().budget_tokens == math.inf
    assert SpreadSettings().enabled  # on by default (docs/benchmarks.md, "The whole turn")


# --- the walk: a session's request ends on a crowded replica ---------------------------------

P = PoolName("p")
ROUTE = "chat"
POOLS = [TierPool(P, window=1_000_000, window_fetched_at_s=0.0, served_model="m")]


def make(**params: Any) -> tuple[Walker, ManualClock]:
    clock = ManualClock(100.0)
    rng = random.Random(0)
    core = RouterCore(
        [PoolSpec(P, tuple(ReplicaSpec(ReplicaId(f"p{i}"), 25_000.0, CAPACITY)
                           for i in range(3)), block_size=16)],
        lambda: make_policy("kvroute", rng, **params), clock=clock)
    return Walker(core, WarmPlanner(enabled=False), WalkSettings(), clock), clock


def turn(walker: Walker, n: int, session: str, tenant: str = "t",
         salt: str | None = None, answer: int = 2_000) -> tuple[Send, list[Any]]:
    ids = [n * 1_000_003 + i for i in range(CTX)]  # every session its own context
    walk = walker.start(WalkRequest(
        request_id=RequestId(f"q{n}"), route=WalkRoute(ROUTE), tenant=TenantName(tenant),
        session_id=session, endpoint="completions", model="m", body={}, max_tokens=4_000,
        prompt_token_ids=ids, cache_salt=salt, shadow_payload=f"payload-{session}"),
        POOLS, None)
    action = walk.begin()
    for _ in range(4):
        if isinstance(action, NeedTokens):
            action = walk.tokens(action.pool, ids)
    assert isinstance(action, Send), action
    walk.answered()
    walk.end(["stop"], {"prompt_tokens": CTX, "completion_tokens": answer})
    return action, walk.take_notes()


def crowd_p0(walker: Walker, clock: ManualClock, sessions: list[tuple[str, str]]) -> None:
    """Sessions that end on p0 (p1 and p2 are down while they are served)."""
    core = walker.core
    for r in ("p1", "p2"):
        core.set_healthy(ReplicaId(r), False)
    for i, (tenant, session) in enumerate(sessions):
        sent, _ = turn(walker, 100 + i, session, tenant)
        assert sent.decision.replica == "p0"
        clock.advance(1.0)
    # p1 and p2 stay down: the next session is served on p0 too


def test_a_session_ending_beside_resting_sessions_is_copied_under_its_own_tenant() -> None:
    walker, clock = make(spread_ahead=True, spread_overlap=0.2)
    crowd_p0(walker, clock, [("t", "a"), ("u", "b")])  # another tenant's session crowds too
    core = walker.core
    # the session is served on p0; then p1 and p2 come back while it rests
    walk_sent, notes = _serve_then_heal(walker, "s", tenant="v", salt="salt-v")
    assert walk_sent.decision.replica == "p0"
    copies = [n for n in notes if isinstance(n, ShadowWarm)]
    assert len(copies) == 1
    copy = copies[0]
    assert copy.scenario == "spread" and copy.pool == P
    assert copy.replicas is not None and len(copy.replicas) == 1
    assert next(iter(copy.replicas)) in ("p1", "p2")
    request = walker.shadow_request(copy, copy.items[0], RequestId("copy-1"))
    assert request.scope == TenantScope(TenantName("v"))  # never another tenant's
    assert request.cache_salt == "salt-v"
    assert request.num_prompt_tokens == CTX and request.expected_output_tokens == 1
    assert set(request.exclude) == {"p0", "p1", "p2"} - set(copy.replicas)
    assert core.route(request).replica in copy.replicas
    assert walker.spread.copies == 1 and walker.spread.tokens == CTX


def _serve_then_heal(walker: Walker, session: str, *, tenant: str,
                     salt: str | None) -> tuple[Send, list[Any]]:
    """Serve one turn of ``session`` on p0 (the only healthy replica), bring p1 and p2
    back while it decodes, then end it: the copy is planned at its end."""
    ids = [7 * 1_000_003 + i for i in range(CTX)]
    walk = walker.start(WalkRequest(
        request_id=RequestId("q-last"), route=WalkRoute(ROUTE), tenant=TenantName(tenant),
        session_id=session, endpoint="completions", model="m", body={}, max_tokens=4_000,
        prompt_token_ids=ids, cache_salt=salt, shadow_payload=f"payload-{session}"),
        POOLS, None)
    action = walk.begin()
    for _ in range(4):
        if isinstance(action, NeedTokens):
            action = walk.tokens(action.pool, ids)
    assert isinstance(action, Send), action
    walk.answered()
    for r in ("p1", "p2"):
        walker.core.set_healthy(ReplicaId(r), True)
    walk.end(["stop"], {"prompt_tokens": CTX, "completion_tokens": 2_000})
    return action, walk.take_notes()


def test_no_copy_when_spread_ahead_is_off_or_the_session_rests_alone() -> None:
    walker, clock = make(spread_ahead=False)
    crowd_p0(walker, clock, [("t", "a"), ("t", "b")])
    _, notes = _serve_then_heal(walker, "s", tenant="t", salt=None)
    assert not [n for n in notes if isinstance(n, ShadowWarm)]
    walker, clock = make(spread_ahead=True, spread_overlap=0.2)
    crowd_p0(walker, clock, [])
    _, notes = _serve_then_heal(walker, "s", tenant="t", salt=None)
    assert not [n for n in notes if isinstance(n, ShadowWarm)]
    assert walker.spread.copies == 0


def test_no_copy_when_every_other_replica_is_out() -> None:
    walker, clock = make(spread_ahead=True, spread_overlap=0.2)
    crowd_p0(walker, clock, [("t", "a"), ("t", "b")])
    _, notes = turn(walker, 9, "s")  # p1 and p2 still down at its end: nowhere to copy
    assert not [n for n in notes if isinstance(n, ShadowWarm)]


@pytest.mark.parametrize("rest_on_copy", [True, False])
def test_a_copied_session_rests_on_the_copys_target_from_the_plan_on(rest_on_copy: bool) -> None:
    """Once its copy is planned the session is expected back on the target: other requests
    (and the next copy's choice of target) see it resting there, and no longer at home."""
    walker, clock = make(spread_ahead=True, spread_overlap=0.2,
                         spread_rest_on_copy=rest_on_copy)
    crowd_p0(walker, clock, [("t", "a"), ("t", "b")])
    _, notes = _serve_then_heal(walker, "s", tenant="t", salt=None)
    (copy,) = [n for n in notes if isinstance(n, ShadowWarm)]
    (target,) = copy.replicas or ()
    load = walker.core.load
    now = clock.now()
    home_resting = load.snapshot(ReplicaId("p0"), now).resting_sessions
    target_resting = load.snapshot(target, now)
    if rest_on_copy:
        assert home_resting == 2  # a and b
        assert target_resting.resting_sessions == 1
        assert target_resting.resting_session_tokens == CTX + 2_000  # its prompt and answer
    else:
        assert home_resting == 3
        assert target_resting.resting_sessions == 0
