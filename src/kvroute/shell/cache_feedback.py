"""Measured hits: the engines' own cache counters and the predicted-vs-reported feedback loop.

Owns two things the router learns from its engines after it has routed, and exports them on
``/metrics`` (docs/observability.md):

* **per replica**, what the engine says of its prefix cache on its own ``/metrics`` (polled
  by ``shell/discovery.py``): queried and hit tokens, the hit rate, preemptions, and whether
  prefix caching is on at all (``core/engine_cache.py``). An engine whose
  ``vllm:cache_config_info`` says ``enable_prefix_caching="False"`` is reported with an error
  in the log and ``kvroute_engine_prefix_caching_enabled 0``, and ``RouterCore.
  set_prefix_caching`` makes sure it is never credited with a hit;
* **per request**, the cached tokens the router predicted for the replica it chose against
  the ``usage.prompt_tokens_details.cached_tokens`` the engine reported in its answer (vLLM
  with ``--enable-prompt-tokens-details``; streamed answers only carry it with
  ``stream_options.include_usage``), a histogram of the difference and the drift alarm
  (``core/cache_drift.py``): an error in the log on entering, with the figures and the usual
  causes, and, past ``cache_drift.threshold``, the pool routed approximately
  (``RouterCore.set_pool_drifting``) until the exact index agrees with the engines again.

Series (prefixed ``kvroute_``), produced at scrape time from plain counters kept here (a
per-request update is a few additions, no ``prometheus_client`` call):

=========================================  =========  ====================================
engine_prefix_cache_queries_total          counter    replica (tokens the engine looked up)
engine_prefix_cache_hits_total             counter    replica (tokens it found cached)
engine_prefix_cache_hit_ratio              gauge      replica (the last poll interval's)
engine_preemptions_total                   counter    replica
engine_prefix_caching_enabled              gauge      replica (1 on, 0 off; absent: unknown)
engine_kv_cache_usage                      gauge      replica (vllm:kv_cache_usage_perc, 0..1)
engine_requests                            gauge      replica, state (running, waiting)
cache_predicted_tokens_total               counter    pool, replica
cache_measured_tokens_total                counter    pool, replica
cache_compared_prompt_tokens_total         counter    pool, replica
cache_predictions_total                    counter    pool, outcome (agree, over, under)
cache_prediction_error                     histogram  pool ((measured − predicted) / prompt;
                                                      buckets only: a histogram with negative
                                                      buckets has no _sum/_count in
                                                      prometheus_client, the +Inf bucket is
                                                      the count)
cache_drift_ratio                          gauge      pool (disagreeing share of the window)
cache_drift_alarm                          gauge      pool (1 while the alarm is on)
cache_drift_alarms_total                   counter    pool
=========================================  =========  ====================================
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from kvroute.core.cache_drift import (
    ERROR_BOUNDS,
    CacheDriftMonitor,
    CacheDriftSettings,
    DriftSample,
    DriftTransition,
)
from kvroute.core.engine_cache import EngineCacheCounters
from kvroute.core.router import RouterCore, RoutingDecision
from kvroute.core.types import PoolName, ReplicaId, RequestId
from kvroute.wire.prom import VllmMetrics, format_float

__all__ = ["CacheFeedback", "ReplicaComparison", "reported_cached_tokens"]

log = logging.getLogger(__name__)


def reported_cached_tokens(usage: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """``(prompt_tokens, cached_tokens)`` from an answer's ``usage``, or None when the engine
    did not report prompt-token details (vLLM without ``--enable-prompt-tokens-details``)."""
    if not usage:
        return None
    details = usage.get("prompt_tokens_details")
    prompt = usage.get("prompt_tokens")
    if not isinstance(details, Mapping) or not isinstance(prompt, int):
        return None
    cached = details.get("cached_tokens")
    if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
        return None
    return prompt, cached


@dataclass(slots=True)
class ReplicaComparison:
    """One replica's predicted and reported cached tokens, summed over compared answers."""

    requests: int = 0
    prompt_tokens: int = 0
    predicted_tokens: int = 0
    measured_tokens: int = 0


class CacheFeedback(Collector):
    """The engines' cache counters and the drift alarm (module docstring).

    Every method runs on the router's event loop (discovery's round task and the request
    handlers), like every ``RouterCore`` call, so no locks are needed. Registered on the
    router's metrics registry by the constructor.
    """

    def __init__(self, core: RouterCore, settings: CacheDriftSettings,
                 registry: CollectorRegistry, *, namespace: str = "kvroute") -> None:
        self._core = core
        self.settings = settings
        self._ns = namespace
        self.engines: dict[ReplicaId, EngineCacheCounters] = {}
        # The last load each engine reported: (kv usage, running, waiting), None if absent.
        self.engine_load: dict[ReplicaId, tuple[float | None, float | None, float | None]] = {}
        self.pools: dict[PoolName, CacheDriftMonitor] = {
            name: CacheDriftMonitor(settings) for name in core.pool_names()
        }
        self.replicas: dict[ReplicaId, ReplicaComparison] = {}
        self.alarms: dict[PoolName, int] = {}
        self._since_alarm: dict[PoolName, int] = {}  # compared answers while it stays on
        self.unreported = 0
        # Shadow predictions of requests routed while their pool drifts, by request id,
        # taken when routed (at the answer, the engine's events for this very request may
        # already be in the index); each is popped when its answer (or failure) ends.
        self._shadow: dict[RequestId, int | None] = {}
        registry.register(self)

    # -- engine counters (discovery) ----------------------------------------------------------

    def on_engine_metrics(self, replica: ReplicaId, parsed: VllmMetrics) -> None:
        """One ``/metrics`` reading of ``replica``'s engine."""
        self.engine_load[replica] = (parsed.kv_cache_usage_perc, parsed.num_requests_running,
                                     parsed.num_requests_waiting)
        counters = self.engines.get(replica)
        if counters is None:
            counters = self.engines[replica] = EngineCacheCounters()
        change = counters.observe(
            queries=parsed.prefix_cache_queries_total, hits=parsed.prefix_cache_hits_total,
            preemptions=parsed.num_preemptions_total,
            caching_enabled=parsed.enable_prefix_caching,
        )
        if change is None:
            return
        self._core.set_prefix_caching(replica, change.now is not False)
        if change.now is False:
            log.error(
                "replica %s runs with prefix caching OFF (vllm:cache_config_info "
                "enable_prefix_caching=%r): it never reuses a cached prefix, so kvroute "
                "credits it with no hits and its cache-aware routing buys nothing there. "
                "Start the engine with --enable-prefix-caching (vLLM's default) or take it "
                "out of the pool.", replica, parsed.cache_config.get("enable_prefix_caching"))
        elif change.was is False:
            log.warning("replica %s now runs with prefix caching on; credited with hits again",
                        replica)

    def forget_replica(self, replica: ReplicaId) -> None:
        """``replica`` left the fleet (Kubernetes scale-in): stop exporting its engine's series,
        whose last readings would otherwise stand for a pod that no longer exists. The
        router's own predicted/measured counters by replica keep their history."""
        self.engine_load.pop(replica, None)
        self.engines.pop(replica, None)

    # -- the feedback loop (forwarder) -------------------------------------------------------

    def on_decision(self, decision: RoutingDecision) -> None:
        """A request was routed: while its pool drifts, take the exact index's prediction
        for the chosen replica now (the shadow the alarm compares, module docstring)."""
        request = decision.request
        if decision.approximate and self._core.pool_drifting(request.pool):
            self._shadow[request.request_id] = self._core.exact_cached_tokens(
                request, decision.replica)

    def on_answer(self, decision: RoutingDecision, usage: Mapping[str, Any] | None) -> None:
        """Compare one answered request's prediction with what its engine reported (every
        routed request ends here, answered or not; ``usage`` None: nothing reported)."""
        shadow = self._shadow.pop(decision.request.request_id, None)
        if not self.settings.enabled:
            return
        reported = reported_cached_tokens(usage)
        if reported is None:
            self.unreported += 1
            return
        prompt_tokens, measured = reported
        request = decision.request
        pool, replica = request.pool, decision.replica
        core = self._core
        if core.prefix_caching_off(replica):
            return  # nothing to compare: it is credited with nothing and caches nothing
        if not decision.approximate:
            predicted: int | None = decision.expected_cached_tokens
        elif core.pool_drifting(pool):
            predicted = shadow
        else:
            predicted = None  # declared approximate: no exact prediction to check
        monitor = self.pools.get(pool)
        if predicted is None or monitor is None:
            return
        row = self.replicas.get(replica)
        if row is None:
            row = self.replicas[replica] = ReplicaComparison()
        row.requests += 1
        row.prompt_tokens += prompt_tokens
        row.predicted_tokens += predicted
        row.measured_tokens += measured
        block_size = core.pool(pool).block_size
        transition = monitor.observe(DriftSample(predicted, measured, prompt_tokens, block_size))
        if transition is DriftTransition.ENTERED:
            self._since_alarm[pool] = 0
            self._entered(pool, monitor, block_size)
        elif monitor.alarm:
            since = self._since_alarm[pool] = self._since_alarm.get(pool, 0) + 1
            if since % self.settings.window == 0:
                log.error("CACHE DRIFT in pool %s continues after %d more answers (%.0f%% of "
                          "the last %d disagree; %d over-, %d under-predicted in all)", pool,
                          since, 100 * monitor.drift_ratio, monitor.window_samples,
                          monitor.over, monitor.under)
        elif transition is DriftTransition.LEFT:
            core.set_pool_drifting(pool, False)
            log.warning("pool %s: the router's cached-token predictions agree with the "
                        "engines' reports again (%.0f%% of the last %d requests disagree); "
                        "exact prefix routing resumes", pool, 100 * monitor.drift_ratio,
                        monitor.window_samples)

    def _entered(self, pool: PoolName, monitor: CacheDriftMonitor, block_size: int) -> None:
        self.alarms[pool] = self.alarms.get(pool, 0) + 1
        approximate = self.settings.approximate_on_alarm
        if approximate:
            self._core.set_pool_drifting(pool, True)
        spec = self._core.pool(pool)
        log.error(
            "CACHE DRIFT in pool %s: the cached tokens kvroute predicted disagree with what the "
            "engines report on at least %.0f%% of the last %d requests (so far %d over-predicted, "
            "%d under-predicted, %d agreed; predicted %d vs reported %d tokens in all). The "
            "index does not describe what the engines cache: check that block_size=%d, "
            "hash_algo=%s and hash_seed=%s match the engines (PYTHONHASHSEED), that LoRA "
            "adapters and cache_salt reach the router, and that KV events arrive. %s",
            pool, 100 * self.settings.threshold, self.settings.window, monitor.over,
            monitor.under, monitor.agree, monitor.predicted_total, monitor.measured_total,
            block_size, spec.hash_algo, spec.hash_seed,
            "The pool routes approximately until they agree again." if approximate else
            "cache_drift.approximate_on_alarm is off: routing stays exact.",
        )

    # -- views ------------------------------------------------------------------------------

    def drifting_pools(self) -> list[PoolName]:
        return [pool for pool, monitor in self.pools.items() if monitor.alarm]

    def collect(self) -> Iterator[Metric]:
        """The series of the module docstring, from the counters as they are now."""
        ns = self._ns
        queries = CounterMetricFamily(f"{ns}_engine_prefix_cache_queries",
                                      "Prompt tokens the engine looked up in its prefix cache "
                                      "(vllm:prefix_cache_queries, kept monotonic across "
                                      "engine restarts).", labels=["replica"])
        hits = CounterMetricFamily(f"{ns}_engine_prefix_cache_hits",
                                   "Prompt tokens the engine found in its prefix cache "
                                   "(vllm:prefix_cache_hits).", labels=["replica"])
        ratio = GaugeMetricFamily(f"{ns}_engine_prefix_cache_hit_ratio",
                                  "The engine's own prefix-cache hit rate over the last poll "
                                  "interval with lookups (hits / queried tokens).",
                                  labels=["replica"])
        preempt = CounterMetricFamily(f"{ns}_engine_preemptions",
                                      "Preemptions the engine reported (vllm:num_preemptions).",
                                      labels=["replica"])
        enabled = GaugeMetricFamily(f"{ns}_engine_prefix_caching_enabled",
                                    "1 if the engine's prefix caching is on, 0 if off "
                                    "(vllm:cache_config_info); an engine with it off is never "
                                    "credited with hits.", labels=["replica"])
        for replica, c in self.engines.items():
            queries.add_metric([replica], c.queries_total)
            hits.add_metric([replica], c.hits_total)
            preempt.add_metric([replica], c.preemptions_total)
            if c.interval_hit_ratio is not None:
                ratio.add_metric([replica], c.interval_hit_ratio)
            if c.caching_enabled is not None:
                enabled.add_metric([replica], 1.0 if c.caching_enabled else 0.0)
        usage = GaugeMetricFamily(f"{ns}_engine_kv_cache_usage",
                                  "The engine's KV-cache usage, 0..1 (vllm:kv_cache_usage_perc, "
                                  "mean over its data-parallel ranks).", labels=["replica"])
        requests = GaugeMetricFamily(f"{ns}_engine_requests",
                                     "Requests the engine reported running or waiting "
                                     "(vllm:num_requests_running/waiting).",
                                     labels=["replica", "state"])
        for replica, (kv, running, waiting) in self.engine_load.items():
            if kv is not None:
                usage.add_metric([replica], kv)
            if running is not None:
                requests.add_metric([replica, "running"], running)
            if waiting is not None:
                requests.add_metric([replica, "waiting"], waiting)
        yield from (queries, hits, ratio, preempt, enabled, usage, requests)

        predicted = CounterMetricFamily(f"{ns}_cache_predicted_tokens",
                                        "Cached prompt tokens the router predicted on the "
                                        "replica it chose, for answers whose engine reported "
                                        "cached_tokens.", labels=["pool", "replica"])
        measured = CounterMetricFamily(f"{ns}_cache_measured_tokens",
                                       "Cached prompt tokens the engine reported "
                                       "(usage.prompt_tokens_details.cached_tokens) on those "
                                       "answers.", labels=["pool", "replica"])
        compared = CounterMetricFamily(f"{ns}_cache_compared_prompt_tokens",
                                       "Prompt tokens of those answers (the engine's count).",
                                       labels=["pool", "replica"])
        for replica, row in self.replicas.items():
            labels = [self._core.pool_of(replica), replica]
            predicted.add_metric(labels, row.predicted_tokens)
            measured.add_metric(labels, row.measured_tokens)
            compared.add_metric(labels, row.prompt_tokens)
        yield from (predicted, measured, compared)

        outcomes = CounterMetricFamily(f"{ns}_cache_predictions",
                                       "Compared answers by outcome: agree (within the "
                                       "tolerance), over (predicted more than reported), under.",
                                       labels=["pool", "outcome"])
        errors = HistogramMetricFamily(f"{ns}_cache_prediction_error",
                                       "(reported − predicted cached tokens) / prompt tokens, "
                                       "per compared answer.", labels=["pool"])
        drift = GaugeMetricFamily(f"{ns}_cache_drift_ratio",
                                  "Share of the pool's recent informative answers whose "
                                  "prediction disagreed with the engine.", labels=["pool"])
        alarm = GaugeMetricFamily(f"{ns}_cache_drift_alarm",
                                  "1 while the pool's drift alarm is on (it then routes "
                                  "approximately when cache_drift.approximate_on_alarm).",
                                  labels=["pool"])
        alarms = CounterMetricFamily(f"{ns}_cache_drift_alarms",
                                     "Times the pool's drift alarm went on.", labels=["pool"])
        for pool, m in self.pools.items():
            outcomes.add_metric([pool, "agree"], m.agree)
            outcomes.add_metric([pool, "over"], m.over)
            outcomes.add_metric([pool, "under"], m.under)
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip(ERROR_BOUNDS, m.error_counts, strict=False):
                cumulative += count
                buckets.append((format_float(bound), cumulative))
            buckets.append(("+Inf", m.num_samples))
            errors.add_metric([pool], buckets, sum_value=m.error_sum)
            drift.add_metric([pool], m.drift_ratio)
            alarm.add_metric([pool], 1.0 if m.alarm else 0.0)
            alarms.add_metric([pool], self.alarms.get(pool, 0))
        yield from (outcomes, errors, drift, alarm, alarms)
