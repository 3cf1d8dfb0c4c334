"""The upstream side: forwarding through the engine client, timeouts, and the streaming relay.

Owns the rules for what counts as "before the first byte" (retryable elsewhere) and "after"
(the stream is ended with a well-formed error event), over ``http/client.py``'s pooled
connections; and ``make_client_session``, the aiohttp session the rest of the shell uses for
calls off the request path (discovery: models, metrics, health). It does not choose replicas: ``shell/app.py`` asks the core
and hands a URL here (choosing is separate from sending).

Theory of operation
-------------------
``Upstream.open`` sends one request and returns only once something can be relayed:

* non-streamed: the whole answer (vLLM sends a non-streamed answer in one piece at the end,
  so its headers *are* its first byte); bounded by ``timeouts.total_s``;
* streamed: the response headers *and the first body chunk*, bounded by
  ``timeouts.first_byte_s``. Engines send their headers at once and the first chunk after
  the prefill, so an engine that dies during the prefill fails here, while nothing has been
  sent to the client yet, and the request can be retried on another replica. After that,
  a stream silent for ``timeouts.stall_s`` (a stalled engine) is ended like a dead one.

Every failure inside ``open`` raises ``UpstreamError`` with a ``kind`` (``connect``,
``timeout``, ``disconnect``, ``status``) and whether a retry elsewhere makes sense (5xx and
transport failures: yes; 4xx: no, the next engine would refuse it too).

``relay_stream`` then answers the client: the head with the first whole events, the rest
chunk by chunk, the last events with the end of the body. It never cuts an SSE event: bytes
are written up to the last event boundary (``\\n\\n``) and only an unterminated tail is held
back, so if the engine dies mid-stream the client gets every complete event, then
``wire.sse.error_event`` and ``data: [DONE]``. vLLM writes one event per chunk, so the held
tail is normally empty and nothing is delayed.

TCP_NODELAY: the engine client sets it on its sockets, and asyncio on every socket the
router's HTTP server accepts (``http/server.py``): a relay with Nagle on
adds ~40 ms to each small SSE write (``docs/benchmarks.md#tcp_nodelay-on-every-socket``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import aiohttp

from kvroute.config import TimeoutsConfig
from kvroute.core.errors import RouterError
from kvroute.http.client import (
    ConnectFailed,
    ConnectTimeout,
    EngineClient,
    EngineClientError,
    EngineResponse,
)
from kvroute.http.server import Request, StreamResponse
from kvroute.wire.sse import DONE, error_event

__all__ = [
    "Upstream",
    "UpstreamError",
    "UpstreamReply",
    "make_client_session",
    "make_engine_client",
    "relay_stream",
]

log = logging.getLogger(__name__)

UpstreamErrorKind = Literal["connect", "timeout", "disconnect", "status"]

# Response headers that describe the upstream hop, not the content.
_HOP_HEADERS = frozenset({
    "connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
    "date", "server", "proxy-authenticate", "upgrade", "trailer", "te",
})
_READ_CHUNK = 64 * 1024


class UpstreamError(RouterError):
    """An upstream call failed before anything was relayed to the client.

    Attributes:
        kind: ``connect`` (no connection), ``timeout``, ``disconnect`` (the engine closed
            the connection), or ``status`` (the engine answered with an error status).
        retryable: whether another replica might succeed (5xx and transport failures).
        status: the engine's HTTP status (``status`` kind only).
        body: the engine's error body (``status`` kind only).
        content_type: its content type.
    """

    def __init__(self, kind: UpstreamErrorKind, message: str, *, retryable: bool,
                 status: int | None = None, body: bytes = b"",
                 content_type: str = "application/json") -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable
        self.status = status
        self.body = body
        self.content_type = content_type

    @property
    def connect_failed(self) -> bool:
        """No connection to the replica: refused, unreachable, or a connect (not read)
        timeout (the walk then takes the replica out)."""
        if self.kind == "connect":
            return True
        return self.kind == "timeout" and isinstance(self.__cause__, ConnectTimeout)


@dataclass(slots=True)
class UpstreamReply:
    """An upstream answer ready to relay.

    For a non-streamed answer ``body`` is complete and ``response`` is already released; for
    a streamed one ``body`` is the first chunk and ``response`` is still open (the caller
    must ``relay_stream`` it or ``close()`` it).

    ``sent_ns`` is when the request was written to the engine and ``ready_ns`` when ``body``
    was complete (``perf_counter_ns``; 0 when unknown, as for a canned reply in a test).
    """

    status: int
    headers: Mapping[str, str]
    body: bytes
    response: EngineResponse | None
    sent_ns: int = 0
    ready_ns: int = 0

    def close(self) -> None:
        if self.response is not None:
            self.response.close()


def make_client_session(timeouts: TimeoutsConfig, *, limit: int = 1024,
                        keepalive_s: float = 60.0) -> aiohttp.ClientSession:
    """The router's aiohttp session, for calls off the request path (discovery's model,
    metrics and health reads): a keep-alive connection pool to every engine.

    Args:
        timeouts: the defaults every call starts from (``connect_s``, ``total_s``).
        limit: connections open at once across all engines.
        keepalive_s: how long an idle connection is kept for reuse.
    """
    connector = aiohttp.TCPConnector(
        limit=limit, limit_per_host=0, keepalive_timeout=keepalive_s, enable_cleanup_closed=False,
        ttl_dns_cache=300,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeouts.total_s, connect=timeouts.connect_s),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )


def relay_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The upstream response headers worth passing to the client (content, not transport)."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}


def make_engine_client(timeouts: TimeoutsConfig, *, keepalive_s: float = 60.0) -> EngineClient:
    """The router's forwarding client: connect and total timeouts from the configuration."""
    return EngineClient(connect_timeout_s=timeouts.connect_s, total_timeout_s=timeouts.total_s,
                        keepalive_s=keepalive_s)


class Upstream:
    """Sends forwarded requests to engines through one shared ``EngineClient``.

    Args:
        client: the router's engine client (``make_engine_client``).
        timeouts: first-byte and total timeouts in seconds (connect: the client's own).
    """

    def __init__(self, client: EngineClient, timeouts: TimeoutsConfig) -> None:
        self.client = client
        self.timeouts = timeouts

    async def open(self, url: str, body: bytes, *, stream: bool,
                   headers: Mapping[str, str] | None = None) -> UpstreamReply:
        """POST ``body`` to ``url`` and wait for something relayable (see module docstring).

        Raises:
            UpstreamError: before anything was relayed; ``retryable`` says whether another
                replica might do better.
        """
        limit = self.timeouts.first_byte_s if stream else self.timeouts.total_s
        resp: EngineResponse | None = None
        try:
            async with asyncio.timeout(limit):
                resp = await self.client.post(url, body, headers)
                if resp.status >= 400:
                    err_body = await resp.read()
                    raise UpstreamError(
                        "status", f"{url} answered HTTP {resp.status}",
                        retryable=resp.status >= 500, status=resp.status, body=err_body,
                        content_type=resp.headers.get("content-type", "application/json"),
                    )
                if not stream:
                    data = await resp.read()
                    return UpstreamReply(resp.status, relay_headers(resp.headers), data, None,
                                         resp.sent_ns, resp.end_ns)
                first = await resp.readany()
                if not first and resp.at_eof():
                    raise UpstreamError(
                        "disconnect", f"{url} ended the stream before its first byte",
                        retryable=True,
                    )
                resp.watch_stall(self.timeouts.stall_s)
                return UpstreamReply(resp.status, relay_headers(resp.headers), first, resp,
                                     resp.sent_ns, resp.first_body_ns)
        except UpstreamError:
            if resp is not None:
                resp.close()
            raise
        except TimeoutError as exc:
            if resp is not None:
                resp.close()
            what = "first byte" if stream else "answer"
            raise UpstreamError(
                "timeout", f"{url} sent no {what} within {limit:g}s", retryable=stream,
            ) from exc
        except ConnectTimeout as exc:  # nothing reached the engine: always safe elsewhere
            raise UpstreamError("timeout", f"{url}: {exc}", retryable=True) from exc
        except ConnectFailed as exc:
            raise UpstreamError("connect", f"cannot connect to {url}: {exc.os_error or exc}",
                                retryable=True) from exc
        except EngineClientError as exc:  # disconnected, or not HTTP
            if resp is not None:
                resp.close()
            raise UpstreamError("disconnect", f"{url} dropped the connection: {exc}",
                                retryable=True) from exc
        except BaseException:
            # Cancelled (the client went away) or a bug: never leave the engine generating.
            if resp is not None:
                resp.close()
            raise


def _event_boundary(data: bytes | bytearray) -> int:
    """Index just past the last complete SSE event in ``data`` (0 if none)."""
    a = data.rfind(b"\n\n")
    b = data.rfind(b"\r\n\r\n")
    return max(a + 2 if a >= 0 else 0, b + 4 if b >= 0 else 0)


async def relay_stream(
    reply: UpstreamReply,
    out: StreamResponse,
    request: Request,
    *,
    replica: str,
    on_error: Callable[[str, str], None] | None = None,
    on_chunk: Callable[[bytes], Awaitable[None] | None] | None = None,
) -> bool:
    """Answer ``request`` with ``out`` (not yet prepared): the streamed upstream answer,
    whole events at a time, then the end of the body.

    The head goes out together with the first whole events the upstream sent, and the last
    events together with the end of the body when the upstream has finished by then: the
    client wakes once for each pair and nothing waits for it.

    Args:
        reply: from ``Upstream.open(..., stream=True)``; its first chunk is relayed first.
        out: the client response, with its status and headers set.
        request: the client request it answers.
        replica: for the error event's message.
        on_error: called with ``(kind, message)`` when the upstream fails mid-stream.
        on_chunk: called with every relayed piece (e.g. to watch for usage).

    Returns:
        True if the upstream ended normally, False if the stream was ended with an error
        event. A client that disconnects raises ``ConnectionResetError`` (or the handler
        is cancelled); the upstream response is closed on every exit path.
    """
    assert reply.response is not None, "relay_stream needs a streamed reply"
    resp = reply.response
    pending = bytearray(reply.body)
    try:
        cut = _event_boundary(pending)
        piece = bytes(pending[:cut])
        del pending[:cut]
        await out.prepare(request, piece)
        ended = False
        while True:
            if piece and on_chunk is not None:
                maybe = on_chunk(piece)
                if maybe is not None:
                    await maybe
            if ended:
                return True
            try:
                chunk = await resp.readany()
            except (EngineClientError, TimeoutError) as exc:
                kind = "timeout" if isinstance(exc, TimeoutError) else "disconnect"
                message = (
                    f"replica {replica} failed after the stream started ({kind}: "
                    f"{exc!r}); the answer is incomplete. Retry the request."
                )
                if on_error is not None:
                    on_error(kind, message)
                # An unterminated tail is dropped: half an event is not an event.
                await out.write_eof(error_event(message, type="Bad Gateway", code=502) + DONE)
                return False
            if not chunk:
                await out.write_eof(bytes(pending))  # the engine's own last bytes, as sent
                return True
            pending += chunk
            cut = _event_boundary(pending)
            piece = bytes(pending[:cut])
            del pending[:cut]
            if not piece:
                continue
            if resp.at_eof():  # the upstream has ended: its last events and our end at once
                await out.write_eof(piece + bytes(pending))
                ended = True
            else:
                await out.write(piece)
    finally:
        resp.close()
