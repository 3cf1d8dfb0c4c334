"""The router consults the verdict book (``core/verdict_book.py``) wherever it would serve
a request from state other weights computed: a cross-version prefill→decode split and a
version sharing an older version's salt happen only with a current passing verdict."""

from __future__ import annotations

import random

from kvroute.core.clock import ManualClock
from kvroute.core.disagg import DisaggSpec
from kvroute.core.gate import PairKey, Verdict, VerdictStore
from kvroute.core.index import TenantScope
from kvroute.core.load import DecodeTiming
from kvroute.core.model_identity import ModelIdentity
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore, RouteRequest
from kvroute.core.scenarios import RouteScenarios, version_salt
from kvroute.core.tiers import TierPool
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName
from kvroute.core.verdict_book import PD_PATH, SALT_PATH
from kvroute.core.walk import (
    GateRefused,
    NeedTokens,
    Note,
    Send,
    Walker,
    WalkRequest,
    WalkRoute,
    WalkSettings,
)
from kvroute.core.warm import WarmPlanner

POOL = PoolName("pd")
TIMING = DecodeTiming(0.006, 20e-6, 50e-9)
RATE = 25_000.0


def passing(serving: str, source: str, path: str) -> Verdict:
    return Verdict(PairKey(serving, "t:1", source, "t:1", path), True, "replay passed")


def identify(core: RouterCore, **versions: str) -> None:
    for replica, version in versions.items():
        core.set_identity(ReplicaId(replica), ModelIdentity("m", "/m", version, "t:1"))


def pd_core(*replicas: tuple[str, str], mode: str = "always") -> RouterCore:
    specs = tuple(ReplicaSpec(ReplicaId(name), RATE, role=role)  # type: ignore[arg-type]
                  for name, role in replicas)
    spec = PoolSpec(POOL, specs, decode_timing=TIMING,
                    disagg=DisaggSpec(mode, 131_072 / 12.5e9))  # type: ignore[arg-type]
    rng = random.Random(0)
    return RouterCore([spec], lambda: make_policy("kvroute", rng), clock=ManualClock())


def ask(core: RouterCore, rid: str, n: int = 4_000) -> RouteRequest:
    return RouteRequest(RequestId(rid), POOL, TenantScope(TenantName("t")), num_prompt_tokens=n,
                        prompt_token_ids=list(range(n)), expected_output_tokens=64)


def test_a_cross_version_split_needs_a_current_passing_verdict() -> None:
    core = pd_core(("p0", "prefill"), ("d0", "decode"))
    identify(core, p0="w:old", d0="w:new")
    refused = core.route(ask(core, "a"))
    assert refused.prefill_replica is None and refused.replica == "d0"  # colocated: recompute
    assert refused.gate_refusal is not None
    assert (refused.gate_refusal.path, refused.gate_refusal.status) == (PD_PATH, "none")
    assert refused.gate_refusal.recomputed_tokens == 4_000  # d0 held nothing of it

    core.verdicts.load(VerdictStore([passing("w:new", "w:old", PD_PATH)]))
    allowed = core.route(ask(core, "b", 4_400))
    assert allowed.prefill_replica == "p0" and allowed.gate_refusal is None

    identify(core, p0="w:old2")  # the prefill replica restarts on other weights
    stale = core.route(ask(core, "c", 4_800))
    assert stale.prefill_replica is None and stale.gate_refusal is not None
    assert stale.gate_refusal.status == "stale"


def test_a_failing_verdict_refuses_and_same_weights_need_none() -> None:
    core = pd_core(("p0", "prefill"), ("d0", "decode"))
    identify(core, p0="w:old", d0="w:new")
    failing = Verdict(PairKey("w:new", "t:1", "w:old", "t:1", PD_PATH), False, "replay failed")
    core.verdicts.load(VerdictStore([failing]))
    decision = core.route(ask(core, "a"))
    assert decision.prefill_replica is None and decision.gate_refusal is not None
    assert decision.gate_refusal.status == "fail"
    identify(core, p0="w:new")  # same weights on both sides: native, no verdict asked
    native = core.route(ask(core, "b", 4_400))
    assert native.prefill_replica == "p0" and native.gate_refusal is None


def test_without_a_verdict_the_split_pairs_within_the_version_group() -> None:
    core = pd_core(("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))
    identify(core, p0="w:a", d0="w:a", p1="w:b", d1="w:b")
    for i in range(8):
        decision = core.route(ask(core, f"r{i}", 4_000 + 64 * i))
        assert decision.prefill_replica is not None
        assert (core.versions.version(decision.prefill_replica)
                == core.versions.version(decision.replica))
        assert decision.gate_refusal is None or decision.gate_refusal.recomputed_tokens == 0


# -- through the walk ---------------------------------------------------------------------------


def walk_once(walker: Walker, pool: PoolName, rid: str, n: int) -> tuple[Send, list[Note]]:
    ids = list(range(n))
    walk = walker.start(WalkRequest(
        request_id=RequestId(rid), route=WalkRoute("chat"), tenant=TenantName("t"),
        session_id=None, endpoint="completions", model="m", body={"prompt": ids},
        max_tokens=64, prompt_token_ids=ids), [TierPool(pool, window=100_000,
                                                        window_fetched_at_s=0.0,
                                                        served_model="m")], None)
    action = walk.begin()
    while isinstance(action, NeedTokens):
        action = walk.tokens(action.pool, ids)
    assert isinstance(action, Send), action
    return action, walk.take_notes()


def test_the_walk_notes_a_refused_split() -> None:
    core = pd_core(("p0", "prefill"), ("d0", "decode"))
    identify(core, p0="w:old", d0="w:new")
    walker = Walker(core, WarmPlanner(enabled=False), WalkSettings(), ManualClock())
    send, notes = walk_once(walker, POOL, "a", 4_000)
    refusals = [n for n in notes if isinstance(n, GateRefused)]
    assert send.decision.prefill_replica is None
    assert [(r.refusal.path, r.refusal.status) for r in refusals] == [(PD_PATH, "none")]


def salted_walker() -> tuple[Walker, RouterCore]:
    p = PoolName("p")
    rng = random.Random(0)
    core = RouterCore([PoolSpec(p, tuple(ReplicaSpec(ReplicaId(f"r{i}")) for i in range(3)),
                                block_size=4)],
                      lambda: make_policy("kvroute", rng), clock=ManualClock())
    identify(core, r0="v1", r1="v2", r2="v2")  # v2 is the largest group: new sessions go there
    walker = Walker(core, WarmPlanner(enabled=False), WalkSettings(), ManualClock())
    walker.set_scenarios("chat", RouteScenarios(version_salt=True))
    return walker, core


def test_a_new_version_reuses_the_old_salt_only_with_passing_verdicts() -> None:
    walker, core = salted_walker()
    send, notes = walk_once(walker, PoolName("p"), "a", 40)
    assert send.decision.replica in ("r1", "r2")
    assert send.decision.request.cache_salt == version_salt("v2", None)  # its own: recompute
    refusals = [n.refusal for n in notes if isinstance(n, GateRefused)]
    assert [(r.path, r.status, r.serving, r.source) for r in refusals] == [
        (SALT_PATH, "none", "v2", "v1")]

    # v1 still runs, so both directions must pass before the two share blocks
    core.verdicts.load(VerdictStore([passing("v2", "v1", SALT_PATH)]))
    send, notes = walk_once(walker, PoolName("p"), "b", 40)
    assert send.decision.request.cache_salt == version_salt("v2", None)
    core.verdicts.load(VerdictStore([passing("v2", "v1", SALT_PATH),
                                     passing("v1", "v2", SALT_PATH)]))
    send, notes = walk_once(walker, PoolName("p"), "c", 40)
    assert send.decision.request.cache_salt == version_salt("v1", None)
    assert not [n for n in notes if isinstance(n, GateRefused)]
