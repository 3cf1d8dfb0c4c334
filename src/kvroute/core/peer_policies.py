"""The peers' replica-selection policies, reimplemented for side-by-side comparison.

Each follows the peer's published algorithm and defaults as recorded in
``docs/reference/peer-routers.md`` (versions: sglang-router 0.3.2, vllm-router 0.1.17, Dynamo 2026
config, production-stack main of 2026-08, llm-d chart defaults). Where a peer's behaviour
depends on list order (first minimum wins), that is kept on purpose: it is part of what the
benchmarks must reproduce (sequential cold requests all landing on the first worker).

Names (selectable in config and in ``kvroute bench``): ``round_robin``, ``random``,
``least_loaded``, ``power_of_two``, ``session``, ``prefixaware``, ``cache_aware``,
``dynamo``, ``llmd``.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Sequence

import xxhash

from kvroute.core.errors import ConfigError
from kvroute.core.policy import (
    Candidate,
    KvrouteCostPolicy,
    Policy,
    PolicyInput,
    Selection,
    cached_tokens_for,
    rank_by_cost,
)
from kvroute.core.text_prefix import CharRadixTree, ChunkHashTrie
from kvroute.core.types import ReplicaId


def _rest_by_load(
    chosen: ReplicaId, candidates: Sequence[Candidate], rng: random.Random
) -> tuple[ReplicaId, ...]:
    """``chosen`` first, then the others by in-flight count (the retry order)."""
    others = [c for c in candidates if c.replica != chosen]
    keyed = sorted(others, key=lambda c: (c.load.num_in_flight, rng.random()))
    return (chosen, *(c.replica for c in keyed))


class RoundRobinPolicy:
    """Cycle through the candidates in list order."""

    name = "round_robin"
    needs_text = False
    uses_predicted = False

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._next = 0

    def select(self, request: PolicyInput, candidates: Sequence[Candidate]) -> Selection:
        index = self._next % len(candidates)
        self._next += 1
        ranking = tuple(c.replica for c in candidates[index:]) + tuple(
            c.replica for c in candidates[:index]
        )
        return Selection(ranking=ranking, reason="round_robin")

    def forget_replica(self, replica: ReplicaId) -> None:
        """No per-replica state."""


class RandomPolicy:
    """Uniformly at random."""

    name = "random"
    needs_text = False
    uses_predicted = False

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, request: PolicyInput, candidates: Sequence[Candidate]) -> Selection:
        order = [c.replica for c in candidates]
        self._rng.shuffle(order)
        return Selection(ranking=tuple(order), reason="random")

    def forget_replica(self, replica: ReplicaId) -> None:
        """No per-replica state."""


class LeastLoadedPolicy:
    """Fewest requests in flight; ties at random (the best plain load balancer here)."""

    name = "least_loaded"
    needs_text = False
    uses_predicted = False

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, request: PolicyInput, candidates: Sequence[Candidate]) -> Selection:
        loads = {c.replica: float(c.load.num_in_flight) for c in candidates}
        return Selection(ranking=rank_by_cost(loads, candidates, self._rng), scores=loads,
                         reason="least_loaded")

    def forget_replica(self, replica: ReplicaId) -> None:
        """No per-replica state."""


class PowerOfTwoPolicy:
    """Two random candidates, the one with fewer requests in flight (SGLang ``power_of_two``)."""

    name = "power_of_two"
    needs_text = False
    uses_predicted = False

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, request: PolicyInput, candidates: Sequence[Candidate]) -> Selection:
        if len(candidates) == 1:
            return Selection(ranking=(candidates[0].replica,), reason="power_of_two")
        a, b = self._rng.sample(list(candidates), 2)
        if (b.load.num_in_flight, self._rng.random()) < (a.load.num_in_flight, 0.5):
            a = b
        return Selection(ranking=_rest_by_load(a.replica, candidates, self._rng),
                         reason="power_of_two")

    def forget_replica(self, replica: ReplicaId) -> None:
        """No per-replica state."""


class SessionPolicy:
    """Session affinity by rendezvous hashing of the session id (LiteLLM's scheme).

    Requests without a session go to the least-loaded replica (production-stack's fallback).
    Rendezvous hashing moves only the sessions of a replica that leaves.
    """

    name = "session"
    needs_text = False
    uses_predicted = False

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, request: PolicyInput, candidates: Sequence[Candidate]) -> Selection:
        if request.session_id is None:
            loads = {c.replica: float(c.load.num_in_flight) for c in candidates}
            return Selection(ranking=rank_by_cost(loads, candidates, self._rng),
                             reason="no_session")
        key = request.session_id.encode("utf-8")
        weights = {
            c.replica: float(xxhash.xxh64_intdigest(key + b"\x00" + c.replica.encode("utf-8")))
            for c in candidates
        }
        ranking = tuple(sorted(weights, key=lambda r: -weights[r]))
        pinned = request.preferred_replica
        if pinned is not None and pinned in weights and ranking[0] != pinned:
            # A live pin (shared by every router process) keeps the session where it already
            # is, even if the rendezvous order changed since (a replica came back).
            ranking = (pinned, *(r for r in ranking if r != pinned))
            return Selection(ranking=ranking, scores=weights, reason="pinned")
        return Selection(ranking=ranking, scores=weights, reason="session")

    def forget_replica(self, replica: ReplicaId) -> None:
        """Stateless: rendezvous hashing needs no table."""


class PrefixAwarePolicy:
    """vLLM production-stack ``prefixaware``: longest 128-char chunk chain, random among holders.

    No load term; a request matching nothing goes to a uniformly random endpoint (with
    ``min_match_chunks`` > 0, below it the least-loaded endpoint, as its QPS fallback).
    """

    name = "prefixaware"
    needs_text = True
    uses_predicted = False

    def __init__(self, rng: random.Random, *, chunk_chars: int = 128,
                 min_match_chunks: int = 0) -> None:
        self._rng = rng
        self._trie = ChunkHashTrie(chunk_chars)
        self.min_match_chunks = min_match_chunks

    def select(self, request: PolicyInput, candidates: Sequence[Candidate]) -> Selection:
        live = {c.replica for c in candidates}
        depth, holders = self._trie.longest_match(request.routing_text, live)
        if depth == 0 or depth < self.min_match_chunks:
            if self.min_match_chunks > 0:
                loads = {c.replica: float(c.load.num_in_flight) for c in candidates}
                chosen = rank_by_cost(loads, candidates, self._rng)[0]
            else:
                chosen = self._rng.choice([c.replica for c in candidates])
            reason = "no_match"
        else:
            chosen = self._rng.choice(sorted(holders))
            reason = "prefix"
        self._trie.insert(request.routing_text, chosen)
        return Selection(ranking=_rest_by_load(chosen, candidates, self._rng), reason=reason)

    def forget_replica(self, replica: ReplicaId) -> None:
        self._trie.remove_endpoint(replica)


class CacheAwarePolicy:
    """SGLang router 0.3.2 ``cache_aware`` (also vllm-router's, on token text).

    1. Imbalanced when ``max_load - min_load > balance_abs`` and ``max_load > balance_rel *
       min_load`` (loads are in-flight request counts): go to the least-loaded worker.
    2. Otherwise match the request text in the char radix tree; if the matched fraction is
       above ``cache_threshold``, go to the tenant recorded at the deepest matched node,
       else to the least-loaded worker.
    3. Insert the text for the chosen worker.
    Least-loaded ties go to the first worker in list order, as in 0.3.2. Eviction trims each
    worker to ``max_tree_chars`` every ``eviction_interval_s``.
    """

    name = "cache_aware"
    needs_text = True
    uses_predicted = False

    def __init__(
        self,
        rng: random.Random,
        *,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        eviction_interval_s: float = 60.0,
        max_tree_chars: int = 2**26,
    ) -> None:
        self._rng = rng
        self._tree = CharRadixTree()
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_chars = max_tree_chars
        self._last_eviction_s: float | None = None

    def select(self, request: PolicyInput, candidates: Sequence[Candidate]) -> Selection:
        now = request.now_s
        if self._last_eviction_s is None:
            self._last_eviction_s = now
        elif now - self._last_eviction_s >= self.eviction_interval_s:
            self._tree.evict(self.max_tree_chars)
            self._last_eviction_s = now
        loads = [c.load.num_in_flight for c in candidates]
        least = min(candidates, key=lambda c: c.load.num_in_flight)  # first minimum, as 0.3.2
        max_load, min_load = max(loads), min(loads)
        text = request.routing_text
        if max_load - min_load > self.balance_abs and max_load > self.balance_rel * min_load:
            chosen, reason = least.replica, "imbalance"
        else:
            matched, tenant = self._tree.match(text)
            live = {c.replica for c in candidates}
            ratio = matched / len(text) if text else 0.0
            if ratio > self.cache_threshold and tenant is not None and tenant in live:
                chosen, reason = tenant, "cache"
            else:
                chosen, reason = least.replica, "least_loaded"
        self._tree.insert(text, chosen, now)
        return Selection(ranking=_rest_by_load(chosen, candidates, self._rng), reason=reason)

    def forget_replica(self, replica: ReplicaId) -> None:
        self._tree.remove_tenant(replica)


class DynamoPolicy:
    """NVIDIA Dynamo's KV router cost (2026 config defaults), temperature 0.

    In blocks of ``B`` tokens, per worker:
    ``raw_prefill = active_prefill_tokens/B + ISL/B``;
    ``credit = credit·gpu + 0.75·host + 0.25·disk`` matched blocks;
    ``decode = active KV blocks + the request's blocks``;
    ``cost = prefill_load_scale · max(0, raw_prefill − credit) + decode``; argmin, random ties.
    Predicted (predict-on-route) entries are off by default, as in Dynamo.
    """

    name = "dynamo"
    needs_text = False

    def __init__(
        self,
        rng: random.Random,
        *,
        overlap_score_credit: float = 1.0,
        prefill_load_scale: float = 1.0,
        host_weight: float = 0.75,
        disk_weight: float = 0.25,
        predicted: bool = False,
    ) -> None:
        self._rng = rng
        self.overlap_score_credit = overlap_score_credit
        self.prefill_load_scale = prefill_load_scale
        self.host_weight = host_weight
        self.disk_weight = disk_weight
        self.uses_predicted = predicted

    def select(self, request: PolicyInput, candidates: Sequence[Candidate]) -> Selection:
        bs = request.block_size
        isl_blocks = request.num_prompt_tokens / bs
        costs: dict[ReplicaId, float] = {}
        cached: dict[ReplicaId, int] = {}
        for cand in candidates:
            m = cand.match
            device = m.num_gpu_blocks + (m.num_predicted_blocks if self.uses_predicted else 0)
            credit = (
                self.overlap_score_credit * device
                + self.host_weight * m.num_cpu_blocks
                + self.disk_weight * m.num_storage_blocks
            )
            raw_prefill = cand.load.outstanding_prefill_tokens / bs + isl_blocks
            decode = cand.load.active_kv_tokens / bs + isl_blocks
            costs[cand.replica] = self.prefill_load_scale * max(0.0, raw_prefill - credit) + decode
            cached[cand.replica] = int(min(credit * bs, max(0, request.num_prompt_tokens - 1)))
        return Selection(ranking=rank_by_cost(costs, candidates, self._rng),
                         expected_cached_tokens=cached, scores=costs, reason="cost")

    def forget_replica(self, replica: ReplicaId) -> None:
        """Stateless across requests."""


class LlmdPolicy:
    """llm-d's inference scheduler: weighted scorers and a max-score picker (chart defaults).

    ``prefix`` = matched blocks / total blocks (weight 3); ``queue`` = (maxQ − q)/(maxQ − minQ)
    over the engines' waiting counts, 1.0 when all equal (weight 2); ``kv`` = 1 − KV usage
    (weight 2). Ties at random.
    """

    name = "llmd"
    needs_text = False
    uses_predicted = False

    def __init__(self, rng: random.Random, *, prefix_weight: float = 3.0,
                 queue_weight: float = 2.0, kv_weight: float = 2.0) -> None:
        self._rng = rng
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight

    def select(self, request: PolicyInput, candidates: Sequence[Candidate]) -> Selection:
        total_blocks = max(1, len(request.block_hashes))
        queues = [float(c.load.engine_waiting or 0) for c in candidates]
        q_min, q_max = min(queues), max(queues)
        scores: dict[ReplicaId, float] = {}
        cached: dict[ReplicaId, int] = {}
        for cand, q in zip(candidates, queues):
            matched = cand.match.num_gpu_blocks + cand.match.num_cpu_blocks
            prefix = min(1.0, matched / total_blocks)
            queue = 1.0 if q_max == q_min else (q_max - q) / (q_max - q_min)
            kv = 1.0 - (cand.load.kv_usage or 0.0)
            scores[cand.replica] = (
                self.prefix_weight * prefix + self.queue_weight * queue + self.kv_weight * kv
            )
            cached[cand.replica] = int(
                cached_tokens_for(cand.match, request.num_prompt_tokens, request.block_size,
                                  predicted_credit=0.0)
            )
        ranking = rank_by_cost(scores, candidates, self._rng, lower_is_better=False)
        return Selection(ranking=ranking, expected_cached_tokens=cached, scores=scores,
                         reason="score")

    def forget_replica(self, replica: ReplicaId) -> None:
        """Stateless across requests."""


POLICY_FACTORIES: dict[str, Callable[..., Policy]] = {
    "kvroute": KvrouteCostPolicy,
    "round_robin": RoundRobinPolicy,
    "random": RandomPolicy,
    "least_loaded": LeastLoadedPolicy,
    "power_of_two": PowerOfTwoPolicy,
    "session": SessionPolicy,
    "prefixaware": PrefixAwarePolicy,
    "cache_aware": CacheAwarePolicy,
    "dynamo": DynamoPolicy,
    "llmd": LlmdPolicy,
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICY_FACTORIES)


def policy_parameters(name: str) -> dict[str, str]:
    """The parameters the policy called ``name`` takes: name -> type (``float``, ``int`` or
    ``bool``, as its constructor annotates it), in the constructor's order.

    Raises:
        ConfigError: unknown name.
    """
    factory = POLICY_FACTORIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown policy {name!r}; choose one of: {', '.join(POLICY_NAMES)}")
    return {
        p.name: p.annotation if isinstance(p.annotation, str) else p.annotation.__name__
        for p in inspect.signature(factory).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def make_policy(name: str, rng: random.Random, **params: float | bool) -> Policy:
    """Build the policy called ``name`` with optional parameter overrides.

    Raises:
        ConfigError: unknown name, a parameter that policy does not take (the message lists
            the ones it does), or a value the policy refuses.
    """
    known = policy_parameters(name)
    unknown = [key for key in params if key not in known]
    if unknown:
        raise ConfigError(
            f"policy {name!r} has no parameter {', '.join(map(repr, unknown))}; it takes "
            f"{', '.join(known) if known else 'no parameters'}"
        )
    try:
        return POLICY_FACTORIES[name](rng, **params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"policy {name!r} refused parameters {params}: {exc}") from exc
