"""The live dashboard: one HTML page and the JSON it polls.

Owns ``GET /dashboard`` (a static page shipped as package data,
``kvroute/data/dashboard/index.html``: plain HTML and JavaScript, nothing to build) and
``GET /dashboard/data`` (a JSON snapshot the page fetches every two seconds): per pool its
tier settings (window, hashing, approximate, drift alarm) and decisions per second; per
replica its load, KV use, hit rate as predicted by the router and as measured by the engine,
preemptions and prefix caching; warm-up counts; admission; the last refusals.

Both are open like ``/metrics`` is: they show the fleet's names, load and counts, never a
tenant's prompts, keys or index entries (those stay behind the admin key on
``/admin/state`` and ``/admin/index``). docs/observability.md describes the page.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Final

from kvroute.config import RouterConfig
from kvroute.core.router import RouterCore
from kvroute.core.types import ReplicaId
from kvroute.http.server import Request, Response
from kvroute.shell.activity import Activity
from kvroute.shell.admin import DiscoveryView
from kvroute.shell.admission import Admission
from kvroute.shell.cache_feedback import CacheFeedback
from kvroute.shell.metrics import RouterMetrics

__all__ = ["Dashboard"]

_HTML: Final = "text/html; charset=utf-8"


@cache
def _page() -> bytes:
    return (resources.files("kvroute") / "data" / "dashboard" / "index.html").read_bytes()


def _ratio(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


@dataclass(slots=True)
class Dashboard:
    """The two handlers (module docstring)."""

    config: RouterConfig
    core: RouterCore
    metrics: RouterMetrics
    admission: Admission
    activity: Activity
    feedback: CacheFeedback | None = None
    discovery: DiscoveryView | None = None

    async def page(self, request: Request) -> Response:
        return Response(body=_page(), content_type=_HTML)

    async def data(self, request: Request) -> Response:
        body = json.dumps(self.snapshot(), separators=(",", ":")).encode()
        response = Response(body=body, content_type="application/json")
        response.headers["Cache-Control"] = "no-store"
        return response

    def snapshot(self) -> dict[str, Any]:
        """Everything the page shows, as plain JSON values."""
        per_second = self.activity.decisions_per_second()
        feedback = self.feedback
        pools = []
        for name in self.core.pool_names():
            spec = self.core.pool(name)
            pool_cfg = self.config.pools[name]
            row: dict[str, Any] = {
                "name": name, "model": pool_cfg.model,
                "window": self.discovery.pool_window(name) if self.discovery else None,
                "block_size": spec.block_size, "hash_algo": spec.hash_algo,
                "approximate": spec.approximate or self.core.pool_drifting(name),
                "decisions_per_s": round(per_second.get(name, 0.0), 2),
                "external": pool_cfg.external is not None,
            }
            monitor = feedback.pools.get(name) if feedback is not None else None
            if monitor is not None:
                row["drift"] = {
                    "alarm": monitor.alarm, "ratio": _ratio(monitor.drift_ratio),
                    "compared": monitor.num_samples, "agree": monitor.agree,
                    "over": monitor.over, "under": monitor.under,
                    "predicted_tokens": monitor.predicted_total,
                    "measured_tokens": monitor.measured_total,
                }
            pools.append(row)
        replicas = [self._replica(pool.name, rep.name) for pool in self.config.pools.values()
                    if pool.external is None for rep in self.core.pool(pool.name).replicas]
        adm = self.admission
        return {
            "time": time.time(),
            "policy": self.config.policy.name,
            "decisions_per_s": round(sum(per_second.values()), 2),
            "pools": pools,
            "replicas": replicas,
            "warm": self._warm_counts(),
            "admission": {"in_flight": adm.in_flight, "queued": adm.queued,
                          "max_in_flight": adm.max_in_flight, "max_queue": adm.max_queue},
            "refusals": self.activity.recent_refusals(),
        }

    def _replica(self, pool: str, name: ReplicaId) -> dict[str, Any]:
        load = self.core.load.snapshot(name)
        row: dict[str, Any] = {
            "name": name, "pool": pool, "healthy": self.core.is_healthy(name),
            "in_flight": load.num_in_flight, "decoding": load.num_decoding,
            "outstanding_prefill_tokens": round(load.outstanding_prefill_tokens),
            "engine_running": load.engine_running, "engine_waiting": load.engine_waiting,
            "kv_usage": _ratio(load.kv_usage),
            "predicted_hit_ratio": _ratio(self.activity.predicted_hit_ratio(name)),
            "reported_hit_ratio": None, "engine_hit_ratio": None,
            "engine_hit_ratio_total": None, "preemptions": None, "prefix_caching": None,
            "excluded": None,
        }
        if self.discovery is not None:
            # Discovery's ReplicaInfo has these; a thinner view (tests) may not.
            info = self.discovery.replica_info(name)
            excluded = getattr(info, "excluded_reason", None)
            row["excluded"] = excluded or (None if row["healthy"] else
                                           getattr(info, "last_error", None))
            if row["kv_usage"] is None:
                row["kv_usage"] = _ratio(getattr(info, "kv_usage", None))
        if self.feedback is not None:
            engine = self.feedback.engines.get(name)
            if engine is not None:
                row["engine_hit_ratio"] = _ratio(engine.interval_hit_ratio)
                row["engine_hit_ratio_total"] = _ratio(engine.hit_ratio)
                row["preemptions"] = int(engine.preemptions_total)
                row["prefix_caching"] = engine.caching_enabled
            compared = self.feedback.replicas.get(name)
            if compared is not None and compared.prompt_tokens:
                row["reported_hit_ratio"] = _ratio(compared.measured_tokens
                                                   / compared.prompt_tokens)
        return row

    def _warm_counts(self) -> Mapping[str, int]:
        """Warm-ahead requests by outcome (``kvroute_warm_total``; ``skipped`` and ``failed``
        by reason, ``skipped: cooldown``, the others summed over their target pools)."""
        counts: dict[str, int] = {}
        for family in self.metrics.registry.collect():
            if family.name != "kvroute_warm":
                continue
            for sample in family.samples:
                if sample.name == "kvroute_warm_total":
                    outcome = sample.labels.get("outcome", "")
                    reason = sample.labels.get("reason", "")
                    if outcome in ("skipped", "failed") and reason:
                        outcome = f"{outcome}: {reason}"
                    counts[outcome] = counts.get(outcome, 0) + int(sample.value)
        return counts
