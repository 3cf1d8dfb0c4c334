"""The router's HTTP API and the composition root ``build_app``.

Owns the request walk's shell steps (DESIGN.md steps 1, 2, 5, 6, 8): accept and validate a
request, authenticate its tenant, measure its prompt, ask ``RouterCore`` for a replica, send
it through ``shell/proxy.py`` with retries before the first byte, account for it, and log one
line per decision. It also serves ``/v1/models``, ``/health``, ``/metrics`` and the admin
endpoints ``/admin/index`` and ``/admin/state``.

It must not make routing decisions itself (that is ``core``) nor open sockets other than
through the ``Upstream`` it is given; every collaborator is passed to ``build_app``, so tests
build exactly what they need and nothing is a module global.

The request walk (``Router.handle``)
------------------------------------
1. authenticate (``Authorization: Bearer``; no tenants configured = one default tenant);
2. read the body with a size limit and ``wire.openai.parse_request`` it; resolve the route
   (the ``model`` field) — every bad input ends here with OpenAI's error shape;
3. admission: a slot among ``max_in_flight``, or a bounded wait, or 429 + ``Retry-After``;
4. choose the tier (``shell/tiering.py`` over ``core/tiers.py``): estimate the prompt (from
   the session's last usage when known), pick the first pool whose window holds it plus the
   output floor, asking the pool's ``/tokenize`` when the estimate straddles a window, clamp
   ``max_tokens``; no pool fits → 400 in OpenAI's overflow wording, with the numbers;
5. tokens: the pool's ``PromptTokenizer`` (engine ``/tokenize`` or local; asked once per
   pool per request), or the prompt's own token ids, or nothing (the request is then routed
   approximately, and says so);
6. ``core.route`` in the tenant's ``TenantScope``, with the session's pin (memory or Redis)
   as ``preferred_replica`` when it is in the chosen pool; then warm-ahead is decided (pure)
   and, if it fires, sent by ``shell/warm.py`` in the background;
7. forward: ``Upstream.open``; an overflow rejection (a 400/413/422 body, or an error event
   opening a 200 stream) goes to ``_overflow`` (``core/tiers.plan_recovery``: clamp and
   retry, escalate to a larger pool, or give up with a 400), bounded by ``2 × pools``
   attempts; any other failure before the first byte goes to ``_recover`` (next replica of
   the ranking, bounded by ``retries.max_retries``; a refused connection takes the replica
   out of routing through ``on_replica_failure``); after the first byte the stream is
   relayed and a failure ends it with an error event;
8. account: ``core.on_first_token`` / ``core.on_complete`` on every exit path, metrics, the
   decision log line, the session pin (refreshed TTL), the session's usage and cut-short
   answers (``finish_reason``/``usage`` read from the answer; for a stream, only the chunks
   that carry them are decoded).

Session pins: a request with a session id pins its session to the replica that served it
(TTL ``state.session_ttl_s``, refreshed each time). Every policy receives the live pin as
``RouteRequest.preferred_replica``: the cost policies use it to break ties, the ``session``
policy follows it while the replica is healthy (so sessions stay put when the fleet changes,
which rendezvous hashing alone would not guarantee).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Protocol, TypeVar

import msgspec

from kvroute.config import DEFAULT_TENANT, RouteConfig, RouterConfig, Secrets
from kvroute.core.clock import Clock
from kvroute.core.errors import NoEligibleReplica
from kvroute.core.index import AdminCapability, TenantScope
from kvroute.core.peer_policies import POLICY_FACTORIES
from kvroute.core.router import RouterCore, RouteRequest, RoutingDecision
from kvroute.core.tiers import GiveUp, Retry
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName, WireHash
from kvroute.http.client import ConnectTimeout
from kvroute.http.server import (
    Answer,
    Handler,
    HttpServer,
    Request,
    Response,
    StreamResponse,
)
from kvroute.shell.admission import Admission, AdmissionRejected
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.proxy import Upstream, UpstreamError, UpstreamReply, relay_stream
from kvroute.shell.state import MonotonicClock, SessionState
from kvroute.shell.tiering import Tiering, TierRefused, TierView, TierWalk, session_key
from kvroute.shell.warm import WarmSender
from kvroute.tokenize.prompt import PromptTokenizer
from kvroute.wire.openai import (
    Endpoint,
    ParsedRequest,
    RequestError,
    encode_request,
    error_body,
    model_card,
    models_response,
    parse_request,
    session_from_request,
    warm_request_body,
)
from kvroute.wire.overflow import Overflow, parse_overflow

__all__ = [
    "DiscoveryView",
    "PromptTokenizer",
    "Router",
    "RouterApp",
    "build_app",
    "forward_body",
    "routing_text",
]

log = logging.getLogger("kvroute.app")
decision_log = logging.getLogger("kvroute.decision")

HDR_REPLICA: Final = "x-kvroute-replica"
HDR_POOL: Final = "x-kvroute-pool"
HDR_CACHED: Final = "x-kvroute-cached-tokens"
HDR_APPROX: Final = "x-kvroute-approximate"
_JSON: Final = "application/json"
_JSON_DECODER: Final = msgspec.json.Decoder()


class DiscoveryView(TierView, Protocol):
    """What the HTTP layer reads from discovery (``shell/discovery.py``): windows for
    ``/v1/models`` and everything the tier logic reads (``shell/tiering.TierView``)."""


# --------------------------------------------------------------------------------------------
# Request shapes
# --------------------------------------------------------------------------------------------


def routing_text(parsed: ParsedRequest) -> str:
    """The prompt as plain text, for approximate routing and text-matching peer policies.

    Chat: each message's role and its text content (text parts joined), in order; tools
    first, as chat templates put them. Completions: the prompt string(s).
    """
    if parsed.messages is not None:
        parts: list[str] = []
        if parsed.tools:
            parts.append(json.dumps(parsed.tools, separators=(",", ":"), sort_keys=True))
        for message in parsed.messages:
            parts.append(str(message.get("role", "")))
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text") if isinstance(part, dict) else None
                    parts.append(text if isinstance(text, str) else f"<{part.get('type')}>")
        return "\n".join(parts)
    prompt = parsed.prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return ""


def _prompt_ids_from_body(parsed: ParsedRequest) -> list[int] | None:
    """A completions prompt sent as one list of token ids is already exact."""
    prompt = parsed.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return [int(t) for t in prompt if isinstance(t, int)]
    return None


_FINISH_OR_USAGE: Final = re.compile(rb'"finish_reason":\s*"|"usage":\s*\{')
"""A relayed SSE piece worth decoding: a choice's end, or the usage chunk. Every other
chunk (one per engine step) is passed through without being parsed."""


class _StreamWatcher:
    """Reads ``finish_reason`` and ``usage`` out of a relayed stream, cheaply.

    Invariant: only pieces matching ``_FINISH_OR_USAGE`` are decoded, so a long answer costs
    one regex scan per chunk; undecodable events are ignored (they are relayed regardless).
    """

    __slots__ = ("_reasons", "usage")

    def __init__(self) -> None:
        self._reasons: dict[int, str] = {}
        self.usage: Mapping[str, Any] | None = None

    @property
    def finish_reasons(self) -> list[str | None]:
        return [self._reasons.get(i) for i in range(max(self._reasons, default=-1) + 1)]

    def feed(self, piece: bytes) -> None:
        if _FINISH_OR_USAGE.search(piece) is None:
            return
        for line in piece.splitlines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if not data or data == b"[DONE]":
                continue
            try:
                doc = _JSON_DECODER.decode(data)
            except msgspec.DecodeError:
                continue
            if isinstance(doc, dict):
                _read_completion(doc, self._reasons)
                usage = doc.get("usage")
                if isinstance(usage, dict):
                    self.usage = usage


def _read_completion(doc: Mapping[str, Any], reasons: dict[int, str]) -> None:
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return
    for pos, choice in enumerate(choices):
        if not isinstance(choice, dict):
            continue
        reason = choice.get("finish_reason")
        index = choice.get("index", pos)
        if isinstance(reason, str) and isinstance(index, int):
            reasons[index] = reason


class _Choice(msgspec.Struct):
    index: int | None = None
    finish_reason: str | None = None


class _Completion(msgspec.Struct):
    """The two things read from a whole answer; msgspec skips every other field (the
    generated text above all) without building objects for it."""

    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: dict[str, Any] | None = None


_COMPLETION_DECODER: Final = msgspec.json.Decoder(_Completion)


def _completion_of(body: bytes) -> tuple[list[str | None], Mapping[str, Any] | None]:
    """``finish_reason`` of each choice and the ``usage`` of a whole (non-streamed) answer.

    The typed decode is the fast path; an answer of another shape (a field of an unexpected
    type) falls back to the lenient walk over the generic decode, so the two always agree.
    """
    try:
        typed = _COMPLETION_DECODER.decode(body)
    except msgspec.DecodeError:
        pass  # ValidationError is a DecodeError: try the lenient walk
    else:
        found: dict[int, str] = {}
        for pos, choice in enumerate(typed.choices):
            if choice.finish_reason is not None:
                found[choice.index if choice.index is not None else pos] = choice.finish_reason
        return [found.get(i) for i in range(max(found, default=-1) + 1)], typed.usage
    return _completion_of_any(body)


def _completion_of_any(body: bytes) -> tuple[list[str | None], Mapping[str, Any] | None]:
    """``_completion_of`` by a lenient walk over the generic decode: any JSON shape."""
    try:
        doc = _JSON_DECODER.decode(body)
    except msgspec.DecodeError:
        return [], None
    if not isinstance(doc, dict):
        return [], None
    reasons: dict[int, str] = {}
    _read_completion(doc, reasons)
    usage = doc.get("usage")
    return ([reasons.get(i) for i in range(max(reasons, default=-1) + 1)],
            usage if isinstance(usage, dict) else None)


def forward_body(raw: bytes, parsed: ParsedRequest, *, max_tokens: int | None, model: str,
                 cache_salt: str | None) -> bytes:
    """The body to send upstream: the client's own bytes when nothing in it changes.

    ``encode_request`` copies and re-encodes the whole body (about 10 µs for a 2 kB prompt,
    proportional to its size); most requests need no change at all (the route's name is the
    served model, no clamp, no router salt), and then the engine gets exactly what the client
    sent. The conditions mirror ``encode_request`` field by field, so the two always agree on
    the decoded JSON:

    * ``model`` already equals the pool's served name;
    * ``cache_salt`` is None or already the body's own (``parse_request`` validated it);
    * ``max_tokens`` is None, or every output-limit field the client sent is a number no
      larger than it (``encode_request`` adds ``max_tokens`` when none is present, and lowers
      a larger or null one).

    Args:
        raw: the client's body, as read.
        parsed: its parse.
        max_tokens / model / cache_salt: as ``encode_request`` takes them.
    """
    body = parsed.body
    unchanged = body.get("model") == model and (
        cache_salt is None or body.get("cache_salt") == cache_salt)
    if unchanged and max_tokens is not None:
        present = parsed.output_param_names
        unchanged = bool(present) and all(
            body[key] is not None and body[key] <= max_tokens for key in present)
    if unchanged:
        return raw
    return encode_request(parsed, max_tokens=max_tokens, model=model, cache_salt=cache_salt)


def _streamed_overflow(reply: UpstreamReply) -> Overflow | None:
    """An overflow sent as the first SSE event of a 200 stream (SGLang 0.4), before any token.

    Only the first chunk is looked at (an overflow after content cannot be retried), and only
    parsed when it mentions an error at all, so normal streams pay one substring search.
    """
    if reply.response is None or b"error" not in reply.body:
        return None
    return parse_overflow(reply.status, reply.body)


def _is_connect_failure(error: UpstreamError) -> bool:
    """No connection to the replica: refused, unreachable, or a connect (not read) timeout."""
    if error.kind == "connect":
        return True
    return error.kind == "timeout" and isinstance(error.__cause__, ConnectTimeout)


def request_ids() -> Iterator[str]:
    """Ids for requests that arrive without ``X-Request-Id``: a random 96-bit prefix drawn
    once per router, then a counter (``3f9c...-17``). Unique across router processes and
    restarts like a fresh ``uuid4`` per request, without its ``os.urandom`` call on every
    request."""
    prefix = uuid.uuid4().hex[:24]
    return (f"{prefix}-{n}" for n in itertools.count(1))


@dataclass(frozen=True, slots=True)
class _Forward:
    """What the forwarding loop needs to plan another attempt after an overflow."""

    walk: TierWalk
    tenant: TenantName
    session: str | None
    salt: str | None
    pinned: str | None
    pin_key: str | None


# --------------------------------------------------------------------------------------------
# The router
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Attempt:
    """Bookkeeping of one request's walk, for the log line and the headers."""

    request_id: RequestId
    route: str
    pool: PoolName
    tenant: TenantName
    session: str | None
    num_prompt_tokens: int
    exact: bool
    routing_us: float = 0.0
    retries: int = 0
    outcome: str = "ok"
    pinned: bool = False
    failed: set[ReplicaId] = field(default_factory=set)


@dataclass(slots=True)
class Router:
    """The HTTP handlers and what they share. Built by ``build_app``; one per application.

    Invariant: every ``core`` call happens on the event loop's thread, between awaits, so the
    core needs no locks (the KV-event subscribers call it the same way).
    """

    config: RouterConfig
    core: RouterCore
    upstream: Upstream
    admission: Admission
    secrets: Secrets
    metrics: RouterMetrics
    tiering: Tiering
    state: SessionState | None = None
    discovery: DiscoveryView | None = None
    tokenizers: Mapping[str, PromptTokenizer] = field(default_factory=dict)
    admin: AdminCapability | None = None
    extra_state: Callable[[], Mapping[str, Any]] | None = None
    on_replica_failure: Callable[[ReplicaId, str], None] | None = None
    on_scrape: Callable[[], None] | None = None
    warm: WarmSender | None = None
    _background: set[asyncio.Task[None]] = field(default_factory=set)
    _request_ids: Iterator[str] = field(default_factory=request_ids)

    # -- entry points ---------------------------------------------------------------------

    async def chat(self, request: Request) -> Answer:
        return await self.handle(request, "chat")

    async def completions(self, request: Request) -> Answer:
        return await self.handle(request, "completions")

    async def handle(self, request: Request, endpoint: Endpoint) -> Answer:
        try:
            tenant = self._tenant(request)
            raw = self._body(request)
            parsed = parse_request(raw, endpoint, max_body_bytes=self.config.max_body_bytes)
            route = self._route(parsed)
        except RequestError as exc:
            return _error(exc.status, exc.body())
        try:
            await self.admission.acquire()
        except AdmissionRejected as exc:
            self.metrics.admission_reject(exc.reason)
            body = error_body(exc.message, status=429, code=429)
            return _error(429, body, extra={"Retry-After": str(exc.retry_after_s)})
        try:
            return await self._serve(request, raw, parsed, route, tenant)
        finally:
            self.admission.release()

    # -- steps ------------------------------------------------------------------------------

    def _tenant(self, request: Request) -> TenantName:
        if not self.secrets.api_keys:
            return DEFAULT_TENANT
        key = _bearer(request)
        if key is None:
            raise RequestError(
                "Missing API key: send 'Authorization: Bearer <your key>'.", status=401,
                code="invalid_api_key",
            )
        tenant = _lookup_key(self.secrets.api_keys, key)
        if tenant is None:
            raise RequestError(
                "Invalid API key: the key in 'Authorization: Bearer ...' is not known to this "
                "router. Check the key your administrator gave you.", status=401,
                code="invalid_api_key",
            )
        return tenant

    def _body(self, request: Request) -> bytes:
        """The request's body; the server has already read it, up to ``max_body_bytes``."""
        if request.body_too_large:
            limit = self.config.max_body_bytes
            declared = request.content_length
            size = f"{declared} bytes, over" if declared is not None else "over"
            raise RequestError(
                f"Request body is {size} this router's limit of {limit} bytes. Send a "
                "shorter prompt, or raise the router's max_body_bytes setting.", status=413,
            )
        return request.body

    def _route(self, parsed: ParsedRequest) -> RouteConfig:
        route = self.config.routes.get(parsed.model)
        if route is None:
            known = ", ".join(sorted(self.config.routes))
            raise RequestError(
                f"The model `{parsed.model}` does not exist. This router serves: {known} "
                "(GET /v1/models lists them).", status=404, param="model",
                type="NotFoundError", code=404,
            )
        return route

    async def _serve(self, request: Request, raw: bytes, parsed: ParsedRequest,
                     route: RouteConfig, tenant: TenantName) -> Answer:
        request_id = RequestId(request.headers.get("x-request-id") or next(self._request_ids))
        session_ref = session_from_request(request.headers, parsed.body, lowered=True)
        session = session_ref.session_id if session_ref is not None else None
        try:
            walk = await self.tiering.plan(route, parsed,
                                           session_key(tenant, route.name, session))
        except TierRefused as exc:
            self._log(_Attempt(request_id, route.name, PoolName("none"), tenant, session, 0,
                               False, outcome="no_fit"), None)
            return _error(exc.status, exc.body)
        pool_name = walk.pool_name
        salt = self._cache_salt(tenant, parsed.cache_salt)
        pin_key = f"{tenant}\x1f{session}" if session is not None else None
        pinned: str | None = None
        if pin_key is not None and self.state is not None:
            pinned = await self.state.get_pin(pin_key)
        route_request = await self._route_request(walk, pool_name, request_id, tenant,
                                                  session, salt, pinned)
        attempt = _Attempt(request_id, route.name, pool_name, tenant, session,
                           route_request.num_prompt_tokens,
                           route_request.prompt_token_ids is not None,
                           pinned=route_request.preferred_replica is not None)
        started = time.perf_counter()
        try:
            decision = self.core.route(route_request)
        except NoEligibleReplica as exc:
            attempt.outcome = "no_replica"
            self._log(attempt, None)
            return _error(503, error_body(str(exc), status=503), pool=pool_name)
        attempt.routing_us = (time.perf_counter() - started) * 1e6
        self._decided(attempt, decision)
        self._maybe_warm(walk, tenant, session, salt, pinned)
        body = self._external_body(walk, pool_name) if self.tiering.is_external(pool_name) else (
            forward_body(raw, parsed, max_tokens=walk.max_tokens,
                         model=self.config.pools[pool_name].model, cache_salt=salt))
        headers = {"X-Request-Id": request_id}
        ctx = _Forward(walk, tenant, session, salt, pinned, pin_key)
        return await self._forward(request, parsed, attempt, decision, body, headers, ctx)

    async def _route_request(self, walk: TierWalk, pool_name: PoolName, request_id: RequestId,
                             tenant: TenantName, session: str | None, salt: str | None,
                             pinned: str | None) -> RouteRequest:
        """The ``RouteRequest`` for ``pool_name``: its exact tokens if its tokenizer gives them
        (asked once per walk), else the text; the session's pin if it is in this pool."""
        if self.tiering.is_external(pool_name):
            return self._external_request(walk, pool_name, request_id, tenant, session)
        token_ids: Sequence[int] | None = _prompt_ids_from_body(walk.parsed)
        if token_ids is None:
            token_ids = await self.tiering.tokens(walk, pool_name)
        needs_text = getattr(POLICY_FACTORIES[self.config.policy.name], "needs_text", False)
        text = routing_text(walk.parsed) if token_ids is None or needs_text else ""
        num_tokens = len(token_ids) if token_ids is not None else max(1, walk.estimate.low)
        preferred: ReplicaId | None = None
        if pinned is not None and any(
            rep.name == pinned for rep in self.config.pools[pool_name].replicas
        ):
            preferred = ReplicaId(pinned)
        max_tokens = walk.state.max_tokens
        return RouteRequest(
            request_id=request_id,
            pool=pool_name,
            scope=TenantScope(tenant),
            num_prompt_tokens=num_tokens,
            prompt_token_ids=token_ids,
            routing_text=text,
            cache_salt=salt,
            session_id=session,
            expected_output_tokens=max_tokens if max_tokens is not None else 256,
            preferred_replica=preferred,
        )

    def _maybe_warm(self, walk: TierWalk, tenant: TenantName, session: str | None,
                    salt: str | None, pinned: str | None) -> None:
        """Warm-ahead (DESIGN.md step 4): decide here (pure), send in the background."""
        if self.warm is None:
            return
        fire = self.tiering.consider_warm(walk)
        if fire is None:
            return
        parsed = walk.parsed
        warm_parsed = parsed if salt is None else replace(
            parsed, body={**parsed.body, "cache_salt": salt}, cache_salt=salt)
        body = warm_request_body(warm_parsed, model=fire.target_model)
        target = PoolName(fire.target_pool_name)
        path = "/v1/chat/completions" if parsed.endpoint == "chat" else "/v1/completions"

        async def build(request_id: RequestId) -> RouteRequest:
            req = await self._route_request(walk, target, request_id, tenant, session, salt,
                                            pinned)
            return replace(req, expected_output_tokens=1)

        self.warm.fire(fire, body, path, fire.claim_key, build)

    def _cache_salt(self, tenant: TenantName, client_salt: str | None) -> str | None:
        """The salt the engine must hash into block 0.

        A salted tenant's salt is the router's (derived from its name and the server secret);
        a client salt sent by such a tenant is folded into it, so the client can partition its
        own cache further but can never reach another tenant's blocks. Unsalted tenants' own
        salts pass through unchanged.
        """
        tenant_salt = self.secrets.cache_salts.get(tenant)
        if tenant_salt is None:
            return client_salt
        if client_salt is None:
            return tenant_salt
        return hmac.new(tenant_salt.encode(), client_salt.encode(), hashlib.sha256).hexdigest()[:32]

    def _decided(self, attempt: _Attempt, decision: RoutingDecision) -> None:
        self.metrics.decision(
            attempt.pool, decision.replica, decision.reason, decision.expected_cached_tokens,
            attempt.num_prompt_tokens, attempt.routing_us / 1e6, decision.approximate,
        )

    async def _forward(self, request: Request, parsed: ParsedRequest, attempt: _Attempt,
                       decision: RoutingDecision, body: bytes, headers: Mapping[str, str],
                       ctx: _Forward) -> Answer:
        path = "/v1/chat/completions" if parsed.endpoint == "chat" else "/v1/completions"
        current = decision
        active: ReplicaId | None = decision.replica  # the replica whose load is open
        try:
            while True:
                url = self.config.replica(current.replica).url + path
                overflow: Overflow | None = None
                try:
                    reply = await self.upstream.open(url, body, stream=parsed.stream,
                                                     headers=self._upstream_headers(current,
                                                                                    headers))
                except UpstreamError as exc:
                    if exc.kind == "status" and exc.status is not None:
                        overflow = parse_overflow(exc.status, exc.body)
                    if overflow is None:
                        self.metrics.upstream_error(current.replica, exc.kind)
                        nxt, released = self._recover(attempt, current, exc)
                        if released:
                            active = None
                        if nxt is None:
                            attempt.outcome = f"upstream_{exc.kind}"
                            return self._upstream_failure(current, exc, attempt.retries)
                        self.metrics.retry(current.replica)
                        attempt.retries += 1
                        current = nxt
                        active = nxt.replica
                        continue
                else:
                    overflow = _streamed_overflow(reply)
                    if overflow is not None:
                        reply.close()
                if overflow is not None:
                    # The reactive backstop (DESIGN.md step 7): clamp, escalate or give up.
                    self.metrics.upstream_error(current.replica, "overflow")
                    self.core.on_complete(current.replica, attempt.request_id)
                    active = None
                    step = await self._overflow(attempt, current, overflow, ctx)
                    if isinstance(step, Response):
                        return step
                    current, body = step
                    active = current.replica
                    continue
                break
            self.core.on_first_token(current.replica, attempt.request_id)
            if ctx.pin_key is not None and self.state is not None:
                self._spawn(self.state.set_pin(ctx.pin_key, current.replica,
                                               self.config.state.session_ttl_s))
            if reply.response is None:
                self.tiering.on_complete(ctx.walk, *_completion_of(reply.body))
                whole = self._whole(reply, current)
                self._router_time(request, reply, time.perf_counter_ns())
                return whole
            watcher = _StreamWatcher()
            response = await self._stream(request, reply, attempt, current, watcher)
            self._router_time(request, reply, response.head_sent_ns)
            self.tiering.on_complete(ctx.walk, watcher.finish_reasons, watcher.usage)
            return response
        finally:
            if active is not None:
                self.core.on_complete(active, attempt.request_id)
            self._log(attempt, current, ctx.walk)

    async def _overflow(self, attempt: _Attempt, failed: RoutingDecision, overflow: Overflow,
                        ctx: _Forward) -> tuple[RoutingDecision, bytes] | Response:
        """Plan the next attempt after an overflow rejection (``core/tiers.plan_recovery``).

        Returns the next decision and body, or the 400 to answer (give up, or no replica).
        """
        walk = ctx.walk
        plan = self.tiering.recover(walk, overflow, failed.replica)
        if isinstance(plan, GiveUp):
            attempt.outcome = f"overflow_{plan.reason.value}"
            return _routed(Response(status=400, body=Tiering.give_up_body(plan),
                                    content_type=_JSON), failed)
        pool_name = walk.pool_name
        attempt.pool = pool_name
        attempt.retries += 1
        req = await self._route_request(walk, pool_name, attempt.request_id, ctx.tenant,
                                        ctx.session, ctx.salt, ctx.pinned)
        if isinstance(plan, Retry):
            req = replace(req, preferred_replica=failed.replica)
        try:
            decision = self.core.route(req)
        except NoEligibleReplica as exc:
            attempt.outcome = "no_replica"
            return _error(503, error_body(str(exc), status=503), pool=pool_name)
        attempt.num_prompt_tokens = req.num_prompt_tokens
        attempt.exact = req.prompt_token_ids is not None
        self._decided(attempt, decision)
        if self.tiering.is_external(pool_name):
            return decision, self._external_body(walk, pool_name)
        body = encode_request(walk.parsed, max_tokens=walk.max_tokens,
                              model=self.config.pools[pool_name].model, cache_salt=ctx.salt)
        return decision, body

    def _external_body(self, walk: TierWalk, pool_name: PoolName) -> bytes:
        """The body for an external provider: its model name for the route (the catalog),
        and no ``cache_salt`` (a vLLM field other providers reject; no index of ours there)."""
        return encode_request(walk.parsed, max_tokens=walk.max_tokens,
                              model=self.tiering.upstream_model(walk.route, pool_name),
                              remove_fields=("cache_salt",))

    def _external_request(self, walk: TierWalk, pool_name: PoolName, request_id: RequestId,
                          tenant: TenantName, session: str | None) -> RouteRequest:
        """An external provider's ``RouteRequest``: no tokens and no text (so no index entry),
        every endpoint but the least-loaded healthy one excluded (``Tiering.least_loaded``),
        so the core only keeps its load accounting."""
        names = [rep.name for rep in self.config.pools[pool_name].replicas]
        best = self.tiering.least_loaded({name: self.core.load.snapshot(name).num_in_flight
                                          for name in names if self.core.is_healthy(name)})
        max_tokens = walk.state.max_tokens
        return RouteRequest(
            request_id=request_id, pool=pool_name, scope=TenantScope(tenant),
            num_prompt_tokens=max(1, walk.estimate.low), session_id=session,
            expected_output_tokens=max_tokens if max_tokens is not None else 256,
            exclude=frozenset(name for name in names if name != best),
        )

    def _upstream_headers(self, decision: RoutingDecision,
                          headers: Mapping[str, str]) -> Mapping[str, str]:
        """``headers``, plus the provider's key as ``Authorization: Bearer`` when the
        decision's pool is external and has one (``Secrets.provider_keys``)."""
        key = self.secrets.provider_keys.get(decision.request.pool)
        return headers if key is None else {**headers, "Authorization": f"Bearer {key}"}

    def _recover(self, attempt: _Attempt, decision: RoutingDecision,
                 error: UpstreamError) -> tuple[RoutingDecision | None, bool]:
        """The one place a transport failure (or a 5xx) before the first byte is handled.

        A retryable failure moves the request to the next replica of the same ranking
        (``core.reroute``), at most ``retries.max_retries`` times; a refused connection or a
        connect timeout also tells the failure hook (discovery takes the replica out at once,
        until its ``/health`` answers again). A non-retryable answer (4xx) is relayed as is.
        Context overflows never come here: ``_overflow`` plans those.

        Returns:
            ``(next decision or None, whether the failed replica's load was released)``.
        """
        attempt.failed.add(decision.replica)
        if _is_connect_failure(error) and self.on_replica_failure is not None:
            self.on_replica_failure(decision.replica, str(error))
        if not error.retryable or attempt.retries >= self.config.retries.max_retries:
            return None, False
        nxt = self.core.reroute(decision, decision.replica)  # releases the failed load
        return nxt, True

    def _upstream_failure(self, decision: RoutingDecision, exc: UpstreamError,
                          retries: int) -> Response:
        """The answer when ``_recover`` gives up: the engine's own error answer as it is, or a
        502/504 that says what failed and why it was not tried elsewhere."""
        if exc.kind == "status" and exc.status is not None:
            return _routed(Response(status=exc.status, body=exc.body,
                                    content_type=_content_type(exc.content_type)), decision)
        status = 504 if exc.kind == "timeout" else 502
        limit = self.config.retries.max_retries
        if not exc.retryable:
            why = ("Not retried: the engine may already have run the request (raise "
                   "timeouts.total_s for long answers, or stream them).")
        elif retries >= limit:
            why = (f"Gave up after {retries} {'retry' if retries == 1 else 'retries'} on other "
                   f"replicas (retries.max_retries: {limit}); check the engines' /health.")
        else:
            why = "No other healthy replica was left to retry on; check the engines' /health."
        message = f"kvroute could not get an answer from replica {decision.replica}: {exc}. {why}"
        return _routed(Response(status=status, body=error_body(message, status=status),
                                content_type=_JSON), decision)

    def _router_time(self, request: Request, reply: UpstreamReply, written_ns: int) -> None:
        """Record the router's own share of this request's latency: request read → forwarded
        (retries included), and the engine's answer (its first bytes when streamed) → written
        to the client. Skipped where a timestamp is missing (a canned reply, a client gone
        before the head)."""
        if reply.sent_ns and reply.ready_ns and written_ns:
            self.metrics.router_time((reply.sent_ns - request.received_ns) / 1e9,
                                     (written_ns - reply.ready_ns) / 1e9)

    def _whole(self, reply: UpstreamReply, decision: RoutingDecision) -> Response:
        response = Response(status=reply.status, body=reply.body)
        for key, value in reply.headers.items():
            response.headers[key] = value
        return _routed(response, decision)

    async def _stream(self, request: Request, reply: UpstreamReply, attempt: _Attempt,
                      decision: RoutingDecision, watcher: _StreamWatcher) -> StreamResponse:
        response = StreamResponse(status=reply.status)
        for key, value in reply.headers.items():
            response.headers[key] = value
        _routed(response, decision)

        def failed(kind: str, message: str) -> None:
            attempt.outcome = f"stream_{kind}"
            self.metrics.upstream_error(decision.replica, f"stream_{kind}")

        try:
            await relay_stream(reply, response, request, replica=decision.replica,
                               on_error=failed, on_chunk=watcher.feed)
        except ConnectionResetError:
            attempt.outcome = "client_gone"
        return response

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

    def _log(self, attempt: _Attempt, decision: RoutingDecision | None,
             walk: TierWalk | None = None) -> None:
        if not decision_log.isEnabledFor(logging.INFO):
            return
        record = {
            "event": "route",
            "request_id": attempt.request_id,
            "route": attempt.route,
            "pool": attempt.pool,
            "replica": decision.replica if decision else None,
            "policy": decision.policy if decision else self.config.policy.name,
            "reason": decision.reason if decision else None,
            "cached_tokens": decision.expected_cached_tokens if decision else 0,
            "prompt_tokens": attempt.num_prompt_tokens,
            "approximate": decision.approximate if decision else not attempt.exact,
            "routing_us": round(attempt.routing_us, 1),
            "tenant": attempt.tenant,
            "session": attempt.session is not None,
            "retries": attempt.retries,
            "outcome": attempt.outcome,
        }
        if walk is not None:
            record["tier"] = walk.place.reason.value
            record["estimate_tokens"] = walk.estimate.low
            record["max_tokens_sent"] = walk.state.max_tokens
            record["overflows"] = walk.num_overflows
        if self.config.log_format == "json":
            decision_log.info(json.dumps(record, separators=(",", ":")))
        else:
            decision_log.info(" ".join(f"{k}={v}" for k, v in record.items()))

    # -- other endpoints ----------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        created = int(time.time())
        cards = []
        for name, route in self.config.routes.items():
            pool = route.pools[-1]
            window = self.discovery.pool_window(pool) if self.discovery is not None else None
            cards.append(model_card(id=name, created=created, max_model_len=window,
                                    permission_id=f"modelperm-{name}",
                                    root=self.tiering.upstream_model(route, pool)))
        return _json(models_response(cards))

    async def health(self, request: Request) -> Response:
        pools = {
            name: sum(1 for rep in pool.replicas if self.core.is_healthy(rep.name))
            for name, pool in self.config.pools.items()
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

    def _check_admin(self, request: Request) -> AdminCapability:
        if self.admin is None or self.secrets.admin_key is None:
            raise RequestError(
                "Admin endpoints are disabled: set admin_key_env in the router's config and "
                "export that variable.", status=404, type="NotFoundError",
            )
        key = _bearer(request)
        if key is None:
            raise RequestError("Missing admin key: send 'Authorization: Bearer <admin key>'.",
                               status=401, code="invalid_api_key")
        if not hmac.compare_digest(key.encode(), self.secrets.admin_key.encode()):
            raise RequestError("This key is not the admin key; admin endpoints need it.",
                               status=403, code="forbidden")
        return self.admin

    async def admin_index(self, request: Request) -> Response:
        try:
            capability = self._check_admin(request)
            hashes = _query_hashes(request.query.get("hashes"))
        except RequestError as exc:
            return _error(exc.status, exc.body())
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
            self._check_admin(request)
        except RequestError as exc:
            return _error(exc.status, exc.body())
        replicas: dict[str, Any] = {}
        for pool, rep in self.config.replicas():
            load = self.core.load.snapshot(rep.name)
            replicas[rep.name] = {
                "pool": pool.name,
                "url": rep.url,
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
                           "approximate": spec.approximate}
        body: dict[str, Any] = {
            "policy": self.config.policy.name,
            "pools": pools,
            "replicas": replicas,
            "admission": {"in_flight": self.admission.in_flight, "queued": self.admission.queued,
                          "max_in_flight": self.admission.max_in_flight,
                          "max_queue": self.admission.max_queue},
        }
        if self.extra_state is not None:
            body.update(self.extra_state())
        return _json(body)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    scheme, _, key = value.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def _lookup_key(keys: Mapping[str, TenantName], key: str) -> TenantName | None:
    """Constant-time over the key values (a timing side channel must not leak key prefixes)."""
    found: TenantName | None = None
    probe = key.encode()
    for known, tenant in keys.items():
        if hmac.compare_digest(known.encode(), probe):
            found = tenant
    return found


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


def _content_type(value: str) -> str:
    return value.split(";", 1)[0].strip() or _JSON


def _json(obj: Any, status: int = 200) -> Response:
    return Response(status=status, body=json.dumps(obj).encode(), content_type=_JSON)


def _error(status: int, body: bytes, *, pool: str = "none",
           extra: Mapping[str, str] | None = None) -> Response:
    response = Response(status=status, body=body, content_type=_JSON)
    response.headers[HDR_REPLICA] = "none"
    response.headers[HDR_POOL] = pool
    response.headers[HDR_CACHED] = "0"
    if extra:
        response.headers.update(extra)
    return response


_R = TypeVar("_R", Response, StreamResponse)


def _routed(response: _R, decision: RoutingDecision) -> _R:
    """Stamp the decision on a response (every routed answer carries these headers)."""
    response.headers[HDR_REPLICA] = decision.replica
    response.headers[HDR_POOL] = decision.request.pool
    response.headers[HDR_CACHED] = str(decision.expected_cached_tokens)
    response.headers[HDR_APPROX] = "true" if decision.approximate else "false"
    return response


@dataclass(slots=True)
class RouterApp:
    """The router's HTTP side as built by ``build_app``: the handlers and the server that
    routes requests to them. ``start`` listens; ``close`` stops listening, lets answers in
    flight end (``grace_s``) and stops the warm-up sender."""

    router: Router
    http: HttpServer

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the bound port."""
        return await self.http.start(host, port)

    async def close(self, grace_s: float = 10.0) -> None:
        try:
            await self.http.close(grace_s)
        finally:
            if self.router.warm is not None:
                await self.router.warm.close()


def _openai_error(status: int, message: str) -> bytes:
    return error_body(message, status=status)


def build_app(
    config: RouterConfig,
    *,
    core: RouterCore,
    upstream: Upstream,
    secrets: Secrets,
    metrics: RouterMetrics | None = None,
    state: SessionState | None = None,
    discovery: DiscoveryView | None = None,
    tokenizers: Mapping[str, PromptTokenizer] | None = None,
    admission: Admission | None = None,
    extra_state: Callable[[], Mapping[str, Any]] | None = None,
    on_replica_failure: Callable[[ReplicaId, str], None] | None = None,
    on_scrape: Callable[[], None] | None = None,
    clock: Clock | None = None,
) -> RouterApp:
    """The composition root of the HTTP layer: wire the collaborators into the handlers and
    their HTTP server (``http/server.py``).

    Nothing is created behind the caller's back except what has no I/O (admission, metrics,
    the admin capability). ``shell/runtime.py`` builds the rest (client session, discovery,
    tokenizers, state, event subscribers) and starts them.

    Args:
        config: the validated configuration.
        core: the router core (the only owner of index and load state).
        upstream: the pooled upstream client.
        secrets: resolved API keys, admin key and cache salts (``config.resolve_secrets``).
        metrics: the router's Prometheus series; a fresh registry when None.
        state: session pins; None disables pinning.
        discovery: for windows in ``/v1/models``; None reports them as unknown.
        tokenizers: per pool; a pool without one is routed approximately.
        admission: defaults to ``config.admission``.
        extra_state: adds sections (subscribers, discovery) to ``/admin/state``.
        on_replica_failure: told when a replica refuses connections (discovery's hook).
        on_scrape: called before ``/metrics`` renders (to sync counters kept elsewhere).
        clock: monotonic seconds for window ages and warm cooldowns (the clock discovery
            stamps windows with); ``time.monotonic`` when None.
    """
    adm = admission or Admission(
        config.admission.max_in_flight, config.admission.max_queue,
        config.admission.queue_timeout_s, config.admission.retry_after_s,
    )
    metrics = metrics or RouterMetrics()
    tokenizers = dict(tokenizers or {})
    tiering = Tiering(config, discovery=discovery, tokenizers=tokenizers, metrics=metrics,
                      clock=clock or MonotonicClock())
    warm = WarmSender(config, core=core, upstream=upstream, metrics=metrics, state=state,
                      on_replica_failure=on_replica_failure)
    router = Router(
        config=config, core=core, upstream=upstream, admission=adm, secrets=secrets,
        metrics=metrics, tiering=tiering, state=state, discovery=discovery,
        tokenizers=tokenizers,
        admin=AdminCapability() if secrets.admin_key is not None else None,
        extra_state=extra_state, on_replica_failure=on_replica_failure, on_scrape=on_scrape,
        warm=warm,
    )
    # The server keeps bodies up to the limit and flags larger ones; Router._body answers
    # those with the OpenAI-shaped 413 (so every error a client sees is in one shape).
    routes: dict[str, dict[str, Handler]] = {
        "/v1/chat/completions": {"POST": router.chat},
        "/v1/completions": {"POST": router.completions},
        "/v1/models": {"GET": router.models},
        "/health": {"GET": router.health},
        "/metrics": {"GET": router.metrics_endpoint},
        "/admin/index": {"GET": router.admin_index},
        "/admin/state": {"GET": router.admin_state},
    }
    server = HttpServer(routes, max_body_bytes=config.max_body_bytes,
                        error_body=_openai_error)
    return RouterApp(router, server)
