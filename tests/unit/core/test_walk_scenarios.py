"""The model-bound cache scenarios in the request walk (``core/scenarios.py`` applied by
``core/walk.py``): version groups, upgrade with shadow warming, A/B split, failover."""

from __future__ import annotations

import random
from typing import Any

from kvroute.core.clock import ManualClock
from kvroute.core.model_identity import ModelIdentity
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore
from kvroute.core.scenarios import (
    AbArm,
    AbSplitSettings,
    FailoverSettings,
    FailoverSwitch,
    RouteScenarios,
    UpgradeSettings,
    choose_arm,
    recompute_bill,
)
from kvroute.core.session import SessionRecord, SessionTable
from kvroute.core.tiers import TierPool
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName
from kvroute.core.walk import (
    ArmServed,
    NeedTokens,
    ScenarioMove,
    Send,
    ShadowWarm,
    Walker,
    WalkRequest,
    WalkRoute,
    WalkSettings,
)
from kvroute.core.warm import WarmPlanner

P, B = PoolName("p"), PoolName("b")
TENANT = TenantName("t")
ROUTE = "chat"


def make(scenarios: RouteScenarios | None = None) -> tuple[Walker, ManualClock]:
    clock = ManualClock(100.0)
    rng = random.Random(0)
    core = RouterCore(
        [PoolSpec(P, tuple(ReplicaSpec(ReplicaId(f"p{i}")) for i in range(3)), block_size=4),
         PoolSpec(B, tuple(ReplicaSpec(ReplicaId(f"b{i}")) for i in range(2)), block_size=4)],
        lambda: make_policy("kvroute", rng), clock=clock)
    walker = Walker(core, WarmPlanner(enabled=False), WalkSettings(), clock)
    if scenarios is not None:
        walker.set_scenarios(ROUTE, scenarios)
    return walker, clock


POOLS = [TierPool(P, window=100_000, window_fetched_at_s=100.0, served_model="m")]
ALT = {B: TierPool(B, window=100_000, window_fetched_at_s=100.0, served_model="m")}


class Driver:
    """Runs walks to their end like a driver does, keeping session records."""

    def __init__(self, walker: Walker) -> None:
        self.walker = walker
        self.sessions = SessionTable()
        self.notes: list[Any] = []
        self.n = 0

    def turn(self, session: str | None, num_tokens: int, *, ids_body: bool = False,
             fail_all: bool = False) -> Send:
        self.n += 1
        ids = list(range(num_tokens))
        key = f"t\x1f{ROUTE}\x1f{session}"
        record = self.sessions.get(key, 0.0) if session else None
        walk = self.walker.start(WalkRequest(
            request_id=RequestId(f"q{self.n}"), route=WalkRoute(ROUTE), tenant=TENANT,
            session_id=session, endpoint="completions", model="m", body={"prompt": ids},
            max_tokens=8, prompt_token_ids=ids if ids_body else None,
            shadow_payload=f"payload-{session}"), POOLS, record, alternates=ALT)
        action = walk.begin()
        for _ in range(6):
            if isinstance(action, NeedTokens):
                action = walk.tokens(action.pool, ids)
            elif isinstance(action, Send) and fail_all and action.decision.request.pool == P:
                action = walk.failed("connect", retryable=True, unreachable=True)
            else:
                break
        assert isinstance(action, Send), action
        walk.answered()
        write = walk.end(["stop"], {"prompt_tokens": num_tokens, "completion_tokens": 8})
        self.notes += walk.take_notes()
        if write is not None:
            self.sessions.put(write.key, write.record, 0.0)
        return action

    def of(self, kind: type) -> list[Any]:
        return [n for n in self.notes if isinstance(n, kind)]


def identify(walker: Walker, versions: dict[str, str]) -> None:
    for replica, version in versions.items():
        walker.core.set_identity(ReplicaId(replica), ModelIdentity("m", "/m", version))


def test_a_session_stays_in_its_version_group_and_a_weight_change_moves_and_bills_it() -> None:
    walker, _ = make()
    versions = {"p0": "v1", "p1": "v1", "p2": "v2"}
    identify(walker, versions)
    drive = Driver(walker)
    first = drive.turn("s", 40)  # a new session may go anywhere: the policy chooses
    mine = versions[first.decision.replica]
    group = [r for r, v in versions.items() if v == mine]
    for _ in range(5):
        assert drive.turn("s", 40).decision.replica in group
    pinned = drive.sessions.get(f"t\x1f{ROUTE}\x1fs", 0.0)
    assert pinned is not None and pinned.version == mine
    identify(walker, dict.fromkeys(group, "v3"))  # its replicas restart on other weights
    moved = drive.turn("s", 44)
    bills = drive.of(ScenarioMove)
    assert [(b.scenario, b.from_place, b.to_place) for b in bills] == [("version", mine, "v3")]
    assert bills[0].tokens == 40  # its last prompt, in whole blocks, nothing cached now
    assert moved.decision.expected_cached_tokens == 0


def test_a_salted_route_puts_a_new_session_in_the_largest_group() -> None:
    walker, _ = make(RouteScenarios(version_salt=True))
    identify(walker, {"p0": "v1", "p1": "v1", "p2": "v2"})
    drive = Driver(walker)
    for s in range(6):
        assert drive.turn(f"s{s}", 40).decision.replica in ("p0", "p1")


def test_an_upgrade_warms_the_new_version_in_shadow_before_it_takes_traffic() -> None:
    walker, clock = make(RouteScenarios(upgrade=UpgradeSettings(warm_budget_tokens=100)))
    identify(walker, {"p0": "v1", "p1": "v1", "p2": "v1"})
    drive = Driver(walker)
    for s in ("a", "b", "c"):
        drive.turn(s, 40)
    identify(walker, {"p2": "v2"})  # one replica comes back on the new weights
    clock.advance(1.0)
    during = drive.turn("a", 44)
    assert during.decision.replica != "p2"  # warming: no traffic yet
    warms = drive.of(ShadowWarm)
    assert len(warms) == 1 and warms[0].version == "v2" and warms[0].pool == P
    assert [i.key.rsplit("\x1f", 1)[1] for i in warms[0].items] == ["c", "b"]  # budget 100
    assert warms[0].items[0].payload == "payload-c"
    rr = walker.shadow_request(warms[0], warms[0].items[0], RequestId("w0"))
    assert rr.exclude == {ReplicaId("p0"), ReplicaId("p1")} and rr.expected_output_tokens == 1
    for _ in warms[0].items:
        walker.shadow_done(warms[0])
    assert drive.turn("b", 44).decision.replica != "p2"  # warm, but 1 of 3: not its share
    identify(walker, {"p1": "v2"})  # a second replica joins: warmed with what is left
    drive.turn("c", 44)
    second = drive.of(ShadowWarm)[1:]
    assert len(second) == 1 and second[0].replicas == {ReplicaId("p1")}
    assert [i.key.rsplit("\x1f", 1)[1] for i in second[0].items] == ["a"]
    assert walker.shadow_request(second[0], second[0].items[0], RequestId("w1")).exclude == {
        ReplicaId("p0"), ReplicaId("p2")}
    walker.shadow_done(second[0])
    moved = drive.turn("b", 48)  # ready (2 of 3, warmed): sessions move at their next turn
    assert moved.decision.replica in ("p1", "p2")
    bill = [m for m in drive.of(ScenarioMove) if m.scenario == "upgrade"]
    assert len(bill) == 1 and bill[0].to_place == "v2"


def test_an_upgrade_without_budget_takes_traffic_cold_at_once() -> None:
    walker, _ = make(RouteScenarios(upgrade=UpgradeSettings(warm_budget_tokens=0)))
    identify(walker, {"p0": "v1", "p1": "v1", "p2": "v1"})
    drive = Driver(walker)
    drive.turn("a", 40)
    identify(walker, {"p1": "v2", "p2": "v2"})
    assert drive.turn("a", 44).decision.replica in ("p1", "p2")
    assert [m.tokens for m in drive.of(ScenarioMove)] == [40]
    assert not drive.of(ShadowWarm)


def test_a_sticky_split_never_flips_a_session_and_a_per_request_one_bills_flips() -> None:
    split = (AbArm(P, 1.0), AbArm(B, 1.0))
    walker, _ = make(RouteScenarios(ab_split=AbSplitSettings(split, sticky=True)))
    drive = Driver(walker)
    arms: dict[str, set[str]] = {}
    for turn in range(6):
        for s in range(8):
            send = drive.turn(f"s{s}", 40 + turn * 4)
            arms.setdefault(f"s{s}", set()).add(send.decision.request.pool)
    assert all(len(a) == 1 for a in arms.values())
    assert {next(iter(a)) for a in arms.values()} == {P, B}  # both arms used
    assert not drive.of(ScenarioMove)
    assert {n.arm for n in drive.of(ArmServed)} == {P, B}

    walker, _ = make(RouteScenarios(ab_split=AbSplitSettings(split, sticky=False)))
    drive = Driver(walker)
    for turn in range(6):
        drive.turn("s", 40 + turn * 4)
    flips = drive.of(ScenarioMove)
    assert flips and all(m.scenario == "ab" and m.tokens > 0 for m in flips)


def test_token_ids_in_the_body_stay_on_the_control_arm_unless_tokenizers_match() -> None:
    split = AbSplitSettings((AbArm(P, 1.0), AbArm(B, 1.0)), sticky=False)
    walker, _ = make(RouteScenarios(ab_split=split))
    drive = Driver(walker)
    pools = {drive.turn(None, 40, ids_body=True).decision.request.pool for _ in range(12)}
    assert pools == {P}
    for replica in ("p0", "p1", "p2", "b0"):
        walker.core.set_identity(ReplicaId(replica), ModelIdentity("m", tokenizer="t:1"))
    walker.core.set_identity(ReplicaId("b1"), ModelIdentity("m2", tokenizer="t:2"))
    pools = {drive.turn(None, 40, ids_body=True).decision.request.pool for _ in range(12)}
    assert pools == {P}  # one replica of b tokenizes otherwise: not proven
    walker.core.set_identity(ReplicaId("b1"), ModelIdentity("m2", tokenizer="t:1"))
    pools = {drive.turn(None, 40, ids_body=True).decision.request.pool for _ in range(12)}
    assert pools == {P, B}  # proven identical by fingerprints


def test_choose_arm_follows_the_weights() -> None:
    split = AbSplitSettings((AbArm(P, 3.0), AbArm(B, 1.0)))
    counts = {P: 0, B: 0}
    for i in range(4000):
        counts[choose_arm(split, f"k{i}").pool] += 1
    assert 0.70 < counts[P] / 4000 < 0.80


def test_failover_takes_the_route_and_comes_back_after_the_hysteresis() -> None:
    failover = FailoverSettings(P, B, back_after_s=30.0)
    walker, clock = make(RouteScenarios(failover=failover))
    drive = Driver(walker)
    assert drive.turn("s", 40).decision.request.pool == P
    for i in range(3):
        walker.core.set_healthy(ReplicaId(f"p{i}"), False)
    assert drive.turn("s", 44).decision.request.pool == B
    for i in range(3):
        walker.core.set_healthy(ReplicaId(f"p{i}"), True)
    clock.advance(10.0)
    assert drive.turn("s", 48).decision.request.pool == B  # usable seen now: not yet back
    clock.advance(29.0)
    assert drive.turn("s", 50).decision.request.pool == B
    clock.advance(1.0)
    assert drive.turn("s", 52).decision.request.pool == P
    moves = [(m.from_place, m.to_place) for m in drive.of(ScenarioMove)]
    assert moves == [(P, B), (B, P)]


def test_a_request_whose_primary_replicas_all_fail_is_served_by_the_backup() -> None:
    walker, _ = make(RouteScenarios(failover=FailoverSettings(P, B)))
    drive = Driver(walker)
    send = drive.turn("s", 40, fail_all=True)  # p0, p1, p2 refuse: max_retries 2 → backup
    assert send.decision.request.pool == B
    assert walker.scenarios[ROUTE].failover is not None
    assert walker.scenarios[ROUTE].failover.active


def test_the_backup_is_warmed_in_shadow_with_recent_sessions_within_its_budget() -> None:
    failover = FailoverSettings(P, B, warm_budget_tokens=90, warm_interval_s=5.0)
    walker, clock = make(RouteScenarios(failover=failover))
    drive = Driver(walker)
    drive.turn("a", 40)  # the first walk warms nothing: no session seen before it
    drive.turn("b", 40)
    clock.advance(6.0)
    drive.turn("c", 40)
    warms = drive.of(ShadowWarm)
    assert len(warms) == 1 and warms[0].pool == B and warms[0].scenario == "failover"
    assert sorted(i.key[-1] for i in warms[0].items) == ["a", "b"]
    clock.advance(1.0)
    drive.turn("d", 40)
    assert len(drive.of(ShadowWarm)) == 1  # within the interval: none


def test_version_salting_gives_each_version_its_own_salt() -> None:
    walker, _ = make(RouteScenarios(version_salt=True))
    identify(walker, {"p0": "v1", "p1": "v1", "p2": "v2"})
    drive = Driver(walker)
    a = drive.turn("a", 40).decision.request.cache_salt
    b = drive.turn("b", 40).decision.request.cache_salt
    assert a is not None and a == b  # both in v1 (the largest group)
    identify(walker, {"p0": "v2", "p1": "v2"})
    c = drive.turn("c", 40).decision.request.cache_salt
    assert c is not None and c != a


def test_failover_switch_and_bill_arithmetic() -> None:
    switch = FailoverSwitch(back_after_s=10.0)
    assert switch.update(0.0, primary_usable=True) is False
    assert switch.update(1.0, primary_usable=False) is True
    assert switch.update(2.0, primary_usable=True) is True
    assert switch.update(5.0, primary_usable=False) is True  # flapping resets the wait
    assert switch.update(6.0, primary_usable=True) is True
    assert switch.update(16.0, primary_usable=True) is False
    assert switch.switches == 2
    assert recompute_bill(100, 120, 16, 0) == 96
    assert recompute_bill(100, 120, 16, 64) == 32
    assert recompute_bill(100, 50, 16, 0) == 48  # never the last token of a shorter prompt
    assert recompute_bill(0, 50, 16, 0) == 0
    assert SessionRecord().version is None
