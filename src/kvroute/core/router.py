"""RouterCore: the request walk as pure decisions (inputs in, decisions out).

The live server (``shell``) and the virtual-time simulator (``sim.fleet``) drive the same
``RouterCore``: the shell feeds it parsed requests, KV-event batches, health and engine
metrics from real sockets; the simulator feeds it the same from engine models on a virtual
clock. Nothing here waits, sends or reads a clock of its own.

One owner: the prefix index, the load tracker and the per-pool policies change only through
``RouterCore`` methods, and the shell calls them from one task, so no locks are needed.

What ``route`` does, for a request already assigned to a pool (tier choice is
``core/tiers.py``'s job, before this):

1. hash the prompt's full blocks exactly as the pool's engines do (block size, algorithm,
   seed and ``cache_salt`` read from the engines, never assumed) — or, in the pool's declared
   *approximate* mode (no exact tokens available), hash chained text chunks instead, which
   only predicted entries can match;
2. ask the index, in the tenant's scope, how many leading blocks each healthy replica holds;
3. let the pool's policy rank the replicas with their load snapshots;
4. record the choice: the request's prefill as outstanding load on the chosen replica, and
   (for policies that use them) its blocks as *predicted* index entries so that siblings sent
   before the engine's ``BlockStored`` arrives co-locate.

``reroute`` moves a request that failed before its first byte to the next replica of the same
ranking, moving its accounting with it.

LoRA adapters. A request for an adapter (``RouteRequest.lora``, built by the walk from
``lora_key``) is hashed with vLLM's ``("lora", name, path)`` extra key, and only replicas that
list the adapter with that path are candidates (discovery reports each replica's adapters from
``/v1/models`` through ``set_replica_adapters``). Among them, a replica whose adapter slots are
all taken by *other* adapters (``vllm:lora_requests_info``: ``max_lora`` reached by its running
adapters, plus the adapters the router has in flight there) is used only when every candidate
is: vLLM defers such a request until a slot frees, however much of its prefix is cached.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

import xxhash

from kvroute.core.clock import Clock
from kvroute.core.disagg import DisaggSpec, Role, choose_split
from kvroute.core.errors import ConfigError, NoEligibleReplica
from kvroute.core.events import EventBatch
from kvroute.core.hash_memo import BlockHashMemo
from kvroute.core.hashing import BlockHasher, LoraKey
from kvroute.core.hashing_chains import DEFAULT_CHAIN_TOKENS, SessionChains
from kvroute.core.index import LookupScope, PrefixIndex, PrefixMatch, TenantScope
from kvroute.core.load import DEFAULT_DECODE_TIMING, DecodeTiming, LoadTracker, ReplicaLoad
from kvroute.core.model_identity import ModelIdentity
from kvroute.core.peers import Announcement, Done, FirstToken, Placed
from kvroute.core.policy import NO_MATCH, Candidate, Policy, PolicyInput
from kvroute.core.pseudonyms import Pseudonyms
from kvroute.core.recency import BlockRecency
from kvroute.core.types import PoolName, ReplicaId, RequestId, WireHash
from kvroute.core.verdict_book import PD_PATH, GateRefusal, VerdictBook
from kvroute.core.versions import IdentityChange, ReplicaVersions

APPROX_CHUNK_CHARS = 64
"""Text chunk per pseudo-block in approximate mode (about 16 tokens of English)."""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """A replica as the router core needs it: its name, its configured prefill speed and,
    when known before the engine reports it, its KV capacity in tokens, and its role in a
    disaggregated pool (``core/disagg.py``: ``both``, ``prefill`` or ``decode``)."""

    name: ReplicaId
    prefill_rate_tps: float = 10_000.0
    kv_capacity_tokens: int | None = None
    role: Role = "both"


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One pool of interchangeable replicas (same model, same window, same block hashing).

    Attributes:
        name: the pool's name.
        replicas: its replicas.
        block_size: tokens per hashed block, as the engines report it.
        hash_algo: the engines' ``prefix_caching_hash_algo``.
        hash_seed: the engines' ``PYTHONHASHSEED`` if they run with one.
        approximate: no exact tokenization is available for this pool; route on text
            chunks and predicted entries (declared, visible, never silent).
        decode_timing: the engines' decode step model (``core/load.DecodeTiming``).
        disagg: prefill/decode disaggregation (``core/disagg.py``): None, every request is
            colocated and every replica must have role ``both``.
    """

    name: PoolName
    replicas: tuple[ReplicaSpec, ...]
    block_size: int = 16
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    approximate: bool = False
    decode_timing: DecodeTiming = DEFAULT_DECODE_TIMING
    disagg: DisaggSpec | None = None


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A request ready to be placed in a pool.

    Attributes:
        request_id: unique id.
        pool: the pool chosen for it (by the tier logic or the route's only pool).
        scope: the tenant's lookup scope (required: index lookups fail closed).
        num_prompt_tokens: exact or estimated prompt length.
        prompt_token_ids: the exact prompt tokens as the engines will see them, if known.
        block_hashes: their block hashes in wire form, when the caller already computed them
            with the pool's hashing (the simulator hashes each prompt once for router and
            engine alike).
        routing_text: the prompt as text (approximate mode and text-matching peers).
        cache_salt: the salt the engines will hash into block 0.
        lora: the LoRA adapter, if the request targets one.
        session_id: the session id, if any.
        expected_output_tokens: the output budget (for load accounting).
        predicted_output_tokens: the output the request will likely produce (learned per
            route and session, at most the budget); None: the budget.
        exclude: replicas not to use (already failed for this request).
        preferred_replica: the replica the session is pinned to, if any (wins ties).
    """

    request_id: RequestId
    pool: PoolName
    scope: LookupScope
    num_prompt_tokens: int
    prompt_token_ids: Sequence[int] | None = None
    block_hashes: Sequence[WireHash] | None = None
    routing_text: str = ""
    cache_salt: str | None = None
    lora: LoraKey | None = None
    session_id: str | None = None
    expected_output_tokens: int = 256
    predicted_output_tokens: int | None = None
    exclude: frozenset[ReplicaId] = frozenset()
    preferred_replica: ReplicaId | None = None


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Where a request goes and why.

    Attributes:
        replica: the chosen replica.
        ranking: every eligible replica, best first (retry order).
        expected_cached_tokens: prefix tokens expected to be served from cache there.
        block_hashes: the request's block hashes (wire form) used for the decision.
        approximate: the decision used text chunks, not exact block hashes.
        reason: the policy's reason word.
        scores: per-replica scores, for logs.
        prefill_replica: a split's prefill replica (``core/disagg.py``): the driver sends the
            prompt there first with ``max_tokens: 1`` and the KV is pulled by ``replica``;
            None: colocated.
        prefill_cached_tokens: prefix tokens the prefill replica is expected to hold.
        gate_refusal: a cross-version split the verdict book refused for this request
            (``core/verdict_book.py``), else None.
    """

    request: RouteRequest
    replica: ReplicaId
    ranking: tuple[ReplicaId, ...]
    expected_cached_tokens: int
    block_hashes: tuple[WireHash, ...]
    approximate: bool
    reason: str
    policy: str
    scores: dict[ReplicaId, float] = field(default_factory=dict)
    cached_by_replica: dict[ReplicaId, int] = field(default_factory=dict)
    prefill_replica: ReplicaId | None = None
    prefill_cached_tokens: int = 0
    gate_refusal: GateRefusal | None = None

    @property
    def prefill_request_id(self) -> RequestId:
        """The id the prefill half's load is counted under on ``prefill_replica``."""
        return RequestId(f"{self.request.request_id}{PREFILL_SUFFIX}")


PREFILL_SUFFIX: Final = "#prefill"


@dataclass(frozen=True, slots=True)
class AdapterSlots:
    """What ``vllm:lora_requests_info`` said of one replica's adapters.

    Attributes:
        running: adapters of the requests in its running batch.
        waiting: adapters of its waiting requests.
        max_lora: adapters one batch can hold (``--max-loras``); None: not reported.
    """

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_lora: int | None = None


@dataclass(slots=True)
class _Pool:
    spec: PoolSpec
    hasher: BlockHashMemo
    policy: Policy
    healthy: set[ReplicaId]
    drifting: bool = False  # the drift alarm's approximate mode (core/cache_drift.py)


def text_chunk_hashes(text: str, chunk_chars: int = APPROX_CHUNK_CHARS) -> list[WireHash]:
    """Chained 64-bit hashes of the full ``chunk_chars`` chunks of ``text`` (approximate mode)."""
    out: list[WireHash] = []
    prev = 0
    data = text.encode("utf-8")
    for start in range(0, len(data) - chunk_chars + 1, chunk_chars):
        prev = xxhash.xxh64_intdigest(data[start : start + chunk_chars], seed=prev)
        out.append(WireHash(prev))
    return out


class RouterCore:
    """The router's decisions and the state they rest on (index, load, per-pool policies)."""

    def __init__(
        self,
        pools: Sequence[PoolSpec],
        policy_factory: Callable[[], Policy],
        *,
        clock: Clock,
        index: PrefixIndex | None = None,
        predicted_ttl_s: float = 2.0,
        approx_predicted_ttl_s: float = 120.0,
        track_recency: bool = False,
        session_chain_tokens: int = DEFAULT_CHAIN_TOKENS,
        dynamic_pools: frozenset[PoolName] = frozenset(),
        pool_policy_factory: Callable[[PoolName], Policy] | None = None,
    ) -> None:
        """``policy_factory`` builds each pool's policy; ``pool_policy_factory``, when given,
        does instead, told the pool (a pool may set its own policy parameters,
        ``config.PoolConfig.policy_params``)."""
        if not pools:
            raise ConfigError("the router needs at least one pool; add one under 'pools:'")
        self._clock = clock
        self.index = index or PrefixIndex(clock=clock, predicted_ttl_s=predicted_ttl_s)
        # Approximate pools have no engine events to confirm predictions, so they live longer
        # in an index of their own (Dynamo's approximate mode uses 120 s).
        self.approx_index = PrefixIndex(clock=clock, predicted_ttl_s=approx_predicted_ttl_s)
        self.load = LoadTracker()
        self._no_prefix_caching: set[ReplicaId] = set()
        self.recency: BlockRecency | None = BlockRecency() if track_recency else None
        """Per-replica LRU order of GPU blocks from the events (``core/recency.py``)."""
        # A session's previous prompt as hashed, so its next turn hashes only what it added
        # (``core/hashing_chains.py``; reused only after checking ids and hashing basis).
        self.chains = SessionChains(session_chain_tokens)
        self.versions = ReplicaVersions()
        self.verdicts = VerdictBook(self.versions)
        """The fidelity gate's verdicts (``core/verdict_book.py``); empty until the shell
        loads a verdict file: every cross-version path recomputes."""
        self._pool_versions: dict[PoolName, dict[str, int]] = {}
        self._pools: dict[PoolName, _Pool] = {}
        self._pool_of: dict[ReplicaId, PoolName] = {}
        self._adapters: dict[ReplicaId, Mapping[str, str]] = {}
        self._slots: dict[ReplicaId, AdapterSlots] = {}
        self._adapter_in_flight: dict[ReplicaId, Counter[str]] = {}
        self._adapter_of: dict[RequestId, tuple[ReplicaId, str]] = {}
        self.announce: Callable[[Announcement], None] | None = None
        """Told of every placement, first token and end (``core/peers.py``), when several
        routers share their fresh placements (the shell sets it; None: one router)."""
        self.session_names: Pseudonyms | None = None
        """Set when several routers share sessions (``core/pseudonyms.py``): the load
        tracker's session keys are then keyed pseudonyms, equal on every router holding the
        cluster secret, so the key a ``Placed`` announcement carries names no one in clear."""
        for spec in pools:
            if spec.name in self._pools:
                raise ConfigError(f"pool {spec.name!r} is defined twice; pool names must be unique")
            if not spec.replicas and spec.name not in dynamic_pools:
                raise ConfigError(f"pool {spec.name!r} has no replicas; list at least one")
            for rep in spec.replicas:
                if rep.name in self._pool_of:
                    raise ConfigError(
                        f"replica {rep.name!r} appears in pools {self._pool_of[rep.name]!r} and "
                        f"{spec.name!r}; replica names must be unique across pools"
                    )
                if rep.role != "both" and spec.disagg is None:
                    raise ConfigError(
                        f"replica {rep.name!r} of pool {spec.name!r} has role {rep.role!r} but "
                        "the pool is not disaggregated; give the pool a 'disaggregation:' "
                        "section or make the replica's role 'both'")
                self._pool_of[rep.name] = spec.name
                self.load.add_replica(rep.name, prefill_rate_tps=rep.prefill_rate_tps,
                                      decode_timing=spec.decode_timing,
                                      kv_capacity_tokens=rep.kv_capacity_tokens)
            self._pools[spec.name] = _Pool(
                spec=spec,
                hasher=BlockHashMemo(BlockHasher(spec.hash_algo, spec.block_size,
                                                 spec.hash_seed)),
                policy=(policy_factory() if pool_policy_factory is None
                        else pool_policy_factory(spec.name)),
                healthy={rep.name for rep in spec.replicas},
            )

    # -- configuration learned at run time --------------------------------------------------

    def policy_of(self, name: PoolName) -> Policy:
        """The policy that ranks pool ``name``'s replicas."""
        return self._pool(name).policy

    def pool(self, name: PoolName) -> PoolSpec:
        return self._pool(name).spec

    def pool_names(self) -> list[PoolName]:
        return list(self._pools)

    def has_replica(self, replica: ReplicaId) -> bool:
        return replica in self._pool_of

    def pool_of(self, replica: ReplicaId) -> PoolName:
        return self._pool_of[replica]

    def knows(self, replica: ReplicaId) -> bool:
        """``replica`` is one of the router's (a session may name one from an older config)."""
        return replica in self._pool_of

    def set_pool_hashing(
        self, pool: PoolName, *, block_size: int, hash_algo: str, hash_seed: str | None = None,
        approximate: bool | None = None,
    ) -> None:
        """Adopt the block size and hash algorithm the engines reported (discovery)."""
        entry = self._pool(pool)
        spec = entry.spec
        new = replace(spec, block_size=block_size, hash_algo=hash_algo, hash_seed=hash_seed,
                      approximate=spec.approximate if approximate is None else approximate)
        if new != spec:
            entry.hasher = BlockHashMemo(BlockHasher(hash_algo, block_size, hash_seed))
            entry.spec = new

    # -- membership at run time (Kubernetes discovery) ----------------------------------------

    def add_replica(self, pool: PoolName, replica: ReplicaSpec) -> None:
        """``replica`` joins ``pool`` at run time. It starts out of routing: discovery
        brings it in (``set_healthy``) once its engine answers.

        Raises:
            ConfigError: the name is already a replica's (names are unique across pools).
        """
        if replica.name in self._pool_of:
            raise ConfigError(f"replica {replica.name!r} is already in pool "
                              f"{self._pool_of[replica.name]!r}; replica names must be unique")
        entry = self._pool(pool)
        self._pool_of[replica.name] = pool
        self.load.add_replica(replica.name, prefill_rate_tps=replica.prefill_rate_tps,
                              decode_timing=entry.spec.decode_timing,
                              kv_capacity_tokens=replica.kv_capacity_tokens)
        entry.spec = replace(entry.spec, replicas=(*entry.spec.replicas, replica))

    def remove_replica(self, replica: ReplicaId) -> None:
        """``replica`` left (scaled in): out of routing, its index entries, load, sessions
        resting there and adapters forgotten. Requests in flight there complete as
        unknown (``LoadTracker.num_unknown_completions``). Unknown names: no-op."""
        pool = self._pool_of.pop(replica, None)
        if pool is None:
            return
        entry = self._pool(pool)
        entry.healthy.discard(replica)
        entry.spec = replace(entry.spec, replicas=tuple(
            rep for rep in entry.spec.replicas if rep.name != replica))
        self.index.remove_replica(replica)
        self.approx_index.remove_replica(replica)
        if self.recency is not None:
            self.recency.clear(replica)
        self.load.remove_replica(replica)
        self._no_prefix_caching.discard(replica)
        self.verdicts.forget_cache(replica)
        self._adapters.pop(replica, None)
        self._slots.pop(replica, None)
        self._adapter_in_flight.pop(replica, None)

    # -- health and events --------------------------------------------------------------------

    def set_healthy(self, replica: ReplicaId, healthy: bool) -> None:
        """Take a replica out of routing and out of the index, or bring it back."""
        entry = self._pool(self._pool_of[replica])
        if healthy:
            entry.healthy.add(replica)
            return
        entry.healthy.discard(replica)
        self.index.clear_replica(replica)
        if self.recency is not None:
            self.recency.clear(replica)
        self.approx_index.clear_replica(replica)
        self.load.reset_replica(replica)

    def set_pool_drifting(self, pool: PoolName, drifting: bool) -> None:
        """The drift alarm (``core/cache_drift.py``) is on: route ``pool`` approximately
        (text chunks and predicted entries) until its exact index agrees with the engines
        again. Independent of the declared ``PoolSpec.approximate``."""
        self._pool(pool).drifting = drifting

    def pool_drifting(self, pool: PoolName) -> bool:
        return self._pool(pool).drifting

    def set_prefix_caching(self, replica: ReplicaId, enabled: bool) -> None:
        """The engine says its prefix caching is on or off (``vllm:cache_config_info``).

        A replica with caching off is never credited with a cached block: its index entries
        are dropped, lookups see nothing for it and no entry is predicted for it.
        """
        if enabled:
            self._no_prefix_caching.discard(replica)
            return
        self._no_prefix_caching.add(replica)
        self.index.clear_replica(replica)
        self.approx_index.clear_replica(replica)

    def prefix_caching_off(self, replica: ReplicaId) -> bool:
        return replica in self._no_prefix_caching

    def is_healthy(self, replica: ReplicaId) -> bool:
        return replica in self._pool(self._pool_of[replica]).healthy

    def apply_events(self, replica: ReplicaId, batch: EventBatch) -> None:
        """Apply one KV-event batch from ``replica``'s engine, in sequence order."""
        self.index.apply_batch(replica, batch)
        if self.recency is not None:
            self.recency.apply(replica, batch)

    def set_hit_reports(self, replica: ReplicaId, on: bool) -> None:
        """``replica``'s requests carry ``kv_cache_report_mode: "full"``: its parent-less
        stores of held blocks are hits re-announced (``PrefixIndex``, "Hit reports")."""
        self._pool(self._pool_of[replica])
        self.index.set_hit_reports(replica, on)

    def reset_replica_index(self, replica: ReplicaId) -> None:
        """Forget what ``replica`` caches (event gap not recoverable, or engine restarted)."""
        self.index.clear_replica(replica)
        if self.recency is not None:
            self.recency.clear(replica)

    # -- LoRA adapters ----------------------------------------------------------------------

    def set_replica_adapters(self, replica: ReplicaId, adapters: Mapping[str, str]) -> None:
        """The adapters ``replica`` lists on ``/v1/models``: {name: path it was loaded from}."""
        self._pool(self._pool_of[replica])
        self._adapters[replica] = dict(adapters)

    def set_adapter_slots(self, replica: ReplicaId, slots: AdapterSlots) -> None:
        """``replica``'s last ``vllm:lora_requests_info`` (discovery)."""
        self._pool(self._pool_of[replica])
        self._slots[replica] = slots

    def replica_adapters(self, replica: ReplicaId) -> Mapping[str, str]:
        return self._adapters.get(replica, {})

    def adapter_pools(self, name: str) -> list[PoolName]:
        """The pools with at least one replica listing adapter ``name``, in pool order."""
        return [pool for pool, entry in self._pools.items()
                if any(name in self._adapters.get(rep.name, {}) for rep in entry.spec.replicas)]

    def lora_key(self, pool: PoolName, name: str) -> LoraKey | None:
        """The key ``pool``'s engines hash adapter ``name`` with: its name and the path most
        of the pool's replicas loaded it from (ties: the smaller path); None when no
        replica of ``pool`` lists it. Replicas that loaded it from another path hash it
        differently, so ``route`` never sends them the adapter's requests."""
        paths: Counter[str] = Counter(
            self._adapters[rep.name][name] for rep in self._pool(pool).spec.replicas
            if name in self._adapters.get(rep.name, {}))
        if not paths:
            return None
        path = min(paths, key=lambda p: (-paths[p], p))
        return LoraKey(name, path)

    def _adapter_fits(self, replica: ReplicaId, name: str) -> bool:
        """Adapter ``name`` runs on ``replica`` without waiting for a slot: it is already
        there (running, waiting, or sent by this router), or a slot is free."""
        slots = self._slots.get(replica, AdapterSlots())
        mine = self._adapter_in_flight.get(replica, Counter())
        if name in slots.running or name in slots.waiting or mine[name] > 0:
            return True
        if slots.max_lora is None:
            return True
        busy = slots.running | {n for n, count in mine.items() if count > 0}
        return len(busy) < slots.max_lora

    def _release_adapter(self, request_id: RequestId) -> None:
        held = self._adapter_of.pop(request_id, None)
        if held is None:
            return
        counts = self._adapter_in_flight.get(held[0])
        if counts is not None and counts[held[1]] > 0:
            counts[held[1]] -= 1

    def set_identity(self, replica: ReplicaId, identity: ModelIdentity) -> IdentityChange | None:
        """Record the weights ``replica`` runs (``core/versions.py``). When they differ from
        the ones known before, its index entries and learned rates are dropped at once:
        they describe a cache and a speed of weights it no longer runs."""
        before = self.versions.version(replica)
        change = self.versions.observe(replica, identity)
        if before != identity.version:
            counts = self._pool_versions.setdefault(self._pool_of[replica], {})
            if before is not None:
                counts[before] -= 1
                if not counts[before]:
                    del counts[before]
            counts[identity.version] = counts.get(identity.version, 0) + 1
        if change is not None:
            self.index.clear_replica(replica)
            self.approx_index.clear_replica(replica)
            if self.recency is not None:
                self.recency.clear(replica)
            self.load.forget_learned(replica)
        return change

    def single_version(self, pool: PoolName) -> str | None:
        """The version every replica of ``pool`` with a known identity runs, when they all
        run one (O(1): the walk asks on every request)."""
        counts = self._pool_versions.get(pool)
        if not counts or len(counts) != 1:
            return None
        return next(iter(counts))

    def cached_tokens_on(self, replica: ReplicaId, request: RouteRequest) -> int:
        """The prefix tokens of ``request`` the index says ``replica`` holds (any medium),
        hashed with ``replica``'s own pool's hashing; 0 when the request has no exact
        tokens. What a session leaves behind when it moves (a scenario's recompute bill)."""
        if request.prompt_token_ids is None:
            return 0
        pool = self._pool(self._pool_of[replica])
        if pool.spec.approximate:
            return 0
        hashes = pool.hasher.wire_hashes(request.prompt_token_ids,
                                         cache_salt=request.cache_salt, lora=request.lora)
        held = self.index.match(hashes, request.scope).get(replica)
        if held is None:
            return 0
        cap = max(0, (request.num_prompt_tokens - 1) // pool.spec.block_size)
        return min(held.num_blocks, cap) * pool.spec.block_size

    def on_engine_metrics(self, replica: ReplicaId, *, running: int | None,
                          waiting: int | None, kv_usage: float | None,
                          kv_capacity_tokens: int | None = None) -> None:
        self.load.on_engine_metrics(replica, running=running, waiting=waiting, kv_usage=kv_usage,
                                    kv_capacity_tokens=kv_capacity_tokens)

    # -- routing --------------------------------------------------------------------------

    def block_hashes(self, request: RouteRequest) -> tuple[tuple[WireHash, ...], bool]:
        """The request's block hashes and whether they are approximate (text chunks)."""
        entry = self._pool(request.pool)
        if entry.spec.approximate or entry.drifting or request.prompt_token_ids is None:
            return tuple(text_chunk_hashes(request.routing_text)), True
        return self._exact_hashes(entry, request), False

    def _exact_hashes(self, entry: _Pool, request: RouteRequest) -> tuple[WireHash, ...]:
        assert request.prompt_token_ids is not None
        if request.block_hashes is not None:
            return tuple(request.block_hashes)
        # One call site for every exact prompt: whatever else comes to enter the hash must be
        # passed here, where SessionChains makes it part of its reuse check (or bypasses).
        session = (None if request.session_id is None
                   else (request.scope, request.pool, request.session_id))
        hashes = self.chains.wire_hashes(session, entry.hasher, request.prompt_token_ids,
                                         cache_salt=request.cache_salt, lora=request.lora)
        return tuple(hashes)

    def exact_cached_tokens(self, request: RouteRequest, replica: ReplicaId) -> int | None:
        """What the exact index says ``replica`` caches of ``request``'s prompt, in tokens
        (GPU, CPU, storage and predicted blocks alike, capped below the last token as vLLM
        caps hits), whatever the pool routes on now: the drift alarm's shadow prediction.
        None when the pool cannot hash exactly (hashing unknown) or the ids are unknown.
        """
        entry = self._pool(request.pool)
        if entry.spec.approximate or request.prompt_token_ids is None:
            return None
        if replica in self._no_prefix_caching:
            return 0
        hashes = self._exact_hashes(entry, request)
        held = self.index.match(hashes, request.scope).get(replica, NO_MATCH)
        size = entry.spec.block_size
        n = request.num_prompt_tokens
        cap = ((n - 1) // size) * size if n > 0 else 0
        return min(held.num_blocks * size, cap)

    def route(self, request: RouteRequest) -> RoutingDecision:
        """Choose a replica for ``request`` and record the choice (load, predictions).

        Raises:
            NoEligibleReplica: every replica of the pool is unhealthy or excluded.
            ScopeError: the request carries no valid tenant scope.
        """
        entry = self._pool(request.pool)
        hashes, approximate = self.block_hashes(request)
        index = self.approx_index if approximate else self.index
        matches = index.match(hashes, request.scope)
        now = self._clock.now()
        snapshot, healthy, exclude = self.load.snapshot, entry.healthy, request.exclude
        no_caching = self._no_prefix_caching
        session = self._session_key(request)
        candidates = [
            Candidate(rep.name, snapshot(rep.name, now, session),
                      NO_MATCH if no_caching and rep.name in no_caching
                      else matches.get(rep.name, NO_MATCH))
            for rep in entry.spec.replicas
            if rep.name in healthy and rep.name not in exclude
        ]
        lora = request.lora
        if lora is not None and candidates:
            candidates = [c for c in candidates
                          if self._adapters.get(c.replica, {}).get(lora.name) == lora.path]
            if not candidates:
                raise NoEligibleReplica(
                    f"no healthy replica in pool {request.pool!r} serves LoRA adapter "
                    f"{lora.name!r} loaded from {lora.path!r} (excluded: "
                    f"{sorted(request.exclude)}); load it on the engines (--lora-modules "
                    f"{lora.name}=<path>) or check their /v1/models"
                )
            roomy = [c for c in candidates if self._adapter_fits(c.replica, lora.name)]
            candidates = roomy or candidates
        if not candidates:
            raise NoEligibleReplica(
                f"no healthy replica in pool {request.pool!r} for request {request.request_id} "
                f"(excluded: {sorted(request.exclude)}); check the engines' /health"
            )
        policy_input = PolicyInput(
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            block_size=APPROX_CHUNK_CHARS // 4 if approximate else entry.spec.block_size,
            block_hashes=hashes,
            expected_output_tokens=request.expected_output_tokens,
            predicted_output_tokens=request.predicted_output_tokens,
            decode_timing=entry.spec.decode_timing,
            now_s=now,
            session_id=request.session_id,
            routing_text=request.routing_text if entry.policy.needs_text else "",
            preferred_replica=request.preferred_replica,
        )
        disagg = entry.spec.disagg
        prefill: ReplicaId | None = None
        prefill_cached = 0
        refusal: GateRefusal | None = None
        if disagg is None:
            selection = entry.policy.select(policy_input, candidates)
        else:
            roles = {rep.name: rep.role for rep in entry.spec.replicas}
            if request.expected_output_tokens <= 1:  # a warm-up is a prefill: never split
                disagg = replace(disagg, mode="never")
            try:
                split = choose_split(entry.policy, policy_input, candidates, roles, disagg,
                                     self._may_pair if self.versions.known else None)
            except ValueError as exc:
                raise NoEligibleReplica(
                    f"pool {request.pool!r}: {exc} for request {request.request_id} "
                    f"(excluded: {sorted(request.exclude)}); check the decode engines' "
                    "/health") from exc
            selection, prefill, prefill_cached = (split.selection, split.prefill,
                                                  split.prefill_cached_tokens)
            if split.refused is not None:
                refusal = self._pair_refusal(*split.refused, split.refused_tokens)
        decision = RoutingDecision(
            request=request,
            replica=selection.replica,
            ranking=selection.ranking,
            expected_cached_tokens=selection.expected_cached_tokens.get(selection.replica, 0),
            block_hashes=hashes,
            approximate=approximate,
            reason=selection.reason,
            policy=entry.policy.name,
            scores=selection.scores,
            cached_by_replica=selection.expected_cached_tokens,
            prefill_replica=prefill,
            prefill_cached_tokens=prefill_cached,
            gate_refusal=refusal,
        )
        self._commit(decision, entry, session, matches.get(selection.replica, NO_MATCH))
        if prefill is not None:
            self._commit_prefill(decision, entry, matches.get(prefill, NO_MATCH))
        return decision

    def _may_pair(self, prefill: ReplicaId, decode: ReplicaId) -> bool:
        """May ``decode`` decode the KV ``prefill`` computes? Same weights: yes (native);
        other weights: only with a current passing ``cross-engine`` verdict; an identity not
        read yet on either side: no (unproven)."""
        a, b = self.versions.version(decode), self.versions.version(prefill)
        if a is None or b is None:
            return False
        return self.verdicts.allows(a, b, PD_PATH).allowed

    def _pair_refusal(self, prefill: ReplicaId, decode: ReplicaId,
                      tokens: int) -> GateRefusal:
        a = self.versions.version(decode)
        b = self.versions.version(prefill)
        if a is None or b is None:
            return GateRefusal(PD_PATH, "none", a or "?", b or "?",
                               f"{prefill} -> {decode}: a replica's identity is not read yet",
                               tokens)
        ruling = self.verdicts.allows(a, b, PD_PATH)
        return GateRefusal(PD_PATH, ruling.status, a, b,
                           f"{prefill} -> {decode}: {ruling.reason}", tokens)

    def colocate(self, decision: RoutingDecision) -> RoutingDecision:
        """A split whose prefill failed, colocated on its decode replica: the prefill's load
        released there, the decode replica charged with the whole prefill."""
        assert decision.prefill_replica is not None, "colocate() is for a split decision"
        self.prefill_done(decision)
        self.on_complete(decision.replica, decision.request.request_id)
        moved = replace(decision, prefill_replica=None, prefill_cached_tokens=0,
                        reason="colocated")
        self._commit(moved, self._pool(decision.request.pool), self._session_key(moved.request))
        return moved

    def prefill_done(self, decision: RoutingDecision) -> None:
        """The prefill half of a split ended (answered or failed): release its load."""
        if decision.prefill_replica is not None:
            self.on_complete(decision.prefill_replica, decision.prefill_request_id)

    def reroute(self, decision: RoutingDecision, failed: ReplicaId) -> RoutingDecision | None:
        """Move a request that failed on ``failed`` before its first byte to the next replica.

        Returns ``None`` when the ranking has no other healthy replica left.
        """
        self.load.on_complete(failed, decision.request.request_id)
        if self.announce is not None:
            self.announce(Done(decision.request.request_id, failed))
        self._release_adapter(decision.request.request_id)
        entry = self._pool(decision.request.pool)
        tried = decision.request.exclude | {failed}
        lora = decision.request.lora
        for replica in decision.ranking:
            if replica in tried or replica not in entry.healthy:
                continue
            if lora is not None and self._adapters.get(replica, {}).get(lora.name) != lora.path:
                continue
            request = replace(decision.request, exclude=tried)
            moved = RoutingDecision(
                request=request,
                replica=replica,
                ranking=decision.ranking,
                expected_cached_tokens=decision.cached_by_replica.get(replica, 0),
                block_hashes=decision.block_hashes,
                approximate=decision.approximate,
                reason="retry",
                policy=decision.policy,
                scores=decision.scores,
                cached_by_replica=decision.cached_by_replica,
            )
            self._commit(moved, entry, self._session_key(request))
            return moved
        return None

    def on_first_token(self, replica: ReplicaId, request_id: RequestId, *,
                       learn: bool = True) -> None:
        """The request's first token on ``replica``; ``learn=False`` when its time since
        dispatch is not a sample of that replica's prefill rate (a split's decode half: it
        waited for another replica's prefill and the transfer). Peers are told the rate
        sample learned here, to learn it too (``core/peers.py``)."""
        sample = self.load.on_first_token(replica, request_id, now_s=self._clock.now(),
                                          learn=learn)
        if self.announce is not None:
            self.announce(FirstToken(request_id, replica, sample))

    def on_complete(self, replica: ReplicaId, request_id: RequestId, *,
                    output_tokens: int | None = None) -> None:
        """The request ended; ``output_tokens`` (the answer's count, when known) teaches the
        replica's inter-token factor."""
        itl_sample = self.load.on_complete(replica, request_id, now_s=self._clock.now(),
                                           output_tokens=output_tokens)
        if self.announce is not None:
            self.announce(Done(request_id, replica, output_tokens, itl_sample))
        self._release_adapter(request_id)

    def load_beside(self, replica: ReplicaId, request: RouteRequest) -> ReplicaLoad:
        """``replica``'s load now as ``request`` would be scored there: its own session left
        out of the sessions resting there (spread-ahead reads a session's home this way)."""
        return self.load.snapshot(replica, self._clock.now(), self._session_key(request))

    def rest_on_copy(self, request: RouteRequest, replica: ReplicaId) -> bool:
        """``request``'s session rests on ``replica`` from now on: a spread-ahead copy of its
        context is on its way there (``LoadTracker.move_resting``)."""
        session = self._session_key(request)
        return session is not None and self.load.move_resting(session, replica)

    # -- internals ------------------------------------------------------------------------

    def _commit_prefill(self, decision: RoutingDecision, entry: _Pool,
                        held: PrefixMatch) -> None:
        """Record a split's prefill half on its prefill replica: its prefill as load (one
        output token), and the blocks it will store as predicted entries there."""
        request = decision.request
        prefill = decision.prefill_replica
        assert prefill is not None
        prefill_tokens = max(1, request.num_prompt_tokens - decision.prefill_cached_tokens)
        self.load.on_dispatch(
            prefill, decision.prefill_request_id, prefill_tokens=prefill_tokens,
            prompt_tokens=request.num_prompt_tokens, expected_output_tokens=1,
            now_s=self._clock.now(), predicted_output_tokens=1)
        written: tuple[WireHash, ...] = ()
        if (prefill not in self._no_prefix_caching and decision.block_hashes
                and (entry.policy.uses_predicted or decision.approximate)):
            index = self.approx_index if decision.approximate else self.index
            other = held.num_cpu_blocks + held.num_storage_blocks + held.num_predicted_blocks
            confirmed = 0 if other else held.num_gpu_blocks
            written = decision.block_hashes[confirmed:]
            index.add_predicted(prefill, written, request.scope)
        if self.announce is not None:  # sibling routers count the prefill half too
            tenant = request.scope.tenant if type(request.scope) is TenantScope else None
            self.announce(Placed(
                decision.prefill_request_id, prefill, prefill_tokens,
                request.num_prompt_tokens, 1, 1, None, tenant,
                written if tenant is not None else (), decision.approximate))

    def _commit(self, decision: RoutingDecision, entry: _Pool, session: str | None,
                held: PrefixMatch = NO_MATCH) -> None:
        """Record the dispatch: load, and predicted entries for the blocks the replica will
        store.

        ``session`` is ``_session_key(decision.request)``, computed once by the caller (a
        keyed pseudonym when routers share sessions: ``route`` has it already).

        ``held`` is how the chosen replica already holds the request's leading blocks. When
        that whole run is on the engine's GPU (confirmed by its events, no prediction, no
        offloaded block the request would bring back), those blocks are not predicted again:
        a request sharing a long cached prefix writes (and later expires) entries only for
        its new blocks, most of the index work per request. Predicting them would change no
        lookup while they stay: a confirmed block already counts for that replica, at a
        better medium; if the engine evicts one, it stores it again when this request
        recomputes it, and says so.
        """
        request = decision.request
        prefill_tokens = (1 if decision.prefill_replica is not None  # a split: one token
                          else max(1, request.num_prompt_tokens
                                   - decision.expected_cached_tokens))
        self.load.on_dispatch(
            decision.replica,
            request.request_id,
            prefill_tokens=prefill_tokens,
            prompt_tokens=request.num_prompt_tokens,
            expected_output_tokens=request.expected_output_tokens,
            now_s=self._clock.now(),
            predicted_output_tokens=request.predicted_output_tokens,
            session=session,
        )
        if request.lora is not None:
            self._release_adapter(request.request_id)
            self._adapter_in_flight.setdefault(decision.replica, Counter())[request.lora.name] += 1
            self._adapter_of[request.request_id] = (decision.replica, request.lora.name)
        written: tuple[WireHash, ...] = ()
        if (decision.replica not in self._no_prefix_caching  # such an engine reuses nothing
                and decision.block_hashes
                and (entry.policy.uses_predicted or decision.approximate)):
            index = self.approx_index if decision.approximate else self.index
            other = held.num_cpu_blocks + held.num_storage_blocks + held.num_predicted_blocks
            confirmed = 0 if other else held.num_gpu_blocks
            written = decision.block_hashes[confirmed:]
            index.add_predicted(decision.replica, written, request.scope)
        if self.announce is not None:
            tenant = request.scope.tenant if type(request.scope) is TenantScope else None
            self.announce(Placed(
                request.request_id, decision.replica, prefill_tokens,
                request.num_prompt_tokens, request.expected_output_tokens,
                request.predicted_output_tokens, session, tenant,
                written if tenant is not None else (), decision.approximate))

    def _session_key(self, request: RouteRequest) -> str | None:
        """The load tracker's key for ``request``'s session (None: no session). Two tenants'
        sessions of one id are two sessions. A pseudonym when ``session_names`` is set."""
        if request.session_id is None:
            return None
        key = f"{getattr(request.scope, 'tenant', '')}\x1f{request.session_id}"
        names = self.session_names
        return key if names is None else names.session(key)

    def _pool(self, name: PoolName) -> _Pool:
        entry = self._pools.get(name)
        if entry is None:
            raise ConfigError(f"unknown pool {name!r}; known pools: {sorted(self._pools)}")
        return entry
