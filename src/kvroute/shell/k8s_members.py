"""Pools whose engines come from the Kubernetes API: watchers, and replicas joining and leaving.

A pool with ``kubernetes:`` in the config starts with no replicas. ``KubernetesMembers`` runs
one ``shell/k8s_watch.EndpointSliceWatcher`` per such pool and applies each change it
announces to every holder of the replica set, synchronously on the event loop (so a request
never sees a replica the core knows and the picker does not):

* **joined** (scale-out; a re-pointed pod leaves, then joins at its new address):
  ``RouterCore.add_replica`` (out of routing), ``Discovery.add_replica`` (whose first
  ``/health`` brings it in), then the runtime's hook (its KV-event subscriber) and every
  listener (the picker's ``ip:port`` map);
* **left** (scale-in): listeners and the runtime's hook first, then ``Discovery`` and
  ``RouterCore.remove_replica`` (its index entries, load and resting sessions forgotten).

A discovered replica is named after its pod. A name already taken (a configured replica of
another pool) is refused with an error in the log and that engine is not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final, Protocol

import aiohttp

from kvroute.config import KubernetesSource, PoolConfig, ReplicaConfig, RouterConfig
from kvroute.core.errors import ConfigError
from kvroute.core.router import ReplicaSpec, RouterCore
from kvroute.core.types import PoolName, ReplicaId
from kvroute.shell.discovery import Discovery
from kvroute.shell.k8s_watch import EndpointSliceWatcher, K8sApi
from kvroute.wire.k8s_endpoints import EndpointDiff, EngineEndpoint, PortNames

__all__ = ["KubernetesMembers", "MembershipListener", "kubernetes_pools"]

log = logging.getLogger(__name__)

FIRST_LIST_WAIT_S: Final = 10.0
"""How long start-up waits for each pool's first list before serving without it."""


class MembershipListener(Protocol):
    def joined(self, pool: PoolName, replica: ReplicaConfig) -> None: ...
    def left(self, replica: ReplicaId) -> None: ...


def kubernetes_pools(config: RouterConfig) -> dict[PoolName, KubernetesSource]:
    return {name: pool.kubernetes for name, pool in config.pools.items()
            if pool.kubernetes is not None}


def _api(source: KubernetesSource, env: Mapping[str, str]) -> K8sApi:
    if source.kubeconfig is not None:
        return K8sApi.from_kubeconfig(Path(os.path.expanduser(source.kubeconfig)))
    return K8sApi.in_cluster(env)


class KubernetesMembers:
    """Keeps the discovered pools' replicas in the core, discovery and the listeners.

    Args:
        config: the router config (the pools with ``kubernetes:``).
        core / discovery: the replica set's holders.
        session: the aiohttp session the watchers use.
        hook: the runtime's own listener (KV-event subscribers), told first on join and
            leave alike.
        env: for in-cluster credentials (``os.environ`` in production).
        retry_s: the watchers' pause after a failed list or watch.
    """

    def __init__(self, config: RouterConfig, core: RouterCore, discovery: Discovery,
                 session: aiohttp.ClientSession, *, hook: MembershipListener,
                 env: Mapping[str, str], retry_s: float = 2.0) -> None:
        self._config = config
        self._core = core
        self._discovery = discovery
        self._hook = hook
        self.listeners: list[MembershipListener] = []
        self._members: dict[ReplicaId, tuple[PoolName, ReplicaConfig]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.watchers: dict[PoolName, EndpointSliceWatcher] = {}
        for name, source in kubernetes_pools(config).items():
            self.watchers[name] = EndpointSliceWatcher(
                _api(source, env), session, namespace=source.namespace,
                label_selector=source.label_selector,
                ports=PortNames(http=source.http_port, kv_events=source.kv_events_port),
                on_change=self._on_change(config.pools[name]), retry_s=retry_s)

    def members(self) -> list[tuple[PoolName, ReplicaConfig]]:
        """The discovered replicas now (for a listener added after start)."""
        return list(self._members.values())

    async def start(self) -> None:
        """Start the watchers and wait (bounded) for each pool's first list."""
        for name, watcher in self.watchers.items():
            task = asyncio.create_task(watcher.run(), name=f"kvroute-k8s-{name}")
            task.add_done_callback(self._ended)
            self._tasks.append(task)
        for name, watcher in self.watchers.items():
            try:
                await asyncio.wait_for(watcher.listed.wait(), FIRST_LIST_WAIT_S)
            except TimeoutError:
                log.error("kubernetes: pool %s has no engines after %.0fs (the API server is "
                          "unreachable or the selector matches nothing); serving without "
                          "them and still watching", name, FIRST_LIST_WAIT_S)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("kubernetes watcher %s ended with an error; its pool no longer follows "
                      "the cluster", task.get_name(), exc_info=task.exception())

    def _on_change(self, pool: PoolConfig,
                   ) -> Callable[[EndpointDiff, Mapping[str, EngineEndpoint]], None]:  # fmt: skip
        source = pool.kubernetes
        assert source is not None

        def apply(diff: EndpointDiff, _: Mapping[str, EngineEndpoint]) -> None:
            for ep in (*diff.removed, *diff.changed):
                self._leave(ReplicaId(ep.name))
            for ep in (*diff.added, *diff.changed):
                self._join(pool, ReplicaConfig(
                    name=ReplicaId(ep.name), url=ep.url, kv_events=ep.kv_events,
                    prefill_rate_tps=source.prefill_rate_tps))

        return apply

    def _join(self, pool: PoolConfig, rep: ReplicaConfig) -> None:
        try:
            self._core.add_replica(pool.name, ReplicaSpec(rep.name, rep.prefill_rate_tps))
        except ConfigError as exc:
            log.error("kubernetes: engine %s (%s) not added to pool %s: %s", rep.name, rep.url,
                      pool.name, exc)
            return
        if pool.report_hits:
            self._core.set_hit_reports(rep.name, True)
        self._members[rep.name] = (pool.name, rep)
        self._discovery.add_replica(pool.name, rep)
        self._hook.joined(pool.name, rep)
        for listener in self.listeners:
            listener.joined(pool.name, rep)
        log.info("kubernetes: %s joined pool %s at %s", rep.name, pool.name, rep.url)

    def _leave(self, name: ReplicaId) -> None:
        member = self._members.pop(name, None)
        if member is None:
            return  # never added (its name was taken)
        pool = member[0]
        for listener in self.listeners:
            listener.left(name)
        self._hook.left(name)
        self._discovery.remove_replica(name)
        self._core.remove_replica(name)
        log.info("kubernetes: %s left pool %s", name, pool)
