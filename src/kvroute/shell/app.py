"""The router's HTTP API and the composition root ``build_app``.

Owns the walk's first step (docs/architecture.md, "The request walk", step 1): accept a
request, read its body within the size limit, parse and validate it, authenticate its tenant,
resolve its route, and take an admission slot; every bad input ends here with OpenAI's
error shape and a message that says what was wrong. The rest of the walk is
``shell/forward.py`` driving ``core/walk.py``; the router's own endpoints are
``shell/admin.py``.

It must not make routing decisions itself (that is ``core``) nor open sockets other than
through the ``Upstream`` it is given; every collaborator is passed to ``build_app``, so tests
build exactly what they need and nothing is a module global.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvroute.config import RouteConfig, RouterConfig, Secrets
from kvroute.core.clock import Clock
from kvroute.core.index import AdminCapability
from kvroute.core.peer_policies import POLICY_FACTORIES
from kvroute.core.router import RouterCore
from kvroute.core.types import ReplicaId, RequestId
from kvroute.core.walk import Walker, WalkSettings
from kvroute.core.warm import WarmPlanner
from kvroute.http.server import Answer, Handler, HttpServer, Request
from kvroute.shell.activity import Activity
from kvroute.shell.admin import AdminEndpoints, DiscoveryView
from kvroute.shell.admission import Admission, AdmissionRejected
from kvroute.shell.audit_sample import AuditSampler
from kvroute.shell.cache_feedback import CacheFeedback
from kvroute.shell.dashboard import Dashboard
from kvroute.shell.forward import Forwarder, error_answer
from kvroute.shell.lora_loader import LoraLoader
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.proxy import Upstream
from kvroute.shell.request_limits import TOO_DEEP, parse_within_limits, too_deep
from kvroute.shell.shadow_warm import ShadowWarmSender
from kvroute.shell.state import MonotonicClock, SessionState
from kvroute.shell.tenancy import cache_salt, log_tenant_isolation, tenant_of
from kvroute.shell.tier_pools import TierPools
from kvroute.shell.transcript_sample import TranscriptWriter
from kvroute.shell.warm import WarmSender
from kvroute.tokenize.prompt import PromptTokenizer
from kvroute.wire.openai import Endpoint, ParsedRequest, RequestError, error_body

__all__ = ["DiscoveryView", "PromptTokenizer", "Router", "RouterApp", "build_app", "request_ids"]

class _PerfCounter:
    """``time.perf_counter`` as the walk's routing timer."""

    __slots__ = ()

    def __call__(self) -> float:
        return time.perf_counter()


def request_ids() -> Iterator[str]:
    """Ids for requests that arrive without ``X-Request-Id``: a random 96-bit prefix drawn
    once per router, then a counter (``3f9c...-17``). Unique across router processes and
    restarts like a fresh ``uuid4`` per request, without its ``os.urandom`` call on every
    request."""
    prefix = uuid.uuid4().hex[:24]
    return (f"{prefix}-{n}" for n in itertools.count(1))


@dataclass(slots=True)
class Router:
    """The inference handlers: accept a request (module docstring), then hand it to the
    forwarder. Built by ``build_app``; one per application."""

    config: RouterConfig
    secrets: Secrets
    admission: Admission
    metrics: RouterMetrics
    forwarder: Forwarder
    warm: WarmSender | None = None
    activity: Activity | None = None
    core: RouterCore | None = None
    _request_ids: Iterator[str] = field(default_factory=request_ids)

    async def chat(self, request: Request) -> Answer:
        return await self.handle(request, "chat")

    async def completions(self, request: Request) -> Answer:
        return await self.handle(request, "completions")

    async def handle(self, request: Request, endpoint: Endpoint) -> Answer:
        try:
            tenant = tenant_of(request, self.secrets)
            raw = self._body(request)
            parsed = parse_within_limits(raw, endpoint,
                                         max_body_bytes=self.config.max_body_bytes)
            route, adapter = self._route(parsed)
        except RequestError as exc:
            return error_answer(exc.status, exc.body())
        try:
            await self.admission.acquire()
        except AdmissionRejected as exc:
            self.metrics.admission_reject(exc.reason)
            if self.activity is not None:
                self.activity.refused(429, route.pools[0], f"admission: {exc.message}")
            body = error_body(exc.message, status=429, code=429)
            return error_answer(429, body, extra={"Retry-After": str(exc.retry_after_s)})
        try:
            request_id = RequestId(request.headers.get("x-request-id")
                                   or next(self._request_ids))
            salt = cache_salt(self.secrets, tenant, parsed.cache_salt)
            return await self.forwarder.serve(request, raw, parsed, route, tenant, request_id,
                                              salt, adapter=adapter)
        except RecursionError:
            # Decoded, but too deep to encode again for the engine (nothing was sent): the
            # body's fault only if it is deep, otherwise a bug of ours (a 500, logged).
            if not too_deep(parsed):
                raise
            return error_answer(400, RequestError(TOO_DEEP).body())
        finally:
            self.admission.release()

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

    def _route(self, parsed: ParsedRequest) -> tuple[RouteConfig, str | None]:
        """The request's route, and the LoRA adapter it names (None: a route's own name).

        A ``model`` that is no route's name but an adapter some replica lists on
        ``/v1/models`` (vLLM serves adapters under their own names), or that a pool declares
        under ``lora_adapters``, takes the first route, in configuration order, with a pool
        where that adapter is listed or declared."""
        route = self.config.routes.get(parsed.model)
        if route is not None:
            return route, None
        pools = set(self.core.adapter_pools(parsed.model)) if self.core is not None else set()
        pools.update(name for name, pool in self.config.pools.items()
                     if parsed.model in pool.lora_adapters)
        for candidate in self.config.routes.values():
            if pools.intersection(candidate.pools):
                return candidate, parsed.model
        if route is None:
            known = ", ".join(sorted(self.config.routes))
            raise RequestError(
                f"The model `{parsed.model}` does not exist. This router serves: {known} "
                "(GET /v1/models lists them).", status=404, param="model",
                type="NotFoundError", code=404,
            )
        return route, None


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
            if self.router.forwarder.sampler is not None:
                self.router.forwarder.sampler.close()
            if self.router.forwarder.transcripts is not None:
                await self.router.forwarder.transcripts.close()
            if self.router.warm is not None:
                await self.router.warm.close()
            if self.router.forwarder.shadow is not None:
                await self.router.forwarder.shadow.close()


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
    feedback: CacheFeedback | None = None,
) -> RouterApp:
    """The composition root of the HTTP layer: wire the collaborators into the handlers and
    their HTTP server (``shell/http_server.py``).

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
        feedback: the engines' cache counters and the drift alarm (``shell/cache_feedback``),
            told every answer's usage; None compares nothing.
    """
    adm = admission or Admission(
        config.admission.max_in_flight, config.admission.max_queue,
        config.admission.queue_timeout_s, config.admission.retry_after_s,
    )
    metrics = metrics or RouterMetrics()
    clock = clock or MonotonicClock()
    warm_cfg = config.warm_ahead
    planner = WarmPlanner(fraction=warm_cfg.fraction, cooldown_s=warm_cfg.cooldown_s,
                          max_sessions=config.state.max_warm, enabled=warm_cfg.enabled,
                          rewarm_fraction=warm_cfg.rewarm_fraction)
    settings = WalkSettings(
        max_retries=config.retries.max_retries, window_ttl_s=config.discovery.window_ttl_s,
        policy_needs_text=bool(getattr(POLICY_FACTORIES[config.policy.name], "needs_text",
                                       False)))
    walker = Walker(core, planner, settings, clock, timer=_PerfCounter())
    for route in config.routes.values():
        walker.set_scenarios(route.name, route.scenarios)
    pools = TierPools(config, discovery=discovery, metrics=metrics, clock=clock)
    replica_url = discovery.member_url if discovery is not None else None
    warm = WarmSender(config, core=core, upstream=upstream, metrics=metrics, state=state,
                      on_replica_failure=on_replica_failure, replica_url=replica_url)
    activity = Activity(clock)
    forwarder = Forwarder(config=config, walker=walker, upstream=upstream, secrets=secrets,
                          metrics=metrics, pools=pools, state=state,
                          tokenizers=dict(tokenizers or {}), warm=warm,
                          on_replica_failure=on_replica_failure, feedback=feedback,
                          activity=activity,
                          sampler=(AuditSampler(config.audit_sample)
                                   if config.audit_sample is not None else None),
                          transcripts=(TranscriptWriter(
                                           config.gate.sample,
                                           on_counts=metrics.set_transcript_sample)
                                       if config.gate.sample is not None else None),
                          lora_loader=(LoraLoader(config, core, upstream,
                                                  replica_url=replica_url)
                                       if any(p.lora_adapters for p in config.pools.values())
                                       else None),
                          shadow=ShadowWarmSender(config, walker, upstream, metrics,
                                                  on_replica_failure, replica_url=replica_url),
                          replica_url=replica_url)
    router = Router(config=config, secrets=secrets, admission=adm, metrics=metrics,
                    forwarder=forwarder, warm=warm, activity=activity, core=core)
    dashboard = Dashboard(config=config, core=core, metrics=metrics, admission=adm,
                          activity=activity, feedback=feedback, discovery=discovery)
    endpoints = AdminEndpoints(
        config=config, core=core, secrets=secrets, metrics=metrics, admission=adm, pools=pools,
        discovery=discovery, admin=AdminCapability() if secrets.admin_key is not None else None,
        extra_state=extra_state, on_scrape=on_scrape)
    # The server keeps bodies up to the limit and flags larger ones; Router._body answers
    # those with the OpenAI-shaped 413 (so every error a client sees is in one shape).
    routes: dict[str, dict[str, Handler]] = {
        "/v1/chat/completions": {"POST": router.chat},
        "/v1/completions": {"POST": router.completions},
        "/v1/models": {"GET": endpoints.models},
        "/health": {"GET": endpoints.health},
        "/metrics": {"GET": endpoints.metrics_endpoint},
        "/admin/index": {"GET": endpoints.admin_index},
        "/admin/state": {"GET": endpoints.admin_state},
        "/dashboard": {"GET": dashboard.page},
        "/dashboard/data": {"GET": dashboard.data},
    }
    limits = config.http
    server = HttpServer(routes, max_body_bytes=config.max_body_bytes,
                        error_body=_openai_error, keepalive_timeout_s=limits.idle_timeout_s,
                        max_head_bytes=limits.max_header_bytes,
                        header_timeout_s=limits.header_timeout_s,
                        body_timeout_s=limits.body_timeout_s,
                        send_timeout_s=limits.send_timeout_s,
                        max_connections=limits.max_connections)
    log_tenant_isolation(config)
    return RouterApp(router, server)
