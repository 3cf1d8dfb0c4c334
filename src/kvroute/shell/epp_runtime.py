"""Start and stop ``kvroute epp``: a whole router (``shell/runtime.py``) plus the picker's
gRPC servers (``shell/epp_server.py``).

Owns the order only. The router comes up exactly as ``kvroute serve`` brings it up (core,
discovery, KV-event subscribers, session state, tokenizers, its HTTP server for ``/metrics``,
``/health`` and ``/admin/*``), the picker is made from that router's collaborators
(``Picker.of``) so both share one index, one admission bound and one session store, and the
gRPC servers listen last; readiness turns ``SERVING`` once everything is up, and
``NOT_SERVING`` first on the way down.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvroute.config import RouterConfig
from kvroute.core.clock import Clock
from kvroute.shell.epp_server import EppServer
from kvroute.shell.lifecycle import Service
from kvroute.shell.picker import Picker
from kvroute.shell.runtime import RouterRuntime

__all__ = ["EppRuntime"]


class EppRuntime(Service):
    """A running picker. ``async with EppRuntime(config, ...) as rt:`` serves ext_proc on
    ``rt.grpc_port`` and gRPC health on ``rt.health_port``.

    Args:
        config: the validated configuration (its ``listen`` is the HTTP side: metrics,
            health, admin).
        host: where the gRPC servers listen.
        grpc_port / health_port: their ports (0: a free one).
        fallbacks: endpoints after the chosen one (``Picker.fallbacks``).
        env / clock: as ``RouterRuntime`` takes them.
    """

    def __init__(self, config: RouterConfig, *, host: str = "127.0.0.1", grpc_port: int = 9002,
                 health_port: int = 9003, fallbacks: int = 0,
                 env: Mapping[str, str] | None = None, clock: Clock | None = None) -> None:
        self.router = RouterRuntime(config, env=env, clock=clock)
        self._host = host
        self._ports = (grpc_port, health_port)
        self._fallbacks = fallbacks
        self.server: EppServer | None = None
        self.picker: Picker | None = None
        self.grpc_port = 0
        self.health_port = 0

    async def start(self) -> None:
        await self.router.start()
        assert self.router.app is not None, "RouterRuntime.start builds the app"
        self.picker = Picker.of(self.router.app, fallbacks=self._fallbacks)
        discovery = self.router.discovery
        assert discovery is not None, "RouterRuntime.start builds discovery"
        # data-parallel ranks discovery found at start-up replace their configured replica;
        # later resizes reach the picker as they reach the runtime (shell/dp_discovery.py)
        probed = {rep.name for _, rep in discovery.members()}
        for configured in self.router.config.pools.values():
            for rep in configured.replicas:
                if configured.external is None and rep.name not in probed:
                    self.picker.left(rep.name)
        for pool_name, rep in discovery.members():
            self.picker.joined(pool_name, rep)
        discovery.members_hooks.append(self.picker)
        members = self.router.members
        if members is not None:  # engines from the Kubernetes API: follow them
            for pool, rep in members.members():
                self.picker.joined(pool, rep)
            members.listeners.append(self.picker)
        self.server = EppServer(self.picker)
        self.grpc_port, self.health_port = await self.server.start(self._host, *self._ports)
        await self.server.set_ready(True)

    async def stop(self) -> None:
        """The gRPC servers first (streams in flight end), then the router; both always."""
        try:
            if self.server is not None:
                await self.server.stop()
                self.server = None
        finally:
            await self.router.stop()
