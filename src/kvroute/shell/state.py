"""Session records and warm-ahead cooldowns: in memory for one router, in Redis for several.

Owns the two pieces of per-session state that must survive between requests and, with
several router processes behind one Service, be shared by them:

* a *session record* (``core/session.SessionRecord``: the replica that served it last, the
  largest tier it reached, its last ``usage``), read once when a request's walk starts and
  written once when it ends, with a TTL refreshed on each write (an active session keeps its
  replica and tier, an idle one is forgotten);
* a *warm cooldown*: at most one warm-ahead per key per cooldown, claimed atomically
  (``try_start_warm`` returns True to exactly one caller, in one process or across many).

Everything else (the prefix index, load) is rebuilt by each router from the engines' own
event streams and ``/metrics``, so it is deliberately not here.

Failure policy. State is an optimisation: losing it costs cache hits, never correctness.
``RedisState`` therefore degrades instead of failing: a Redis error or timeout reads as
"no record" and "no warm" (never two warms: refusing is the safe side), is counted in
``kvroute_state_errors_total`` and logged once per outage (and once on recovery). It never
raises into a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any, Final, Protocol

import msgspec
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from kvroute.config import RouterConfig
from kvroute.core.clock import Clock
from kvroute.core.errors import ConfigError
from kvroute.core.pseudonyms import Pseudonyms
from kvroute.core.session import SessionRecord, SessionTable, SessionUsage
from kvroute.core.types import ReplicaId
from kvroute.shell.metrics import RouterMetrics

__all__ = [
    "DEFAULT_MAX_PINS",
    "DEFAULT_MAX_WARM",
    "DEFAULT_REDIS_TIMEOUT_S",
    "MemoryState",
    "MonotonicClock",
    "RedisState",
    "SessionState",
    "build_state",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_PINS: Final = 100_000
DEFAULT_MAX_WARM: Final = 256
DEFAULT_REDIS_TIMEOUT_S: Final = 0.25
"""Per call. A pin lookup sits on the request path: a slow Redis must cost little."""


class MonotonicClock:
    """``time.monotonic`` as a ``Clock`` (the live server's clock)."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()


class SessionState(Protocol):
    """Session records and warm cooldowns, shared by every router process that uses the same
    backend."""

    async def get_session(self, key: str) -> SessionRecord | None:
        """The record of ``key`` (``core.session.session_key``), or None (never written,
        expired, or the store is unavailable)."""
        ...

    async def put_session(self, key: str, record: SessionRecord, ttl_s: float) -> None:
        """Write ``key``'s record; it lives ``ttl_s`` seconds from now (refreshes the TTL)."""
        ...

    async def try_start_warm(self, key: str, cooldown_s: float) -> bool:
        """True at most once per ``key`` per ``cooldown_s``: the caller may warm now."""
        ...

    async def close(self) -> None:
        ...


def _check_duration(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


class MemoryState:
    """Process-local state: session records in a ``core.session.SessionTable`` and warm
    cooldowns in a bounded LRU, both with expiry times on an injected clock.

    Invariants: at most ``max_pins`` records and ``max_warm`` cooldowns are held; the least
    recently used entry is evicted first; an entry whose expiry time has passed is never
    returned (it is dropped when met). Expired entries are not swept: the bound, not a
    timer, limits memory, so there is no background task to own.

    Evicting a live cooldown early only allows one extra warm-ahead for that key (harmless);
    evicting a live record loses one session's affinity (one cache miss at worst).

    Args:
        max_pins: bound on session records (default 100 000).
        max_warm: bound on warm cooldowns (default 256, as ``core/warm.py``'s map).
        clock: monotonic seconds; ``time.monotonic`` when None.
    """

    __slots__ = ("_clock", "_sessions", "_warm", "max_pins", "max_warm")

    def __init__(
        self,
        max_pins: int = DEFAULT_MAX_PINS,
        max_warm: int = DEFAULT_MAX_WARM,
        *,
        clock: Clock | None = None,
    ) -> None:
        if max_pins < 1 or max_warm < 1:
            raise ConfigError(
                f"state bounds must be >= 1 (max_pins={max_pins}, max_warm={max_warm}); "
                "raise them in 'state:'"
            )
        self.max_pins = max_pins
        self.max_warm = max_warm
        self._clock: Clock = clock or MonotonicClock()
        self._sessions = SessionTable(max_pins)
        self._warm: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def num_warm(self) -> int:
        return len(self._warm)

    async def get_session(self, key: str) -> SessionRecord | None:
        return self._sessions.get(key, self._clock.now())

    async def put_session(self, key: str, record: SessionRecord, ttl_s: float) -> None:
        _check_duration("ttl_s", ttl_s)
        self._sessions.put(key, record, self._clock.now(), ttl_s)

    async def try_start_warm(self, key: str, cooldown_s: float) -> bool:
        _check_duration("cooldown_s", cooldown_s)
        now = self._clock.now()
        until = self._warm.get(key)
        if until is not None and now < until:
            return False
        self._warm[key] = now + cooldown_s
        self._warm.move_to_end(key)
        while len(self._warm) > self.max_warm:
            self._warm.popitem(last=False)
        return True

    async def close(self) -> None:
        self._sessions.clear()
        self._warm.clear()


class RedisState:
    """State in Redis, shared by every router process pointed at the same server.

    Keys: ``<namespace>:session:<key>`` (value: the record as JSON, ``{"pin": ..., "tier":
    ..., "usage": [prompt, completion, messages], "version": ..., "arm": ...,
    "prompt_tokens": ...}``, ``PX`` = TTL; an unreadable value reads
    as no record and is counted, never raised) and
    ``<namespace>:warm:<key>`` (claimed with ``SET NX PX``, so exactly one process wins per
    cooldown). The namespace defaults to ``kvroute``; several fleets can share one Redis with
    different namespaces.

    With ``secret`` (the cluster secret; ``kvroute serve`` always has one, ``resolve_secrets``
    refuses to start Redis state without it), ``<key>`` is the keyed pseudonym of the session
    key (``core/pseudonyms.Pseudonyms.state_key``), not the key itself: the session key holds
    the tenant, route and session id, and whoever can list the Redis keys must learn none of
    them. Every router with the same secret derives the same Redis key. The values hold no
    tenant or session id (a replica, a tier, token counts, a version, an arm). Without a
    secret (code and tests building ``RedisState`` directly) the key is the session key.

    Every call is bounded by ``timeout_s`` (socket timeouts plus an overall
    ``asyncio.timeout``) and redis-py's own retries are off: a retry loop against a dead server
    would hold the request far longer than the pin is worth. Failures degrade (see the module
    docstring) and flip ``available`` to False until a call succeeds again.

    Args:
        client: a ``redis.asyncio.Redis`` (``decode_responses`` not required).
        namespace: the first part of every key (a trailing ``:`` is ignored).
        timeout_s: bound on each call.
        metrics: where failures are counted (``state_errors_total{backend="redis"}``).
        owns_client: close the client in ``close()``.
        secret: the cluster secret: keys are pseudonyms under it (None: keys in clear).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str = "kvroute",
        timeout_s: float = DEFAULT_REDIS_TIMEOUT_S,
        metrics: RouterMetrics | None = None,
        owns_client: bool = True,
        secret: str | None = None,
    ) -> None:
        _check_duration("timeout_s", timeout_s)
        namespace = namespace.removesuffix(":")
        if not namespace or any(ch.isspace() for ch in namespace):
            raise ConfigError(
                f"state.namespace must be non-empty and without spaces, got {namespace!r}; "
                "use e.g. kvroute"
            )
        self._client = client
        self._prefix = namespace + ":"
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._owns_client = owns_client
        self._names = None if secret is None else Pseudonyms(secret)
        self.available = True
        self.num_errors = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str = "kvroute",
        timeout_s: float = DEFAULT_REDIS_TIMEOUT_S,
        metrics: RouterMetrics | None = None,
        secret: str | None = None,
    ) -> RedisState:
        """Connect lazily to ``url`` (``redis://host:port/db``); nothing is sent until used.

        Raises:
            ConfigError: the URL is not a Redis URL.
        """
        try:
            client = aioredis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
            )
        except ValueError as exc:
            raise ConfigError(
                f"state.url {url!r} is not a Redis URL ({exc}); use e.g. redis://127.0.0.1:6379/0"
            ) from exc
        return cls(client, namespace=namespace, timeout_s=timeout_s, metrics=metrics,
                   secret=secret)

    def _hidden(self, key: str) -> str:
        names = self._names
        return key if names is None else names.state_key(key)

    def session_key(self, key: str) -> str:
        """The Redis key of ``key``'s session record."""
        return f"{self._prefix}session:{self._hidden(key)}"

    def warm_key(self, key: str) -> str:
        """The Redis key of ``key``'s warm cooldown."""
        return f"{self._prefix}warm:{self._hidden(key)}"

    async def get_session(self, key: str) -> SessionRecord | None:
        ok, value = await self._call("get_session", self._client.get(self.session_key(key)))
        if not ok or value is None:
            return None
        record = decode_record(value)
        if record is None:
            self.num_errors += 1
            if self._metrics is not None:
                self._metrics.state_error("redis", "decode_session")
            log.error("shared state (Redis): the session record under %r is not one this "
                      "router wrote (%r); treating it as absent", self.session_key(key),
                      bytes(value)[:80])
        return record

    async def put_session(self, key: str, record: SessionRecord, ttl_s: float) -> None:
        _check_duration("ttl_s", ttl_s)
        await self._call("put_session", self._client.set(
            self.session_key(key), encode_record(record), px=_ms(ttl_s)))

    async def try_start_warm(self, key: str, cooldown_s: float) -> bool:
        _check_duration("cooldown_s", cooldown_s)
        ok, value = await self._call(
            "try_start_warm",
            self._client.set(self.warm_key(key), b"1", nx=True, px=_ms(cooldown_s)),
        )
        return ok and bool(value)

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def _call(self, op: str, awaitable: Any) -> tuple[bool, Any]:
        """Await one Redis command; (True, result) or (False, None) after counting the failure.

        NOTE: ``except`` is narrowed to what a Redis outage raises (redis errors, timeouts,
        socket errors); anything else is a bug and propagates.
        """
        try:
            async with asyncio.timeout(self._timeout_s):
                result = await awaitable
        except (RedisError, TimeoutError, OSError) as exc:
            self.num_errors += 1
            if self._metrics is not None:
                self._metrics.state_error("redis", op)
            if self.available:
                self.available = False
                log.error(
                    "shared state (Redis) unavailable: %s failed with %s: %s; routing continues "
                    "without session pins and warm-ahead until it recovers",
                    op, type(exc).__name__, exc,
                )
            return False, None
        if not self.available:
            self.available = True
            log.warning("shared state (Redis) reachable again after %d failed calls",
                        self.num_errors)
        return True, result


class _WireRecord(msgspec.Struct, omit_defaults=True):
    pin: str | None = None
    tier: int = 0
    usage: tuple[int, int, int] | None = None
    version: str | None = None
    arm: str | None = None
    prompt_tokens: int = 0


_RECORD_ENCODER: Final = msgspec.json.Encoder()
_RECORD_DECODER: Final = msgspec.json.Decoder(_WireRecord)


def encode_record(record: SessionRecord) -> bytes:
    """A session record as stored in Redis (compact JSON)."""
    usage = record.usage
    return _RECORD_ENCODER.encode(_WireRecord(
        pin=record.pin, tier=record.tier,
        usage=None if usage is None else (usage.prompt_tokens, usage.completion_tokens,
                                          usage.num_messages),
        version=record.version, arm=record.arm, prompt_tokens=record.prompt_tokens))


def decode_record(data: bytes | str) -> SessionRecord | None:
    """The record ``encode_record`` wrote, or None for anything else."""
    try:
        wire = _RECORD_DECODER.decode(data)
    except msgspec.DecodeError:
        return None
    if (wire.tier < 0 or wire.prompt_tokens < 0
            or (wire.usage is not None and min(wire.usage) < 0)):
        return None
    return SessionRecord(
        pin=None if wire.pin is None else ReplicaId(wire.pin), tier=wire.tier,
        usage=None if wire.usage is None else SessionUsage(*wire.usage),
        version=wire.version, arm=wire.arm, prompt_tokens=wire.prompt_tokens)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _setting(section: object, name: str, default: Any) -> Any:
    """``section.name``, or ``default`` when this config version has no such field."""
    return getattr(section, name, default)


def build_state(
    config: RouterConfig, *, metrics: RouterMetrics | None = None, clock: Clock | None = None,
    secret: str | None = None,
) -> SessionState:
    """The state backend ``config.state`` asks for.

    ``memory``: session records bounded by ``state.max_pins``, warm cooldowns by ``state.max_warm``.
    ``redis``: ``state.url``, keys under ``state.namespace`` (pseudonyms under ``secret``,
    the cluster secret, when given), ``state.timeout_s`` per call.

    Raises:
        ConfigError: unknown backend, or ``redis`` without a URL (``parse_config`` already
            refuses both; checked again for configs built in code).
    """
    state_cfg = config.state
    if state_cfg.backend == "memory":
        return MemoryState(
            int(_setting(state_cfg, "max_pins", DEFAULT_MAX_PINS)),
            int(_setting(state_cfg, "max_warm", DEFAULT_MAX_WARM)),
            clock=clock,
        )
    if state_cfg.backend == "redis":
        if not state_cfg.url:
            raise ConfigError(
                "state.backend is 'redis' but state.url is missing; "
                "set it, e.g. url: redis://127.0.0.1:6379/0"
            )
        return RedisState.from_url(
            state_cfg.url,
            namespace=str(_setting(state_cfg, "namespace", "kvroute")),
            timeout_s=float(_setting(state_cfg, "timeout_s", DEFAULT_REDIS_TIMEOUT_S)),
            metrics=metrics,
            secret=secret,
        )
    raise ConfigError(
        f"state.backend {state_cfg.backend!r} is not known; use 'memory' (one router) or "
        "'redis' (several routers sharing session records and warm cooldowns)"
    )
