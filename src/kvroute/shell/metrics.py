"""The router's own Prometheus metrics.

Owns one ``prometheus_client.CollectorRegistry`` per ``RouterMetrics`` instance and the
names, types and labels of every series kvroute exports. It never touches the process-wide
default registry: two routers (or a router and a test) in one process must not share or
double-register series, and ``build_app`` passes the instance it wants (no singleton).

Every method is a cheap, synchronous update; none does I/O. ``render()`` produces the body
and content type for ``GET /metrics``.

Counts are deferred: the methods called per request or per KV-event batch (``decision``,
``tokenize``, ``warm``, ``upstream_error``, ``retry``, ``admission_reject``, ``discovery``,
``state_error``, ``escalation``, ``cut_short``, ``events``, ``router_time``) only add to
plain Python numbers kept per label tuple, and the registry moves those pending amounts into
the prometheus_client series whenever it is read, so readers still see exact, current values
(why, and the invariants that make it exact: ``shell/deferred_counts.py``). Every update and
every read runs on the router's event loop. ``RouterMetrics()`` refuses to start if
prometheus_client's histogram internals, which the deferred histograms write through, changed.

Series (all prefixed ``kvroute_``):

=====================================  =========  ==========================================
name                                   type       labels
=====================================  =========  ==========================================
decisions_total                        counter    pool, replica, reason, approximate
prompt_tokens_total                    counter    pool
cached_tokens_total                    counter    pool (expected cached prefix tokens)
routing_latency_seconds                histogram  pool
router_time_seconds                    histogram  stage (before_engine, after_engine, total)
gc_pause_seconds                       histogram  generation (0, 1, 2: a full collection)
event_loop_lag_seconds                 histogram  - (how late the loop woke for a 20 ms timer)
upstream_errors_total                  counter    replica, kind
retries_total                          counter    replica
admission_rejects_total                counter    reason
kv_event_batches_applied_total         counter    replica
kv_event_gaps_total                    counter    replica
kv_event_replays_total                 counter    replica
kv_event_resets_total                  counter    replica
kv_event_malformed_total               counter    replica
kv_event_replaying                     gauge      replica (1 while a replay is under way)
kv_stream_up                           gauge      - (1: the durable KV-event stream is in use;
                                                  0: configured, NATS away; absent: not set up)
kv_stream_relay                        gauge      stat (this router's relay: published, resets,
                                                  failed, dropped, snapshots, snapshot_failures)
index_entries / index_hashes           gauge      -
pool_approximate                       gauge      pool (1 = routing on text chunks)
tokenizer_mode                         gauge      pool, mode (1 for the pool's current mode)
tokenizer_check                        gauge      pool, result (1 for the check's current result)
tokenize_total                         counter    pool, outcome
token_piece_cache                      gauge      pool, stat (a local tokenizer's piece cache)
discovery_total                        counter    replica, outcome
replica_healthy                        gauge      replica
pool_window_tokens                     gauge      pool
state_errors_total                     counter    backend, op
cluster                                gauge      stat (several routers: ``shell/cluster.py``)
cluster_info                           gauge      router_id (1; this router's id on the bus)
cluster_peer_seq                       gauge      peer (a peer router's last batch applied)
warm_total                             counter    outcome, reason
escalations_total                      counter    from_pool, to_pool, kind
cut_short_total                        counter    pool
prefix_divergence_block                histogram  route (first block no replica holds)
reasoning_tokens                       histogram  route (thinking tokens an answer reported)
(scenarios: recompute, moves, shadow   see ``shell/scenario_metrics.py``
warm, A/B arms, failover, versions)
=====================================  =========  ==========================================

NOTE: label values come from operator config (pool and replica names) or from small fixed
vocabularies chosen by the callers (reasons, kinds, outcomes); request data never becomes a
label, so cardinality stays bounded by the fleet's size.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvroute.shell.deferred_counts import (
    DecisionTally,
    FlushingRegistry,
    LatencyTally,
    PendingCounts,
    check_histogram_layout,
)
from kvroute.shell.scenario_metrics import ScenarioMetrics

__all__ = [
    "DIVERGENCE_BUCKETS",
    "REASONING_BUCKETS",
    "ROUTER_TIME_BUCKETS",
    "ROUTER_TIME_STAGES",
    "ROUTING_LATENCY_BUCKETS",
    "TOKENIZER_CHECKS",
    "TOKENIZER_MODES",
    "RouterMetrics",
]

ROUTING_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1,
)  # fmt: skip
"""Routing is pure CPU work (hashing plus an index lookup): 10 µs to 100 ms covers it."""

DIVERGENCE_BUCKETS: Final[tuple[float, ...]] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Block indices of ``prefix_divergence_block``: 0 (nothing shared) then powers of two."""
REASONING_BUCKETS: Final[tuple[float, ...]] = (
    0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
"""Thinking tokens per answer: none, then up to the 32K chains of long-reasoning models."""
GC_PAUSE_BUCKETS: Final[tuple[float, ...]] = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
"""A young collection takes tens of µs; a full one ms to hundreds of ms with a large heap."""

ROUTER_TIME_BUCKETS: Final[tuple[float, ...]] = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.00125, 0.0015, 0.00175, 0.002, 0.0025, 0.003,
    0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
"""The router's own share of a request's latency: fine steps around the 1 ms and 2 ms that
matter (a router should add about that much at the median and at p99), coarse beyond."""

ROUTER_TIME_STAGES: Final = ("before_engine", "after_engine", "total")
"""``router_time_seconds``'s stages (``RouterMetrics.router_time``)."""

_ROUTER_TIME_BOUNDS: Final[tuple[float, ...]] = (*ROUTER_TIME_BUCKETS, float("inf"))
_GC_PAUSE_BOUNDS: Final[tuple[float, ...]] = (*GC_PAUSE_BUCKETS, float("inf"))
_DIVERGENCE_BOUNDS: Final[tuple[float, ...]] = (*DIVERGENCE_BUCKETS, float("inf"))
_REASONING_BOUNDS: Final[tuple[float, ...]] = (*REASONING_BUCKETS, float("inf"))

TOKENIZER_MODES: Final = ("engine", "local", "approximate")
TOKENIZER_CHECKS: Final = ("pending", "verified", "mismatch", "unverifiable", "no_local")
"""Results of ``tokenize/check.py`` (its ``CheckResult``)."""

_LATENCY_BOUNDS: Final[tuple[float, ...]] = (*ROUTING_LATENCY_BUCKETS, float("inf"))
"""The routing-latency histogram's upper bounds as prometheus_client stores them (+Inf last)."""


def _set_one_of(gauge: Gauge, pool: str, what: str, choices: tuple[str, ...],
                value: str) -> None:
    """Set ``pool``'s series of a one-of gauge: 1 for ``value``, 0 for every other choice
    (so a dashboard can select the current one without knowing the previous)."""
    if value not in choices:
        raise ValueError(f"{what} must be one of {choices}, got {value!r}")
    for known in choices:
        gauge.labels(pool, known).set(1 if known == value else 0)


class RouterMetrics:
    """kvroute's Prometheus series, in a registry of their own.

    Invariant: every series is registered once, in ``__init__``; the methods only update
    (most of them deferred: see the module docstring), and every read of ``registry`` first
    moves the pending amounts in.

    Args:
        namespace: prefix of every series name (``kvroute``).
    """

    def __init__(self, namespace: str = "kvroute") -> None:
        check_histogram_layout()
        # Pending request-path counts, by label values (see the module docstring).
        self._decision_tallies: dict[tuple[str, str, str, bool], DecisionTally] = {}
        self._latencies: dict[str, LatencyTally] = {}
        self._pending: list[PendingCounts] = []
        self.registry: CollectorRegistry = FlushingRegistry(self._flush)
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
        router_time = Histogram(
            "router_time_seconds", "The router's own share of a request's latency: from the "
            "client's request read to its forwarding to the engine (before_engine), from the "
            "engine's answer (streamed: its first bytes; whole: its end) to its write to the "
            "client (after_engine), and their sum (total). Network hops not included.",
            ["stage"], namespace=ns, registry=r, buckets=ROUTER_TIME_BUCKETS,
        )
        self._router_time = tuple(LatencyTally(router_time.labels(stage), _ROUTER_TIME_BOUNDS)
                                  for stage in ROUTER_TIME_STAGES)
        gc_pause = Histogram(
            "gc_pause_seconds", "Garbage collections of the router's process and how long each "
            "stopped it, by generation (2: a full collection, whose cost grows with the objects "
            "the router keeps).",
            ["generation"], namespace=ns, registry=r, buckets=GC_PAUSE_BUCKETS,
        )
        self._gc_pause = tuple(LatencyTally(gc_pause.labels(str(g)), _GC_PAUSE_BOUNDS)
                               for g in range(3))
        self._loop_lag = LatencyTally(Histogram(
            "event_loop_lag_seconds", "How late the router's event loop woke for a 20 ms "
            "timer: stalls of the whole loop (collections, waiting for a CPU, blocking calls, "
            "long callbacks), which router_time_seconds does not see while requests wait in "
            "sockets or on engines.",
            namespace=ns, registry=r, buckets=GC_PAUSE_BUCKETS), _GC_PAUSE_BOUNDS)
        self._divergence = Histogram(
            "prefix_divergence_block", "Per routed request with exact hashes, the first block "
            "of its prompt that no replica holds (as the index sees it): where prefix reuse "
            "breaks. Mass at 0 on a route whose requests share a system prompt means something "
            "early in the prompt changes per request (kvroute audit finds what).",
            ["route"], namespace=ns, registry=r, buckets=DIVERGENCE_BUCKETS,
        )
        self._divergence_by_route: dict[str, LatencyTally] = {}
        self._reasoning = Histogram(
            "reasoning_tokens", "Thinking tokens per answer, as the engine reported them "
            "(usage.completion_tokens_details.reasoning_tokens, vLLM with a reasoning parser).",
            ["route"], namespace=ns, registry=r, buckets=REASONING_BUCKETS,
        )
        self._reasoning_by_route: dict[str, LatencyTally] = {}
        self._upstream_errors = self._deferred(Counter(
            "upstream_errors", "Failed upstream calls by replica and kind.",
            ["replica", "kind"], namespace=ns, registry=r,
        ))
        self._retries = self._deferred(Counter(
            "retries", "Requests retried on another replica after this one failed.",
            ["replica"], namespace=ns, registry=r,
        ))
        self._admission_rejects = self._deferred(Counter(
            "admission_rejects", "Requests refused before routing, by reason.",
            ["reason"], namespace=ns, registry=r,
        ))
        self._event_counts = tuple(self._deferred(Counter(
            name, documentation, ["replica"], namespace=ns, registry=r,
        )) for name, documentation in (
            ("kv_event_batches_applied", "KV-event batches applied to the index."),
            ("kv_event_gaps", "Sequence gaps detected in a replica's KV-event stream."),
            ("kv_event_replays", "Replay requests sent to a replica's replay socket."),
            ("kv_event_resets", ("Times a replica's index entries were dropped as "
             "untrustworthy.")),
            ("kv_event_malformed", "KV-event messages that could not be decoded."),
        ))
        self._index_entries = Gauge(
            "index_entries", "(replica, block hash) entries in the prefix index.",
            namespace=ns, registry=r,
        )
        self._index_hashes = Gauge(
            "index_hashes", "Distinct block hashes in the prefix index.",
            namespace=ns, registry=r,
        )
        self._replaying = Gauge(
            "kv_event_replaying", "1 while the replica's KV-event subscriber receives or "
            "delivers a replay (a catch-up after the router starts, or a gap's recovery).",
            ["replica"], namespace=ns, registry=r,
        )
        self._kv_stream_up = Gauge(
            "kv_stream_up", "1 while the durable KV-event stream (NATS JetStream) is in use, "
            "0 while it is configured but NATS is away (retried in the background).",
            namespace=ns, registry=r,
        )
        self._transcript_sample = Gauge(
            "gate_sample_conversations", "The live transcript sample (gate.sample) since "
            "start, by outcome: offered (answers seen), sampled (conversations taken), "
            "written (lines appended), too_short, dropped_open, dropped_rate, dropped_full, "
            "duplicate (stopped by a bound); open: conversations held now.",
            ["outcome"], namespace=ns, registry=r,
        )
        self._kv_stream_relay = Gauge(
            "kv_stream_relay", "This router's relay into the durable KV-event stream, since "
            "start: batches published, resets written, publishes failed, batches dropped, "
            "snapshots written and failed.",
            ["stat"], namespace=ns, registry=r,
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
        self._tokenizer_check = Gauge(
            "tokenizer_check",
            "The check of a local or auto tokenizer against the engines' /tokenize "
            "(1 for the current result).",
            ["pool", "result"], namespace=ns, registry=r,
        )
        self._tokenize = self._deferred(Counter(
            "tokenize", "Prompt tokenizations by outcome.",
            ["pool", "outcome"], namespace=ns, registry=r,
        ))
        self._piece_cache = Gauge(
            "token_piece_cache", "A local tokenizer's cache of prompt pieces: enabled (0/1; "
            "it turns itself off on any disagreement with whole-prompt tokenization), hits, "
            "misses, cached_tokens, mismatches, checks (whole-prompt comparisons done, on a "
            "worker thread), checks_dropped (due while one ran), checks_failed (since start).",
            ["pool", "stat"], namespace=ns, registry=r,
        )
        self._discovery = self._deferred(Counter(
            "discovery", "Discovery probes by replica and outcome.",
            ["replica", "outcome"], namespace=ns, registry=r,
        ))
        self._replica_healthy = Gauge(
            "replica_healthy", "1 if the replica is in routing.",
            ["replica"], namespace=ns, registry=r,
        )
        self._pool_window = Gauge(
            "pool_window_tokens", "Smallest max_model_len among the pool's healthy replicas.",
            ["pool"], namespace=ns, registry=r,
        )
        self._cluster = Gauge(
            "cluster",
            "Several routers (cluster.bus): connected (1/0), peers heard within the expiry, "
            "peer_requests (their requests counted as load here), published, dropped (not "
            "connected), received, applied, unknown (an end for a request never placed), "
            "unknown_replica, rate_samples and itl_samples (peers' prefill rate and inter-token "
            "samples learned from), bad_samples "
            "(refused: no measurement), expired_peers, expired_requests, gaps (batches lost), bad "
            "(foreign bytes on the subject), seq (this router's last batch published), "
            "outbox (announcements not yet in a batch); counts since start.",
            ["stat"], namespace=ns, registry=r,
        )
        self._cluster_info = Gauge(
            "cluster_info", "1, labelled with this router's id on the cluster bus.",
            ["router_id"], namespace=ns, registry=r,
        )
        self._cluster_peer_seq = Gauge(
            "cluster_peer_seq",
            "Per peer router heard within the expiry, the seq of its last batch applied here "
            "(compare with that router's kvroute_cluster{stat=\"seq\"}).",
            ["peer"], namespace=ns, registry=r,
        )
        self._peers_exported: set[str] = set()
        self._state_errors = self._deferred(Counter(
            "state_errors", "Shared-state operations that failed and degraded to no pin / "
            "no warm.", ["backend", "op"], namespace=ns, registry=r,
        ))
        self._warm = self._deferred(Counter(
            "warm", "Warm-ahead requests by outcome (fired, skipped, failed, hit, chunk).",
            ["outcome", "reason"], namespace=ns, registry=r,
        ))
        self._escalations = self._deferred(Counter(
            "escalations", "Requests moved to a larger tier.",
            ["from_pool", "to_pool", "kind"], namespace=ns, registry=r,
        ))
        self.scenarios = ScenarioMetrics(r, ns)
        """Model-bound cache scenarios' series (``shell/scenario_metrics.py``)."""
        self._cut_short = self._deferred(Counter(
            "cut_short", "Responses the engine cut short (finish_reason length with fewer "
            "tokens than asked).", ["pool"], namespace=ns, registry=r,
        ))

    def _deferred(self, counter: Counter) -> PendingCounts:
        pending = PendingCounts(counter)
        self._pending.append(pending)
        return pending

    def _flush(self) -> None:
        """Move every pending amount into its series (the registry calls this on each read)."""
        for pending in self._pending:
            pending.flush()
        for tally in self._decision_tallies.values():
            tally.flush()
        for latency in self._latencies.values():
            latency.flush()
        for stage in self._router_time:
            stage.flush()
        for generation in self._gc_pause:
            generation.flush()
        self._loop_lag.flush()
        for divergence in self._divergence_by_route.values():
            divergence.flush()
        for reasoning in self._reasoning_by_route.values():
            reasoning.flush()

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
        """Record one routing decision (negative token counts count as 0)."""
        key = (pool, replica, reason, approximate)
        tally = self._decision_tallies.get(key)
        if tally is None:
            tally = self._start_decision(key)
        tally.count += 1
        if prompt_tokens > 0:
            tally.prompt_tokens += prompt_tokens
        if cached_tokens > 0:
            tally.cached_tokens += cached_tokens
        tally.latency.observe(routing_latency_s)

    def _start_decision(self, key: tuple[str, str, str, bool]) -> DecisionTally:
        pool, replica, reason, approximate = key
        latency = self._latencies.get(pool)
        if latency is None:
            latency = self._latencies[pool] = LatencyTally(self._routing_latency.labels(pool),
                                                           _LATENCY_BOUNDS)
        tally = self._decision_tallies[key] = DecisionTally(
            self._decisions.labels(pool, replica, reason, "true" if approximate else "false"),
            self._prompt_tokens.labels(pool),
            self._cached_tokens.labels(pool),
            latency,
        )
        return tally

    def divergence(self, route: str, block: int) -> None:
        """One request's first block no replica holds (``prefix_divergence_block``)."""
        tally = self._divergence_by_route.get(route)
        if tally is None:
            tally = self._divergence_by_route[route] = LatencyTally(
                self._divergence.labels(route), _DIVERGENCE_BOUNDS)
        tally.observe(block)

    def reasoning(self, route: str, tokens: int) -> None:
        """One answer's thinking tokens (``reasoning_tokens``)."""
        tally = self._reasoning_by_route.get(route)
        if tally is None:
            tally = self._reasoning_by_route[route] = LatencyTally(
                self._reasoning.labels(route), _REASONING_BOUNDS)
        tally.observe(tokens)

    def gc_pause(self, generation: int, seconds: float) -> None:
        """One garbage collection (``heap.watch_gc_pauses``). Called inside the collector, from
        whichever thread collects: a tally (two list updates, no lock to wait on, nothing
        tracked allocated), moved into the histogram when it is read, as the latencies are."""
        self._gc_pause[generation].observe(seconds)

    def loop_lag(self, seconds: float) -> None:
        """How late one of the event loop's timer wake-ups came (``heap.watch_loop_lag``)."""
        self._loop_lag.observe(seconds)

    def router_time(self, before_engine_s: float, after_engine_s: float) -> None:
        """Record the router's own time in one answered request (``router_time_seconds``):
        ``before_engine_s`` from its request read to its forwarding, ``after_engine_s`` from
        the engine's answer to the write to the client."""
        before, after, total = self._router_time
        before.observe(before_engine_s)
        after.observe(after_engine_s)
        total.observe(before_engine_s + after_engine_s)

    def upstream_error(self, replica: str, kind: str) -> None:
        self._upstream_errors.add((replica, kind), 1)

    def retry(self, replica: str) -> None:
        """Count a retry away from ``replica`` (the replica that failed)."""
        self._retries.add((replica,), 1)

    def admission_reject(self, reason: str) -> None:
        self._admission_rejects.add((reason,), 1)

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
        """Add to a replica's event-stream counters (each argument is an increment >= 0;
        a negative one raises ``ValueError`` before anything is counted)."""
        amounts = (applied, gaps, replays, resets, malformed)
        for amount in amounts:
            if amount < 0:
                raise ValueError(f"event counters only go up; got {amount} for {replica!r}")
        key = (replica,)
        for pending, amount in zip(self._event_counts, amounts, strict=True):
            if amount:
                pending.add(key, amount)

    def set_replaying(self, replica: str, on: bool) -> None:
        self._replaying.labels(replica).set(1 if on else 0)

    def set_transcript_sample(self, counts: dict[str, int]) -> None:
        """The transcript sample's counts (``shell/transcript_sample.py``)."""
        for outcome, value in counts.items():
            self._transcript_sample.labels(outcome).set(value)

    def set_kv_stream(self, up: bool, relay: dict[str, int] | None) -> None:
        """The durable KV-event stream's state, and the relay's counters when this router
        relays (``shell/kv_stream_relay.py``)."""
        self._kv_stream_up.set(1 if up else 0)
        for stat, value in (relay or {}).items():
            self._kv_stream_relay.labels(stat).set(value)

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
        _set_one_of(self._tokenizer_mode, pool, "tokenizer mode", TOKENIZER_MODES, mode)

    def set_tokenizer_check(self, pool: str, result: str) -> None:
        """Export the result of ``pool``'s tokenizer check (one of ``TOKENIZER_CHECKS``)."""
        _set_one_of(self._tokenizer_check, pool, "tokenizer check", TOKENIZER_CHECKS, result)

    def tokenize(self, pool: str, outcome: str) -> None:
        self._tokenize.add((pool, outcome), 1)

    def set_token_piece_cache(self, pool: str, *, enabled: bool, hits: int, misses: int,
                              cached_tokens: int, mismatches: int, checks: int,
                              checks_dropped: int, checks_failed: int) -> None:
        """Export a local tokenizer's piece-cache state (``tokenize.segments.SegmentEncoder``;
        its checks: ``tokenize/piece_check.py``)."""
        for stat, value in (("enabled", 1 if enabled else 0), ("hits", hits),
                            ("misses", misses), ("cached_tokens", cached_tokens),
                            ("mismatches", mismatches), ("checks", checks),
                            ("checks_dropped", checks_dropped),
                            ("checks_failed", checks_failed)):
            self._piece_cache.labels(pool, stat).set(value)

    def set_cluster(self, stats: dict[str, float], *, router_id: str = "",
                    peer_seqs: dict[str, int] | None = None) -> None:
        """Export ``ClusterSharing.stats()``, its router id and ``peer_seqs()``
        (``shell/cluster.py``). A peer no longer heard (left, expired) loses its series:
        router ids are few (the fleet's routers), but a restarted router under a default
        ``<host>-<pid>`` id is a new one each time."""
        for stat, value in stats.items():
            self._cluster.labels(stat).set(value)
        if router_id:
            self._cluster_info.labels(router_id).set(1)
        seqs = peer_seqs or {}
        for peer in self._peers_exported - seqs.keys():
            self._cluster_peer_seq.remove(peer)
        for peer, seq in seqs.items():
            self._cluster_peer_seq.labels(peer).set(seq)
        self._peers_exported = set(seqs)

    def discovery(self, replica: str, outcome: str) -> None:
        self._discovery.add((replica, outcome), 1)

    def set_replica_healthy(self, replica: str, healthy: bool) -> None:
        self._replica_healthy.labels(replica).set(1 if healthy else 0)

    def forget_replica(self, replica: str) -> None:
        """Drop the gauges of a replica that left the fleet (scale-in), so its last value is
        not exported for ever: ``replica_healthy`` 0 would keep the "replica down" alert of
        ``deploy/prometheus`` firing for a pod that no longer exists. Its counters stay; a
        counter's history is still true."""
        for gauge in (self._replica_healthy, self._replaying):
            try:
                gauge.remove(replica)
            except KeyError:
                continue  # never exported for this replica: nothing to drop

    def set_pool_window(self, pool: str, window: int | None) -> None:
        """Export the pool's window; ``None`` (unknown) is exported as 0."""
        self._pool_window.labels(pool).set(window or 0)

    def state_error(self, backend: str, op: str) -> None:
        self._state_errors.add((backend, op), 1)

    # -- warm-ahead and tiers ---------------------------------------------------------------

    def warm(self, outcome: str, reason: str | None = None) -> None:
        """Count a warm-ahead outcome: ``fired``, ``skipped`` (with a reason), ``failed``,
        ``hit``, ``chunk`` (one per request of a warm-up sent in prefix chunks)."""
        self._warm.add((outcome, reason or ""), 1)

    def escalation(self, from_pool: str, to_pool: str, kind: str) -> None:
        self._escalations.add((from_pool, to_pool, kind), 1)

    def cut_short(self, pool: str) -> None:
        self._cut_short.add((pool,), 1)

    # -- exposition -------------------------------------------------------------------------

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's value by its full name (e.g. ``kvroute_tokenize_total``), or None.

        Exact: the registry moves the pending counts in before it is read."""
        return self.registry.get_sample_value(name, labels or {})

    def render(self) -> tuple[bytes, str]:
        """The ``/metrics`` body (Prometheus text format 0.0.4) and its content type (the
        registry moves the pending counts in first, so the body is exact)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
