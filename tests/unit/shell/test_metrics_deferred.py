"""RouterMetrics' deferred counts: every reader sees exactly what plain series would hold.

The request-path methods only add to pending Python numbers; the registry moves them into
the prometheus_client series when it is read. These tests feed the same calls to a
``RouterMetrics`` and to plain prometheus_client series (updated directly, as the module did
before deferral) and require the same sample lines, bit for bit, after every read.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.shell import deferred_counts
from kvroute.shell.metrics import ROUTING_LATENCY_BUCKETS, RouterMetrics

Op = tuple[str, tuple[Any, ...], dict[str, Any]]


class Plain:
    """The deferred series as plain prometheus_client series, updated on every call."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, labels: list[str]) -> Counter:
            return Counter(name, name, labels, namespace="kvroute", registry=self.registry)

        self.decisions = counter("decisions", ["pool", "replica", "reason", "approximate"])
        self.prompt = counter("prompt_tokens", ["pool"])
        self.cached = counter("cached_tokens", ["pool"])
        self.latency = Histogram("routing_latency_seconds", "", ["pool"], namespace="kvroute",
                                 registry=self.registry, buckets=ROUTING_LATENCY_BUCKETS)
        self.upstream_errors = counter("upstream_errors", ["replica", "kind"])
        self.retries = counter("retries", ["replica"])
        self.admission_rejects = counter("admission_rejects", ["reason"])
        self.events = {kind: counter(f"kv_event_{kind}", ["replica"])
                       for kind in ("batches_applied", "gaps", "replays", "resets", "malformed")}
        self.tokenize = counter("tokenize", ["pool", "outcome"])
        self.discovery = counter("discovery", ["replica", "outcome"])
        self.state_errors = counter("state_errors", ["backend", "op"])
        self.warm = counter("warm", ["outcome", "reason"])
        self.escalations = counter("escalations", ["from_pool", "to_pool", "kind"])
        self.cut_short = counter("cut_short", ["pool"])

    def apply(self, op: Op) -> None:
        name, args, kwargs = op
        if name == "decision":
            pool, replica, reason, cached, prompt, latency_s, approximate = args
            self.decisions.labels(pool, replica, reason, str(approximate).lower()).inc()
            self.prompt.labels(pool).inc(max(prompt, 0))
            self.cached.labels(pool).inc(max(cached, 0))
            self.latency.labels(pool).observe(latency_s)
        elif name == "events":
            (replica,) = args
            for arg, kind in (("applied", "batches_applied"), ("gaps", "gaps"),
                              ("replays", "replays"), ("resets", "resets"),
                              ("malformed", "malformed")):
                if kwargs.get(arg):
                    self.events[kind].labels(replica).inc(kwargs[arg])
        elif name == "warm":
            outcome, reason = args
            self.warm.labels(outcome, reason or "").inc()
        else:
            series = {
                "upstream_error": self.upstream_errors, "retry": self.retries,
                "admission_reject": self.admission_rejects, "tokenize": self.tokenize,
                "discovery": self.discovery, "state_error": self.state_errors,
                "escalation": self.escalations, "cut_short": self.cut_short,
            }[name]
            series.labels(*args).inc()


def apply(m: RouterMetrics, plain: Plain, op: Op) -> None:
    name, args, kwargs = op
    getattr(m, name)(*args, **kwargs)
    plain.apply(op)


LATENCY_EDGES = (*ROUTING_LATENCY_BUCKETS, 0.0, -0.000001, 0.5, 1e-9, math.nextafter(0.001, 1),
                 math.nextafter(0.001, 0))
"""Latencies on, just above and just below bucket bounds, and beyond both ends."""


def random_ops(rng: random.Random, n: int) -> Iterator[Op]:
    """``n`` request-path calls over a small, fixed set of label values."""
    pools, replicas = ("small", "large"), ("r0", "r1", "r2")
    for _ in range(n):
        kind = rng.randrange(12)
        if kind < 4:
            latency = (rng.choice(LATENCY_EDGES) if rng.random() < 0.3
                       else rng.lognormvariate(-9, 2))
            yield ("decision", (rng.choice(pools), rng.choice(replicas),
                                rng.choice(("cache", "load", "pin")), rng.randrange(-5, 4000),
                                rng.randrange(-5, 9000), latency, rng.random() < 0.2), {})
        elif kind == 4:
            yield ("tokenize", (rng.choice(pools), rng.choice(("ok", "cached", "error"))), {})
        elif kind == 5:
            yield ("warm", (rng.choice(("fired", "skipped", "hit")),
                            rng.choice((None, "", "below_threshold", "busy"))), {})
        elif kind == 6:
            yield ("upstream_error", (rng.choice(replicas), rng.choice(("connect", "http"))), {})
        elif kind == 7:
            yield (rng.choice(("retry", "cut_short")), (rng.choice(replicas),), {})
        elif kind == 8:
            yield ("admission_reject", (rng.choice(("queue_full", "too_long")),), {})
        elif kind == 9:
            yield ("discovery", (rng.choice(replicas), rng.choice(("health_ok", "timeout"))), {})
        elif kind == 10 and rng.random() < 0.5:
            yield ("state_error", ("redis", rng.choice(("get_pin", "set_pin"))), {})
        elif kind == 10:
            yield ("escalation", ("small", "large", rng.choice(("proactive", "reactive"))), {})
        else:
            yield ("events", (rng.choice(replicas),),
                   {key: rng.randrange(0, 4) for key in
                    rng.sample(("applied", "gaps", "replays", "resets", "malformed"), 2)})


def sample_lines(body: bytes, names: set[str] | None = None) -> list[str]:
    """The body's sample lines, ``*_created`` left out (a creation time differs between two
    series), restricted to the sample names in ``names`` when given."""
    out = []
    for line in body.decode().splitlines():
        if line.startswith("#") or "_created" in line.split("{")[0]:
            continue
        if names is None or line.split("{")[0].split(" ")[0] in names:
            out.append(line)
    return sorted(out)


def sample_names(registry: CollectorRegistry) -> set[str]:
    return {s.name for family in registry.collect() for s in family.samples}


def assert_same(m: RouterMetrics, plain: Plain) -> None:
    """``render()`` text and ``value()`` agree, exactly, with the plain series."""
    expected = sample_lines(generate_latest(plain.registry))
    names = sample_names(plain.registry)
    assert sample_lines(m.render()[0], names) == expected
    for family in plain.registry.collect():
        for s in family.samples:
            if not s.name.endswith("_created"):
                assert m.value(s.name, s.labels) == s.value, (s.name, s.labels, s.value)


def test_many_calls_render_and_value_match_plain_series() -> None:
    rng = random.Random(20240611)
    m, plain = RouterMetrics(), Plain()
    for op in random_ops(rng, 20_000):
        apply(m, plain, op)
    assert_same(m, plain)
    body = m.render()[0].decode()
    # The histogram text itself, not only parsed values: buckets are cumulative, count = +Inf.
    hist = [line for line in body.splitlines()
            if line.startswith("kvroute_routing_latency_seconds_bucket{")]
    assert len(hist) == 2 * (len(ROUTING_LATENCY_BUCKETS) + 1)
    count = m.value("kvroute_routing_latency_seconds_count", {"pool": "small"})
    assert count == m.value("kvroute_routing_latency_seconds_bucket",
                            {"pool": "small", "le": "+Inf"})
    assert count is not None and count > 1000


def test_each_method_counts_exactly() -> None:
    """Known calls, known totals (not only agreement with another implementation)."""
    m = RouterMetrics()
    n = 1000
    for i in range(n):
        m.decision("p", "r0", "cache", cached_tokens=3, prompt_tokens=7,
                   routing_latency_s=0.00003 if i % 2 else 0.2, approximate=False)
        m.tokenize("p", "ok")
        m.warm("skipped", "below_threshold")
        m.upstream_error("r0", "connect")
        m.retry("r0")
        m.admission_reject("queue_full")
        m.cut_short("p")
        m.escalation("small", "large", "reactive")
        m.state_error("redis", "get_pin")
        m.discovery("r0", "health_ok")
        m.events("r0", applied=2, malformed=1)
    v = m.value
    assert v("kvroute_decisions_total", {"pool": "p", "replica": "r0", "reason": "cache",
                                         "approximate": "false"}) == n
    assert v("kvroute_prompt_tokens_total", {"pool": "p"}) == 7 * n
    assert v("kvroute_cached_tokens_total", {"pool": "p"}) == 3 * n
    assert v("kvroute_routing_latency_seconds_bucket", {"pool": "p", "le": "2.5e-05"}) == 0
    assert v("kvroute_routing_latency_seconds_bucket", {"pool": "p", "le": "5e-05"}) == n / 2
    assert v("kvroute_routing_latency_seconds_bucket", {"pool": "p", "le": "0.1"}) == n / 2
    assert v("kvroute_routing_latency_seconds_bucket", {"pool": "p", "le": "+Inf"}) == n
    assert v("kvroute_routing_latency_seconds_count", {"pool": "p"}) == n
    total = 0.0
    for i in range(n):
        total += 0.00003 if i % 2 else 0.2
    assert v("kvroute_routing_latency_seconds_sum", {"pool": "p"}) == total
    assert v("kvroute_tokenize_total", {"pool": "p", "outcome": "ok"}) == n
    assert v("kvroute_warm_total", {"outcome": "skipped", "reason": "below_threshold"}) == n
    assert v("kvroute_upstream_errors_total", {"replica": "r0", "kind": "connect"}) == n
    assert v("kvroute_retries_total", {"replica": "r0"}) == n
    assert v("kvroute_admission_rejects_total", {"reason": "queue_full"}) == n
    assert v("kvroute_cut_short_total", {"pool": "p"}) == n
    assert v("kvroute_escalations_total", {"from_pool": "small", "to_pool": "large",
                                           "kind": "reactive"}) == n
    assert v("kvroute_state_errors_total", {"backend": "redis", "op": "get_pin"}) == n
    assert v("kvroute_discovery_total", {"replica": "r0", "outcome": "health_ok"}) == n
    assert v("kvroute_kv_event_batches_applied_total", {"replica": "r0"}) == 2 * n
    assert v("kvroute_kv_event_malformed_total", {"replica": "r0"}) == n
    assert v("kvroute_kv_event_gaps_total", {"replica": "r0"}) is None  # never counted


def test_interleaved_updates_and_reads_stay_exact() -> None:
    """Update, read, update, read: each read is exact, and a read never loses or repeats a
    count (a second read with nothing pending changes nothing)."""
    rng = random.Random(7)
    m, plain = RouterMetrics(), Plain()
    for round_ in range(80):
        for op in random_ops(rng, rng.choice((0, 1, 2, 17, 300))):
            apply(m, plain, op)
        if round_ % 2:
            expected = sample_lines(generate_latest(plain.registry))
            names = sample_names(plain.registry)
            assert sample_lines(m.render()[0], names) == expected
            assert sample_lines(m.render()[0], names) == expected
        else:
            samples = [s for family in plain.registry.collect() for s in family.samples
                       if not s.name.endswith("_created")]
            for s in rng.sample(samples, min(5, len(samples))):
                assert m.value(s.name, s.labels) == s.value, (s.name, s.labels, s.value)
    assert_same(m, plain)


def test_every_registry_reader_sees_pending_counts() -> None:
    """Direct readers of ``registry`` (collect, get_sample_value, generate_latest, a
    restricted registry) go through the same move as ``render`` and ``value``."""
    m = RouterMetrics()
    m.warm("fired")
    assert m.registry.get_sample_value("kvroute_warm_total",
                                       {"outcome": "fired", "reason": ""}) == 1
    m.warm("fired")
    assert sum(s.value for family in m.registry.collect() for s in family.samples
               if s.name == "kvroute_warm_total") == 2
    m.warm("fired")
    assert b'kvroute_warm_total{outcome="fired",reason=""} 3.0' in generate_latest(m.registry)
    m.warm("fired")
    m.tokenize("p", "ok")
    restricted = m.registry.restricted_registry(["kvroute_warm_total"])
    assert sample_lines(generate_latest(restricted)) == [
        'kvroute_warm_total{outcome="fired",reason=""} 4.0']
    m.warm("fired")  # counted after the restricted view was made, before it is read
    assert sample_lines(generate_latest(restricted)) == [
        'kvroute_warm_total{outcome="fired",reason=""} 5.0']


def test_pending_state_is_bounded_by_label_tuples() -> None:
    """Nothing grows with the number of calls: one tally per label tuple, each back to 0
    once read, and the series then hold everything."""
    m = RouterMetrics()

    def pending_entries() -> int:
        return (sum(len(p.amounts) for p in m._pending) + len(m._decision_tallies)
                + len(m._latencies))

    def calls(k: int) -> None:
        for i in range(k):
            m.decision("p", f"r{i % 3}", "cache", 1, 2, 0.0001, approximate=False)
            m.tokenize("p", "ok")
            m.warm("skipped", "busy")
            m.events("r0", applied=1)

    calls(10)
    size = pending_entries()
    assert size == 3 + 1 + 1 + 1 + 1  # three decision keys, one pool, three counters
    calls(20_000)
    assert pending_entries() == size
    assert m.value("kvroute_tokenize_total", {"pool": "p", "outcome": "ok"}) == 20_010
    assert all(amount == 0 for p in m._pending for amount in p.amounts.values())
    assert all(t.count == t.prompt_tokens == t.cached_tokens == 0
               for t in m._decision_tallies.values())
    assert all(not any(lat.counts) for lat in m._latencies.values())


def test_series_is_created_at_its_first_count() -> None:
    """A child is made at the first count (labels checked at the caller, ``*_created`` is
    that time), not at the later read that moves the count in."""
    m = RouterMetrics()
    before = time.time()
    m.retry("r0")
    after = time.time()
    time.sleep(0.02)
    created = m.value("kvroute_retries_created", {"replica": "r0"})
    assert created is not None and before <= created <= after


def test_negative_event_amount_counts_nothing() -> None:
    m = RouterMetrics()
    with pytest.raises(ValueError, match="only go up; got -1 for 'r0'"):
        m.events("r0", applied=2, gaps=-1)
    assert m.value("kvroute_kv_event_batches_applied_total", {"replica": "r0"}) is None


def test_refuses_a_prometheus_client_with_another_histogram_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The histogram's buckets are written directly; a release storing them cumulatively
    (or renaming them) must stop the router at start, not skew ``/metrics``."""

    class CumulativeHistogram(Histogram):
        def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
            self._sum.inc(amount)
            for bound, bucket in zip(self._upper_bounds, self._buckets, strict=True):
                if amount <= bound:
                    bucket.inc(1)

    class RenamedHistogram(Histogram):
        def _metric_init(self) -> None:
            super()._metric_init()
            self._bucket_values = self._buckets
            del self._buckets

        def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
            pass

    make: Callable[[], RouterMetrics] = RouterMetrics
    for changed in (CumulativeHistogram, RenamedHistogram):
        monkeypatch.setattr(deferred_counts, "Histogram", changed)
        with pytest.raises(RuntimeError, match="Histogram internals changed"):
            make()
    monkeypatch.undo()
    make()


def test_parses_back() -> None:
    """The body stays valid exposition text after many moves."""
    m = RouterMetrics()
    for op in random_ops(random.Random(3), 2000):
        getattr(m, op[0])(*op[1], **op[2])
        if op[0] == "retry":
            m.render()
    families = {f.name for f in text_string_to_metric_families(m.render()[0].decode())}
    assert {"kvroute_decisions", "kvroute_routing_latency_seconds", "kvroute_warm"} <= families
