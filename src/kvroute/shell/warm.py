"""The background sender of warm-ahead requests (``core/warm.py`` decides, this sends).

Owns the warm-up tasks, which drive their in-flight guards (``core.warm_slots.WarmSlots``,
pure bookkeeping): claim the session's shared cooldown (``SessionState.try_start_warm``,
Redis ``SET NX PX`` with several routers), route the warm-up through ``RouterCore.route`` in
the target pool (same tenant scope, same ``cache_salt``, so the engine computes exactly the
blocks the escalated request will look up), POST the ``max_tokens: 1`` body, and count what
happened. It must not import ``shell/app.py`` (the app builds the route request for it).

Never on the request's critical path: ``fire`` only records a job and maybe creates a task.
A warm-up that fails, times out (``warm_ahead.timeout_s`` after it was sent) or finds no
replica costs a counter (``kvroute_warm_total{outcome="failed", reason}``) and a log line,
nothing else.

Why the in-flight guards exist: a warm-up is a full prefill on the target engine, and vLLM
schedules FCFS, so a real request that escalates queues behind every warm-up already sent
there, and warm-ups of many sessions arriving together pile up (``kvroute bench tiers-live``
with 12 sessions on one large engine). Three bounds, in this order, and chunking:

1. **One warm-up per session in flight** (``WarmSlots.offer``). A later growth stage of a
   session whose warm-up is still on its way *waits* for it rather than superseding it: the
   earlier prompt is a prefix of the later one, so once it is cached the later warm-up only
   prefills the growth, whereas two in flight together compute the shared prefix twice, and
   cancelling the earlier one throws away whatever part of it the engine had not committed
   to its cache yet. What waits is coalesced: a session has at most one job waiting, the
   latest stage (the one the next escalation needs); an older waiting stage is dropped and
   counted ``skipped``/``superseded``. A job not yet *committed* (still waiting for a
   replica slot, nothing sent) is replaced in place the same way.
2. **At most ``warm_ahead.max_in_flight_per_replica`` warm-ups per target replica**
   (``WarmSlots.acquire``; per router process, the count is not shared through Redis).
   Beyond it the warm-up is *deferred*, not dropped: it waits (uncommitted, so a later stage
   can still replace it) until a warm-up on that replica ends, at most ``timeout_s``; if no
   slot frees in time it is counted ``skipped``/``replica_busy`` and never sent. Deferral
   keeps the engine's queue of warm-ups at the bound, so an escalated request waits behind
   at most that many, while the session still gets its prefix warmed: a skipped warm-up
   would leave that session's own escalation cold. A deferred warm-up sent after its session
   already escalated is a cache hit on the engine (its prompt is a prefix of the escalated
   one), so lateness costs little.
3. **At most ``warm_ahead.max_in_flight`` sessions with warm-up work** (waiting or sending)
   in this process; beyond it a new session's warm-up is skipped, reason ``busy``. This
   bounds the tasks, and with (1) the jobs: at most two per session.

4. **A long warm-up is sent in chunks** (``warm_ahead.chunk_tokens``, default 512;
   ``core.warm.chunk_bounds``). Bounds 1-3 keep the engine's queue of warm-ups short, but
   the engine runs what it admitted to the end: an escalation arriving during another
   session's first warm-up (≈2,700 tokens on the live bench) waited for all of it. When
   the router holds the prompt's exact token ids for the target pool, the warm-up is sent
   as growing prefixes of those ids (``POST /v1/completions``, ``prompt: ids[:end]``,
   ``wire.openai.warm_chunk_body``), each computing at most ``chunk_tokens`` new tokens,
   all to the replica the warm-up was routed to, then the original body as the last
   request (so what the escalation looks up is cached even if the tokenizer the router
   asked disagreed with the engine's chat template). Between chunks the replica slot is
   released and taken again, so the engine's FCFS queue takes escalations, and other
   sessions' warm-ups waiting for the slot, between two chunks. Without exact ids
   (approximate pool, multimodal prompt, tokenizer down) a prefix of the text is not a
   prefix of the engine's tokens, and the warm-up is one request as before.
   Why 512: smaller chunks let an escalation in sooner but each costs an engine step and
   router work; 512 was the best of 256, 512 and 1,024 when many sessions' warm-ups meet
   escalations (docs/benchmarks.md, "Warm-up chunk size").

The replica is known only after routing, and ``RouterCore.route`` records load and predicted
blocks; a route that lands on a full replica is undone at once (``on_complete``; the
predicted entries expire within ``predicted_ttl_s``) and the warm-up waits. Replicas are not
excluded to find a free one: that would warm a replica without the session's earlier prefix.
A refused connection is reported to discovery like a failed request's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvroute.config import RouterConfig
from kvroute.core.errors import NoEligibleReplica
from kvroute.core.router import RouterCore, RouteRequest, RoutingDecision
from kvroute.core.types import PoolName, ReplicaId, RequestId
from kvroute.core.warm import WarmFire, chunk_bounds
from kvroute.core.warm_slots import Offer, WarmSlots
from kvroute.shell.dp_headers import DpRankHeaders
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.proxy import Upstream, UpstreamError
from kvroute.shell.state import SessionState
from kvroute.wire.openai import warm_chunk_body

__all__ = ["WarmJob", "WarmSender"]

log = logging.getLogger("kvroute.warm")

RouteRequestFactory = Callable[[RequestId], Awaitable[RouteRequest]]
WarmBodyFactory = Callable[[str | None], bytes]


@dataclass(frozen=True, slots=True)
class WarmJob:
    """One warm-up to send: the planner's decision and everything the sender needs.

    Attributes:
        fire: the planner's decision (session, target pool, stage).
        body_for_salt: the warm-up body (``wire.openai.warm_request_body``) for the
            ``cache_salt`` the routed request carries: the tenant's, or the target
            version's when the route salts by version, known only once ``build`` ran.
        path: ``/v1/chat/completions`` or ``/v1/completions``.
        claim_key: the session's key in the shared cooldown store.
        build: makes the ``RouteRequest`` for the target pool (tokenizing there).
    """

    fire: WarmFire
    body_for_salt: WarmBodyFactory
    path: str
    claim_key: str
    build: RouteRequestFactory

    @property
    def session_id(self) -> str:
        """The session it warms (what ``WarmSlots`` keys its guards on)."""
        return self.fire.session_id


class WarmSender:
    """Sends warm-ahead requests in background tasks (module docstring).

    Invariant: ``len(self.tasks) <= max_in_flight``, one task per session with warm-up
    work; every task releases the load it put on ``RouterCore`` (``on_complete``) and the
    replica slot it took on every exit path, and ``close`` cancels them all.

    Args:
        config: ``warm_ahead`` (timeout, bounds, cooldown) and the replicas' URLs.
        core: the router core (routing and load bookkeeping of the warm-up).
        upstream: the pooled upstream client.
        metrics: ``warm_total``.
        state: the shared cooldowns; None = this process's view only.
        on_replica_failure: told when a replica refuses the connection.
    """

    def __init__(self, config: RouterConfig, *, core: RouterCore, upstream: Upstream,
                 metrics: RouterMetrics, state: SessionState | None,
                 on_replica_failure: Callable[[ReplicaId, str], None] | None = None,
                 replica_url: Callable[[ReplicaId], str | None] | None = None,
                 ) -> None:  # fmt: skip
        self._config = config
        self._dp_headers = DpRankHeaders(config)
        self._replica_url = replica_url
        self._core = core
        self._upstream = upstream
        self._metrics = metrics
        self._state = state
        self._on_replica_failure = on_replica_failure
        self.timeout_s = config.warm_ahead.timeout_s
        self.max_in_flight = config.warm_ahead.max_in_flight
        self.slots: WarmSlots[WarmJob] = WarmSlots(config.warm_ahead.max_in_flight_per_replica)
        self.tasks: set[asyncio.Task[None]] = set()
        self._freed: asyncio.Event | None = None

    def fire(self, fire: WarmFire, body_for_salt: WarmBodyFactory, path: str, claim_key: str,
             build: RouteRequestFactory) -> bool:  # fmt: skip
        """Hand one warm-up to the background; False (counted ``busy``) when a new session's
        warm-up would exceed ``max_in_flight``.

        A session that already has a warm-up keeps one task: the job replaces its waiting
        one or queues behind the one being sent (module docstring, guard 1).

        Args:
            fire: the planner's decision.
            body_for_salt: the warm-up body for a ``cache_salt`` (:class:`WarmJob`).
            path: ``/v1/chat/completions`` or ``/v1/completions``.
            claim_key: the session's key in the shared cooldown store.
            build: makes the ``RouteRequest`` for the target pool (tokenizing there).
        """
        session = fire.session_id
        if session not in self.slots and len(self.tasks) >= self.max_in_flight:
            self._metrics.warm("skipped", "busy")
            return False
        offer, superseded = self.slots.offer(WarmJob(fire, body_for_salt, path, claim_key, build))
        if superseded is not None:
            self._metrics.warm("skipped", "superseded")
            log.debug("warm-ahead of session %s: stage %d superseded by stage %d before it "
                      "was sent", session, superseded.fire.stage, fire.stage)
        if offer is Offer.START:
            task = asyncio.get_running_loop().create_task(
                self._session_loop(session), name=f"kvroute-warm-{session}")
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

    async def _session_loop(self, session: str) -> None:
        """The session's jobs, one after the other (guard 1)."""
        try:
            job: WarmJob | None = self.slots.current(session)
            while job is not None:
                await self._run(session)
                job = self.slots.advance(session)  # None: the session is forgotten
        except BaseException:
            self.slots.drop(session)
            raise

    # -- replica slots -------------------------------------------------------------------

    def _pool_replicas(self, pool: str) -> list[ReplicaId]:
        return [r.name for r in self._core.pool(PoolName(pool)).replicas
                if self._core.is_healthy(r.name)]

    async def _slot_freed(self) -> None:
        """Wait until some warm-up releases its replica slot."""
        if self._freed is None:
            self._freed = asyncio.Event()
        await self._freed.wait()

    def _release(self, replica: ReplicaId) -> None:
        self.slots.release(replica)
        if self._freed is not None:
            self._freed.set()
            self._freed = None

    # -- one warm-up ---------------------------------------------------------------------

    async def _run(self, session: str) -> None:
        """Wait for room (uncommitted), claim, route, send, count: the session's current job."""
        job = self.slots.current(session)
        request_id = RequestId(f"warm-{uuid.uuid4().hex}")
        waiting = False
        decision = None
        try:
            # Guard 2, before anything is fixed (a later stage may still replace the job):
            # wait at most timeout_s for a slot (one budget, from now: also spent by a wait
            # after routing, when another warm-up took the last slot in between), then at
            # most timeout_s for the answer (of every chunk, with the waits for the slot
            # between chunks).
            slot_deadline = asyncio.get_running_loop().time() + self.timeout_s
            async with asyncio.timeout_at(slot_deadline):
                waiting = True
                while not self.slots.has_room(replicas := self._pool_replicas(
                        self.slots.current(session).fire.target_pool_name)) and replicas:
                    await self._slot_freed()
                waiting = False
            job = self.slots.commit(session)
            async with asyncio.timeout(self.timeout_s):
                cooldown_s = self._config.warm_ahead.cooldown_s
                claimed = (self._state is None or cooldown_s <= 0
                           or await self._state.try_start_warm(job.claim_key, cooldown_s))
                if not claimed:
                    self._metrics.warm("skipped", "cooldown_shared")
                    return
                route_request = await job.build(request_id)
                while True:
                    decision = self._core.route(route_request)
                    if self.slots.acquire(decision.replica):
                        break
                    # Routed to a full replica (another warm-up took the last slot during
                    # the awaits above): undo the route and wait for a slot.
                    self._core.on_complete(decision.replica, request_id)
                    decision = None
                    waiting = True
                    async with asyncio.timeout_at(slot_deadline):
                        await self._slot_freed()
                    waiting = False
                self._metrics.warm("fired", job.fire.target_pool_name)
                await self._send(job, route_request, decision)
        except NoEligibleReplica as exc:
            self._failed("no_replica", job.fire, str(exc))
            return
        except TimeoutError:
            if waiting:
                job = self.slots.current(session)  # the latest stage, if one replaced it
                self._metrics.warm("skipped", "replica_busy")
                log.info("warm-ahead of session %s to pool %r skipped: no warm-up slot on its "
                         "replica freed within %gs", job.fire.session_id,
                         job.fire.target_pool_name, self.timeout_s)
            else:
                self._failed("timeout", job.fire, f"no answer within {self.timeout_s:g}s")
            return
        except UpstreamError as exc:
            self._failed(exc.kind, job.fire, str(exc))
            if exc.kind == "connect" and self._on_replica_failure is not None \
                    and decision is not None:
                self._on_replica_failure(decision.replica, str(exc))
            return
        self._metrics.warm("completed", job.fire.target_pool_name)

    async def _send(self, job: WarmJob, request: RouteRequest, decision: RoutingDecision,
                    ) -> None:  # fmt: skip
        """Send the routed warm-up, in chunks when ``_chunk_plan`` makes some (guard 4), and
        release its load and its replica slot (taken by the caller) on every exit path.

        Every chunk goes to ``decision.replica``: the first chunk's blocks are there, and
        the escalation will be routed to where the prefix is. Between chunks the slot is
        released, control is yielded once (a warm-up already routed to this replica and
        waiting for its slot takes it first), and it is taken again, waiting for it if need
        be; the caller's ``timeout_s`` bounds the whole series.
        """
        replica, request_id = decision.replica, decision.request.request_id
        ids = request.prompt_token_ids
        ends = self._chunk_plan(request, decision)
        url = (self._replica_url(replica) if self._replica_url is not None
               else self._config.replica(replica).url)
        holding = True
        try:
            if url is None:  # it left the pool since it was chosen: nothing to warm
                return
            for k, end in enumerate(ends):
                if k:
                    self._release(replica)
                    holding = False
                    await asyncio.sleep(0)
                    while not self.slots.acquire(replica):
                        await self._slot_freed()
                    holding = True
                if k == len(ends) - 1:
                    # The salt the blocks were routed under (a version's, when the route
                    # salts by version), as the chunks before it carry it.
                    path, chunk_id = job.path, request_id
                    body = job.body_for_salt(request.cache_salt)
                else:
                    assert ids is not None, "a chunk plan exists only for exact token ids"
                    path, chunk_id = "/v1/completions", RequestId(f"{request_id}-c{k}")
                    body = warm_chunk_body(ids[:end], model=job.fire.target_model,
                                           cache_salt=request.cache_salt)
                await self._upstream.open(url + path, body, stream=False,
                                          headers={"X-Request-Id": chunk_id,
                                                   **self._dp_headers.of(replica)})
                if len(ends) > 1:
                    self._metrics.warm("chunk", job.fire.target_pool_name)
            # NOTE: a chunked warm-up's duration includes the waits between its chunks, so
            # it would teach the load tracker a prefill rate far too low: only a warm-up
            # sent as one request reports its first token. The load it put on the replica
            # (its whole uncached prefill) stays counted until the last chunk answers,
            # which is what the replica still has to compute for this session.
            if len(ends) == 1:
                self._core.on_first_token(replica, request_id)
        finally:
            self._core.on_complete(replica, request_id)
            if holding:
                self._release(replica)

    def _chunk_plan(self, request: RouteRequest, decision: RoutingDecision) -> list[int]:
        """The prefix lengths to send (``core.warm.chunk_bounds``); one entry, the whole
        prompt, when chunking is off or the prompt has no exact token ids (approximate
        pool, multimodal or an unavailable tokenizer: a prefix of text is not a prefix of
        the engine's tokens)."""
        ids = request.prompt_token_ids
        chunk_tokens = self._config.warm_ahead.chunk_tokens
        if ids is None or not ids or chunk_tokens == 0 or decision.approximate:
            return [request.num_prompt_tokens]
        block_size = self._core.pool(request.pool).block_size
        ends = chunk_bounds(len(ids), block_size, chunk_tokens, decision.expected_cached_tokens)
        if len(ends) > 1:
            log.debug("warm-ahead of session %s to %s in %d chunks: %s (%d tokens expected "
                      "cached)", request.session_id, decision.replica, len(ends), ends,
                      decision.expected_cached_tokens)
        return ends

    def _failed(self, reason: str, fire: WarmFire, detail: str) -> None:
        self._metrics.warm("failed", reason)
        log.warning("warm-ahead of session %s to pool %r failed (%s): %s; the session will "
                    "find the prefix uncached if it escalates", fire.session_id,
                    fire.target_pool_name, reason, detail)
