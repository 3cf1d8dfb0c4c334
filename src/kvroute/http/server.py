"""A lean HTTP/1.1 server for the router's own API.

Owns the client-facing sockets: it accepts connections, parses requests with llhttp (the C
parser behind Node.js, through ``httptools``), hands each complete request to the handler
registered for its path and method, and writes the handler's answer, whole or streamed. What
a request *means* is the handlers' business (``shell/app.py``); this module knows HTTP only.

Why not aiohttp's server: at saturation its server side (request objects with multidicts and
URL objects, a payload stream per request, the router and middleware chain, response header
multidicts, a writer object) was the largest single item of the router's CPU per request once
the engine client had been made lean (``http/client.py``;
``docs/benchmarks.md#the-routers-own-http-server-and-engine-client``). The router serves a
handful of JSON endpoints on keep-alive connections; parsing with llhttp, one dict of headers
and one ``write`` per whole answer does that for a fraction of the cost.

Theory of operation
-------------------
* One ``_Connection`` (an ``asyncio.Protocol``) per client socket. Requests are parsed as
  bytes arrive; a request is dispatched once its body is complete (the handlers all need the
  whole JSON body anyway), so a handler never waits on the client's upload.
* At most one handler runs per connection; pipelined requests wait their turn in order (and
  reading pauses while ``_MAX_PIPELINED`` of them wait), so answers go out in request order.
* A handler returns a ``Response`` (written with one ``write``: head and body together) or a
  ``StreamResponse`` it has already ``prepare``\\ d and written to (chunked transfer encoding;
  connection-framed for an HTTP/1.0 client).
* The client going away cancels its running handler (the handler's ``finally`` blocks close
  the upstream request). Writing to a gone client raises ``ConnectionResetError``.
* Flow control: ``StreamResponse.write`` waits while the socket's send buffer is above the
  transport's high-water mark (a slow client reading a fast stream).
* Limits, each answered with an OpenAI-shaped JSON error that says what to change: a request
  line plus headers over ``max_head_bytes`` (431); a body over ``max_body_bytes`` (the handler
  is called at once with ``Request.body_too_large`` set, so the router can say 413 in its own
  words, and the connection closes after that answer); bytes that are not HTTP/1.1 (400);
  an unknown path (404) or method (405, with ``Allow``). A handler that raises gets a 500
  and the error is logged with its traceback, never swallowed.
* ``Expect: 100-continue`` is answered before the body is read (curl sends it for bodies
  over 1 kB and would otherwise wait a second), unless the declared body is too large.
* Time limits, as nginx sets them (``docs/reliability.md``): a connection idle between
  requests for ``keepalive_timeout_s`` is closed; a request head (request line and headers)
  not complete ``header_timeout_s`` after its first byte, or after the connection opened for
  a first request, gets a 408 and the connection closes (a slowloris client sending a header
  line a second is shut out); a body that stops arriving for ``body_timeout_s`` gets a 408
  too. A client that reads nothing of its answer for ``send_timeout_s`` is dropped (its
  handler is cancelled). ``max_connections`` bounds open client connections: one over it
  gets a 503 with ``Retry-After`` and is closed. A connection closed by the server after
  an answer it sent early (a body too large, a malformed request) is closed
  "lingering": the server half-closes, then reads and drops what the client still sends for
  up to ``_LINGER_S``, so the client reads the answer instead of a reset.
* ``Upgrade`` (h2c, websocket) is not supported: a request that asks for it is answered over
  HTTP/1.1 when it has no body, refused with 400 when it has one (the parser stops at the
  head of an upgrade request), and its connection is closed after the answer.

TCP_NODELAY: asyncio (and uvloop) set it on every accepted TCP socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import http
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Final, cast
from urllib.parse import parse_qsl, unquote

import httptools

__all__ = [
    "Answer",
    "Handler",
    "HttpServer",
    "Request",
    "Response",
    "StreamResponse",
]

log = logging.getLogger("kvroute.http")

_MAX_PIPELINED: Final = 16
"""Complete requests waiting behind the running one before the connection stops reading."""

_LINGER_S: Final = 2.0
"""How long a lingering close keeps reading (and dropping) what the client still sends."""

_FRAMING_HEADERS: Final = frozenset({"content-length", "transfer-encoding", "connection",
                                     "keep-alive", "date"})
"""Header names the server writes itself; a handler's values for them are not sent."""

_REASONS: Final = {s.value: s.phrase for s in http.HTTPStatus}


class Request:
    """One complete client request.

    Invariants: ``headers`` has lower-cased names (a repeated header keeps its first value);
    ``body`` is the whole body, or ``b""`` when ``body_too_large`` (the body went
    over the server's ``max_body_bytes`` and was not kept). ``received_ns`` is the
    ``perf_counter_ns`` at which the request was complete (its creation until then).
    """

    __slots__ = ("_conn", "_query", "body", "body_too_large", "content_length", "headers",
                 "keep_alive", "method", "path", "query_string", "received_ns", "version")

    def __init__(self, conn: _Connection | None, method: str, path: str, query_string: str,
                 headers: dict[str, str], version: str, keep_alive: bool) -> None:
        self._conn = conn
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.version = version
        self.keep_alive = keep_alive
        self.body = b""
        self.body_too_large = False
        cl = headers.get("content-length")
        self.content_length: int | None = int(cl) if cl is not None and cl.isdigit() else None
        self._query: dict[str, str] | None = None
        self.received_ns = time.perf_counter_ns()

    def close_connection(self) -> None:
        """Close the connection this request came on once what was written has gone out: the
        answer breaks off there (a simulated engine crashing mid-answer). The handler's
        return value is then not sent."""
        conn = self._conn
        if conn is not None:
            conn.close_now()

    @property
    def query(self) -> Mapping[str, str]:
        """The query string's fields (the first value of a repeated field), decoded."""
        if self._query is None:
            self._query = {}
            for key, value in parse_qsl(self.query_string, keep_blank_values=True):
                self._query.setdefault(key, value)
        return self._query


class Response:
    """A whole answer, sent with ``Content-Length`` in one write.

    ``headers`` are sent as given (set each name once); the server writes the framing
    headers (``Content-Length``, ``Connection``, ``Date``) itself.
    """

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int = 200, body: bytes = b"", *, content_type: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.headers: dict[str, str] = dict(headers) if headers else {}
        if content_type is not None:
            self.headers["Content-Type"] = content_type


class StreamResponse:
    """An answer written piece by piece: ``await prepare(request)``, ``await write(piece)``
    as often as needed, ``await write_eof()``.

    Invariant: each ``write`` is one chunk on the wire, sent at once (nothing is buffered
    here), so a relayed event stream keeps its timing.
    """

    __slots__ = ("_chunked", "_conn", "_eof", "_head_only", "head_sent_ns", "headers", "status")

    def __init__(self, status: int = 200, *, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.headers: dict[str, str] = dict(headers) if headers else {}
        self._conn: _Connection | None = None
        self._chunked = True
        self._head_only = False
        self._eof = False
        self.head_sent_ns = 0
        """``perf_counter_ns`` when ``prepare`` wrote the head (0: not yet)."""

    @property
    def prepared(self) -> bool:
        return self._conn is not None

    async def prepare(self, request: Request, first: bytes = b"") -> None:
        """Send the status line and headers, and ``first`` as the body's first piece.

        A relay that already holds its first piece passes it here: head and piece go out in
        one write, so the client wakes once for both (and a small first event is not a
        segment of its own).

        Raises:
            ConnectionResetError: the client has gone.
        """
        if self._conn is not None:
            raise RuntimeError("this StreamResponse is already prepared")
        conn = request._conn
        if conn is None:
            raise RuntimeError("the request has no connection to answer on")
        conn.check_open()
        self._conn = conn
        self._chunked = request.version != "1.0"
        self._head_only = request.method == "HEAD"
        if not self._chunked:
            request.keep_alive = False  # the body ends when the connection does
        framing = "Transfer-Encoding: chunked\r\n" if self._chunked else ""
        head = render_head(self.status, self.headers, framing, request.keep_alive)
        conn.send(head + self._framed(first) if first else head)
        self.head_sent_ns = time.perf_counter_ns()
        await conn.drain()

    async def write(self, data: bytes) -> None:
        """Send ``data`` now; wait while the client's socket is backed up.

        Raises:
            ConnectionResetError: the client has gone.
        """
        conn = self._conn
        if conn is None or self._eof:
            raise RuntimeError("write() needs a prepared StreamResponse that is not ended")
        conn.check_open()
        if not data or self._head_only:
            return  # an empty chunk would end a chunked body
        conn.send(self._framed(data))
        await conn.drain()

    async def write_eof(self, last: bytes = b"") -> None:
        """End the body, after ``last`` if given (one write for both); a second call does
        nothing."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("write_eof() needs a prepared StreamResponse")
        if self._eof:
            return
        self._eof = True
        if self._head_only:
            return
        if self._chunked or last:
            conn.check_open()
            tail = self._framed(last) if last else b""
            conn.send(tail + b"0\r\n\r\n" if self._chunked else tail)
            await conn.drain()

    def _framed(self, data: bytes) -> bytes:
        """``data`` as it goes on the wire: one chunk, or as is when connection-framed."""
        if self._head_only:
            return b""
        return b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data


Answer = Response | StreamResponse
"""What a handler returns."""

Handler = Callable[[Request], Awaitable[Answer]]
ErrorBody = Callable[[int, str], bytes]


def _plain_error_body(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "code": status}}).encode()


_date_second = 0
_date_text = ""


def _http_date() -> str:
    """The ``Date`` header's value, formatted once a second."""
    global _date_second, _date_text
    now = time.time()
    second = int(now)
    if second != _date_second:
        _date_second = second
        _date_text = email.utils.formatdate(now, usegmt=True)
    return _date_text


def render_head(status: int, headers: Mapping[str, str], framing: str,
                keep_alive: bool) -> bytes:
    """The status line and header block, ``framing`` (e.g. ``Content-Length: 3\\r\\n``)
    included, ending with the blank line.

    Raises:
        ValueError: a header name or value holds CR or LF (it would inject headers).
    """
    parts = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
    for name, value in headers.items():
        if name.lower() in _FRAMING_HEADERS:
            continue
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
            raise ValueError(f"header {name!r} holds a line break; refusing to send it")
        parts.append(f"{name}: {value}\r\n")
    parts.append(framing)
    if not keep_alive:
        parts.append("Connection: close\r\n")
    parts.append(f"Date: {_http_date()}\r\n\r\n")
    return "".join(parts).encode("latin-1")


class _HeadTooLarge(Exception):
    pass


class _Connection(asyncio.Protocol):
    """One client connection: parsing, dispatch in order, writing, closing (module docstring).

    Invariant: ``_task`` is the only handler running on this connection; ``_queue`` holds
    complete requests in arrival order.
    """

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._closed = False
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._reading_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0
        self._last_data = 0.0
        self._head_started = 0.0  # loop time of the first byte of the head being read
        self._in_head = False  # between a request's first byte and the end of its head
        self._awaiting_first = True  # no byte yet on this connection
        self._linger_timer: asyncio.TimerHandle | None = None
        self._lingering = False
        self._ignore_input = False  # after an upgrade request or a malformed one
        self._close_after: Response | None = None  # an error to send once the queue drains
        self._stop_after_current = False
        self._head_sent = False  # the running answer's status line has gone out
        # the request being parsed
        self._url: list[bytes] = []
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._current: Request | None = None
        self._dispatched_early = False

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport; not an ``asyncio.Transport`` instance under uvloop.
        self._transport = cast(asyncio.Transport, transport)
        server = self._server
        over = len(server._connections) >= server.max_connections
        server._connections.add(self)
        if over:
            self._ignore_input = True
            self._send_and_close(server.error(
                503, f"This {server.name} has {server.max_connections} client connections "
                     "open, its max_connections limit; retry shortly, reuse keep-alive "
                     "connections, or raise http.max_connections in its config.",
                headers={"Retry-After": "1"}))
            return
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server._connections.discard(self)
        for timer in (self._timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._queue.clear()
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client closed the connection"))
        self._drain_waiter = None

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._drain_waiter = None

    def data_received(self, data: bytes) -> None:
        if self._lingering or self._ignore_input:
            return  # dropping what follows an answer that closes the connection
        self._last_data = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # on_message_complete has handled the request (see _enqueue); what follows its
            # head is another protocol's bytes.
            self._ignore_input = True
            self._stop_after_current = True
            self._pause_reading()
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):
                self._refuse(431, f"The request line and headers are over this router's limit "
                                  f"of {self._server.max_head_bytes} bytes. Send fewer or "
                                  "shorter headers.")
            else:
                raise
        except httptools.HttpParserError as exc:
            self._refuse(400, f"The request is not valid HTTP/1.1 ({exc}). Send an HTTP/1.1 "
                              "request such as 'POST /v1/chat/completions HTTP/1.1' with "
                              "Content-Type: application/json.")

    def eof_received(self) -> bool | None:
        """The client closed its side: taken as the client going away (as aiohttp does).

        Returning False lets asyncio close the transport, so ``connection_lost`` cancels a
        running handler and its upstream request. A client that half-closes on purpose
        and still waits for its answer would lose it; LLM clients close to cancel, so
        cancelling is what they mean.
        """
        return False

    # -- llhttp callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_head = True
        self._awaiting_first = False
        self._head_started = self._last_data  # data_received has just read the clock
        self._url = []
        self._headers = {}
        self._head_bytes = 0
        self._body = []
        self._body_size = 0
        self._current = None
        self._dispatched_early = False

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._head_bytes += len(url)
        if self._head_bytes > self._server.max_head_bytes:
            raise _HeadTooLarge

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self._server.max_head_bytes:
            raise _HeadTooLarge
        # The first of repeated headers wins (what the handlers read before, with aiohttp).
        self._headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        raw = b"".join(self._url)
        path, _, query = raw.partition(b"?")
        path_text = path.decode("latin-1")
        if "%" in path_text:
            path_text = unquote(path_text)
        request = Request(self, parser.get_method().decode("ascii"), path_text,
                          query.decode("latin-1"), self._headers, parser.get_http_version(),
                          parser.should_keep_alive())
        self._current = request
        declared = request.content_length
        if declared is not None and declared > self._server.max_body_bytes:
            self._too_large(request)
            return
        if self._headers.get("expect", "").lower() == "100-continue" \
                and request.version == "1.1" and self._transport is not None:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._dispatched_early:
            return
        self._body_size += len(body)
        if self._body_size > self._server.max_body_bytes:
            assert self._current is not None
            self._body = []
            self._too_large(self._current)
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        request = self._current
        self._current = None
        if request is None or self._dispatched_early:
            return
        if self._parser.should_upgrade():
            # llhttp stops at the head of an upgrade request: a body it announced is unread.
            request.keep_alive = False
            if request.content_length or "transfer-encoding" in request.headers:
                self._refuse(400, "HTTP upgrades (h2c, websocket) are not supported by this "
                                  "router; send plain HTTP/1.1 requests without an 'Upgrade' "
                                  "header.")
                return
        if self._body:
            request.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
            self._body = []
        request.received_ns = time.perf_counter_ns()
        self._enqueue(request)

    # -- dispatch ---------------------------------------------------------------------------

    def _too_large(self, request: Request) -> None:
        """Dispatch ``request`` now without its body; the connection closes after it."""
        self._dispatched_early = True
        request.body_too_large = True
        request.keep_alive = False
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        self._queue.append(request)
        if self._task is None:
            self._start_next()
        elif len(self._queue) >= _MAX_PIPELINED and not self._reading_paused:
            self._pause_reading()

    def _start_next(self) -> None:
        if self._closed:
            return
        if not self._queue:
            if self._close_after is not None:
                self._send_and_close(self._close_after)
            elif self._stop_after_current:
                self._close()
            else:
                self._arm_idle()
            return
        request = self._queue.popleft()
        if self._reading_paused and len(self._queue) < _MAX_PIPELINED // 2:
            self._resume_reading()
        self._task = self._loop.create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        self._head_sent = False
        try:
            answer = await self._server.dispatch(request)
            if self._closed:
                return
            if isinstance(answer, StreamResponse):
                await self._finish_stream(answer, request)
            else:
                self.send(self._whole(answer, request))
                await self.drain()  # a client that does not read gets no further answers
        except asyncio.CancelledError:
            if not self._closed:  # cancelled by the server's shutdown, not by the client
                self._close()
            return
        except ConnectionResetError:
            return  # the client went away while we wrote
        except Exception as exc:
            log.exception("kvroute's HTTP server failed to answer %s %s", request.method,
                          request.path)
            if self._head_sent:
                self._close()  # the client sees the answer break off
            else:
                self._send_and_close(self._server.error(
                    500, f"kvroute failed to answer this request ({type(exc).__name__}); "
                         f"the {self._server.name}'s log has the details."))
            return
        finally:
            self._task = None
        if not request.keep_alive or self._lingering:
            self._linger_close()
            return
        self._start_next()

    async def _finish_stream(self, answer: StreamResponse, request: Request) -> None:
        if not answer.prepared:  # returned unprepared: an empty body
            await answer.prepare(request)
        if not answer._eof:
            await answer.write_eof()

    def _whole(self, answer: Response, request: Request) -> bytes:
        body = answer.body
        head = render_head(answer.status, answer.headers, f"Content-Length: {len(body)}\r\n",
                           request.keep_alive)
        return head if request.method == "HEAD" else head + body

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request the parser rejected, after the ones already queued, and close."""
        answer = self._server.error(status, message)
        self._ignore_input = True
        self._pause_reading()
        if self._task is None and not self._queue:
            self._send_and_close(answer)
        else:
            self._close_after = answer

    # -- writing and closing ----------------------------------------------------------------

    def check_open(self) -> None:
        if self._closed or self._transport is None or self._transport.is_closing():
            raise ConnectionResetError("the client closed the connection")

    def send(self, data: bytes) -> None:
        """Write ``data`` (an answer's head first: ``_head_sent`` notes it)."""
        assert self._transport is not None
        self._head_sent = True
        self._transport.write(data)

    async def drain(self) -> None:
        """Wait while the client's socket is backed up; a client that reads nothing for
        ``send_timeout_s`` is dropped (``ConnectionResetError``)."""
        if not self._write_paused:
            return
        self.check_open()
        if self._drain_waiter is None:
            self._drain_waiter = self._loop.create_future()
        stalled = self._loop.call_later(self._server.send_timeout_s, self._send_stalled)
        try:
            await self._drain_waiter
        finally:
            stalled.cancel()

    def _send_stalled(self) -> None:
        log.warning("dropping a client that read nothing of its answer for %g s "
                    "(send_timeout_s)", self._server.send_timeout_s)
        self.abort()

    def _send_and_close(self, answer: Response) -> None:
        if self._closed or self._transport is None:
            return
        self._transport.write(render_head(answer.status, answer.headers,
                                          f"Content-Length: {len(answer.body)}\r\n", False)
                              + answer.body)
        self._linger_close()

    def _linger_close(self) -> None:
        """Half-close, drop what the client still sends for ``_LINGER_S``, then close."""
        transport = self._transport
        if self._closed or transport is None:
            return
        self._lingering = True
        if self._reading_paused:
            self._resume_reading()
        if transport.can_write_eof():
            try:
                transport.write_eof()
            except OSError:
                self._close()
                return
            self._linger_timer = self._loop.call_later(_LINGER_S, self._close)
        else:
            self._close()

    def _close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def close_now(self) -> None:
        """Close after flushing, and send nothing more (``Request.close_connection``)."""
        self._closed = True
        self._close()

    def _arm_idle(self) -> None:
        """Note that the connection is idle from now; one timer per connection enforces the
        time limits (module docstring).

        The timer is not re-armed per request or per read: it fires at least once per
        ``_server.check_interval_s`` (the shortest limit) and re-arms itself for whatever is
        left of the current limit, so a request costs one clock read here, and a limit is
        enforced on time whatever state the connection went through since the timer was set.
        """
        self._idle_since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_later(self._server.check_interval_s,
                                                self._check_limits)

    def _check_limits(self) -> None:
        self._timer = None
        if self._closed or self._lingering:
            return
        server = self._server
        now = self._loop.time()
        if self.busy:
            deadline = now + server.check_interval_s  # a handler is answering: no limit here
        elif self._in_head:
            deadline = self._head_started + server.header_timeout_s
            if now >= deadline:
                self._refuse(408, f"The request line and headers did not arrive within "
                                  f"{server.header_timeout_s:g} s (this {server.name}'s "
                                  "header_timeout_s). Send the whole request head at once.")
                return
        elif self._current is not None:
            deadline = self._last_data + server.body_timeout_s
            if now >= deadline:
                self._refuse(408, f"The request body stopped arriving for "
                                  f"{server.body_timeout_s:g} s (this {server.name}'s "
                                  "body_timeout_s). Send the body without pauses.")
                return
        else:
            limit = server.header_timeout_s if self._awaiting_first \
                else server.keepalive_timeout_s
            deadline = max(self._idle_since, self._last_data) + limit
            if now >= deadline:
                self._close()
                return
        delay = min(deadline - now, server.check_interval_s)
        self._timer = self._loop.call_later(delay, self._check_limits)

    def _pause_reading(self) -> None:
        if self._transport is not None and not self._reading_paused:
            self._reading_paused = True
            with contextlib.suppress(RuntimeError):
                self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._transport is not None and self._reading_paused:
            self._reading_paused = False
            with contextlib.suppress(RuntimeError):
                self._transport.resume_reading()

    @property
    def busy(self) -> bool:
        return self._task is not None or bool(self._queue)

    def close_when_idle(self) -> None:
        """For shutdown: close now if idle, else once the running answer is done."""
        self._stop_after_current = True
        self._queue.clear()
        if self._task is None:
            self._close()


class HttpServer:
    """The listening socket and its routes.

    Args:
        routes: ``{path: {method: handler}}``; a ``GET`` handler also answers ``HEAD``.
        max_body_bytes: the largest request body kept (see ``Request.body_too_large``).
        error_body: renders an error answer's JSON body from ``(status, message)``.
        keepalive_timeout_s: a connection idle between requests is closed after this long.
        max_head_bytes: the largest request line plus headers (431 beyond).
        header_timeout_s: a request head must be complete this long after its first byte
            (408 beyond).
        body_timeout_s: the longest pause while a request body arrives (408 beyond).
        send_timeout_s: the longest a client may read nothing of an answer it is sent
            before the connection is dropped.
        max_connections: open client connections; one more gets a 503 and is closed.
        name: what the server is, in error messages ("router"; the simulated engines serve
            through this module too).
    """

    def __init__(self, routes: Mapping[str, Mapping[str, Handler]], *, max_body_bytes: int,
                 error_body: ErrorBody | None = None, keepalive_timeout_s: float = 75.0,
                 max_head_bytes: int = 60 * 1024, header_timeout_s: float = 60.0,
                 body_timeout_s: float = 60.0, send_timeout_s: float = 60.0,
                 max_connections: int = 4096,
                 name: str = "router") -> None:
        for what, value in (("max_body_bytes", max_body_bytes),
                            ("keepalive_timeout_s", keepalive_timeout_s),
                            ("max_head_bytes", max_head_bytes),
                            ("header_timeout_s", header_timeout_s),
                            ("body_timeout_s", body_timeout_s),
                            ("send_timeout_s", send_timeout_s),
                            ("max_connections", max_connections)):
            if not value > 0:
                raise ValueError(f"HttpServer: {what} must be > 0, got {value!r}")
        self.name = name
        self._routes: dict[str, dict[str, Handler]] = {}
        for path, methods in routes.items():
            table = {method.upper(): handler for method, handler in methods.items()}
            if "GET" in table and "HEAD" not in table:
                table["HEAD"] = table["GET"]
            self._routes[path] = table
        self.max_body_bytes = max_body_bytes
        self.max_head_bytes = max_head_bytes
        self.keepalive_timeout_s = keepalive_timeout_s
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.send_timeout_s = send_timeout_s
        self.max_connections = max_connections
        self.check_interval_s = min(keepalive_timeout_s, header_timeout_s, body_timeout_s)
        """The longest a connection's timer waits before looking at its limits again."""
        self._error_body = error_body or _plain_error_body
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self.port = 0

    def error(self, status: int, message: str, *,
              headers: Mapping[str, str] | None = None) -> Response:
        return Response(status, self._error_body(status, message),
                        content_type="application/json", headers=headers)

    def dispatch(self, request: Request) -> Awaitable[Answer]:
        """The handler's answer to ``request``, or the 404/405 the routes call for."""
        methods = self._routes.get(request.path)
        if methods is None:
            known = ", ".join(sorted(self._routes))
            return _ready(self.error(
                404, f"No endpoint {request.path!r} on this {self.name}. It serves: {known}."))
        handler = methods.get(request.method)
        if handler is None:
            allowed = ", ".join(sorted(methods))
            return _ready(self.error(
                405, f"{request.path} does not take {request.method}; use {allowed}.",
                headers={"Allow": allowed}))
        return handler(request)

    async def start(self, host: str, port: int, *, backlog: int = 1024) -> int:
        """Listen on ``host:port`` (0 picks a free port); returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port,
                                                backlog=backlog, reuse_address=True)
        sockets = self._server.sockets
        self.port = int(sockets[0].getsockname()[1]) if sockets else port
        return self.port

    async def close(self, grace_s: float = 10.0) -> None:
        """Stop listening, close idle connections, give running answers ``grace_s`` to end,
        then cancel them and drop their connections."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self._connections):
            conn.close_when_idle()
        deadline = time.monotonic() + grace_s
        while any(conn.busy for conn in self._connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self._connections):
            task = conn._task
            if task is not None and not task.done():
                task.cancel()
            conn.abort()
        await asyncio.sleep(0)


async def _ready(answer: Response) -> Response:
    return answer
