"""The background sender of warm-ahead requests (``core/warm.py`` decides, this sends).

Owns the warm-up tasks: claim the session's shared cooldown (``SessionState.try_start_warm``,
Redis ``SET NX PX`` with several routers), route the warm-up through ``RouterCore.route`` in
the target pool (same tenant scope, same ``cache_salt``, so the engine computes exactly the
blocks the escalated request will look up), POST the ``max_tokens: 1`` body, and count what
happened. It must not import ``shell/app.py`` (the app builds the route request for it).

Never on the request's critical path: ``fire`` only creates a task. A warm-up that fails,
times out (``warm_ahead.timeout_s``) or finds no replica costs a counter
(``kvroute_warm_total{outcome="failed", reason}``) and a log line, nothing else; at most
``warm_ahead.max_in_flight`` run at once (beyond that a warm-up is skipped, reason
``busy``), so a slow large pool cannot pile up background work. A refused connection is
reported to discovery like a failed request's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable

from kvroute.config import RouterConfig
from kvroute.core.errors import NoEligibleReplica
from kvroute.core.router import RouterCore, RouteRequest
from kvroute.core.types import ReplicaId, RequestId
from kvroute.core.warm import WarmFire
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.proxy import Upstream, UpstreamError
from kvroute.shell.state import SessionState

__all__ = ["WarmSender"]

log = logging.getLogger("kvroute.warm")

RouteRequestFactory = Callable[[RequestId], Awaitable[RouteRequest]]


class WarmSender:
    """Sends warm-ahead requests in background tasks (module docstring).

    Invariant: ``len(self.tasks) <= max_in_flight``; every task releases the load it put
    on ``RouterCore`` (``on_complete``) on every exit path, and ``close`` cancels them all.

    Args:
        config: ``warm_ahead`` (timeout, bound, cooldown) and the replicas' URLs.
        core: the router core (routing and load bookkeeping of the warm-up).
        upstream: the pooled upstream client.
        metrics: ``warm_total``.
        state: the shared cooldowns; None = this process's view only.
        on_replica_failure: told when a replica refuses the connection.
    """

    def __init__(self, config: RouterConfig, *, core: RouterCore, upstream: Upstream,
                 metrics: RouterMetrics, state: SessionState | None,
                 on_replica_failure: Callable[[ReplicaId, str], None] | None = None,
                 ) -> None:  # fmt: skip
        self._config = config
        self._core = core
        self._upstream = upstream
        self._metrics = metrics
        self._state = state
        self._on_replica_failure = on_replica_failure
        self.timeout_s = config.warm_ahead.timeout_s
        self.max_in_flight = config.warm_ahead.max_in_flight
        self.tasks: set[asyncio.Task[None]] = set()

    def fire(self, fire: WarmFire, body: bytes, path: str, claim_key: str,
             build: RouteRequestFactory) -> bool:  # fmt: skip
        """Start one warm-up in the background; False (counted ``busy``) when at the bound.

        Args:
            fire: the planner's decision.
            body: the warm-up body (``wire.openai.warm_request_body``, salt included).
            path: ``/v1/chat/completions`` or ``/v1/completions``.
            claim_key: the session's key in the shared cooldown store.
            build: makes the ``RouteRequest`` for the target pool (tokenizing there).
        """
        if len(self.tasks) >= self.max_in_flight:
            self._metrics.warm("skipped", "busy")
            return False
        task = asyncio.get_running_loop().create_task(
            self._run(fire, body, path, claim_key, build), name=f"kvroute-warm-{fire.session_id}"
        )
        self.tasks.add(task)
        task.add_done_callback(self._reap)
        return True

    def _reap(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # A bug, not an engine failure (those are counted inside _run): say it loudly.
            self._metrics.warm("failed", "internal")
            log.error("warm-ahead task failed", exc_info=task.exception())

    async def close(self) -> None:
        """Cancel every running warm-up and wait for them to release their load."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, fire: WarmFire, body: bytes, path: str, claim_key: str,
                   build: RouteRequestFactory) -> None:  # fmt: skip
        cooldown_s = self._config.warm_ahead.cooldown_s
        claimed = (self._state is None or cooldown_s <= 0
                   or await self._state.try_start_warm(claim_key, cooldown_s))
        if not claimed:
            self._metrics.warm("skipped", "cooldown_shared")
            return
        request_id = RequestId(f"warm-{uuid.uuid4().hex}")
        try:
            async with asyncio.timeout(self.timeout_s):
                route_request = await build(request_id)
                decision = self._core.route(route_request)
                self._metrics.warm("fired", fire.target_pool_name)
                try:
                    url = self._config.replica(decision.replica).url + path
                    await self._upstream.open(url, body, stream=False,
                                              headers={"X-Request-Id": request_id})
                    self._core.on_first_token(decision.replica, request_id)
                finally:
                    self._core.on_complete(decision.replica, request_id)
        except NoEligibleReplica as exc:
            self._failed("no_replica", fire, str(exc))
            return
        except TimeoutError:
            self._failed("timeout", fire, f"no answer within {self.timeout_s:g}s")
            return
        except UpstreamError as exc:
            self._failed(exc.kind, fire, str(exc))
            if exc.kind == "connect" and self._on_replica_failure is not None:
                self._on_replica_failure(decision.replica, str(exc))
            return
        self._metrics.warm("completed", fire.target_pool_name)

    def _failed(self, reason: str, fire: WarmFire, detail: str) -> None:
        self._metrics.warm("failed", reason)
        log.warning("warm-ahead of session %s to pool %r failed (%s): %s; the session will "
                    "find the prefix uncached if it escalates", fire.session_id,
                    fire.target_pool_name, reason, detail)
