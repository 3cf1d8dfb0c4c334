"""The request walk driven for a gateway: kvroute as an Endpoint Picker.

``shell/forward.py`` drives ``core/walk.py`` and does the proxying itself; here the gateway
(Envoy, or a Gateway with an ``InferencePool``) proxies, and kvroute only decides. For one
request the gateway has handed over (headers and whole body, ``shell/epp_server.py`` reads
them off the ext_proc stream), :meth:`Picker.pick` runs the walk's first step the way
``shell/app.py`` does (body limit, OpenAI parse, tenant, route, admission slot) and the walk
up to its first ``Send``: tiers, exact tokens, warm-ahead, the cost model, the session's pin.
The answer is a :class:`Picked` (the chosen replica's ``ip:port`` with the ranking's next
replicas as ordered fallbacks, and the body to forward: the client's own bytes, or with
``max_tokens`` clamped, the pool's model and the tenant's ``cache_salt``), or a
:class:`Refused` the gateway sends back at once (4xx as ``kvroute serve`` answers them, 503
when no replica may serve, 429 when admission sheds it).

The response then flows back through :class:`PickedWalk`: the endpoint the gateway reports
as having served it (a fallback moves the walk's accounting there, as a retry would), the
status (2xx: the first byte; anything else: the walk ends without a pin), the body watched
for ``finish_reason`` and ``usage``, and at its end the walk's ``end``: load released,
session written, one ``kvroute.decision`` line. What the gateway's proxying takes away:
an engine's overflow rejection reaches the client as the engine sent it (the walk cannot
clamp and retry a request it does not send); proactive tiering and clamping still apply.

The walk, core, index, discovery, tenancy, admission and session state are the very ones of
the ``Router`` that ``shell/app.build_app`` built (:meth:`Picker.of`), so a picker and an HTTP
router in one process decide as one. No gRPC or protobuf here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvroute.config import ReplicaConfig, RouteConfig
from kvroute.core.errors import ConfigError
from kvroute.core.router import RoutingDecision
from kvroute.core.session import session_key
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName
from kvroute.core.walk import Fail, NeedTokens, Refuse, Send, WalkAction, WalkRequest
from kvroute.http.server import Request
from kvroute.shell.admission import Admission, AdmissionRejected
from kvroute.shell.app import RouterApp, request_ids
from kvroute.shell.forward import (
    HDR_APPROX,
    HDR_CACHED,
    HDR_POOL,
    HDR_REPLICA,
    Forwarder,
    _Exchange,
    thinking_allowed,
)
from kvroute.shell.request_limits import parse_within_limits
from kvroute.shell.tenancy import cache_salt, tenant_of
from kvroute.wire import endpoint_picker as epp
from kvroute.wire.openai import (
    Endpoint,
    ParsedRequest,
    RequestError,
    error_body,
    session_from_request,
)
from kvroute.wire.relay import StreamWatcher, completion_of, prompt_ids_from_body
from kvroute.wire.relay import routing_text as render_routing_text

__all__ = ["Picked", "PickedWalk", "Picker", "Refused"]

log = logging.getLogger("kvroute.epp")

_PATHS: Final[Mapping[str, Endpoint]] = {
    "/v1/chat/completions": "chat", "/v1/completions": "completions"}


@dataclass(frozen=True, slots=True)
class Refused:
    """Answer the client at once with ``status`` and ``body`` (OpenAI's error shape)."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Picked:
    """Where the gateway sends the request, and what it sends.

    Attributes:
        endpoints: ``ip:port`` of the chosen replica, then the fallbacks in order.
        body: the body to forward.
        body_changed: ``body`` differs from the client's (``content-length`` must follow).
        walk: receives the response (:class:`PickedWalk`); ``finish`` it on every path.
        set_headers: request headers to set for the engine (``x-request-id``).
        remove_headers: request headers the engine must not see (the client's API key:
            ``kvroute serve`` never forwards it either).
    """

    endpoints: tuple[str, ...]
    body: bytes
    body_changed: bool
    walk: PickedWalk
    set_headers: Mapping[str, str] = field(default_factory=dict)
    remove_headers: tuple[str, ...] = ("authorization",)


def _routed_headers(decision: RoutingDecision) -> dict[str, str]:
    """The routing headers ``kvroute serve`` stamps on every routed answer."""
    return {HDR_REPLICA: decision.replica, HDR_POOL: decision.request.pool,
            HDR_CACHED: str(decision.expected_cached_tokens),
            HDR_APPROX: "true" if decision.approximate else "false"}


@dataclass(slots=True)
class Picker(Forwarder):
    """Runs walks for a gateway (module docstring); one per process, beside the HTTP router
    whose collaborators it shares.

    Invariant, as for ``Forwarder``: every core call happens on the event loop's thread.

    Attributes:
        admission: the HTTP router's admission (one in-flight bound for both).
        fallbacks: how many of the ranking's next replicas follow the chosen one in the
            destination, at most ``retries.max_retries`` (0, the default, for gateways
            that read one endpoint only, such as Envoy's ``ORIGINAL_DST`` cluster; Envoy's
            ``override_host`` load balancer tries the list in order on retries).
    """

    admission: Admission | None = None
    fallbacks: int = 0
    _endpoints: dict[ReplicaId, str] = field(default_factory=dict)
    _replicas: dict[str, ReplicaId] = field(default_factory=dict)
    _request_ids: Iterator[str] = field(default_factory=request_ids)

    @classmethod
    def of(cls, app: RouterApp, *, fallbacks: int = 0) -> Picker:
        """A picker sharing ``app``'s walker, core, pools, state, tokenizers, warm-up sender,
        admission and metrics.

        Raises:
            EndpointError: a replica's URL cannot be given as ``ip:port``.
            ConfigError: more fallbacks than ``retries.max_retries`` (the walk follows a
                fallback as a retry, so the gateway may not try more than it allows).
        """
        router = app.router
        fwd = router.forwarder
        shared = {f.name: getattr(fwd, f.name) for f in dataclasses.fields(Forwarder)
                  if f.init and not f.name.startswith("_")}
        config = fwd.config
        if not 0 <= fallbacks <= config.retries.max_retries:
            raise ConfigError(
                f"--fallbacks {fallbacks} must be between 0 and retries.max_retries "
                f"({config.retries.max_retries}); raise retries.max_retries to allow more")
        picker = cls(**shared, admission=router.admission, fallbacks=fallbacks)
        picker._request_ids = router._request_ids
        for pool in config.pools.values():
            if pool.external is not None:
                continue
            for rep in pool.replicas:
                address = epp.endpoint_of_url(rep.url)
                picker._endpoints[rep.name] = address
                picker._replicas[address] = rep.name
        return picker

    async def pick(self, path: str, headers: Mapping[str, str], body: bytes,
                   subset: frozenset[str] | None, *, body_size: int | None = None,
                   ) -> Picked | Refused:
        """Walk one request to its destination (module docstring).

        Args:
            path: the request's ``:path`` (query string allowed).
            headers: its headers, names lower-cased.
            body: its whole body (or what was kept of it: see ``body_size``).
            subset: the gateway's candidate endpoints, or None for every replica.
            body_size: the body's size when the caller stopped keeping it past
                ``max_body_bytes`` (it is then refused with a 413).
        """
        assert self.admission is not None, "Picker.of sets the admission"
        endpoint = _PATHS.get(path.split("?", 1)[0])
        if endpoint is None:
            message = (f"kvroute's picker routes POST /v1/chat/completions and "
                       f"/v1/completions, not {path!r}; send other paths to a plain backend.")
            return Refused(404, error_body(message, status=404, code=404))
        request = Request(None, "POST", path, "", dict(headers), "HTTP/1.1", True)
        try:
            tenant = tenant_of(request, self.secrets)
            size = len(body) if body_size is None else body_size
            if size > self.config.max_body_bytes:
                raise RequestError(
                    f"Request body is {size} bytes, over this router's limit of "
                    f"{self.config.max_body_bytes} bytes. Send a shorter prompt, or raise the "
                    "router's max_body_bytes setting.", status=413)
            parsed = parse_within_limits(body, endpoint,
                                         max_body_bytes=self.config.max_body_bytes)
            route = self._route_of(parsed, headers)
        except RequestError as exc:
            return Refused(exc.status, exc.body())
        request.body = body
        try:
            await self.admission.acquire()
        except AdmissionRejected as exc:
            self.metrics.admission_reject(exc.reason)
            return Refused(429, error_body(exc.message, status=429, code=429),
                           {"retry-after": str(exc.retry_after_s),
                            epp.DROPPED_REASON: epp.DROPPED_REASONS.get(exc.reason, exc.reason)})
        return await self._walk(request, body, parsed, route, tenant, headers, subset)

    def _route_of(self, parsed: ParsedRequest, headers: Mapping[str, str]) -> RouteConfig:
        """The route named by the gateway's model rewrite, else by the body's ``model``."""
        name = epp.model_rewrite(headers) or parsed.model
        route = self.config.routes.get(name)
        if route is None:
            known = ", ".join(sorted(self.config.routes))
            raise RequestError(
                f"The model `{name}` does not exist. This router serves: {known}.",
                status=404, param="model", type="NotFoundError", code=404)
        return route

    async def _walk(self, request: Request, raw: bytes, parsed: ParsedRequest,
                    route: RouteConfig, tenant: TenantName, headers: Mapping[str, str],
                    subset: frozenset[str] | None) -> Picked | Refused:
        """The walk up to its destination; owns the admission slot taken for it."""
        session_ref = session_from_request(headers, parsed.body, lowered=True)
        session = session_ref.session_id if session_ref is not None else None
        record = None
        if session is not None and self.state is not None:
            try:
                record = await self.state.get_session(session_key(tenant, route.name, session))
            except BaseException:
                assert self.admission is not None
                self.admission.release()
                raise
        exclude: frozenset[ReplicaId] = frozenset()
        if subset is not None:
            exclude = frozenset(rep for rep, address in self._endpoints.items()
                                if address not in subset)
        request_id = RequestId(headers.get("x-request-id") or next(self._request_ids))
        salt = cache_salt(self.secrets, tenant, parsed.cache_salt)
        walk_request = WalkRequest(
            request_id=request_id, route=self._walk_route(route), tenant=tenant,
            session_id=session, endpoint=parsed.endpoint, model=parsed.model, body=parsed.body,
            max_tokens=parsed.max_tokens, n=parsed.n,
            num_messages=None if parsed.messages is None else len(parsed.messages),
            prompt_token_ids=prompt_ids_from_body(parsed),
            routing_text=lambda: render_routing_text(parsed), cache_salt=salt,
            exclude=exclude, shadow_payload=parsed,
            thinking_tokens=thinking_allowed(parsed, route))
        alternates = self.pools.alternates(route) if route.scenarios.any else None
        walk = self.walker.start(walk_request, self.pools.tier_pools(route), record,
                                 alternates=alternates)
        ex = _Exchange(request, raw, parsed, route, tenant, walk)
        picked = PickedWalk(self, ex, headers)
        try:
            action: WalkAction = walk.begin()
            while isinstance(action, NeedTokens):
                self._drain(walk)
                action = walk.tokens(action.pool, await self._token_ids(ex, action.pool))
            self._drain(walk)
        except BaseException:
            picked.finish()
            raise
        if isinstance(action, Refuse):
            answer = self._refused(action, self._shows(tenant))
            picked.finish()
            return Refused(answer.status, answer.body)
        # A Fail answers a reported failure, and nothing has been sent yet.
        assert not isinstance(action, Fail), "the walk failed before anything was sent"
        return self._destination(ex, action, picked)

    def _destination(self, ex: _Exchange, send: Send, picked: PickedWalk) -> Picked | Refused:
        decision = send.decision
        if send.external:
            ex.walk.outcome = "external_pool"
            picked.finish()
            message = (f"The request was placed in pool {decision.request.pool!r}, an external "
                       "provider; kvroute's picker can only send a gateway to local engines. "
                       "Serve this route with `kvroute serve`, or drop the external pool.")
            return Refused(503, error_body(message, status=503))
        self._warm(ex, send)
        body = self._body(ex, send)
        endpoints = [self._endpoints[decision.replica]]
        # One set of request headers goes to every endpoint of the list: a DP rank's
        # X-data-parallel-rank too. So a fallback is a replica the same header fits (the
        # same rank of another DP engine; no rank when the chosen one has none), at another
        # address (the chosen engine's other ranks share its address).
        rank = self.dp_rank_headers(decision.replica)
        for replica in decision.ranking:
            if len(endpoints) > self.fallbacks:
                break
            if (replica != decision.replica and replica not in decision.request.exclude
                    and self._endpoints[replica] not in endpoints
                    and self.dp_rank_headers(replica) == rank
                    and self.walker.core.is_healthy(replica)):
                endpoints.append(self._endpoints[replica])
        picked.sent_ns = time.perf_counter_ns()
        headers = {"x-request-id": decision.request.request_id,
                   **{k.lower(): v for k, v in rank.items()}}  # gRPC/HTTP/2: lower-case names
        return Picked(tuple(endpoints), body, body is not ex.raw, picked, headers)

    def joined(self, pool: PoolName, replica: ReplicaConfig) -> None:
        """A replica joined ``pool`` (``shell/k8s_members.py``): answer with its ``ip:port``.

        Raises:
            EndpointError: its URL cannot be given as ``ip:port``.
        """
        address = epp.endpoint_of_url(replica.url)
        self._endpoints[replica.name] = address
        self._replicas[address] = replica.name

    def left(self, replica: ReplicaId) -> None:
        address = self._endpoints.pop(replica, None)
        if address is not None and self._replicas.get(address) == replica:
            del self._replicas[address]

    def served_replica(self, endpoint: str) -> ReplicaId | None:
        """The replica at ``endpoint``, if it is one of ours (for the ranks of a
        data-parallel engine, which share one address: the last rank)."""
        return self._replicas.get(endpoint)


class PickedWalk:
    """One picked request's walk while the gateway proxies it (module docstring).

    Call :meth:`response_headers` when the answer's head arrives, :meth:`response_body`
    with every piece of its body, and :meth:`finish` on every path (idempotent): the end of
    the body, a stream cut short, a client gone.
    """

    __slots__ = ("_admitted", "_finished", "_headers", "_picker", "_streamed", "_watcher",
                 "_whole", "ex", "sent_ns")

    def __init__(self, picker: Picker, ex: _Exchange, headers: Mapping[str, str]) -> None:
        self._picker = picker
        self.ex = ex
        self._headers = headers
        self._admitted = True
        self._finished = False
        self._watcher = StreamWatcher()
        self._whole: list[bytes] = []
        self._streamed = False
        self.sent_ns = 0

    @property
    def decision(self) -> RoutingDecision | None:
        return self.ex.walk.decision

    def response_headers(self, status: int, served: str | None,
                         content_type: str = "") -> Mapping[str, str]:
        """The answer's head: move to the served replica, note the first byte (2xx) or the
        failed status; returns the routing headers to add to the answer."""
        walk, picker = self.ex.walk, self._picker
        followed = served is None or self._follow(served)
        decision = walk.decision
        if decision is None:
            return {}
        self._streamed = content_type.split(";", 1)[0].strip() == "text/event-stream"
        shown = picker._shows(self.ex.tenant)  # TenantConfig.routing_headers
        if not followed:  # the walk gave up following the gateway and has ended
            return _routed_headers(decision) if shown else {}
        if 200 <= status < 300:
            walk.answered()
        else:
            walk.outcome = "upstream_status"
            picker.metrics.upstream_error(decision.replica, "status")
        picker._drain(walk)
        return _routed_headers(decision) if shown else {}

    def _follow(self, served: str) -> bool:
        """The gateway served the request at ``served``: when that is a fallback, move the
        walk's accounting along the ranking to it, as a failed attempt would. False when the
        walk could not follow (the replica went out of routing meanwhile, say) and ended
        instead; its accounting is then closed."""
        walk, picker = self.ex.walk, self._picker
        replica = picker.served_replica(served)
        decision = walk.decision
        if decision is None or replica == decision.replica \
                or picker._endpoints.get(decision.replica) == served:  # a DP rank's address
            return True
        if replica is None or replica not in decision.ranking:
            log.warning("the gateway served request %s at %s, which is not among the "
                        "endpoints kvroute gave it; its accounting stays on %s",
                        walk.request.request_id, served, decision.replica)
            return True
        while decision.replica != replica:
            action = walk.failed("fallback", retryable=True,
                                 detail=f"the gateway fell back to {served}")
            picker._drain(walk)
            if not isinstance(action, Send):
                log.warning("request %s: the gateway's fallback %s could not be followed "
                            "(%s); its accounting ends here", walk.request.request_id, served,
                            type(action).__name__)
                self.finish("fallback_lost")
                return False
            decision = action.decision
        return True

    def response_body(self, piece: bytes) -> None:
        """A piece of the answer's body, as relayed."""
        if self._streamed:
            self._watcher.feed(piece)
        elif piece:
            self._whole.append(piece)

    def finish(self, outcome: str | None = None) -> None:
        """End the walk: release its load and admission slot, write the session, log the
        decision. ``outcome`` overrides the walk's (``gateway_closed``, ``fallback_lost``);
        the answer's ``finish_reason`` and ``usage`` are read only when it ended normally."""
        if self._finished:
            return
        self._finished = True
        walk, picker = self.ex.walk, self._picker
        if outcome is not None:
            walk.outcome = outcome
        reasons: Sequence[str | None] = ()
        usage: Mapping[str, Any] | None = None
        if walk.decision is not None and outcome is None:
            if self._streamed:
                reasons, usage = self._watcher.finish_reasons, self._watcher.usage
            elif self._whole:
                reasons, usage = completion_of(b"".join(self._whole))
        try:
            write = walk.end(reasons, usage)
            picker._drain(walk)
            if picker.feedback is not None and walk.decision is not None:
                picker.feedback.on_answer(walk.decision, usage)  # shell/cache_feedback.py
            if write is not None and picker.state is not None:
                picker._spawn(picker.state.put_session(write.key, write.record,
                                                       picker.config.state.session_ttl_s))
            picker._log(self.ex)
        finally:
            if self._admitted and picker.admission is not None:
                self._admitted = False
                picker.admission.release()
