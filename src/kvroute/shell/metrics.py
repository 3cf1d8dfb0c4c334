"""The router's own Prometheus metrics.

Owns one ``prometheus_client.CollectorRegistry`` per ``RouterMetrics`` instance and the
names, types and labels of every series kvroute exports. It never touches the process-wide
default registry: two routers (or a router and a test) in one process must not share or
double-register series, and ``build_app`` passes the instance it wants (no singleton).

Every method is a cheap, synchronous update; none does I/O. ``render()`` produces the body
and content type for ``GET /metrics``.

Series (all prefixed ``kvroute_``):

=====================================  =========  ==========================================
name                                   type       labels
=====================================  =========  ==========================================
decisions_total                        counter    pool, replica, reason, approximate
prompt_tokens_total                    counter    pool
cached_tokens_total                    counter    pool (expected cached prefix tokens)
routing_latency_seconds                histogram  pool
upstream_errors_total                  counter    replica, kind
retries_total                          counter    replica
admission_rejects_total                counter    reason
kv_event_batches_applied_total         counter    replica
kv_event_gaps_total                    counter    replica
kv_event_replays_total                 counter    replica
kv_event_resets_total                  counter    replica
kv_event_malformed_total               counter    replica
index_entries / index_hashes           gauge      -
pool_approximate                       gauge      pool (1 = routing on text chunks)
tokenizer_mode                         gauge      pool, mode (1 for the pool's current mode)
tokenize_total                         counter    pool, outcome
discovery_total                        counter    replica, outcome
replica_healthy                        gauge      replica
pool_window_tokens                     gauge      pool
state_errors_total                     counter    backend, op
warm_total                             counter    outcome, reason
escalations_total                      counter    from_pool, to_pool, kind
cut_short_total                        counter    pool
=====================================  =========  ==========================================

NOTE: label values come from operator config (pool and replica names) or from small fixed
vocabularies chosen by the callers (reasons, kinds, outcomes); request data never becomes a
label, so cardinality stays bounded by the fleet's size.
"""

from __future__ import annotations

from typing import Any, Final

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["ROUTING_LATENCY_BUCKETS", "TOKENIZER_MODES", "RouterMetrics"]

ROUTING_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1,
)  # fmt: skip
"""Routing is pure CPU work (hashing plus an index lookup): 10 µs to 100 ms covers it."""

TOKENIZER_MODES: Final = ("engine", "local", "approximate")


class RouterMetrics:
    """kvroute's Prometheus series, in a registry of their own.

    Invariant: every series is registered once, in ``__init__``; the methods only update.

    Args:
        namespace: prefix of every series name (``kvroute``).
    """

    def __init__(self, namespace: str = "kvroute") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Label children of the per-request series, by label values (see ``decision``).
        self._decision_children: dict[tuple[str, str, str, bool], tuple[Any, Any, Any, Any]] = {}
        self._tokenize_children: dict[tuple[str, str], Any] = {}
        r = self.registry
        ns = namespace
        self._ns = namespace
        self._decisions = Counter(
            "decisions", "Routing decisions by chosen replica and reason.",
            ["pool", "replica", "reason", "approximate"], namespace=ns, registry=r,
        )
        self._prompt_tokens = Counter(
            "prompt_tokens", "Prompt tokens of routed requests (exact or estimated).",
            ["pool"], namespace=ns, registry=r,
        )
        self._cached_tokens = Counter(
            "cached_tokens", "Prompt tokens expected to be served from the chosen replica's "
            "prefix cache.", ["pool"], namespace=ns, registry=r,
        )
        self._routing_latency = Histogram(
            "routing_latency_seconds", "Time spent choosing a replica (tokenize excluded).",
            ["pool"], namespace=ns, registry=r, buckets=ROUTING_LATENCY_BUCKETS,
        )
        self._upstream_errors = Counter(
            "upstream_errors", "Failed upstream calls by replica and kind.",
            ["replica", "kind"], namespace=ns, registry=r,
        )
        self._retries = Counter(
            "retries", "Requests retried on another replica after this one failed.",
            ["replica"], namespace=ns, registry=r,
        )
        self._admission_rejects = Counter(
            "admission_rejects", "Requests refused before routing, by reason.",
            ["reason"], namespace=ns, registry=r,
        )
        self._events_applied = Counter(
            "kv_event_batches_applied", "KV-event batches applied to the index.",
            ["replica"], namespace=ns, registry=r,
        )
        self._events_gaps = Counter(
            "kv_event_gaps", "Sequence gaps detected in a replica's KV-event stream.",
            ["replica"], namespace=ns, registry=r,
        )
        self._events_replays = Counter(
            "kv_event_replays", "Replay requests sent to a replica's replay socket.",
            ["replica"], namespace=ns, registry=r,
        )
        self._events_resets = Counter(
            "kv_event_resets", "Times a replica's index entries were dropped as untrustworthy.",
            ["replica"], namespace=ns, registry=r,
        )
        self._events_malformed = Counter(
            "kv_event_malformed", "KV-event messages that could not be decoded.",
            ["replica"], namespace=ns, registry=r,
        )
        self._index_entries = Gauge(
            "index_entries", "(replica, block hash) entries in the prefix index.",
            namespace=ns, registry=r,
        )
        self._index_hashes = Gauge(
            "index_hashes", "Distinct block hashes in the prefix index.",
            namespace=ns, registry=r,
        )
        self._approximate = Gauge(
            "pool_approximate", "1 if the pool routes approximately (no exact block hashes: "
            "block size/hash algorithm not read yet, or no tokenizer).",
            ["pool"], namespace=ns, registry=r,
        )
        self._tokenizer_mode = Gauge(
            "tokenizer_mode", "The pool's prompt tokenizer mode (1 for the current mode).",
            ["pool", "mode"], namespace=ns, registry=r,
        )
        self._tokenize = Counter(
            "tokenize", "Prompt tokenizations by outcome.",
            ["pool", "outcome"], namespace=ns, registry=r,
        )
        self._piece_cache = Gauge(
            "token_piece_cache", "A local tokenizer's cache of prompt pieces: enabled (0/1; "
            "it turns itself off on any disagreement with whole-prompt tokenization), hits, "
            "misses, cached_tokens, mismatches (since start).",
            ["pool", "stat"], namespace=ns, registry=r,
        )
        self._discovery = Counter(
            "discovery", "Discovery probes by replica and outcome.",
            ["replica", "outcome"], namespace=ns, registry=r,
        )
        self._replica_healthy = Gauge(
            "replica_healthy", "1 if the replica is in routing.",
            ["replica"], namespace=ns, registry=r,
        )
        self._pool_window = Gauge(
            "pool_window_tokens", "Smallest max_model_len among the pool's healthy replicas.",
            ["pool"], namespace=ns, registry=r,
        )
        self._state_errors = Counter(
            "state_errors", "Shared-state operations that failed and degraded to no pin / "
            "no warm.", ["backend", "op"], namespace=ns, registry=r,
        )
        self._warm = Counter(
            "warm", "Warm-ahead requests by outcome (fired, skipped, failed, hit, chunk).",
            ["outcome", "reason"], namespace=ns, registry=r,
        )
        self._escalations = Counter(
            "escalations", "Requests moved to a larger tier.",
            ["from_pool", "to_pool", "kind"], namespace=ns, registry=r,
        )
        self._cut_short = Counter(
            "cut_short", "Responses the engine cut short (finish_reason length with fewer "
            "tokens than asked).", ["pool"], namespace=ns, registry=r,
        )

    # -- the request path -------------------------------------------------------------------

    def decision(
        self,
        pool: str,
        replica: str,
        reason: str,
        cached_tokens: int,
        prompt_tokens: int,
        routing_latency_s: float,
        approximate: bool,
    ) -> None:
        """Record one routing decision.

        NOTE: ``labels(...)`` takes a lock and validates its arguments on every call; the
        children are kept here per label tuple instead (the label values are config names
        and policy reasons, a small bounded set), which halves this method's cost.
        """
        key = (pool, replica, reason, approximate)
        children = self._decision_children.get(key)
        if children is None:
            children = self._decision_children[key] = (
                self._decisions.labels(pool, replica, reason, "true" if approximate else "false"),
                self._prompt_tokens.labels(pool),
                self._cached_tokens.labels(pool),
                self._routing_latency.labels(pool),
            )
        children[0].inc()
        children[1].inc(max(prompt_tokens, 0))
        children[2].inc(max(cached_tokens, 0))
        children[3].observe(routing_latency_s)

    def upstream_error(self, replica: str, kind: str) -> None:
        self._upstream_errors.labels(replica, kind).inc()

    def retry(self, replica: str) -> None:
        """Count a retry away from ``replica`` (the replica that failed)."""
        self._retries.labels(replica).inc()

    def admission_reject(self, reason: str) -> None:
        self._admission_rejects.labels(reason).inc()

    # -- KV events and the index ------------------------------------------------------------

    def events(
        self,
        replica: str,
        *,
        applied: int = 0,
        gaps: int = 0,
        replays: int = 0,
        resets: int = 0,
        malformed: int = 0,
    ) -> None:
        """Add to a replica's event-stream counters (each argument is an increment >= 0)."""
        for counter, amount in (
            (self._events_applied, applied),
            (self._events_gaps, gaps),
            (self._events_replays, replays),
            (self._events_resets, resets),
            (self._events_malformed, malformed),
        ):
            if amount < 0:
                raise ValueError(f"event counters only go up; got {amount} for {replica!r}")
            if amount:
                counter.labels(replica).inc(amount)

    def set_index_size(self, entries: int, hashes: int) -> None:
        self._index_entries.set(entries)
        self._index_hashes.set(hashes)

    # -- fleet knowledge --------------------------------------------------------------------

    def set_approximate(self, pool: str, on: bool) -> None:
        self._approximate.labels(pool).set(1 if on else 0)

    def approximate(self, pool: str) -> bool | None:
        """The current value of ``pool_approximate`` for ``pool`` (None if never set)."""
        value = self.value(f"{self._ns}_pool_approximate", {"pool": pool})
        return None if value is None else value == 1

    def set_tokenizer_mode(self, pool: str, mode: str) -> None:
        """Export ``pool``'s tokenizer mode (one of ``TOKENIZER_MODES``)."""
        if mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer mode must be one of {TOKENIZER_MODES}, got {mode!r}")
        for known in TOKENIZER_MODES:
            self._tokenizer_mode.labels(pool, known).set(1 if known == mode else 0)

    def tokenize(self, pool: str, outcome: str) -> None:
        key = (pool, outcome)
        child = self._tokenize_children.get(key)
        if child is None:
            child = self._tokenize_children[key] = self._tokenize.labels(pool, outcome)
        child.inc()

    def set_token_piece_cache(self, pool: str, *, enabled: bool, hits: int, misses: int,
                              cached_tokens: int, mismatches: int) -> None:
        """Export a local tokenizer's piece-cache state (``token_segments.SegmentEncoder``)."""
        for stat, value in (("enabled", 1 if enabled else 0), ("hits", hits),
                            ("misses", misses), ("cached_tokens", cached_tokens),
                            ("mismatches", mismatches)):
            self._piece_cache.labels(pool, stat).set(value)

    def discovery(self, replica: str, outcome: str) -> None:
        self._discovery.labels(replica, outcome).inc()

    def set_replica_healthy(self, replica: str, healthy: bool) -> None:
        self._replica_healthy.labels(replica).set(1 if healthy else 0)

    def set_pool_window(self, pool: str, window: int | None) -> None:
        """Export the pool's window; ``None`` (unknown) is exported as 0."""
        self._pool_window.labels(pool).set(window or 0)

    def state_error(self, backend: str, op: str) -> None:
        self._state_errors.labels(backend, op).inc()

    # -- warm-ahead and tiers ---------------------------------------------------------------

    def warm(self, outcome: str, reason: str | None = None) -> None:
        """Count a warm-ahead outcome: ``fired``, ``skipped`` (with a reason), ``failed``,
        ``hit``, ``chunk`` (one per request of a warm-up sent in prefix chunks)."""
        self._warm.labels(outcome, reason or "").inc()

    def escalation(self, from_pool: str, to_pool: str, kind: str) -> None:
        self._escalations.labels(from_pool, to_pool, kind).inc()

    def cut_short(self, pool: str) -> None:
        self._cut_short.labels(pool).inc()

    # -- exposition -------------------------------------------------------------------------

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's value by its full name (e.g. ``kvroute_tokenize_total``), or None."""
        return self.registry.get_sample_value(name, labels or {})

    def render(self) -> tuple[bytes, str]:
        """The ``/metrics`` body (Prometheus text format 0.0.4) and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
