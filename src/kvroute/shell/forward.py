"""The live driver of the request walk: ``core/walk.py``'s actions carried out with awaits.

For one accepted request (``shell/app.py`` has authenticated it, parsed it and taken an
admission slot) this module reads the session's record, runs the walk, and performs what it
asks: token ids from the pool's ``PromptTokenizer``, the upstream call through ``Upstream``
(``shell/proxy.py``), the relay of a whole answer or a stream, the warm-ahead in the
background (``shell/warm.py``), and the record written back once. Every decision is the
walk's; this module turns its notes into Prometheus series and log lines, renders its
refusals in OpenAI's error shape, and logs one ``kvroute.decision`` line per request.

Two parts of a request live in modules of their own, each used only here: a split's
prefill half (``shell/split_prefill.py``, disaggregation's first step) and the capture of
the relayed answer for a spread-ahead copy (``shell/answer_capture.py``).

See docs/architecture.md, "The request walk", for the steps and the module of each.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, TypeVar

from kvroute.config import RouteConfig, RouterConfig, Secrets
from kvroute.core.router import RouteRequest, RoutingDecision
from kvroute.core.session import session_key
from kvroute.core.tokens import EstimateConfig
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName
from kvroute.core.walk import (
    ArmServed,
    CutShortNote,
    Decided,
    Escalated,
    Fail,
    FailReason,
    GateRefused,
    LogLine,
    NeedTokens,
    Recovered,
    Refuse,
    ReplicaUnreachable,
    RequestWalk,
    ScenarioMove,
    Send,
    ShadowWarm,
    StaleWindows,
    UpstreamFailed,
    WalkAction,
    Walker,
    WalkRequest,
    WalkRoute,
    WarmNote,
    WindowLearned,
)
from kvroute.http.server import Answer, Request, Response, StreamResponse
from kvroute.shell.activity import Activity
from kvroute.shell.answer_capture import AnswerCapture, spreads
from kvroute.shell.audit_sample import AuditSampler
from kvroute.shell.cache_feedback import CacheFeedback
from kvroute.shell.dp_headers import DpRankHeaders
from kvroute.shell.lora_loader import LoraLoader
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.proxy import Upstream, UpstreamError, UpstreamReply, relay_stream
from kvroute.shell.shadow_warm import ShadowWarmSender
from kvroute.shell.split_prefill import send_prefill
from kvroute.shell.state import SessionState
from kvroute.shell.tenancy import routing_header_tenants
from kvroute.shell.tier_pools import TierPools
from kvroute.shell.transcript_sample import TranscriptWriter
from kvroute.shell.warm import WarmSender
from kvroute.tokenize.prompt import PromptTokenizer
from kvroute.wire.openai import (
    ParsedRequest,
    encode_request,
    error_body,
    session_from_request,
    warm_request_body,
)
from kvroute.wire.overflow import Overflow, overflow_numbers, parse_overflow
from kvroute.wire.reasoning import expected_thinking, reasoning_fields, reasoning_tokens
from kvroute.wire.relay import StreamWatcher, completion_of, forward_body, prompt_ids_from_body
from kvroute.wire.relay import routing_text as render_routing_text

__all__ = ["HDR_APPROX", "HDR_CACHED", "HDR_POOL", "HDR_PREFILL", "HDR_REPLICA", "Forwarder", "error_answer"]

log = logging.getLogger("kvroute.app")
tier_log = logging.getLogger("kvroute.tiers")
decision_log = logging.getLogger("kvroute.decision")

HDR_REPLICA: Final = "x-kvroute-replica"
HDR_POOL: Final = "x-kvroute-pool"
HDR_CACHED: Final = "x-kvroute-cached-tokens"
HDR_APPROX: Final = "x-kvroute-approximate"
HDR_PREFILL: Final = "x-kvroute-prefill-replica"
"""A split request's prefill replica (``x-kvroute-replica`` decoded it)."""
_JSON: Final = "application/json"
REPORT_HITS: Final = {"kv_cache_report_mode": "full"}
"""vLLM's sampling ``extra_args`` that makes a prefix hit publish ``BlockStored`` too."""
_LEVELS: Final = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
                  "error": logging.ERROR}


def walk_route(route: RouteConfig) -> WalkRoute:
    """The route's settings the walk reads."""
    reserve = route.reasoning.output_reserve if route.reasoning is not None else 0
    return WalkRoute(route.name, proactive=route.proactive,
                     output_floor=route.output_floor + reserve,
                     tokenize_margin=route.tokenize_margin,
                     estimate=EstimateConfig(image_cost=route.image_tokens))


def thinking_allowed(parsed: ParsedRequest, route: RouteConfig) -> int:
    """The thinking the engine will allow this request (``wire.reasoning.expected_thinking``);
    0 off the chat endpoint, where no template switch or budget applies."""
    if parsed.endpoint != "chat":
        return 0
    return expected_thinking(parsed.body, route.reasoning)


def error_answer(status: int, body: bytes, *, pool: str = "none",
                 extra: Mapping[str, str] | None = None) -> Response:
    """An error answer with the routing headers every answer carries (no replica)."""
    response = Response(status=status, body=body, content_type=_JSON)
    response.headers[HDR_REPLICA] = "none"
    response.headers[HDR_POOL] = pool
    response.headers[HDR_CACHED] = "0"
    if extra:
        response.headers.update(extra)
    return response


_R = TypeVar("_R", Response, StreamResponse)


def routed(response: _R, decision: RoutingDecision, show: bool = True) -> _R:
    """Stamp the decision on a response (every routed answer to a client allowed to see
    them carries these headers; ``show`` False leaves them out)."""
    if not show:
        return response
    response.headers[HDR_REPLICA] = decision.replica
    response.headers[HDR_POOL] = decision.request.pool
    response.headers[HDR_CACHED] = str(decision.expected_cached_tokens)
    response.headers[HDR_APPROX] = "true" if decision.approximate else "false"
    if decision.prefill_replica is not None:
        response.headers[HDR_PREFILL] = decision.prefill_replica
    return response


def _streamed_overflow(reply: UpstreamReply) -> Overflow | None:
    """An overflow sent as the first SSE event of a 200 stream (SGLang 0.4), before any token.

    Only the first chunk is looked at (an overflow after content cannot be retried), and only
    parsed when it mentions an error at all, so normal streams pay one substring search.
    """
    if reply.response is None or b"error" not in reply.body:
        return None
    return parse_overflow(reply.status, reply.body)


@dataclass(slots=True)
class _Exchange:
    """One request's I/O context while its walk runs."""

    request: Request
    raw: bytes
    parsed: ParsedRequest
    route: RouteConfig
    tenant: TenantName
    walk: RequestWalk
    token_ids: dict[PoolName, Sequence[int] | None] = field(default_factory=dict)
    error: UpstreamError | None = None


@dataclass(slots=True)
class Forwarder:
    """Runs walks for the HTTP handlers (module docstring). One per application.

    Invariant: every ``core`` call (through the walk) happens on the event loop's thread,
    between awaits, so the core needs no locks.
    """

    config: RouterConfig
    walker: Walker
    upstream: Upstream
    secrets: Secrets
    metrics: RouterMetrics
    pools: TierPools
    state: SessionState | None = None
    tokenizers: Mapping[str, PromptTokenizer] = field(default_factory=dict)
    warm: WarmSender | None = None
    on_replica_failure: Callable[[ReplicaId, str], None] | None = None
    feedback: CacheFeedback | None = None
    activity: Activity | None = None
    sampler: AuditSampler | None = None
    transcripts: TranscriptWriter | None = None
    """``gate.sample``: finished conversations kept for the shadow replay (opt-in)."""
    lora_loader: LoraLoader | None = None
    shadow: ShadowWarmSender | None = None
    replica_url: Callable[[ReplicaId], str | None] | None = None
    """Where a replica is now (discovery's ``member_url``: replicas may join and leave);
    the config's URL when None."""
    _background: set[asyncio.Task[None]] = field(default_factory=set)
    _walk_routes: dict[str, WalkRoute] = field(default_factory=dict)
    _header_tenants: frozenset[TenantName] | None = None
    _dp_headers: DpRankHeaders | None = None

    def __post_init__(self) -> None:
        self._header_tenants = routing_header_tenants(self.config)
        self._dp_headers = DpRankHeaders(self.config)

    def dp_rank_headers(self, replica: ReplicaId) -> Mapping[str, str]:
        """``replica``'s ``X-data-parallel-rank`` header, if it is a DP rank
        (``shell/dp_headers.py``; the table is built once, in ``__post_init__``)."""
        table = self._dp_headers
        assert table is not None, "set in __post_init__"
        return table.of(replica)

    def _shows(self, tenant: TenantName) -> bool:
        """Whether ``tenant`` is shown the routing headers (``TenantConfig.routing_headers``)."""
        allowed = self._header_tenants
        return allowed is None or tenant in allowed

    async def serve(self, request: Request, raw: bytes, parsed: ParsedRequest,
                    route: RouteConfig, tenant: TenantName, request_id: RequestId,
                    salt: str | None, *, adapter: str | None = None) -> Answer:
        """Walk one request to its answer (``adapter``: the LoRA adapter it names)."""
        session_ref = session_from_request(request.headers, parsed.body, lowered=True)
        session = session_ref.session_id if session_ref is not None else None
        if self.sampler is not None:
            self.sampler.offer(parsed.body, session)
        if adapter is not None and self.lora_loader is not None:
            problem = await self.lora_loader.ensure(route, adapter)
            if problem is not None:
                return error_answer(503, error_body(problem, status=503))
        record = None
        if session is not None and self.state is not None:
            record = await self.state.get_session(session_key(tenant, route.name, session))
        capture = AnswerCapture(parsed, keep=session is not None and parsed.n == 1
                                and spreads(self.walker.core, route))
        walk_request = WalkRequest(
            request_id=request_id, route=self._walk_route(route), tenant=tenant,
            session_id=session,
            endpoint=parsed.endpoint, model=parsed.model, body=parsed.body,
            max_tokens=parsed.max_tokens, n=parsed.n,
            num_messages=None if parsed.messages is None else len(parsed.messages),
            prompt_token_ids=prompt_ids_from_body(parsed),
            routing_text=lambda: render_routing_text(parsed), cache_salt=salt,
            adapter=adapter,
            shadow_payload=capture.turn,
            thinking_tokens=thinking_allowed(parsed, route),
        )
        alternates = self.pools.alternates(route) if route.scenarios.any else None
        walk = self.walker.start(walk_request, self.pools.tier_pools(route), record,
                                 alternates=alternates)
        ex = _Exchange(request, raw, parsed, route, tenant, walk)
        reasons: Sequence[str | None] = ()
        usage: Mapping[str, Any] | None = None
        try:
            action = walk.begin()
            while True:
                self._drain(walk)
                if isinstance(action, NeedTokens):
                    action = walk.tokens(action.pool, await self._token_ids(ex, action.pool))
                    continue
                if isinstance(action, Refuse):
                    return self._refused(action, self._shows(tenant))
                if isinstance(action, Fail):
                    assert ex.error is not None, "a Fail answers a reported failure"
                    return self._failed(action, ex.error, self._shows(tenant))
                reply = await self._attempt(ex, action)
                if isinstance(reply, UpstreamReply):
                    break
                action = reply
            decision = action.decision
            walk.answered()
            if walk.arm is not None:
                self.metrics.scenarios.arm_first_byte(
                    route.name, walk.arm, (time.perf_counter_ns() - request.received_ns) / 1e9)
            if reply.response is None:
                reasons, usage = completion_of(reply.body)
                capture.whole(reply.body, reasons)
                whole = routed(self._whole(reply), decision, self._shows(tenant))
                self._router_time(request, reply, time.perf_counter_ns())
                return whole
            watcher = StreamWatcher()
            response = await self._stream(ex, reply, decision, capture.on_chunk(watcher))
            self._router_time(request, reply, response.head_sent_ns)
            reasons, usage = watcher.finish_reasons, watcher.usage
            capture.streamed(reasons)
            return response
        finally:
            thinking = reasoning_tokens(usage)
            if thinking is not None:
                self.metrics.reasoning(route.name, thinking)
            write = walk.end(reasons, usage)
            self._drain(walk)
            if self.transcripts is not None and reasons:  # answered: a finish reason came
                self.transcripts.offer(tenant, route.name, parsed.messages, session,
                                       parsed.max_tokens)
            if self.feedback is not None and walk.decision is not None:
                self.feedback.on_answer(walk.decision, usage)
            scenario = self.walker.scenarios.get(route.name)
            if scenario is not None and scenario.failover is not None:
                self.metrics.scenarios.set_failover(route.name, scenario.failover.active)
            if write is not None and self.state is not None:
                self._spawn(self.state.put_session(write.key, write.record,
                                                   self.config.state.session_ttl_s))
            self._log(ex)

    def _walk_route(self, route: RouteConfig) -> WalkRoute:
        """The route's settings for the walk, built once per route (the config is frozen)."""
        found = self._walk_routes.get(route.name)
        if found is None:
            found = self._walk_routes[route.name] = walk_route(route)
        return found

    # -- the walk's actions ---------------------------------------------------------------------

    async def _token_ids(self, ex: _Exchange, pool: PoolName) -> Sequence[int] | None:
        """The prompt's token ids for ``pool`` (its tokenizer), asked at most once per
        request; None when the pool has no tokenizer (it is then routed approximately)."""
        if pool in ex.token_ids:
            return ex.token_ids[pool]
        tokenizer = self.tokenizers.get(pool)
        ids = None if tokenizer is None else await tokenizer.token_ids(ex.parsed)
        ex.token_ids[pool] = ids
        return ids

    async def _attempt(self, ex: _Exchange, send: Send) -> UpstreamReply | WalkAction:
        """Send one attempt; the reply, or the walk's next action after its failure."""
        walk, decision = ex.walk, send.decision
        if send.warm is not None:
            self._warm(ex, send)
        path = "/v1/chat/completions" if ex.parsed.endpoint == "chat" else "/v1/completions"
        base = self._replica_base(decision.replica)
        if base is None:  # it left the pool (Kubernetes scale-in) since it was chosen
            return walk.failed("connect", retryable=True, unreachable=False,
                               detail=f"replica {decision.replica} left the pool")
        url = base + path
        transfer: Mapping[str, Any] | None = None
        prefill = decision.prefill_replica
        if prefill is not None:  # a split: the prefill half first (shell/split_prefill.py)
            prefill_base = self._replica_base(prefill)
            prefilled = await send_prefill(
                walk, decision, ex.parsed.body,
                url=None if prefill_base is None else prefill_base + path,
                model=self._model(ex, decision.request.pool),
                headers={"X-Request-Id": decision.prefill_request_id,
                         **self.dp_rank_headers(prefill)},  # the prefill replica's rank
                upstream=self.upstream, metrics=self.metrics)
            if not isinstance(prefilled, Mapping):
                return prefilled  # the walk's next action: colocated on the decode replica
            transfer = prefilled
        try:
            reply = await self.upstream.open(url, self._body(ex, send, transfer),
                                             stream=ex.parsed.stream,
                                             headers=self._headers(decision))
        except UpstreamError as exc:
            overflow = None
            if exc.kind == "status" and exc.status is not None:
                overflow = parse_overflow(exc.status, exc.body)
            if overflow is None:
                ex.error = exc
                return walk.failed(exc.kind, retryable=exc.retryable,
                                   unreachable=exc.connect_failed, detail=str(exc))
        else:
            overflow = _streamed_overflow(reply)
            if overflow is None:
                return reply
            reply.close()
        self.metrics.upstream_error(decision.replica, "overflow")
        return walk.overflowed(overflow_numbers(overflow), detail=f"style {overflow.style}")

    def _replica_base(self, replica: ReplicaId) -> str | None:
        """Where ``replica`` is now (None: it left the pool since it was chosen)."""
        if self.replica_url is not None:
            return self.replica_url(replica)
        return self.config.replica(replica).url

    def _model(self, ex: _Exchange, pool: PoolName) -> str:
        """The ``model`` a local pool's engine serves the request under: the request's LoRA
        adapter, else the pool's model."""
        adapter = ex.walk.request.adapter
        return adapter if adapter is not None else self.config.pools[pool].model

    def _body(self, ex: _Exchange, send: Send,
              transfer: Mapping[str, Any] | None = None) -> bytes:
        """The client's body for a local pool (its own bytes when nothing changes); for an
        external provider, its model name for the route (the catalog) and no
        ``cache_salt`` (a vLLM field other providers reject; no index of ours there)."""
        pool = send.decision.request.pool
        if send.external:
            return encode_request(ex.parsed, max_tokens=send.max_tokens,
                                  model=self.pools.upstream_model(ex.route, pool),
                                  remove_fields=("cache_salt",))
        config = self.config.pools[pool]
        reasoning = ex.route.reasoning
        fields = (reasoning_fields(ex.parsed.body, reasoning)
                  if reasoning is not None and ex.parsed.endpoint == "chat" else None)
        if transfer is not None:  # a split's decode half: where to pull the KV from
            fields = {**(fields or {}), "kv_transfer_params": dict(transfer)}
        return forward_body(ex.raw, ex.parsed, max_tokens=send.max_tokens,
                            model=self._model(ex, pool),
                            cache_salt=send.decision.request.cache_salt,  # a version's salt
                            vllm_xargs=REPORT_HITS if config.report_hits else None,
                            set_fields=fields)

    def _headers(self, decision: RoutingDecision) -> Mapping[str, str]:
        """``X-Request-Id``, the DP rank's ``X-data-parallel-rank`` when the replica is one
        rank of a data-parallel engine, plus the provider's key as ``Authorization: Bearer`` when the
        decision's pool is external and has one (``Secrets.provider_keys``)."""
        headers: dict[str, str] = {"X-Request-Id": decision.request.request_id,
                                   **self.dp_rank_headers(decision.replica)}
        key = self.secrets.provider_keys.get(decision.request.pool)
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _warm(self, ex: _Exchange, send: Send) -> None:
        """Warm-ahead (the walk's step 3): decided by the walk, sent in the background."""
        fire = send.warm
        if self.warm is None or fire is None:
            return
        parsed = ex.parsed

        def body_for_salt(salt: str | None) -> bytes:
            warm_parsed = parsed if salt is None else replace(
                parsed, body={**parsed.body, "cache_salt": salt}, cache_salt=salt)
            return warm_request_body(warm_parsed, model=fire.target_model)

        target = PoolName(fire.target_pool_name)
        path = "/v1/chat/completions" if parsed.endpoint == "chat" else "/v1/completions"
        walk = ex.walk

        async def build(request_id: RequestId) -> RouteRequest:
            ids = walk.request.prompt_token_ids
            if ids is None:
                ids = await self._token_ids(ex, target)
            return walk.route_request(target, request_id, ids, expected_output_tokens=1)

        self.warm.fire(fire, body_for_salt, path, fire.claim_key, build)

    # -- answers --------------------------------------------------------------------------------

    def _refused(self, refuse: Refuse, show: bool) -> Response:
        if self.activity is not None:
            self.activity.refused(refuse.status, refuse.pool or "none",
                                  f"{refuse.outcome}: {refuse.message}")
        body = error_body(refuse.message, status=refuse.status, type=refuse.type,
                          param=refuse.param, code=refuse.code)
        if refuse.decision is not None:
            return routed(Response(status=refuse.status, body=body, content_type=_JSON),
                          refuse.decision, show)
        return error_answer(refuse.status, body, pool=refuse.pool or "none")

    def _failed(self, fail: Fail, exc: UpstreamError, show: bool) -> Response:
        """The engine's own error answer as it is, or a 502/504 that says what failed and
        why it was not tried elsewhere."""
        decision = fail.decision
        if exc.kind == "status" and exc.status is not None:
            content_type = exc.content_type.split(";", 1)[0].strip() or _JSON
            return routed(Response(status=exc.status, body=exc.body, content_type=content_type),
                          decision, show)
        status = 504 if exc.kind == "timeout" else 502
        if fail.reason is FailReason.NOT_RETRYABLE:
            why = ("Not retried: the engine may already have run the request (raise "
                   "timeouts.total_s for long answers, or stream them).")
        elif fail.reason is FailReason.RETRIES_SPENT:
            retries = fail.retries
            why = (f"Gave up after {retries} {'retry' if retries == 1 else 'retries'} on other "
                   f"replicas (retries.max_retries: {fail.max_retries}); check the engines' "
                   "/health.")
        else:
            why = "No other healthy replica was left to retry on; check the engines' /health."
        message = f"kvroute could not get an answer from replica {decision.replica}: {exc}. {why}"
        return routed(Response(status=status, body=error_body(message, status=status),
                               content_type=_JSON), decision, show)

    def _whole(self, reply: UpstreamReply) -> Response:
        response = Response(status=reply.status, body=reply.body)
        for key, value in reply.headers.items():
            response.headers[key] = value
        return response

    async def _stream(self, ex: _Exchange, reply: UpstreamReply, decision: RoutingDecision,
                      on_chunk: Callable[[bytes], None]) -> StreamResponse:
        response = StreamResponse(status=reply.status)
        for key, value in reply.headers.items():
            response.headers[key] = value
        routed(response, decision, self._shows(ex.tenant))

        def failed(kind: str, message: str) -> None:
            ex.walk.outcome = f"stream_{kind}"
            self.metrics.upstream_error(decision.replica, f"stream_{kind}")

        try:
            await relay_stream(reply, response, ex.request, replica=decision.replica,
                               on_error=failed, on_chunk=on_chunk)
        except ConnectionResetError:
            ex.walk.outcome = "client_gone"
        return response

    def _router_time(self, request: Request, reply: UpstreamReply, written_ns: int) -> None:
        """Record the router's own share of this request's latency: request read → forwarded
        (retries included), and the engine's answer (its first bytes when streamed) → written
        to the client. Skipped where a timestamp is missing (a canned reply, a client gone
        before the head)."""
        if reply.sent_ns and reply.ready_ns and written_ns:
            self.metrics.router_time((reply.sent_ns - request.received_ns) / 1e9,
                                     (written_ns - reply.ready_ns) / 1e9)

    # -- notes, logs, background ----------------------------------------------------------------

    def observe_failovers(self) -> None:
        """Between requests (after each discovery round): every failover switch told the
        primary's state now, its switches logged and its gauge set."""
        for route, active, line in self.walker.observe_failovers(self.walker.clock.now()):
            if line is not None:
                tier_log.log(_LEVELS[line.level], "%s", line.text)
            self.metrics.scenarios.set_failover(route, active)

    def _drain(self, walk: RequestWalk) -> None:
        """The walk's notes into metrics, logs and the tier view."""
        metrics = self.metrics
        for note in walk.take_notes():
            if isinstance(note, Decided):
                d = note.decision
                if self.activity is not None:
                    self.activity.decided(d.request.pool, d.replica, d.expected_cached_tokens,
                                          note.num_prompt_tokens)
                if self.feedback is not None:
                    self.feedback.on_decision(d)
                metrics.decision(d.request.pool, d.replica, d.reason, d.expected_cached_tokens,
                                 note.num_prompt_tokens, note.routing_s, d.approximate)
                if not d.approximate and d.block_hashes:
                    held = max(d.cached_by_replica.values(), default=0)
                    block_size = self.walker.core.pool(d.request.pool).block_size
                    metrics.divergence(walk.request.route.name, held // block_size)
            elif isinstance(note, LogLine):
                level = _LEVELS[note.level]
                if tier_log.isEnabledFor(level):
                    tier_log.log(level, "%s", note.text)
            elif isinstance(note, UpstreamFailed):
                metrics.upstream_error(note.replica, note.kind)
                if note.retried:
                    metrics.retry(note.replica)
            elif isinstance(note, Recovered):
                tier_log.warning("%s", note.line)
            elif isinstance(note, Escalated):
                metrics.escalation(note.from_pool, note.to_pool, note.how)
            elif isinstance(note, WarmNote):
                if note.reason is None:
                    metrics.warm(note.outcome)
                else:
                    metrics.warm(note.outcome, note.reason)
            elif isinstance(note, WindowLearned):
                self.pools.learn(note)
            elif isinstance(note, StaleWindows):
                self.pools.refresh(note.pools)
            elif isinstance(note, ReplicaUnreachable):
                if self.on_replica_failure is not None:
                    self.on_replica_failure(note.replica, note.detail)
            elif isinstance(note, CutShortNote):
                metrics.cut_short(note.pool)
            elif isinstance(note, ScenarioMove):
                metrics.scenarios.move(note.route, note.scenario, note.tokens, note.to_place)
                log.info("session moved by %s on route %r: %s → %s, %d tokens to prefill "
                         "again", note.scenario, note.route, note.from_place, note.to_place,
                         note.tokens)
            elif isinstance(note, GateRefused):
                r = note.refusal
                metrics.scenarios.gate_refusal(note.route, r.path, r.status,
                                               r.recomputed_tokens)
                log.debug("gate refused %s on route %r (%s): %s; %d tokens recomputed",
                          r.path, note.route, r.status, r.reason, r.recomputed_tokens)
            elif isinstance(note, ArmServed):
                metrics.scenarios.arm_served(note.route, note.arm, note.num_prompt_tokens,
                                             note.cached_tokens)
            elif isinstance(note, ShadowWarm):
                if self.shadow is not None:
                    self.shadow.fire(note)
                else:
                    for _ in note.items:
                        self.walker.shadow_done(note)

    def _spawn(self, work: Awaitable[None]) -> None:
        async def run() -> None:
            await work

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background state update failed", exc_info=task.exception())

    def _log(self, ex: _Exchange) -> None:
        """The request's one ``kvroute.decision`` line."""
        if not decision_log.isEnabledFor(logging.INFO):
            return
        walk = ex.walk
        decision = walk.decision
        record: dict[str, Any] = {
            "event": "route",
            "request_id": walk.request.request_id,
            "route": ex.route.name,
            "pool": decision.request.pool if decision else (
                "none" if walk.outcome == "no_fit" else walk.pool_name),
            "replica": decision.replica if decision else None,
            "policy": decision.policy if decision else self.config.policy.name,
            "reason": decision.reason if decision else None,
            "cached_tokens": decision.expected_cached_tokens if decision else 0,
            "prompt_tokens": walk.num_prompt_tokens,
            "approximate": decision.approximate if decision else not walk.exact,
            "routing_us": round(walk.routing_s * 1e6, 1),
            "tenant": ex.tenant,
            "session": walk.request.session_id is not None,
            "retries": walk.retries,
            "outcome": walk.outcome,
        }
        if decision is not None:
            record["tier"] = walk.place.reason.value
            record["estimate_tokens"] = walk.estimate.low
            record["max_tokens_sent"] = walk.state.max_tokens
            record["overflows"] = walk.num_overflows
        if self.config.log_format == "json":
            decision_log.info(json.dumps(record, separators=(",", ":")))
        else:
            decision_log.info(" ".join(f"{k}={v}" for k, v in record.items()))
