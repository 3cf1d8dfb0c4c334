"""Prometheus series of the model-bound cache scenarios (docs/model-bound-caches.md).

Registered in the router's own registry by ``RouterMetrics`` (``metrics.scenarios``). Label
values are route, pool, replica and scenario names from the config, arm names (pools), and
versions (fingerprints: one per checkpoint a replica has run, so bounded by the fleet's
deploys).

=====================================  =========  ==========================================
name (prefixed ``kvroute_``)           type       labels
=====================================  =========  ==========================================
recompute_tokens_total                 counter    route, scenario (tokens re-prefilled because
                                                  a session moved: upgrade, version, ab,
                                                  failover; gate: a refused transfer)
gate_refusals_total                    counter    path, reason (the verdict book refused a
                                                  path: fail, stale, none)
gate_verdicts                          gauge      (verdicts loaded from gate.verdicts)
gate_verdict_loads_total               counter    outcome (ok, error)
scenario_moves_total                   counter    route, scenario
shadow_warm_total                      counter    route, scenario, outcome (sent, failed)
shadow_warm_tokens_total               counter    route, scenario (prompt tokens sent)
ab_requests_total                      counter    route, arm
ab_prompt_tokens_total                 counter    route, arm
ab_cached_tokens_total                 counter    route, arm (expected cached prefix)
ab_first_byte_seconds                  histogram  route, arm (request read → first byte)
ab_recompute_tokens_total              counter    route, arm (tokens a flip to this arm lost)
failover_active                        gauge      route (1 while the backup takes it)
model_identity_changes_total           counter    replica
replica_version                        gauge      replica, version (1 for the current one)
=====================================  =========  ==========================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ScenarioMetrics"]

_FIRST_BYTE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ScenarioMetrics:
    """The scenario series (module docstring); every method is a cheap update, no I/O."""

    def __init__(self, registry: CollectorRegistry, namespace: str) -> None:
        r, ns = registry, namespace
        self._recompute = Counter(
            "recompute_tokens", "Prompt tokens re-prefilled because a session moved (its "
            "version's replicas changed weights or left, an upgrade, an A/B flip, a failover).",
            ["route", "scenario"], namespace=ns, registry=r)
        self._moves = Counter(
            "scenario_moves", "Sessions moved by a scenario.", ["route", "scenario"],
            namespace=ns, registry=r)
        self._shadow = Counter(
            "shadow_warm", "Shadow warm-ups (max_tokens 1 copies of live sessions' prompts).",
            ["route", "scenario", "outcome"], namespace=ns, registry=r)
        self._shadow_tokens = Counter(
            "shadow_warm_tokens", "Prompt tokens sent in shadow warm-ups.",
            ["route", "scenario"], namespace=ns, registry=r)
        self._ab_requests = Counter(
            "ab_requests", "Requests of an A/B route by arm.", ["route", "arm"],
            namespace=ns, registry=r)
        self._ab_prompt = Counter(
            "ab_prompt_tokens", "Prompt tokens of an A/B route by arm.", ["route", "arm"],
            namespace=ns, registry=r)
        self._ab_cached = Counter(
            "ab_cached_tokens", "Expected cached prefix tokens of an A/B route by arm (the "
            "arm's hit rate is this over ab_prompt_tokens_total).", ["route", "arm"],
            namespace=ns, registry=r)
        self._ab_first_byte = Histogram(
            "ab_first_byte_seconds", "Request read to the engine's first byte, by A/B arm.",
            ["route", "arm"], namespace=ns, registry=r, buckets=_FIRST_BYTE_BUCKETS)
        self._ab_recompute = Counter(
            "ab_recompute_tokens", "Prompt tokens re-prefilled because a session flipped to "
            "this A/B arm (0 with sticky sessions).", ["route", "arm"], namespace=ns,
            registry=r)
        self._failover = Gauge(
            "failover_active", "1 while a route's failover backup takes its traffic.",
            ["route"], namespace=ns, registry=r)
        self._identity_changes = Counter(
            "model_identity_changes", "Times a replica was found on other weights (its index "
            "entries and learned rates were dropped).", ["replica"], namespace=ns, registry=r)
        self._version = Gauge(
            "replica_version", "The model version a replica runs (1 for the current one).",
            ["replica", "version"], namespace=ns, registry=r)
        self._versions: dict[str, str] = {}
        self._gate_refusals = Counter(
            "gate_refusals", "Paths that would serve a request from state other weights "
            "computed, refused for want of a current passing verdict (the request "
            "recomputes).", ["path", "reason"], namespace=ns, registry=r)
        self._gate_verdicts = Gauge(
            "gate_verdicts", "Verdicts loaded from the gate's verdict file.",
            namespace=ns, registry=r)
        self._gate_loads = Counter(
            "gate_verdict_loads", "Loads of the gate's verdict file (an error leaves no "
            "verdict: every transfer path recomputes).", ["outcome"], namespace=ns,
            registry=r)

    def gate_refusal(self, route: str, path: str, reason: str, tokens: int) -> None:
        """A refused transfer path; ``tokens`` it recomputes go to the recompute bill
        (``scenario="gate"``)."""
        self._gate_refusals.labels(path, reason).inc()
        if tokens:
            self._recompute.labels(route, "gate").inc(tokens)

    def gate_loaded(self, verdicts: int, *, ok: bool) -> None:
        self._gate_loads.labels("ok" if ok else "error").inc()
        self._gate_verdicts.set(verdicts)

    def move(self, route: str, scenario: str, tokens: int, to_place: str = "") -> None:
        self._moves.labels(route, scenario).inc()
        if tokens:
            self._recompute.labels(route, scenario).inc(tokens)
            if scenario == "ab":
                self._ab_recompute.labels(route, to_place).inc(tokens)

    def shadow_warm(self, route: str, scenario: str, outcome: str, tokens: int = 0) -> None:
        self._shadow.labels(route, scenario, outcome).inc()
        if tokens:
            self._shadow_tokens.labels(route, scenario).inc(tokens)

    def arm_served(self, route: str, arm: str, prompt_tokens: int, cached_tokens: int) -> None:
        self._ab_requests.labels(route, arm).inc()
        self._ab_prompt.labels(route, arm).inc(prompt_tokens)
        self._ab_cached.labels(route, arm).inc(cached_tokens)

    def arm_first_byte(self, route: str, arm: str, seconds: float) -> None:
        self._ab_first_byte.labels(route, arm).observe(seconds)

    def set_failover(self, route: str, active: bool) -> None:
        self._failover.labels(route).set(1.0 if active else 0.0)

    def identity(self, replica: str, version: str, *, changed: bool) -> None:
        """``replica`` runs ``version`` (``changed``: it ran another one before)."""
        if changed:
            self._identity_changes.labels(replica).inc()
        old = self._versions.get(replica)
        if old is not None and old != version:
            self._version.remove(replica, old)
        self._versions[replica] = version
        self._version.labels(replica, version).set(1.0)
