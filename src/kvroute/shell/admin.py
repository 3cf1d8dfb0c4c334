"""The router's own endpoints: ``/v1/models``, ``/health``, ``/metrics`` and the admin ones.

``/admin/index`` and ``/admin/state`` need the admin key (``shell/tenancy.check_admin``):
they show every tenant's index entries and every replica's load, which no tenant may see.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from kvroute.config import RouterConfig, Secrets
from kvroute.core.index import AdminCapability
from kvroute.core.router import RouterCore
from kvroute.core.types import PoolName, WireHash
from kvroute.http.server import Request, Response
from kvroute.shell.admission import Admission
from kvroute.shell.forward import error_answer
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.tenancy import check_admin
from kvroute.shell.tier_pools import TierPools, TierView
from kvroute.wire.openai import RequestError, model_card, models_response

__all__ = ["AdminEndpoints", "DiscoveryView"]

_JSON: Final = "application/json"


class DiscoveryView(TierView, Protocol):
    """What the HTTP layer reads from discovery (``shell/discovery.py``): windows for
    ``/v1/models`` and everything the tier view reads (``shell/tier_pools.TierView``)."""

    def member_url(self, replica: str) -> str | None: ...


def _json(obj: Any, status: int = 200) -> Response:
    return Response(status=status, body=json.dumps(obj).encode(), content_type=_JSON)


def _query_hashes(value: str | None) -> list[WireHash]:
    if not value:
        return []
    try:
        return [WireHash(int(part, 0)) for part in value.split(",") if part.strip()]
    except ValueError:
        raise RequestError(
            f"'hashes' must be comma-separated integers (wire-form block hashes), got {value!r}.",
            param="hashes",
        ) from None


@dataclass(slots=True)
class AdminEndpoints:
    """Handlers of the router's own endpoints (module docstring)."""

    config: RouterConfig
    core: RouterCore
    secrets: Secrets
    metrics: RouterMetrics
    admission: Admission
    pools: TierPools
    discovery: DiscoveryView | None = None
    admin: AdminCapability | None = None
    extra_state: Callable[[], Mapping[str, Any]] | None = None
    on_scrape: Callable[[], None] | None = None

    async def models(self, request: Request) -> Response:
        created = int(time.time())
        cards = []
        for name, route in self.config.routes.items():
            pool = route.pools[-1]
            window = self.discovery.pool_window(pool) if self.discovery is not None else None
            cards.append(model_card(id=name, created=created, max_model_len=window,
                                    permission_id=f"modelperm-{name}",
                                    root=self.pools.upstream_model(route, pool)))
        listed = set(self.config.routes)
        for name, route in self.config.routes.items():
            # LoRA adapters the route's engines list, as vLLM lists them: parent = the model
            # clients send for the base, root = the path the engines loaded it from.
            for pool in route.pools:
                for adapter in sorted({a for rep in self.core.pool(pool).replicas
                                       for a in self.core.replica_adapters(rep.name)}):
                    key = self.core.lora_key(PoolName(pool), adapter)
                    if adapter in listed or key is None:
                        continue
                    listed.add(adapter)
                    cards.append(model_card(id=adapter, created=created, max_model_len=None,
                                            permission_id=f"modelperm-{adapter}",
                                            root=key.path, parent=name))
        return _json(models_response(cards))

    async def health(self, request: Request) -> Response:
        pools = {
            # The core's replicas: a pool reading its engines from Kubernetes lists none.
            name: sum(1 for rep in self.core.pool(name).replicas
                      if self.core.is_healthy(rep.name))
            for name in self.config.pools
        }
        dead = [name for name, route in self.config.routes.items()
                if not any(pools[p] for p in route.pools)]
        body = {"status": "ok" if not dead else "degraded", "healthy_replicas": pools,
                "routes_without_replicas": dead}
        return _json(body, status=200 if not dead else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        if self.on_scrape is not None:
            self.on_scrape()
        stats = self.core.index.stats()
        self.metrics.set_index_size(stats.num_entries, stats.num_hashes)
        body, content_type = self.metrics.render()
        response = Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    async def admin_index(self, request: Request) -> Response:
        try:
            capability = check_admin(request, self.secrets, self.admin)
            hashes = _query_hashes(request.query.get("hashes"))
        except RequestError as exc:
            return error_answer(exc.status, exc.body())
        stats = self.core.index.stats()
        body: dict[str, Any] = {
            "num_entries": stats.num_entries,
            "num_hashes": stats.num_hashes,
            "num_entries_by_replica": dict(stats.num_entries_by_replica),
            "num_predicted": stats.num_predicted,
            "num_extra_copies": stats.num_extra_copies,
            "num_removed_unknown": stats.num_removed_unknown,
            "num_evicted_for_bound": stats.num_evicted_for_bound,
        }
        if hashes:
            matches = self.core.index.match(hashes, capability.fleet_scope())
            body["match"] = {
                replica: {"gpu": m.num_gpu_blocks, "cpu": m.num_cpu_blocks,
                          "storage": m.num_storage_blocks, "predicted": m.num_predicted_blocks}
                for replica, m in matches.items()
            }
        return _json(body)

    async def admin_state(self, request: Request) -> Response:
        try:
            check_admin(request, self.secrets, self.admin)
        except RequestError as exc:
            return error_answer(exc.status, exc.body())
        replicas: dict[str, Any] = {}
        configured = {rep.name: rep.url for _, rep in self.config.replicas()}
        for pool, rep in ((p, r) for p in self.config.pools.values()
                          for r in self.core.pool(p.name).replicas):
            load = self.core.load.snapshot(rep.name)
            url = configured.get(rep.name)
            if url is None and self.discovery is not None:  # discovered (Kubernetes)
                url = self.discovery.member_url(rep.name)
            replicas[rep.name] = {
                "pool": pool.name,
                "url": url,
                "healthy": self.core.is_healthy(rep.name),
                "outstanding_prefill_tokens": load.outstanding_prefill_tokens,
                "in_flight": load.num_in_flight,
                "decoding": load.num_decoding,
                "prefill_rate_tps": round(load.prefill_rate_tps, 1),
                "engine_running": load.engine_running,
                "engine_waiting": load.engine_waiting,
                "kv_usage": load.kv_usage,
            }
        pools = {}
        for name in self.core.pool_names():
            spec = self.core.pool(name)
            pools[name] = {"block_size": spec.block_size, "hash_algo": spec.hash_algo,
                           "approximate": spec.approximate,
                           "drift_alarm": self.core.pool_drifting(name)}
        adm = self.admission
        body: dict[str, Any] = {
            "policy": self.config.policy.name,
            "pools": pools,
            "replicas": replicas,
            "admission": {"in_flight": adm.in_flight, "queued": adm.queued,
                          "max_in_flight": adm.max_in_flight, "max_queue": adm.max_queue},
        }
        if self.extra_state is not None:
            body.update(self.extra_state())
        return _json(body)
