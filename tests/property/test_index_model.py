"""PrefixIndex against a naive reference model, under random event and lookup sequences.

The model is the obvious design the index's bitmasks replace: a ``Counter`` of copies per
(replica, medium), a dict of predicted entries with their expiry, and a first-stored order of
hashes for the memory bound. Every lookup and every stats snapshot must agree exactly.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvroute.core.clock import ManualClock
from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvroute.core.index import (
    AdminCapability,
    FleetScope,
    PrefixIndex,
    PrefixMatch,
    TenantScope,
)
from kvroute.core.types import Medium, ReplicaId, TenantName, WireHash

REPLICAS = [ReplicaId(f"r{i}") for i in range(4)]
TENANTS = [TenantName("t1"), TenantName("t2")]
FLEET = AdminCapability().fleet_scope()
SCOPES: list[TenantScope | FleetScope] = [TenantScope(t) for t in TENANTS] + [FLEET]
MEDIUM_SPELLINGS = ["GPU", "CPU", "STORAGE", None, "cpu", "nvme"]
TTL_S = 2.0

replicas = st.sampled_from(REPLICAS)
# A small universe so that stores, removals and lookups collide often; a few large values
# exercise the full 64-bit range.
hash_values = st.one_of(
    st.integers(0, 7), st.sampled_from([2**63, 2**64 - 1, 2**32 + 5])
).map(WireHash)
hash_lists = st.lists(hash_values, min_size=0, max_size=8)
mediums = st.sampled_from(MEDIUM_SPELLINGS)
scopes = st.sampled_from(SCOPES)


def _owner(scope: TenantScope | FleetScope) -> TenantName | None:
    return scope.tenant if isinstance(scope, TenantScope) else None


class Model:
    """The reference: plain counters, no bit tricks."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.evict_to = max_entries - max_entries // 64
        self.copies: dict[tuple[ReplicaId, Medium], Counter[int]] = {}
        self.order: dict[int, None] = {}  # hashes held anywhere, in first-stored order
        self.known: dict[ReplicaId, None] = {}
        self.predicted: dict[tuple[TenantName | None, ReplicaId, int], float] = {}
        self.writes: list[tuple[float, TenantName | None, ReplicaId, Sequence[int]]] = []
        self.removed_unknown = 0
        self.evicted = 0

    def held_anywhere(self, h: int) -> bool:
        return any(c[h] > 0 for c in self.copies.values())

    def num_entries(self) -> int:
        return sum(len(c) for c in self.copies.values())

    def store(self, replica: ReplicaId, medium: Medium, hashes: tuple[int, ...]) -> None:
        self.known.setdefault(replica, None)
        counter = self.copies.setdefault((replica, medium), Counter())
        for h in hashes:
            if not self.held_anywhere(h):
                self.order[h] = None
            counter[h] += 1
        if self.num_entries() > self.max_entries:
            while self.num_entries() > self.evict_to:
                oldest = next(iter(self.order))
                del self.order[oldest]
                for c in self.copies.values():
                    if c.pop(oldest, 0):
                        self.evicted += 1

    def remove(self, replica: ReplicaId, medium: Medium, hashes: tuple[int, ...]) -> None:
        self.known.setdefault(replica, None)
        counter = self.copies.setdefault((replica, medium), Counter())
        for h in hashes:
            if counter[h] <= 0:
                del counter[h]
                self.removed_unknown += 1
                continue
            counter[h] -= 1
            if counter[h] == 0:
                del counter[h]
                if not self.held_anywhere(h):
                    del self.order[h]

    def clear(self, replica: ReplicaId) -> None:
        self.known.setdefault(replica, None)
        for medium in Medium:
            gone = self.copies.pop((replica, medium), Counter())
            for h in gone:
                if not self.held_anywhere(h):
                    del self.order[h]
        self.predicted = {k: v for k, v in self.predicted.items() if k[1] != replica}
        self.writes = [w for w in self.writes if w[2] != replica]  # gone, not to be evicted

    def drop(self, replica: ReplicaId) -> None:
        if replica in self.known:
            self.clear(replica)
            del self.known[replica]

    def predict(
        self, owner: TenantName | None, replica: ReplicaId, hashes: Sequence[int], now: float
    ) -> None:
        self.known.setdefault(replica, None)
        self.expire(now)
        if not hashes:
            return
        for h in hashes:
            self.predicted[(owner, replica, h)] = now + TTL_S
        self.writes.append((now + TTL_S, owner, replica, hashes))
        if len(self.predicted) > self.max_entries:
            while len(self.predicted) > self.evict_to:
                self.evicted += self.drop_write(self.writes.pop(0))

    def drop_write(
        self, write: tuple[float, TenantName | None, ReplicaId, Sequence[int]]
    ) -> int:
        expiry, owner, replica, hashes = write
        dropped = 0
        for h in hashes:
            if self.predicted.get((owner, replica, h)) == expiry:
                del self.predicted[(owner, replica, h)]
                dropped += 1
        return dropped

    def expire(self, now: float) -> None:
        while self.writes and self.writes[0][0] <= now:
            self.drop_write(self.writes.pop(0))

    def match(
        self, hashes: Sequence[int], owner: TenantName | None, fleet: bool, now: float
    ) -> dict[ReplicaId, PrefixMatch]:
        result = {}
        for replica in self.known:
            counts = [0, 0, 0, 0]
            for h in hashes:
                for medium in Medium:
                    if self.copies.get((replica, medium), Counter())[h] > 0:
                        counts[medium] += 1
                        break
                else:
                    visible = any(
                        expiry > now and (fleet or o == owner)
                        for (o, r, ph), expiry in self.predicted.items()
                        if r == replica and ph == h
                    )
                    if not visible:
                        break
                    counts[3] += 1
            if sum(counts):
                result[replica] = PrefixMatch(*counts)
        return result


class IndexMachine(RuleBasedStateMachine):
    """Random store/remove/clear/drop/predict/advance steps, checked after every step."""

    clock: ManualClock
    index: PrefixIndex
    model: Model

    @initialize(max_entries=st.sampled_from([1_000_000, 64, 10, 3]))
    def start(self, max_entries: int) -> None:
        self.clock = ManualClock(0.0)
        self.index = PrefixIndex(clock=self.clock, max_entries=max_entries, predicted_ttl_s=TTL_S)
        self.model = Model(max_entries)

    @rule(replica=replicas, events=st.lists(
        st.tuples(st.sampled_from(["store", "remove", "clear"]), mediums, hash_lists),
        min_size=1, max_size=6,
    ))
    def apply_batch(
        self, replica: ReplicaId, events: list[tuple[str, str | None, list[WireHash]]]
    ) -> None:
        built: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for kind, medium, hashes in events:
            m = Medium.from_wire(medium)
            if kind == "store":
                built.append(BlockStored(tuple(hashes), None, (), 16, medium=medium))
                self.model.store(replica, m, tuple(hashes))
            elif kind == "remove":
                # vLLM sends one hash per BlockRemoved; the index must accept more.
                built.append(BlockRemoved(tuple(hashes), medium=medium))
                self.model.remove(replica, m, tuple(hashes))
            else:
                built.append(AllBlocksCleared())
                self.model.clear(replica)
        self.index.apply_batch(replica, EventBatch(0, 0.0, tuple(built)))

    @rule(replica=replicas, medium=mediums, hashes=hash_lists)
    def store(self, replica: ReplicaId, medium: str | None, hashes: list[WireHash]) -> None:
        self.index.apply_event(replica, BlockStored(tuple(hashes), None, (), 16, medium=medium))
        self.model.store(replica, Medium.from_wire(medium), tuple(hashes))

    @rule(replica=replicas, medium=mediums, h=hash_values, copies=st.integers(1, 3))
    def store_copies(self, replica: ReplicaId, medium: str | None, h: WireHash, copies: int) -> None:
        """Several physical copies of one hash (vLLM does not de-duplicate its cache)."""
        for _ in range(copies):
            self.index.apply_event(replica, BlockStored((h,), None, (), 16, medium=medium))
            self.model.store(replica, Medium.from_wire(medium), (h,))

    @rule(replica=replicas, medium=mediums, h=hash_values)
    def remove(self, replica: ReplicaId, medium: str | None, h: WireHash) -> None:
        self.index.apply_event(replica, BlockRemoved((h,), medium=medium))
        self.model.remove(replica, Medium.from_wire(medium), (h,))

    @rule(replica=replicas)
    def clear_replica(self, replica: ReplicaId) -> None:
        self.index.clear_replica(replica)
        self.model.clear(replica)

    @rule(replica=replicas)
    def remove_replica(self, replica: ReplicaId) -> None:
        self.index.remove_replica(replica)
        self.model.drop(replica)

    @rule(replica=replicas, hashes=hash_lists, scope=scopes)
    def predict(self, replica: ReplicaId, hashes: list[WireHash], scope: TenantScope | FleetScope) -> None:
        self.index.add_predicted(replica, hashes, scope)
        self.model.predict(_owner(scope), replica, hashes, self.clock.now())

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0]))
    def advance(self, dt: float) -> None:
        self.clock.advance(dt)

    @rule(hashes=st.lists(hash_values, min_size=0, max_size=12), scope=scopes)
    def lookup(self, hashes: list[WireHash], scope: TenantScope | FleetScope) -> None:
        expected = self.model.match(
            hashes, _owner(scope), isinstance(scope, FleetScope), self.clock.now()
        )
        assert self.index.match(hashes, scope) == expected

    @invariant()
    def stats_agree(self) -> None:
        stats = self.index.stats()
        model = self.model
        now = self.clock.now()
        assert stats.num_entries == model.num_entries()
        assert stats.num_entries <= model.max_entries
        assert stats.num_hashes == len(model.order)
        assert dict(stats.num_entries_by_replica) == {
            r: sum(len(c) for (cr, _), c in model.copies.items() if cr == r) for r in model.known
        }
        assert stats.num_extra_copies == sum(
            n - 1 for c in model.copies.values() for n in c.values()
        )
        assert stats.num_removed_unknown == model.removed_unknown
        assert stats.num_evicted_for_bound == model.evicted
        assert stats.num_predicted == sum(1 for e in model.predicted.values() if e > now)
        assert set(self.index.replicas) == set(model.known)

    @invariant()
    def every_held_prefix_matches(self) -> None:
        """For every hash the model holds, a one-block lookup agrees in every scope."""
        now = self.clock.now()
        for h in list(self.model.order)[:6]:
            for scope in SCOPES:
                expected = self.model.match(
                    [h], _owner(scope), isinstance(scope, FleetScope), now
                )
                assert self.index.match([WireHash(h)], scope) == expected


IndexMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexAgainstModel = IndexMachine.TestCase


def test_long_random_prefixes_against_model() -> None:
    """Long requests (several match chunks) over many replicas at random depths and media."""
    rng = random.Random(7)
    for trial in range(20):
        clock = ManualClock()
        index = PrefixIndex(clock=clock, predicted_ttl_s=TTL_S)
        model = Model(10**9)
        request = [WireHash(rng.getrandbits(64)) for _ in range(rng.randint(1, 900))]
        for r in range(rng.randint(1, 40)):
            replica = ReplicaId(f"r{r}")
            for _ in range(rng.randint(1, 4)):
                lo = rng.randint(0, len(request) - 1)
                hi = rng.randint(lo, len(request))
                medium = rng.choice(MEDIUM_SPELLINGS)
                chunk = tuple(request[lo:hi])
                index.apply_event(replica, BlockStored(chunk, None, (), 16, medium=medium))
                model.store(replica, Medium.from_wire(medium), chunk)
            if rng.random() < 0.3:
                scope = rng.choice(SCOPES)
                hi = rng.randint(0, len(request))
                index.add_predicted(replica, request[:hi], scope)
                model.predict(_owner(scope), replica, request[:hi], clock.now())
        for scope in SCOPES:
            expected = model.match(request, _owner(scope), isinstance(scope, FleetScope), 0.0)
            assert index.match(request, scope) == expected, f"trial {trial}, {scope!r}"


def test_predictions_in_some_chunks_only_against_model() -> None:
    """Predicted runs that cover some match chunks and not others (a long prompt's newest
    blocks, or a middle range): chunks without a prediction take the int-key path."""
    rng = random.Random(11)
    for trial in range(30):
        clock = ManualClock()
        index = PrefixIndex(clock=clock, predicted_ttl_s=TTL_S)
        model = Model(10**9)
        request = [WireHash(rng.getrandbits(64)) for _ in range(rng.randint(300, 1500))]
        for r in range(rng.randint(1, 6)):
            replica = ReplicaId(f"r{r}")
            hi = rng.randint(0, len(request))
            medium = rng.choice(MEDIUM_SPELLINGS)
            index.apply_event(replica, BlockStored(tuple(request[:hi]), None, (), 16,
                                                   medium=medium))
            model.store(replica, Medium.from_wire(medium), tuple(request[:hi]))
            for _ in range(rng.randint(1, 3)):
                scope = rng.choice(SCOPES)
                lo = rng.randint(0, len(request))
                top = rng.randint(lo, len(request))
                index.add_predicted(replica, request[lo:top], scope)
                model.predict(_owner(scope), replica, request[lo:top], clock.now())
        for scope in SCOPES:
            expected = model.match(request, _owner(scope), isinstance(scope, FleetScope), 0.0)
            assert index.match(request, scope) == expected, f"trial {trial}, {scope!r}"


def test_growing_sessions_predicted_where_they_are_held_against_model() -> None:
    """Growing sessions: each turn predicts its blocks on the replica it went to, which then
    stores them (uniform chunks whose predictions the holder covers), with removals, other
    media and other replicas' predictions mixed in."""
    rng = random.Random(23)
    for trial in range(25):
        clock = ManualClock()
        index = PrefixIndex(clock=clock, predicted_ttl_s=TTL_S)
        model = Model(10**9)
        request = [WireHash(rng.getrandbits(64)) for _ in range(rng.randint(600, 2000))]
        replicas = [ReplicaId(f"r{r}") for r in range(rng.randint(1, 4))]
        done = 0
        while done < len(request):
            end = min(len(request), done + rng.randint(50, 500))
            replica = rng.choice(replicas)
            scope = rng.choice(SCOPES)
            index.add_predicted(replica, request[done:end], scope)
            model.predict(_owner(scope), replica, request[done:end], clock.now())
            if rng.random() < 0.8:
                medium = rng.choice(MEDIUM_SPELLINGS)
                chunk = tuple(request[rng.randint(0, done) if rng.random() < 0.2 else done:end])
                index.apply_event(replica, BlockStored(chunk, None, (), 16, medium=medium))
                model.store(replica, Medium.from_wire(medium), chunk)
            if rng.random() < 0.2:
                lo = rng.randint(0, end - 1)
                gone = tuple(request[lo : rng.randint(lo, end)])
                medium = rng.choice(MEDIUM_SPELLINGS)
                index.apply_event(replica, BlockRemoved(gone, medium=medium))
                model.remove(replica, Medium.from_wire(medium), gone)
            done = end
            for scope in SCOPES:
                expected = model.match(request, _owner(scope), isinstance(scope, FleetScope),
                                       0.0)
                assert index.match(request, scope) == expected, f"trial {trial}, {scope!r}"
