"""A lean HTTP/1.1 client for the request path: one POST to an engine, whole or streamed.

Owns the router's connections to its engines for forwarded requests (``shell/proxy.py``'s
``Upstream`` sends through it). Discovery, ``/tokenize``, health checks and admin calls keep
aiohttp's ``ClientSession``: they are not on the per-request path.

Why not aiohttp's client here: its CPU per POST (request and response objects, header
multidicts, payload wrappers, timer contexts, the connector's bookkeeping) was more than
everything kvroute decides per request, while a protocol that writes the request in one
buffer and hands the bytes to llhttp (the C parser behind Node.js and uvicorn, through
``httptools``) costs a fraction of it
(``docs/benchmarks.md#the-routers-own-http-server-and-engine-client``). The router only ever
sends a POST with a JSON body and reads one answer, so that is all this does.

Theory of operation
-------------------
* ``EngineClient.post`` takes a pooled keep-alive connection to the URL's origin (or opens
  one, bounded by ``connect_timeout_s``), writes the request head and body with one
  ``write``, and returns an ``EngineResponse`` as soon as the status line and headers have
  arrived. The body then arrives as chunks (chunked transfer encoding already decoded):
  ``readany`` returns the next one, ``read`` the rest.
* A connection goes back to its pool when its answer is complete and both sides allow
  keep-alive; it is closed (which cancels the engine's request) when the caller closes the
  response early, on any protocol error, and when it has been idle ``keepalive_s``.
* A reused connection that the engine closed while it sat idle fails before any byte of the
  answer; ``post`` then retries once on a fresh connection (the race every keep-alive client
  has). A fresh connection that fails is the caller's failure.
* Flow control: when more than ``_HIGH_WATER`` body bytes wait unread (a slow client behind
  a fast engine) the socket stops reading until they are drained.
* Timeouts: the caller bounds ``post`` (and whole reads) with ``asyncio.timeout``; a
  response also carries an overall deadline (``total_timeout_s``) after which it fails with
  ``TimeoutError`` and its connection is closed (one timer per request, not per chunk).
* ``TCP_NODELAY`` is set on every socket: a relay with Nagle's algorithm on adds ~40 ms to
  small streamed writes.

Errors: ``ConnectFailed`` (no connection; ``ConnectTimeout`` when the attempt timed out),
``Disconnected`` (the engine closed the connection before the answer was complete),
``ProtocolError`` (the engine's bytes are not HTTP/1.1). All derive from
``EngineClientError``. Cancellation closes the connection and propagates.

Only ``http`` and ``https`` URLs; the router's configuration validates replica URLs.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections import deque
from collections.abc import Mapping
from typing import Final, cast
from urllib.parse import urlsplit

import httptools

__all__ = [
    "ConnectFailed",
    "ConnectTimeout",
    "Disconnected",
    "EngineClient",
    "EngineClientError",
    "EngineResponse",
    "ProtocolError",
]

_HIGH_WATER: Final = 256 * 1024
"""Unread body bytes above which the socket stops reading (resumed below a quarter)."""


class EngineClientError(Exception):
    """A forwarded request failed in transport (not an HTTP error status)."""


class ConnectFailed(EngineClientError):
    """No connection to the engine could be opened."""

    def __init__(self, message: str, os_error: OSError | None = None) -> None:
        super().__init__(message)
        self.os_error = os_error


class ConnectTimeout(ConnectFailed):
    """Opening the connection took longer than the connect timeout."""


class Disconnected(EngineClientError):
    """The engine closed the connection before its answer was complete."""


class ProtocolError(EngineClientError):
    """The engine's answer is not valid HTTP/1.1."""


_Origin = tuple[str, str, int]  # scheme, host, port


class EngineResponse:
    """One engine answer: status and headers at once, the body as it arrives.

    Invariant: once ``close`` ran or the body ended, the connection is no longer this
    response's (pooled again or closed); the buffered chunks stay readable.

    Timestamps (``perf_counter_ns``, 0 until it happens), for the router's own-time metric:
    ``sent_ns`` when the request was written, ``first_body_ns`` when the first body bytes
    arrived, ``end_ns`` when the body was complete.
    """

    __slots__ = (
        "_chunks",
        "_conn",
        "_eof",
        "_error",
        "_last_feed",
        "_stall_s",
        "_stall_timer",
        "_timer",
        "_waiter",
        "buffered",
        "end_ns",
        "first_body_ns",
        "headers",
        "sent_ns",
        "status",
        "tcp_nodelay",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        """Header names lower-cased; a repeated header keeps its last value."""
        self._chunks: deque[bytes] = deque()
        self.buffered = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._stall_s = 0.0  # 0: not watched (watch_stall)
        self._stall_timer: asyncio.TimerHandle | None = None
        self._last_feed = 0.0
        self.tcp_nodelay: bool | None = conn.nodelay
        """``TCP_NODELAY`` as read back from the connection's socket (None: not TCP)."""
        self.sent_ns = 0
        self.first_body_ns = 0
        self.end_ns = 0

    # -- reading --------------------------------------------------------------------------

    def at_eof(self) -> bool:
        """True when the body is complete and every chunk has been read."""
        return self._eof and not self._chunks

    async def readany(self) -> bytes:
        """The next body chunk; ``b""`` once the body is complete.

        Raises:
            Disconnected, ProtocolError: the answer broke off.
            TimeoutError: the response's overall deadline passed.
        """
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        chunk = self._chunks.popleft()
        self.buffered -= len(chunk)
        conn = self._conn
        if conn is not None and conn.paused and self.buffered < _HIGH_WATER // 4:
            conn.resume()
        return chunk

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Stop reading: an unfinished answer closes its connection (the engine sees the
        client go and cancels the request); a finished one changes nothing."""
        conn = self._conn
        if conn is not None:
            conn.abort()
        if not self._eof and self._error is None:
            self._error = Disconnected("the response was closed before its end")
        self._finish()

    def watch_stall(self, stall_s: float) -> None:
        """From now on, fail the body with ``TimeoutError`` (and drop the connection, so the
        engine aborts the request) when no bytes arrive for ``stall_s`` seconds: a stalled
        engine. One timer, re-armed at most once per ``stall_s``; a chunk costs a clock read.
        """
        if self._eof or self._error is not None:
            return
        loop = asyncio.get_running_loop()
        self._stall_s = stall_s
        self._last_feed = loop.time()
        if self._stall_timer is None:
            self._stall_timer = loop.call_later(stall_s, self._check_stall)

    def _check_stall(self) -> None:
        self._stall_timer = None
        if self._eof or self._error is not None:
            return
        loop = asyncio.get_running_loop()
        conn = self._conn
        if self._chunks or (conn is not None and conn.paused):
            # Bytes wait unread, or reading is paused: the reader is slow, not the engine.
            self._last_feed = loop.time()
        quiet = loop.time() - self._last_feed
        if quiet < self._stall_s:
            self._stall_timer = loop.call_later(self._stall_s - quiet, self._check_stall)
            return
        self._fail(TimeoutError(f"the engine sent nothing for {self._stall_s:g}s "
                                "(timeouts.stall_s)"))
        if conn is not None:
            conn.abort()

    # -- fed by the connection ----------------------------------------------------------

    def _feed(self, chunk: bytes) -> None:
        if self._stall_s:
            self._last_feed = asyncio.get_running_loop().time()
        if not self.first_body_ns:
            self.first_body_ns = time.perf_counter_ns()
        self._chunks.append(chunk)
        self.buffered += len(chunk)
        self._wake()

    def _end(self) -> None:
        self.end_ns = time.perf_counter_ns()
        self._eof = True
        self._finish()
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self._eof or self._error is not None:
            return
        self._error = error
        self._finish()
        self._wake()

    def _expire(self) -> None:
        self._timer = None
        conn = self._conn
        self._fail(TimeoutError("the engine's answer took longer than the total timeout"))
        if conn is not None:
            conn.abort()

    def _finish(self) -> None:
        self._conn = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one exchange at a time (no pipelining)."""

    def __init__(self, client: EngineClient, origin: _Origin) -> None:
        self._client = client
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.paused = False
        self.used = False
        self.idle_since = 0.0
        self.nodelay: bool | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._response: EngineResponse | None = None
        self._head: asyncio.Future[EngineResponse] | None = None
        self._framed = False
        self._received = False

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport; not an ``asyncio.Transport`` instance under uvloop.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.nodelay = bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:  # bytes nobody asked for: the connection is not trustworthy
            self.abort()
            return
        self._received = True
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(ProtocolError(f"the engine's answer is not valid HTTP/1.1: {exc}"))
        except httptools.HttpParserUpgrade:
            self._broken(ProtocolError("the engine answered with a protocol upgrade"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self._response
        if response is not None and not self._framed and self._head is None and exc is None:
            # No Content-Length and not chunked: the body ends when the connection does.
            self._response = None
            self._parser = None
            response._end()
        else:
            reason = f": {exc}" if exc is not None else ""
            self._broken(Disconnected(f"the engine closed the connection{reason}"))
        self._client._forget(self)

    # -- httptools callbacks ------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self._exchange()
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        response.headers[key] = text
        if key == "content-length" or (key == "transfer-encoding" and "chunked" in text.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        response, head, parser = self._exchange(), self._head, self._parser
        assert parser is not None, "an exchange always has its parser"
        response.status = parser.get_status_code()
        self._head = None
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        response = self._exchange()
        response._feed(body)
        if response.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        response, parser = self._exchange(), self._parser
        assert parser is not None, "an exchange always has its parser"
        keep = parser.should_keep_alive()
        self._response = None
        self._parser = None
        response._end()
        if keep and not self.closed:
            self._client._release(self)
        else:
            self.abort()

    def _exchange(self) -> EngineResponse:
        """The answer being parsed; bytes past its end (none were asked for) are an error
        (raised inside a parser callback, it surfaces as ``HttpParserError``)."""
        response = self._response
        if response is None:
            raise ProtocolError("the engine sent bytes after its answer was complete")
        return response

    # -- used by the client and the response ------------------------------------------------

    def start(self, request: bytes) -> asyncio.Future[EngineResponse]:
        """Send one request; the future resolves when the answer's headers are in."""
        assert self.transport is not None and self._response is None
        head = asyncio.get_running_loop().create_future()
        self._head = head
        response = self._response = EngineResponse(self)
        self._parser = httptools.HttpResponseParser(self)
        self._framed = False
        self._received = False
        self.transport.write(request)
        response.sent_ns = time.perf_counter_ns()
        return head

    @property
    def received(self) -> bool:
        """Whether any byte of the current answer has arrived."""
        return self._received

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def abort(self) -> None:
        """Close now, failing the exchange in progress (if any)."""
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
        self._broken(Disconnected("the connection was closed"))
        self._client._forget(self)

    def _broken(self, error: EngineClientError) -> None:
        response, head = self._response, self._head
        self._response = None
        self._head = None
        self._parser = None
        if head is not None and not head.done():
            head.set_exception(error)
        if response is not None:
            response._fail(error)
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
            self._client._forget(self)


class EngineClient:
    """Pooled keep-alive HTTP/1.1 connections to engines, for forwarded POSTs.

    Args:
        connect_timeout_s: bound on opening one connection.
        total_timeout_s: overall deadline of one answer, from the request to its last byte.
        keepalive_s: how long an idle connection is kept for reuse.
        ssl_context: for ``https`` engines and providers; the system's default trust store
            (``ssl.create_default_context``) when None.

    Connections are opened on demand and kept while idle; how many are in use at once is
    bounded by what uses them (the router's admission bound, the warm-ahead bound).
    """

    def __init__(self, *, connect_timeout_s: float, total_timeout_s: float,
                 keepalive_s: float = 60.0, ssl_context: ssl.SSLContext | None = None) -> None:
        if min(connect_timeout_s, total_timeout_s, keepalive_s) <= 0:
            raise ValueError(
                f"EngineClient needs positive timeouts (connect_timeout_s={connect_timeout_s}, "
                f"total_timeout_s={total_timeout_s}, keepalive_s={keepalive_s})")
        self._connect_timeout_s = connect_timeout_s
        self._total_timeout_s = total_timeout_s
        self._keepalive_s = keepalive_s
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._origins: dict[str, tuple[_Origin, bytes]] = {}
        self._ssl = ssl_context
        self._closed = False

    async def post(self, url: str, body: bytes,
                   headers: Mapping[str, str] | None = None) -> EngineResponse:
        """POST ``body`` (JSON) to ``url``; returns once the answer's headers are in.

        Raises:
            ConnectFailed: no connection (``ConnectTimeout`` if opening it timed out).
            Disconnected, ProtocolError: the exchange broke before the headers.
            RuntimeError: the client is closed.
        """
        if self._closed:
            raise RuntimeError("the engine client is closed")
        origin, request = self._request_bytes(url, body, headers)
        for attempt in (0, 1):
            conn = await self._connection(origin)
            head = conn.start(request)
            try:
                response = await head
            except Disconnected:
                if attempt == 0 and conn.used and not conn.received:
                    continue  # the engine closed an idle connection as we reused it
                raise
            except BaseException:
                conn.abort()  # cancelled or failed: never leave the engine generating
                raise
            if response._conn is not None:  # still arriving (a short answer is complete)
                response._timer = asyncio.get_running_loop().call_later(
                    self._total_timeout_s, response._expire)
            return response
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def close(self) -> None:
        """Close every connection; answers still being read fail with ``Disconnected``."""
        self._closed = True
        for conns in list(self._idle.values()):
            for conn in list(conns):
                conn.abort()
        for conn in list(self._busy):
            conn.abort()
        self._idle.clear()
        self._busy.clear()

    # -- internals ------------------------------------------------------------------------

    def _request_bytes(self, url: str, body: bytes,
                       headers: Mapping[str, str] | None) -> tuple[_Origin, bytes]:
        """The origin and the request's bytes (head and body, one buffer)."""
        cached = self._origins.get(url)
        if cached is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"engine URL {url!r} is not an http(s) URL with a host")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = parts.hostname if parts.port is None else f"{parts.hostname}:{port}"
            if ":" in parts.hostname:  # IPv6 literal
                host = f"[{parts.hostname}]" + ("" if parts.port is None else f":{port}")
            prefix = (f"POST {target} HTTP/1.1\r\nHost: {host}\r\n"
                      "Content-Type: application/json\r\n").encode("latin-1")
            cached = ((parts.scheme, parts.hostname, port), prefix)
            self._origins[url] = cached
        origin, prefix = cached
        lines = [prefix]
        for name, value in (headers or {}).items():
            if name.lower() in ("host", "content-length", "content-type", "transfer-encoding"):
                continue
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise ValueError(f"header {name!r} has a line break or a colon in its name or "
                                 "value; refusing to send it")
            lines.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
        lines.append(body)
        return origin, b"".join(lines)

    async def _connection(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(origin)
        now = loop.time()
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if now - conn.idle_since > self._keepalive_s:
                conn.abort()
                continue
            conn.used = True
            self._busy.add(conn)
            return conn
        scheme, host, port = origin
        context = None
        if scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin), host, port, ssl=context)
        except TimeoutError as exc:
            raise ConnectTimeout(
                f"connecting to {host}:{port} took over {self._connect_timeout_s:g}s") from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}", exc) from exc
        self._busy.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        """An answer is complete and the connection may be reused."""
        self._busy.discard(conn)
        if self._closed:
            conn.abort()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        self._idle.setdefault(conn.origin, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        """A connection closed: it is neither busy nor idle any more."""
        self._busy.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle is not None:
            with contextlib.suppress(ValueError):
                idle.remove(conn)
