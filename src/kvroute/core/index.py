"""The fleet prefix index: which replica caches which block, on which medium.

Owns the router's view of every engine's prefix cache, built from the engines' own KV events
and keyed by the engines' own block hashes (``WireHash``), plus the router's *predicted*
entries for requests it has just sent. Answers one question on the request path: for this
request's block hashes, in order, how many *leading* blocks does each replica hold, and on
which medium.

Tenant isolation
----------------
Every lookup and every predicted-entry write carries a scope object, checked at run time:
``TenantScope(tenant)`` for tenant traffic, ``FleetScope`` (obtainable only from an
``AdminCapability``) for the admin endpoint. Anything else — ``None``, a string, a look-alike —
raises ``ScopeError``: isolation fails closed.

* **Stored blocks are isolated by the hash itself.** vLLM mixes a request's ``cache_salt`` into
  the hash of block 0 only, and every later block's hash chains from its parent's, so a salted
  prompt produces a hash sequence disjoint from any other tenant's (up to 64-bit collisions).
  The index therefore needs no tenant tag on engine-reported entries: a tenant can only ever
  look up hashes its own prompts produce.
* **Predicted entries are router-side state** not derived from the engine, and the router
  writes them from the hashes it computed for one tenant's request. They are recorded with the
  writing tenant and only a lookup with that tenant's scope (or the fleet scope) sees them, so
  one tenant's burst cannot steer another tenant's routing even when both send unsalted,
  identical prefixes. Entries written with the fleet scope are visible to fleet lookups only.

Must not import asyncio, sockets, os, time or logging (``core`` is sans-IO); time comes from
the injected ``Clock``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import ne
from typing import Any

from kvroute.core.clock import Clock
from kvroute.core.errors import ScopeError
from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from kvroute.core.types import Medium, ReplicaId, TenantName, WireHash

__all__ = [
    "AdminCapability",
    "FleetScope",
    "IndexStats",
    "LookupScope",
    "PrefixIndex",
    "PrefixMatch",
    "TenantScope",
]

# Bits per replica slot in a held mask: one per medium, GPU at the lowest position.
_STRIDE = 3
_MEDIUM_MASK = (1 << _STRIDE) - 1
# Blocks looked up per C-level pass in ``match``: long enough to amortise the Python
# overhead, short enough that a run that ends early does not pay for the whole request.
_MATCH_CHUNK = 256


# --- scopes --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TenantScope:
    """A lookup on behalf of one tenant: sees stored blocks and that tenant's predictions."""

    tenant: TenantName

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ScopeError(
                f"TenantScope needs a non-empty tenant name, got {self.tenant!r}; "
                "resolve the tenant from the request's API key before routing"
            )


_FLEET_TOKEN = object()


class FleetScope:
    """A fleet-wide lookup: sees every tenant's predicted entries. For admin endpoints only.

    Cannot be constructed directly; obtain it from ``AdminCapability.fleet_scope()``, so every
    place that can see across tenants is visible in the code as a holder of the capability.
    """

    __slots__ = ("_token",)

    def __init__(self, _token: object = None) -> None:
        if _token is not _FLEET_TOKEN:
            raise ScopeError(
                "FleetScope cannot be constructed directly; ask the AdminCapability minted by "
                "the composition root for capability.fleet_scope()"
            )
        self._token = _token

    def __repr__(self) -> str:
        return "FleetScope()"


class AdminCapability:
    """The right to look across tenants. Minted once by the composition root (``build_app``)
    and handed only to the admin endpoint, which calls ``fleet_scope()``.

    This is a capability in the object sense, not a secret: it makes cross-tenant reads
    explicit and greppable, and a tenant code path that never received it cannot produce a
    ``FleetScope``.
    """

    __slots__ = ()

    def fleet_scope(self) -> FleetScope:
        """Return a scope that sees every tenant's predicted entries."""
        return FleetScope(_FLEET_TOKEN)


LookupScope = TenantScope | FleetScope


def _tenant_key(scope: object, action: str) -> TenantName | None:
    """Return the predicted-entry owner for ``scope`` (``None`` = fleet), or raise ScopeError."""
    if type(scope) is TenantScope:
        return scope.tenant
    if type(scope) is FleetScope and getattr(scope, "_token", None) is _FLEET_TOKEN:
        return None
    raise ScopeError(
        f"{action} needs a TenantScope(tenant) or an admin FleetScope, got {scope!r}; "
        "tenant traffic must pass TenantScope(tenant=...), admin code "
        "AdminCapability.fleet_scope()"
    )


# --- results -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How one replica holds the leading run of a request's blocks.

    Each block of the run is counted once, under the best medium the replica holds it in
    (GPU > CPU > storage > predicted), so the four counts sum to the run length.
    """

    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0
    num_storage_blocks: int = 0
    num_predicted_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        """Length of the leading run this replica holds, in blocks."""
        return (
            self.num_gpu_blocks
            + self.num_cpu_blocks
            + self.num_storage_blocks
            + self.num_predicted_blocks
        )


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A snapshot of the index's size and its anomaly counters.

    An *entry* is one (hash, replica, medium) the index holds, whatever its copy count.
    """

    num_entries: int
    num_hashes: int
    num_entries_by_replica: Mapping[ReplicaId, int]
    num_extra_copies: int
    num_removed_unknown: int
    num_evicted_for_bound: int
    num_predicted: int


# --- the index -----------------------------------------------------------------------------


class PrefixIndex:
    """Block hash → replicas holding it, per medium, reference-counted, with predictions.

    Layout (chosen for the request path: a 2,048-block lookup over 100 replicas in < 1 ms,
    and for memory: < 150 bytes per (block, replica) entry):

    * Each known replica gets a small integer *slot* ``s``. Its three media live at bit
      positions ``3s`` (GPU), ``3s+1`` (CPU) and ``3s+2`` (storage) of a Python int mask.
    * ``_held: dict[WireHash, int]`` maps a hash to the mask of (replica, medium) pairs that
      hold at least one copy. Single-bit masks are shared objects from ``_bits``, so the
      common case — one replica holds a hash — costs one dict entry plus the key.
    * ``_extra: dict[WireHash, dict[int, int]]`` counts copies *beyond the first* per bit
      position. vLLM does not de-duplicate its cache (several physical blocks can carry one
      hash) and its stored/removed events are per physical copy, so the index must
      reference-count; keeping counts > 1 aside keeps the common single-copy case at one bit.
    * Predicted entries: per owner (tenant name, or ``None`` for fleet writes) a dict hash →
      mask of slot positions ``3s``, an expiry per (hash, position), and one FIFO queue of
      write records. Because the TTL is fixed and the clock monotonic, records are queued in
      expiry order; expired ones are purged from the head before every lookup and write, so
      expired entries never count and each record is purged exactly once (amortised O(1)).

    Invariants:

    * ``h in _held`` iff ``_held[h] != 0``; a bit is set iff that replica holds >= 1 copy on
      that medium; ``_extra[h][pos] >= 1`` only where bit ``pos`` of ``_held[h]`` is set.
    * ``_num_entries == sum(popcount(m) for m in _held.values())`` and per slot likewise.
    * Bits exist only for allocated slots: removing a replica scrubs its bits before its slot
      can be reused (slots are reused lowest first, keeping masks short).
    * After any public call, ``_num_entries <= max_entries``.

    Why not per-replica sets (the obvious design)? A lookup would probe every replica for every
    block (204,800 probes for 2,048 blocks x 100 replicas). Here a lookup probes one dict per
    block and narrows an *alive* mask of replicas whose run is still going; per-replica work
    happens only when a replica's medium changes or its run ends, and consecutive blocks with
    the same mask (the common case: a replica holds a whole prefix) cost one int comparison,
    and the per-block lookups and comparisons run in C (``map``/``compress``, 256 at a time).

    Memory bound: when a store takes the index over ``max_entries``, whole hashes are dropped
    (every replica and medium, with their extra copies) in the order they were first stored
    (dict insertion order; a hash that disappears and is stored again counts as new), until
    the index is at ``max_entries - max_entries // 64``. The 1/64 hysteresis batches eviction
    so that scanning the dict's front stays amortised O(1) per entry. Every dropped entry is
    counted in ``num_evicted_for_bound``. FIFO rather than LRU because tracking recency per
    lookup would cost the request path; the price is that a long-held hot prefix is among the
    first dropped. The bound is a safety valve, not a cache policy: size it above the fleet's
    total cache capacity in blocks, so it triggers only when removals were lost, and alert on
    the counter. Predicted entries have the same bound, counted separately: past it, the oldest
    writes are dropped early (as if expired) down to the same watermark, and counted too.

    Hit reports. A replica whose requests carry vLLM's ``kv_cache_report_mode: "full"``
    (``set_hit_reports``) also sends a ``BlockStored`` for every prefix *hit*: parent
    ``None``, blocks from 0, no change in the engine. On the wire it looks like a store, and
    counting it as one would add a copy that no ``BlockRemoved`` ever takes away. For such a
    replica a parent-less store of a hash it already holds on that medium is a touch, not a
    copy. The one store it misreads is a true duplicate of a leading block (two identical
    prompts computed in the same step): one copy too few is counted, so the entry may leave
    before the engine's last copy, a false miss, never a false hit.

    ``AllBlocksCleared``, ``clear_replica`` and ``remove_replica`` scan the whole index
    (O(hashes); about 0.05 s of CPU per million hashes). They are rare (cache reset, restart,
    scale-down), and eager scrubbing keeps every count exact and slots reusable.

    Not thread-safe: one owner (the router's event task) calls it, as the house style says.
    """

    __slots__ = (
        "_bits",
        "_clock",
        "_evict_to",
        "_extra",
        "_free_slots",
        "_held",
        "_hit_replicas",
        "_live_positions",
        "_max_entries",
        "_medium_offset",
        "_num_entries",
        "_num_entries_by_slot",
        "_num_evicted",
        "_num_predicted",
        "_num_removed_unknown",
        "_pred_expiry",
        "_pred_masks",
        "_pred_queue",
        "_predicted_ttl_s",
        "_replica_at",
        "_scrubs",
        "_slot_of",
    )

    def __init__(
        self, *, clock: Clock, max_entries: int = 50_000_000, predicted_ttl_s: float = 2.0
    ) -> None:
        """Create an empty index.

        Args:
            clock: source of monotonic seconds for predicted-entry expiry.
            max_entries: most (hash, replica, medium) entries held; see the class docstring.
            predicted_ttl_s: how long a predicted entry counts after it is written.

        Raises:
            ValueError: ``max_entries`` < 1 or ``predicted_ttl_s`` not > 0.
        """
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(
                f"max_entries must be a positive int, got {max_entries!r}; size it above the "
                "fleet's total KV-cache capacity in blocks"
            )
        if not predicted_ttl_s > 0:
            raise ValueError(
                f"predicted_ttl_s must be > 0, got {predicted_ttl_s!r}; use about the time an "
                "engine takes to report a request's blocks (2 s)"
            )
        self._clock = clock
        self._max_entries = max_entries
        self._evict_to = max_entries - max_entries // 64
        self._predicted_ttl_s = float(predicted_ttl_s)
        self._held: dict[int, int] = {}
        self._extra: dict[int, dict[int, int]] = {}
        self._bits: list[int] = []
        self._slot_of: dict[ReplicaId, int] = {}
        self._replica_at: list[ReplicaId | None] = []
        self._free_slots: list[int] = []
        self._live_positions = 0
        self._num_entries = 0
        self._num_entries_by_slot: list[int] = []
        self._num_removed_unknown = 0
        self._num_evicted = 0
        self._medium_offset: dict[str | None, int] = {}
        self._pred_masks: dict[TenantName | None, dict[int, int]] = {}
        # owner -> replica position -> hash -> expiry of its latest write. Nested rather than
        # keyed by (hash, position) tuples: a prediction writes ~1,000 hashes per request and
        # building a tuple per hash was most of add_predicted's cost.
        self._pred_expiry: dict[TenantName | None, dict[int, dict[int, float]]] = {}
        self._num_predicted = 0
        # (expiry, owner, replica position, hashes, the slot's scrub count when written). The
        # scrub count tells a write made before its replica was cleared (or its slot reused)
        # from a later one with the same expiry (a virtual clock repeats instants), so a
        # stale write never drops or evicts a later write's entries.
        self._pred_queue: deque[tuple[float, TenantName | None, int, tuple[int, ...], int]] = (
            deque()
        )
        self._scrubs: list[int] = []
        self._hit_replicas: set[ReplicaId] = set()

    # --- replicas ----------------------------------------------------------------------

    def _slot(self, replica: ReplicaId) -> int:
        """Return the replica's slot, allocating one (lowest free first) if it is new."""
        slot = self._slot_of.get(replica)
        if slot is not None:
            return slot
        if not isinstance(replica, str) or not replica:
            raise ValueError(f"a replica id must be a non-empty str, got {replica!r}")
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
            self._replica_at[slot] = replica
        else:
            slot = len(self._replica_at)
            self._replica_at.append(replica)
            self._num_entries_by_slot.append(0)
            self._scrubs.append(0)
            base = _STRIDE * slot
            self._bits.extend(1 << pos for pos in range(base, base + _STRIDE))
        self._slot_of[replica] = slot
        self._live_positions |= self._bits[_STRIDE * slot]
        return slot

    def set_hit_reports(self, replica: ReplicaId, on: bool) -> None:
        """``replica``'s requests ask for hit reports (see "Hit reports" above)."""
        if on:
            self._hit_replicas.add(replica)
        else:
            self._hit_replicas.discard(replica)

    def clear_replica(self, replica: ReplicaId) -> None:
        """Forget everything a replica holds (stored and predicted) but keep it known.

        Use when its cache was reset or its event stream had an unrecoverable gap. Unknown
        replicas become known. O(index size).
        """
        self._scrub_slot(self._slot(replica))

    def remove_replica(self, replica: ReplicaId) -> None:
        """Drop a replica and all its entries; its slot is reused later. Unknown: no-op."""
        slot = self._slot_of.pop(replica, None)
        if slot is None:
            return
        self._scrub_slot(slot)
        self._replica_at[slot] = None
        self._live_positions &= ~self._bits[_STRIDE * slot]
        heapq.heappush(self._free_slots, slot)

    def _scrub_slot(self, slot: int) -> None:
        self._scrubs[slot] += 1  # the slot's queued predictions are void from here on
        base = _STRIDE * slot
        rmask = _MEDIUM_MASK << base
        held = self._held
        emptied: list[int] = []
        for h, m in held.items():
            if m & rmask:
                rest = m & ~rmask
                if rest:
                    held[h] = rest  # same size: safe while iterating
                else:
                    emptied.append(h)
        for h in emptied:
            del held[h]
        if self._extra:
            extra_emptied: list[int] = []
            for h, ex in self._extra.items():
                for pos in range(base, base + _STRIDE):
                    ex.pop(pos, None)
                if not ex:
                    extra_emptied.append(h)
            for h in extra_emptied:
                del self._extra[h]
        self._num_entries -= self._num_entries_by_slot[slot]
        self._num_entries_by_slot[slot] = 0
        bit = self._bits[base]
        for owner, masks in self._pred_masks.items():
            gone = self._pred_expiry[owner].pop(base, {})
            for h in gone:
                rest = masks[h] & ~bit
                if rest:
                    masks[h] = rest
                else:
                    del masks[h]
            self._num_predicted -= len(gone)

    # --- events ------------------------------------------------------------------------

    def apply_batch(self, replica: ReplicaId, batch: EventBatch) -> None:
        """Apply one engine step's events for ``replica``, in order.

        Sequence numbers are the subscriber's business (gap detection happens before this).

        Raises:
            TypeError: an event is not a ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``.
        """
        self._apply(self._slot(replica), batch.events)

    def apply_event(self, replica: ReplicaId, event: KVEvent) -> None:
        """Apply one event for ``replica``.

        ``BlockStored`` adds one copy per hash; ``BlockRemoved`` removes one copy per hash
        (never below zero; a hash not held is counted in ``num_removed_unknown``, not an
        error, because vLLM's removal is lazy and the router may have joined mid-stream);
        ``AllBlocksCleared`` clears the replica.

        Raises:
            TypeError: the event is of none of those types.
        """
        self._apply(self._slot(replica), (event,))

    def _medium_pos(self, medium: str | None) -> int:
        offset = int(Medium.from_wire(medium))
        self._medium_offset[medium] = offset
        return offset

    def _apply(self, slot: int, events: Iterable[KVEvent]) -> None:
        held = self._held
        extra = self._extra
        offsets = self._medium_offset
        bits = self._bits
        base = _STRIDE * slot
        added = 0
        dropped = 0
        unknown = 0
        hit_reports = bool(self._hit_replicas) and self._replica_at[slot] in self._hit_replicas
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                offset = offsets.get(event.medium, -1)  # type: ignore[union-attr]
                if offset < 0:
                    offset = self._medium_pos(event.medium)  # type: ignore[union-attr]
                pos = base + offset
                bit = bits[pos]
                touch = hit_reports and event.parent_block_hash is None  # type: ignore[union-attr]
                for h in event.block_hashes:  # type: ignore[union-attr]
                    cur = held.get(h)
                    if cur is None:
                        held[h] = bit
                        added += 1
                    elif touch and cur & bit:
                        continue  # a hit re-announced, not a new copy
                    elif cur & bit:
                        ex = extra.get(h)
                        if ex is None:
                            extra[h] = {pos: 1}
                        else:
                            ex[pos] = ex.get(pos, 0) + 1
                    else:
                        held[h] = cur | bit
                        added += 1
                if self._num_entries + added - dropped > self._max_entries:
                    self._commit(slot, added - dropped, unknown)
                    added = dropped = unknown = 0
                    self._evict()
            elif kind is BlockRemoved:
                offset = offsets.get(event.medium, -1)  # type: ignore[union-attr]
                if offset < 0:
                    offset = self._medium_pos(event.medium)  # type: ignore[union-attr]
                pos = base + offset
                bit = bits[pos]
                for h in event.block_hashes:  # type: ignore[union-attr]
                    cur = held.get(h, 0)
                    if not cur & bit:
                        unknown += 1
                        continue
                    if extra:
                        ex = extra.get(h)
                        if ex is not None:
                            n = ex.get(pos)
                            if n is not None:
                                if n > 1:
                                    ex[pos] = n - 1
                                elif len(ex) > 1:
                                    del ex[pos]
                                else:
                                    del extra[h]
                                continue
                    rest = cur ^ bit
                    if rest:
                        held[h] = rest
                    else:
                        del held[h]
                    dropped += 1
            elif kind is AllBlocksCleared:
                self._commit(slot, added - dropped, unknown)
                added = dropped = unknown = 0
                self._scrub_slot(slot)
            else:
                self._commit(slot, added - dropped, unknown)
                raise TypeError(
                    f"cannot apply {event!r}: expected BlockStored, BlockRemoved or "
                    "AllBlocksCleared (decode wire events with kvroute.wire first)"
                )
        self._commit(slot, added - dropped, unknown)

    def _commit(self, slot: int, delta: int, unknown: int) -> None:
        self._num_entries += delta
        self._num_entries_by_slot[slot] += delta
        self._num_removed_unknown += unknown

    def _evict(self) -> None:
        """Drop the oldest-stored hashes until the index is at its low watermark."""
        held = self._held
        excess = self._num_entries - self._evict_to
        victims: list[int] = []
        for h, m in held.items():
            victims.append(h)
            excess -= m.bit_count()
            if excess <= 0:
                break
        by_slot = self._num_entries_by_slot
        num_dropped = 0
        for h in victims:
            m = held.pop(h)
            self._extra.pop(h, None)
            num_dropped += m.bit_count()
            while m:
                low = m & -m
                by_slot[(low.bit_length() - 1) // _STRIDE] -= 1
                m ^= low
        self._num_entries -= num_dropped
        self._num_evicted += num_dropped

    # --- predictions -------------------------------------------------------------------

    def add_predicted(
        self, replica: ReplicaId, hashes: Sequence[WireHash], scope: LookupScope
    ) -> None:
        """Record that ``replica`` will soon hold ``hashes`` (a request was just sent there).

        The entries count for lookups in the same scope until ``predicted_ttl_s`` has passed
        on the clock; writing a hash again refreshes its expiry.

        Raises:
            ScopeError: ``scope`` is not a ``TenantScope`` or an admin ``FleetScope``.
        """
        owner = _tenant_key(scope, "add_predicted")
        slot = self._slot(replica)
        now = self._clock.now()
        self._purge_predicted(now)
        if not hashes:
            return
        pos = _STRIDE * slot
        bit = self._bits[pos]
        masks = self._pred_masks.setdefault(owner, {})
        expiry = self._pred_expiry.setdefault(owner, {}).setdefault(pos, {})
        expires_at = now + self._predicted_ttl_s
        keys = tuple(hashes)
        before = len(expiry)
        expiry.update(dict.fromkeys(keys, expires_at))
        num_new = len(expiry) - before
        get = masks.get
        for h in keys:
            m = get(h, 0)
            if not m & bit:
                masks[h] = m | bit
        self._num_predicted += num_new
        self._pred_queue.append((expires_at, owner, pos, keys, self._scrubs[slot]))
        if self._num_predicted > self._max_entries:
            # NOTE: the same bound as stored entries, applied separately: a long TTL (the
            # approximate mode's) times a high request rate must not grow without limit.
            # The oldest writes go first, exactly as if they had expired.
            while self._num_predicted > self._evict_to:
                self._num_evicted += self._drop_prediction(self._pred_queue.popleft())

    def _purge_predicted(self, now: float) -> None:
        queue = self._pred_queue
        while queue and queue[0][0] <= now:
            self._drop_prediction(queue.popleft())

    def _drop_prediction(
        self, record: tuple[float, TenantName | None, int, tuple[int, ...], int]
    ) -> int:
        """Remove the entries of one write that no later write refreshed; return how many."""
        expires_at, owner, pos, keys, scrubs = record
        if self._scrubs[pos // _STRIDE] != scrubs:
            return 0  # its replica was cleared since: those entries are gone already
        masks = self._pred_masks.get(owner)
        if masks is None:
            return 0
        expiry = self._pred_expiry[owner].get(pos)
        if expiry is None:
            return 0
        bit = self._bits[pos]
        num_dropped = 0
        get = expiry.get
        for h in keys:
            if get(h) != expires_at:
                continue  # refreshed by a later write, already dropped, or scrubbed
            del expiry[h]
            num_dropped += 1
            rest = masks[h] & ~bit
            if rest:
                masks[h] = rest
            else:
                del masks[h]
        if not expiry:
            del self._pred_expiry[owner][pos]
        if not masks:
            del self._pred_masks[owner]
            del self._pred_expiry[owner]
        self._num_predicted -= num_dropped
        return num_dropped

    def _predicted_tables(self, owner: TenantName | None) -> list[dict[int, int]]:
        """The predicted-entry tables a lookup in ``owner``'s scope sees (None: the fleet's)."""
        if owner is not None:
            masks = self._pred_masks.get(owner)
            return [masks] if masks else []
        return [m for m in self._pred_masks.values() if m]

    @staticmethod
    def _predicted_lookup(tables: list[dict[int, int]]) -> Callable[[int, int], int] | None:
        if not tables:
            return None
        if len(tables) == 1:
            return tables[0].get

        def union(h: int, default: int) -> int:
            out = default
            for table in tables:
                out |= table.get(h, 0)
            return out

        return union

    # --- lookup ------------------------------------------------------------------------

    def match(self, hashes: Sequence[WireHash], scope: LookupScope) -> dict[ReplicaId, PrefixMatch]:
        """Return, per replica holding at least block 0, how it holds the leading run.

        Walks ``hashes`` in order; a replica's run continues while it holds the block on any
        medium or as a predicted entry visible in ``scope``. Each block of the run is counted
        under the best medium the replica holds it in (GPU > CPU > storage > predicted).

        Example: replica ``a`` holds blocks 0-2 on GPU and block 3 on CPU, replica ``b``
        holds block 0 on storage and block 1 nowhere; for ``[h0, h1, h2, h3, h4]`` the
        result is ``{a: PrefixMatch(3, 1, 0, 0), b: PrefixMatch(0, 0, 1, 0)}``.

        Raises:
            ScopeError: ``scope`` is not a ``TenantScope`` or an admin ``FleetScope``.
        """
        owner = _tenant_key(scope, "match")
        self._purge_predicted(self._clock.now())
        alive = self._live_positions
        if not alive or not hashes:
            return {}
        get = self._held.get
        pred_tables = self._predicted_tables(owner)
        pred_get = self._predicted_lookup(pred_tables)
        # A tenant's predictions by replica position (hash -> expiry): the same entries as
        # its mask table (add_predicted, _drop_prediction and a replica's removal keep both).
        by_pos = self._pred_expiry.get(owner) if owner is not None and pred_get else None
        # ``state`` packs the four category masks side by side, ``width`` bits each:
        # GPU | CPU << width | storage << 2*width | predicted << 3*width. A set bit at
        # ``k`` means "replica at position k % width is in category k // width since block
        # starts[k]"; when it clears, the blocks since then are credited to ``counts[k]``.
        width = _STRIDE * len(self._replica_at)
        width2 = 2 * width
        width3 = 3 * width
        starts: dict[int, int] = {}
        counts: dict[int, int] = {}
        state = 0
        prev_key: object = -1  # no block has this key, so block 0 is always a change
        end = num_hashes = len(hashes)
        for chunk_start in range(0, num_hashes, _MATCH_CHUNK):
            chunk = hashes[chunk_start : chunk_start + _MATCH_CHUNK]
            # The per-block work runs in C (map/compress); Python sees only the blocks whose
            # holders differ from the block before, and chunks let a dead run stop early.
            keys: list[Any] = list(map(get, chunk, repeat(0)))
            paired = False
            if pred_get is not None:
                # A chunk keeps its int keys (a key's form changing at a chunk's edge only
                # adds a change point, which leaves the state as it was) when no block in it
                # carries a prediction that can count. A predicted bit counts only for a
                # replica still in the run (``alive``: it never grows back) that holds the
                # block on no medium (``alive`` and the predicted category below). So when
                # every block of the chunk has the same holders, only those replicas' own
                # prediction tables are probed (a growing session's chunks: the replica its
                # turns went to holds what they predicted, and nothing is probed at all);
                # otherwise any prediction in the chunk pairs it (C-level ``isdisjoint``).
                m0 = keys[0]
                if by_pos is not None and keys.count(m0) == len(keys):
                    uncovered = alive & ~(m0 | (m0 >> 1) | (m0 >> 2))
                    paired = uncovered != 0 and not all(
                        table.keys().isdisjoint(chunk) for pos, table in by_pos.items()
                        if uncovered >> pos & 1)
                else:
                    paired = not all(table.keys().isdisjoint(chunk) for table in pred_tables)
                if paired:
                    keys = list(zip(keys, map(pred_get, chunk, repeat(0)), strict=True))
            if keys.count(prev_key) == len(keys):
                continue  # the same holders as the block before, all the chunk (one C pass)
            changed = compress(range(len(keys)), map(ne, keys, chain((prev_key,), keys)))
            prev_key = keys[-1]
            for j in changed:
                if paired:
                    m, p = keys[j]
                else:
                    m, p = keys[j], 0
                i = chunk_start + j
                alive &= m | (m >> 1) | (m >> 2) | p
                g = m & alive
                rest = alive ^ g
                c = (m >> 1) & rest
                rest ^= c
                st = (m >> 2) & rest
                new = g | (c << width) | (st << width2) | ((p & (rest ^ st)) << width3)
                if new != state:
                    left = state & ~new
                    while left:
                        low = left & -left
                        k = low.bit_length() - 1
                        counts[k] = counts.get(k, 0) + i - starts.pop(k)
                        left ^= low
                    entered = new & ~state
                    while entered:
                        low = entered & -entered
                        starts[low.bit_length() - 1] = i
                        entered ^= low
                    state = new
                if not alive:
                    end = i
                    break
            if not alive:
                break
        for k, start in starts.items():
            counts[k] = counts.get(k, 0) + end - start
        per_pos: dict[int, list[int]] = {}
        for k, n in counts.items():
            cat, pos = divmod(k, width)
            row = per_pos.get(pos)
            if row is None:
                row = per_pos[pos] = [0, 0, 0, 0]
            row[cat] = n
        result: dict[ReplicaId, PrefixMatch] = {}
        replica_at = self._replica_at
        for pos, row in per_pos.items():
            replica = replica_at[pos // _STRIDE]
            assert replica is not None, f"bit {pos} is set for a free slot"
            result[replica] = PrefixMatch(row[0], row[1], row[2], row[3])
        return result

    # --- introspection -----------------------------------------------------------------

    @property
    def replicas(self) -> tuple[ReplicaId, ...]:
        """The replicas the index knows, in slot order."""
        return tuple(r for r in self._replica_at if r is not None)

    def stats(self) -> IndexStats:
        """Return sizes and anomaly counters (purging expired predicted entries first)."""
        self._purge_predicted(self._clock.now())
        by_replica = {
            replica: self._num_entries_by_slot[slot] for replica, slot in self._slot_of.items()
        }
        num_extra = sum(sum(ex.values()) for ex in self._extra.values())
        return IndexStats(
            num_entries=self._num_entries,
            num_hashes=len(self._held),
            num_entries_by_replica=by_replica,
            num_extra_copies=num_extra,
            num_removed_unknown=self._num_removed_unknown,
            num_evicted_for_bound=self._num_evicted,
            num_predicted=self._num_predicted,
        )

