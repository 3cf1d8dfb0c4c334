"""Loading a LoRA adapter on demand, where the engines allow it.

Owns the one action the router takes on an engine's adapters: when a request names an adapter
that no replica of its route lists but a pool of the route declares
(``pools.<name>.lora_adapters``), load it on one healthy replica of that pool, the one with
the fewest requests in flight, through vLLM's ``POST /v1/load_lora_adapter {lora_name,
lora_path}`` (served only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), then tell the core
the replica lists it (discovery confirms at its next ``/v1/models``). One load per adapter at
a time: concurrent requests for it wait for the first one's load. An engine that answers 400
"has already been loaded" has it: that counts as loaded.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from collections.abc import Callable

from kvroute.config import RouteConfig, RouterConfig
from kvroute.core.router import RouterCore
from kvroute.core.types import PoolName, ReplicaId
from kvroute.shell.proxy import Upstream, UpstreamError

__all__ = ["LoraLoader"]

log = logging.getLogger(__name__)


class LoraLoader:
    """Loads declared adapters on demand (module docstring)."""

    def __init__(self, config: RouterConfig, core: RouterCore, upstream: Upstream, *,
                 replica_url: Callable[[ReplicaId], str | None] | None = None) -> None:
        self._config = config
        self._replica_url = replica_url
        self._core = core
        self._upstream = upstream
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.loads = 0

    def declared_pool(self, route: RouteConfig, adapter: str) -> PoolName | None:
        """The first pool of ``route`` that declares ``adapter``, or None."""
        for pool in route.pools:
            if adapter in self._config.pools[pool].lora_adapters:
                return pool
        return None

    async def ensure(self, route: RouteConfig, adapter: str) -> str | None:
        """Make sure a replica of ``route`` lists ``adapter``; the reason when it cannot."""
        if set(self._core.adapter_pools(adapter)) & set(route.pools):
            return None
        pool = self.declared_pool(route, adapter)
        if pool is None:
            return (f"no replica of route {route.name!r} lists LoRA adapter {adapter!r}; load "
                    "it on the engines or declare it under pools.<name>.lora_adapters")
        async with self._locks[adapter]:
            if set(self._core.adapter_pools(adapter)) & set(route.pools):
                return None  # loaded while this request waited
            return await self._load(pool, adapter)

    async def _load(self, pool: PoolName, adapter: str) -> str | None:
        path = self._config.pools[pool].lora_adapters[adapter]
        core = self._core
        replicas = [rep.name for rep in core.pool(pool).replicas if core.is_healthy(rep.name)]
        if not replicas:
            return f"no healthy replica in pool {pool!r} to load LoRA adapter {adapter!r} on"
        replica = min(replicas, key=lambda r: (core.load.snapshot(r).num_in_flight, r))
        base = (self._replica_url(replica) if self._replica_url is not None
                else self._config.replica(replica).url)
        if base is None:
            return f"replica {replica!r} left pool {pool!r} before LoRA adapter {adapter!r} was loaded"
        url = base + "/v1/load_lora_adapter"
        body = json.dumps({"lora_name": adapter, "lora_path": path}).encode()
        try:
            reply = await self._upstream.open(url, body, stream=False)
        except UpstreamError as exc:
            text = exc.body.decode("utf-8", "replace") if exc.body else str(exc)
            if exc.status == 400 and "has already been loaded" in text:
                self._listed(replica, adapter, path)
                return None
            hint = (" (vLLM serves it only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
                    if exc.status == 404 else "")
            log.error("loading LoRA adapter %s on %s failed: %s", adapter, replica, text)
            return f"loading LoRA adapter {adapter!r} on replica {replica} failed: {text}{hint}"
        reply.close()
        self.loads += 1
        log.info("loaded LoRA adapter %s from %s on replica %s", adapter, path, replica)
        self._listed(replica, adapter, path)
        return None

    def _listed(self, replica: ReplicaId, adapter: str, path: str) -> None:
        self._core.set_replica_adapters(
            replica, {**self._core.replica_adapters(replica), adapter: path})
