"""The background sender of shadow warm-ups (``core/scenarios.py`` decides, this sends).

A route's upgrade warms the new version's replicas, and its failover may warm the backup,
with ``max_tokens: 1`` copies of live sessions' latest prompts before they take traffic
(docs/model-bound-caches.md). The walk asks for them with a ``ShadowWarm`` note; the live
driver hands the note here. Each item is routed through ``RouterCore.route`` with the
request the walker builds for it (``Walker.shadow_request``: the warmed version's replicas
only, the version's salt when the route salts), sent with the session's own body
(``wire.turn_copy.turn_copy_body``: same prompt, ``max_tokens: 1``, the salt the index was
hashed with; for a ``SessionTurn`` whose answer the forwarder read, the prompt plus that
answer as the next turn will resend it), and reported to the walker when it answered or failed, which is what an
upgrade waits for before the new version takes traffic.

Items of one note are sent one after the other (a shadow warm-up must not queue a burst of
prefills ahead of the engine's live traffic), each bounded by ``warm_ahead.timeout_s``; at
most ``MAX_NOTES`` notes run at once, beyond which a note is dropped and counted (its items
are reported done, so an upgrade is not held back by warm-ups never sent). Failures (an
engine's error, a timeout, even an unexpected exception while building the copy) cost a
counter and a log line, never a request: nothing is raised out of a note's task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Final

from kvroute.config import RouterConfig
from kvroute.core.errors import NoEligibleReplica
from kvroute.core.scenarios import HotSession
from kvroute.core.types import ReplicaId, RequestId
from kvroute.core.walk import ShadowWarm, Walker
from kvroute.shell.dp_headers import DpRankHeaders
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.proxy import Upstream, UpstreamError
from kvroute.wire.openai import ParsedRequest
from kvroute.wire.turn_copy import SessionTurn, turn_copy_body

__all__ = ["MAX_NOTES", "ShadowWarmSender"]

log = logging.getLogger("kvroute.scenarios")

MAX_NOTES: Final = 4
"""Shadow warm-up notes sent at once (each sends its items one after the other)."""


class ShadowWarmSender:
    """Sends shadow warm-ups in the background (module docstring)."""

    def __init__(self, config: RouterConfig, walker: Walker, upstream: Upstream,
                 metrics: RouterMetrics,
                 on_replica_failure: Callable[[ReplicaId, str], None] | None = None, *,
                 replica_url: Callable[[ReplicaId], str | None] | None = None) -> None:
        self._config = config
        self._dp_headers = DpRankHeaders(config)
        self._replica_url = replica_url  # discovery's member_url (replicas may come and go)
        self._walker = walker
        self._upstream = upstream
        self._metrics = metrics
        self._on_replica_failure = on_replica_failure
        self.timeout_s = config.warm_ahead.timeout_s
        self.tasks: set[asyncio.Task[None]] = set()
        self._sequence = 0

    def fire(self, note: ShadowWarm) -> None:
        """Send ``note``'s items in the background (dropped and counted when busy)."""
        if len(self.tasks) >= MAX_NOTES:
            for _ in note.items:
                self._walker.shadow_done(note)
                self._metrics.scenarios.shadow_warm(note.route, note.scenario, "dropped")
            log.warning("shadow warm-up of pool %r (%s) dropped: %d already running",
                        note.pool, note.scenario, len(self.tasks))
            return
        task = asyncio.get_running_loop().create_task(self._run(note),
                                                      name=f"kvroute-shadow-{note.pool}")
        self.tasks.add(task)
        task.add_done_callback(self._reap)

    async def close(self) -> None:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _reap(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("shadow warm-up task failed", exc_info=task.exception())

    async def _run(self, note: ShadowWarm) -> None:
        log.info("shadow warm-up of pool %r (%s%s): %d sessions, %d tokens", note.pool,
                 note.scenario, f", version {note.version}" if note.version else "",
                 len(note.items), sum(item.tokens for item in note.items))
        for item in note.items:
            try:
                ok = await self._send(note, item)
            except Exception:  # a bug or bad session data: this copy fails, nothing else
                log.exception("shadow warm-up of pool %r (%s) failed", note.pool,
                              note.scenario)
                ok = False
            finally:
                self._walker.shadow_done(note)
            self._metrics.scenarios.shadow_warm(note.route, note.scenario,
                                                "sent" if ok else "failed",
                                                item.tokens if ok else 0)

    async def _send(self, note: ShadowWarm, item: HotSession) -> bool:
        payload = item.payload
        if isinstance(payload, SessionTurn):
            parsed, answer = payload.request, payload.answer
        elif isinstance(payload, ParsedRequest):
            parsed, answer = payload, None
        else:
            return False  # no body kept for this session (not a live request)
        core = self._walker.core
        self._sequence += 1
        request_id = RequestId(f"shadow-{note.scenario}-{self._sequence}")
        try:
            decision = core.route(self._walker.shadow_request(note, item, request_id))
        except NoEligibleReplica as exc:
            log.warning("shadow warm-up of pool %r: %s", note.pool, exc)
            return False
        try:
            body = turn_copy_body(parsed, answer, model=self._config.pools[note.pool].model,
                                  cache_salt=decision.request.cache_salt)
            path = "/v1/chat/completions" if parsed.endpoint == "chat" else "/v1/completions"
            base = (self._replica_url(decision.replica) if self._replica_url is not None
                    else self._config.replica(decision.replica).url)
            if base is None:  # it left the pool (Kubernetes scale-in)
                return False
            url = base + path
            async with asyncio.timeout(self.timeout_s):
                await self._upstream.open(url, body, stream=False,
                                          headers={"X-Request-Id": request_id,
                                                   **self._dp_headers.of(decision.replica)})
            core.on_first_token(decision.replica, request_id)
            return True
        except (UpstreamError, TimeoutError) as exc:
            log.warning("shadow warm-up to %s failed: %s", decision.replica, exc)
            if (isinstance(exc, UpstreamError) and exc.kind == "connect"
                    and self._on_replica_failure is not None):
                self._on_replica_failure(decision.replica, str(exc))
            return False
        finally:
            core.on_complete(decision.replica, request_id)
