"""``HttpServer`` on a real loopback socket, driven by raw HTTP bytes.

Each test starts the server with handlers written for it, opens plain TCP connections and
writes exactly the bytes it wants (keep-alive, pipelined, HTTP/1.0, chunked uploads,
``Expect: 100-continue``, oversized and malformed requests, upgrades), then reads the
answers byte for byte, so framing, ordering, limits, cancellation, flow control and the
idle timeout are checked the way a client sees them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import pytest

from kvroute.http.server import Handler, HttpServer, Request, Response, StreamResponse

pytestmark = pytest.mark.integration

Reply = tuple[int, dict[str, str], bytes]

_WRITERS: list[asyncio.StreamWriter] = []
"""Client connections of the running test, closed when its server stops."""


@asynccontextmanager
async def serving(routes: Mapping[str, Mapping[str, Handler]], **kwargs: Any,
                  ) -> AsyncIterator[HttpServer]:
    kwargs.setdefault("max_body_bytes", 4096)
    server = HttpServer(routes, **kwargs)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.close(grace_s=1.0)
        await close_clients()


async def close_clients() -> None:
    while _WRITERS:
        writer = _WRITERS.pop()
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def connect(server: HttpServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    _WRITERS.append(writer)
    return reader, writer


async def read_reply(reader: asyncio.StreamReader, *, head_only: bool = False) -> Reply:
    """One answer: status, headers (names lower-cased) and the body, de-chunked."""
    status_line = await reader.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        assert name.lower() not in headers, f"header {name} sent twice"
        headers[name.lower()] = value.strip()
    if head_only or status == 100:
        return status, headers, b""
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        parts = []
        while True:
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            assert chunk.endswith(b"\r\n")
            if size == 0:
                break
            parts.append(chunk[:-2])
        body = b"".join(parts)
    else:
        body = await reader.read()  # framed by the connection's end
    return status, headers, body


async def closed_by_server(reader: asyncio.StreamReader, timeout: float = 3.0) -> bool:
    """True when the server ends the connection (EOF) within ``timeout``."""
    try:
        rest = await asyncio.wait_for(reader.read(), timeout)
    except (ConnectionResetError, TimeoutError):
        return False
    return rest == b""


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            .encode() + body)


async def echo(request: Request) -> Response:
    doc = {"method": request.method, "path": request.path, "query": dict(request.query),
           "body": request.body.decode(), "too_large": request.body_too_large,
           "content_length": request.content_length,
           "auth": request.headers.get("authorization")}
    return Response(200, json.dumps(doc).encode(), content_type="application/json",
                    headers={"X-Test": "yes"})


ECHO: dict[str, dict[str, Handler]] = {"/echo": {"POST": echo, "GET": echo}}


def test_keep_alive_serves_several_requests_on_one_connection() -> None:
    async def main() -> None:
        async with serving(ECHO) as server:
            reader, writer = await connect(server)
            for i in range(3):
                writer.write(post(f"/echo?i={i}&i=9", b'{"n": %d}' % i,
                                  "Authorization: Bearer k\r\nAuthorization: Bearer other\r\n"))
                status, headers, body = await read_reply(reader)
                assert status == 200
                doc = json.loads(body)
                assert doc["body"] == f'{{"n": {i}}}'
                assert doc["query"] == {"i": str(i)}  # the first of a repeated field
                assert doc["auth"] == "Bearer k"  # the first of a repeated header
                assert headers["x-test"] == "yes"
                assert headers["content-type"] == "application/json"
                assert "date" in headers and "connection" not in headers
            writer.close()

    asyncio.run(main())


def test_pipelined_requests_are_answered_in_order() -> None:
    async def slow_then_fast(request: Request) -> Response:
        await asyncio.sleep(0.2 if request.body == b"first" else 0.0)
        return Response(200, request.body)

    async def main() -> None:
        async with serving({"/p": {"POST": slow_then_fast}}) as server:
            reader, writer = await connect(server)
            writer.write(post("/p", b"first") + post("/p", b"second") + post("/p", b"third"))
            bodies = [(await read_reply(reader))[2] for _ in range(3)]
            assert bodies == [b"first", b"second", b"third"]
            writer.close()

    asyncio.run(main())


def test_http_1_0_gets_its_answer_and_the_connection_closes() -> None:
    async def main() -> None:
        async with serving(ECHO) as server:
            reader, writer = await connect(server)
            writer.write(b"GET /echo HTTP/1.0\r\n\r\n")
            status, headers, _ = await read_reply(reader)
            assert status == 200 and headers["connection"] == "close"
            assert await closed_by_server(reader)

    asyncio.run(main())


def test_a_chunked_upload_is_read_whole() -> None:
    async def main() -> None:
        async with serving(ECHO) as server:
            reader, writer = await connect(server)
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\nhello\r\n")
            await asyncio.sleep(0.05)
            writer.write(b"6\r\n world\r\n0\r\n\r\n")
            _, _, body = await read_reply(reader)
            doc = json.loads(body)
            assert doc["body"] == "hello world" and doc["content_length"] is None
            writer.close()

    asyncio.run(main())


def test_expect_100_continue_is_answered_before_the_body() -> None:
    async def main() -> None:
        async with serving(ECHO) as server:
            reader, writer = await connect(server)
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                         b"Expect: 100-continue\r\n\r\n")
            status, _, _ = await asyncio.wait_for(read_reply(reader), 2.0)
            assert status == 100
            writer.write(b"body")
            status, _, body = await read_reply(reader)
            assert status == 200 and json.loads(body)["body"] == "body"
            writer.close()

    asyncio.run(main())


def test_a_declared_body_over_the_limit_reaches_the_handler_flagged_and_unread() -> None:
    async def main() -> None:
        async with serving(ECHO, max_body_bytes=100) as server:
            reader, writer = await connect(server)
            big = b"x" * 300_000
            writer.write(post("/echo", big, "Expect: 100-continue\r\n"))
            status, headers, body = await read_reply(reader)
            doc = json.loads(body)
            # No "100 Continue": the first answer is the handler's own.
            assert status == 200 and doc["too_large"] is True and doc["body"] == ""
            assert doc["content_length"] == 300_000
            assert headers["connection"] == "close"
            assert await closed_by_server(reader)

    asyncio.run(main())


def test_a_chunked_body_that_grows_over_the_limit_is_flagged() -> None:
    async def main() -> None:
        async with serving(ECHO, max_body_bytes=10) as server:
            reader, writer = await connect(server)
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"8\r\n12345678\r\n8\r\n12345678\r\n")
            _status, headers, body = await read_reply(reader)
            assert json.loads(body)["too_large"] is True
            assert headers["connection"] == "close"
            writer.write(b"0\r\n\r\n")  # the rest is read and dropped, not parsed
            assert await closed_by_server(reader)

    asyncio.run(main())


def test_bytes_that_are_not_http_get_a_400_that_says_so() -> None:
    async def main() -> None:
        async with serving(ECHO) as server:
            reader, writer = await connect(server)
            writer.write(b"HELLO THERE\r\n\r\n")
            status, headers, body = await read_reply(reader)
            assert status == 400 and headers["connection"] == "close"
            assert "not valid HTTP/1.1" in json.loads(body)["error"]["message"]
            assert await closed_by_server(reader)

    asyncio.run(main())


def test_garbage_after_a_valid_request_is_refused_after_its_answer() -> None:
    async def main() -> None:
        async with serving(ECHO) as server:
            reader, writer = await connect(server)
            writer.write(post("/echo", b"ok") + b"\x00\x01garbage\r\n\r\n")
            status, _, body = await read_reply(reader)
            assert status == 200 and json.loads(body)["body"] == "ok"
            status, _, _ = await read_reply(reader)
            assert status == 400
            assert await closed_by_server(reader)

    asyncio.run(main())


def test_headers_over_the_limit_get_a_431() -> None:
    async def main() -> None:
        async with serving(ECHO, max_head_bytes=1024) as server:
            reader, writer = await connect(server)
            writer.write(post("/echo", b"", "X-Big: " + "y" * 2000 + "\r\n"))
            status, _, body = await read_reply(reader)
            assert status == 431
            assert "limit of 1024 bytes" in json.loads(body)["error"]["message"]
            assert await closed_by_server(reader)

    asyncio.run(main())


def test_unknown_paths_and_methods_and_head() -> None:
    async def main() -> None:
        async with serving(ECHO) as server:
            reader, writer = await connect(server)
            writer.write(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, body = await read_reply(reader)
            assert status == 404 and "/echo" in json.loads(body)["error"]["message"]
            writer.write(b"DELETE /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, body = await read_reply(reader)
            assert status == 405 and headers["allow"] == "GET, HEAD, POST"
            writer.write(b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, _ = await read_reply(reader, head_only=True)
            assert status == 200 and int(headers["content-length"]) > 0
            # No body followed the HEAD answer: the next answer starts right after it.
            writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, body = await read_reply(reader)
            assert status == 200 and json.loads(body)["method"] == "GET"
            writer.close()

    asyncio.run(main())


def test_the_server_names_itself_in_its_errors() -> None:
    async def main() -> None:
        async with serving(ECHO, name="engine") as server:
            reader, writer = await connect(server)
            writer.write(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, body = await read_reply(reader)
            assert status == 404
            assert "No endpoint '/nope' on this engine" in json.loads(body)["error"]["message"]
            writer.close()

    asyncio.run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_close_connection_breaks_an_answer_off_after_what_was_written(
        loop: str, caplog: pytest.LogCaptureFixture) -> None:
    """A simulated engine crash: the written events arrive, then the connection ends, and
    what the handler returns afterwards is never sent (nor logged as a failure)."""
    async def crash(request: Request) -> Response:
        stream = StreamResponse(200, headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request, b"data: 1\n\n")
        await stream.write(b"data: 2\n\n")
        request.close_connection()
        return Response(500, b"never sent")

    async def main() -> None:
        async with serving({"/crash": {"GET": crash}}) as server:
            reader, writer = await connect(server)
            writer.write(b"GET /crash HTTP/1.1\r\nHost: x\r\n\r\n")
            rest = await asyncio.wait_for(reader.read(), 3.0)
            assert rest.startswith(b"HTTP/1.1 200")
            _head, _, body = rest.partition(b"\r\n\r\n")
            assert body == b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n"  # no end chunk
            assert b"never sent" not in rest

    with caplog.at_level(logging.WARNING):
        if loop == "uvloop":
            uvloop = pytest.importorskip(
                "uvloop", reason="uvloop is not installed; pip install -e '.[test]' brings it")
            uvloop.run(main())
        else:
            asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_handler_that_raises_gets_a_500_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def broken(request: Request) -> Response:
        raise KeyError("boom")

    async def injected(request: Request) -> Response:
        return Response(200, b"", headers={"X-Evil": "a\r\nSet-Cookie: b"})

    async def main() -> None:
        async with serving({"/broken": {"GET": broken}, "/inject": {"GET": injected}}) as server:
            for path, needle in (("/broken", "KeyError"), ("/inject", "line break")):
                reader, writer = await connect(server)
                writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                status, headers, _body = await read_reply(reader)
                assert status == 500 and headers["connection"] == "close"
                assert "set-cookie" not in headers
                assert needle in caplog.text
                assert await closed_by_server(reader)

    with caplog.at_level(logging.ERROR, logger="kvroute.http"):
        asyncio.run(main())


def test_a_client_that_goes_away_cancels_its_handler() -> None:
    cancelled = asyncio.Event()
    started = asyncio.Event()

    async def waits(request: Request) -> Response:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response(200)

    async def main() -> None:
        async with serving({"/wait": {"GET": waits}}) as server:
            _, writer = await connect(server)
            writer.write(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(started.wait(), 2)
            writer.close()
            await asyncio.wait_for(cancelled.wait(), 2)

    asyncio.run(main())


def test_a_stream_is_chunked_for_1_1_and_connection_framed_for_1_0() -> None:
    async def stream(request: Request) -> StreamResponse:
        out = StreamResponse(200, headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(3):
            await out.write(b"data: %d\n\n" % i)
            await out.write(b"")  # an empty write must not end the body
        await out.write_eof()
        return out

    async def main() -> None:
        async with serving({"/s": {"GET": stream}}) as server:
            reader, writer = await connect(server)
            writer.write(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, body = await read_reply(reader)
            assert status == 200 and headers["transfer-encoding"] == "chunked"
            assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
            writer.write(b"GET /s HTTP/1.0\r\n\r\n")  # same connection, now HTTP/1.0
            _status, headers, body = await read_reply(reader)
            assert "transfer-encoding" not in headers and headers["connection"] == "close"
            assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"

    asyncio.run(main())


def test_the_head_carries_the_first_piece_and_the_end_the_last_in_one_write(
        sent_writes: list[bytes]) -> None:
    writes = sent_writes

    async def stream(request: Request) -> StreamResponse:
        out = StreamResponse(200, headers={"Content-Type": "text/event-stream"})
        await out.prepare(request, b"data: 0\n\n")
        await out.write(b"data: 1\n\n")
        await out.write_eof(b"data: [DONE]\n\n")
        return out

    async def main() -> None:
        async with serving({"/s": {"GET": stream}}) as server:
            reader, writer = await connect(server)
            for version in ("1.1", "1.0"):
                writes.clear()
                writer.write(b"GET /s HTTP/%s\r\nHost: x\r\n\r\n" % version.encode())
                _status, _headers, body = await read_reply(reader)
                assert body == b"data: 0\n\ndata: 1\n\ndata: [DONE]\n\n"
                assert len(writes) == 3  # head + first, the middle, last + end
                if version == "1.1":
                    assert writes[0].endswith(b"\r\n\r\n9\r\ndata: 0\n\n\r\n")
                    assert writes[2] == b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
                else:
                    assert writes[2] == b"data: [DONE]\n\n"  # the connection's close ends it
            reader, writer = await connect(server)
            writes.clear()
            writer.write(b"HEAD /s HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _headers, body = await read_reply(reader, head_only=True)
            assert status == 200 and body == b""
            assert len(writes) == 1 and writes[0].endswith(b"\r\n\r\n")  # the head alone

    asyncio.run(main())


def test_a_slow_reader_holds_the_stream_back() -> None:
    written: list[int] = []
    piece = b"x" * 65536

    async def flood(request: Request) -> StreamResponse:
        out = StreamResponse(200)
        await out.prepare(request)
        for _ in range(256):  # 16 MiB
            await out.write(piece)
            written.append(len(piece))
        await out.write_eof()
        return out

    async def main() -> None:
        async with serving({"/f": {"GET": flood}}) as server:
            reader, writer = await connect(server)
            writer.write(b"GET /f HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.5)  # not reading: the writes must stall
            stalled_at = sum(written)
            assert stalled_at < 8 * 1024 * 1024, stalled_at
            status, _, body = await asyncio.wait_for(read_reply(reader), 20)
            assert status == 200 and len(body) == 256 * 65536

    asyncio.run(main())


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout() -> None:
    async def main() -> None:
        async with serving(ECHO, keepalive_timeout_s=0.3) as server:
            reader, writer = await connect(server)
            writer.write(post("/echo", b"1"))
            assert (await read_reply(reader))[0] == 200
            await asyncio.sleep(0.15)
            writer.write(post("/echo", b"2"))  # activity restarts the idle time
            assert (await read_reply(reader))[0] == 200
            assert await closed_by_server(reader, timeout=2.0)

    asyncio.run(main())


async def trickle(writer: asyncio.StreamWriter, reader: asyncio.StreamReader,
                  line: bytes, *, every_s: float = 0.05, for_s: float = 5.0) -> Reply:
    """Send ``line`` every ``every_s`` (a slowloris client) until the server answers; the
    answer, or an AssertionError after ``for_s``."""
    answer = asyncio.ensure_future(read_reply(reader))
    try:
        for _ in range(int(for_s / every_s)):
            if answer.done():
                break
            try:
                writer.write(line)
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.sleep(every_s)
        return await asyncio.wait_for(answer, 2.0)
    finally:
        answer.cancel()


def test_a_head_sent_a_line_at_a_time_gets_a_408_at_the_header_timeout() -> None:
    async def main() -> None:
        async with serving(ECHO, header_timeout_s=0.3) as server:
            reader, writer = await connect(server)
            writer.write(b"GET /echo HTTP/1.1\r\n")
            status, headers, body = await trickle(writer, reader, b"X-Slow: 1\r\n")
            assert status == 408 and headers["connection"] == "close"
            assert "header_timeout_s" in json.loads(body)["error"]["message"]
            assert await closed_by_server(reader)
            # A connection that sends nothing at all is closed as well.
            reader, _ = await connect(server)
            assert await closed_by_server(reader)
            # A well-behaved client is served as before.
            reader, writer = await connect(server)
            writer.write(post("/echo", b"ok"))
            assert (await read_reply(reader))[0] == 200

    asyncio.run(main())


def test_a_body_that_stops_arriving_gets_a_408_at_the_body_timeout() -> None:
    async def main() -> None:
        async with serving(ECHO, body_timeout_s=0.3) as server:
            reader, writer = await connect(server)
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")
            status, _, body = await asyncio.wait_for(read_reply(reader), 5.0)
            assert status == 408 and "body_timeout_s" in json.loads(body)["error"]["message"]
            assert await closed_by_server(reader)

    asyncio.run(main())


def test_connections_over_the_limit_get_a_503_and_the_others_are_served() -> None:
    async def main() -> None:
        async with serving(ECHO, max_connections=2) as server:
            held = [await connect(server) for _ in range(2)]
            reader, _ = await connect(server)
            status, headers, body = await asyncio.wait_for(read_reply(reader), 5.0)
            assert status == 503 and headers["retry-after"] == "1"
            assert "max_connections" in json.loads(body)["error"]["message"]
            for held_reader, held_writer in held:
                held_writer.write(post("/echo", b"x"))
                assert (await read_reply(held_reader))[0] == 200

    asyncio.run(main())


def test_a_client_that_reads_nothing_is_dropped_after_the_send_timeout() -> None:
    cancelled = asyncio.Event()
    piece = b"x" * 65536

    async def flood(request: Request) -> StreamResponse:
        out = StreamResponse(200)
        await out.prepare(request)
        try:
            for _ in range(4096):  # 256 MiB: far beyond every socket buffer
                await out.write(piece)
        except ConnectionResetError:
            cancelled.set()
            raise
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return out

    async def main() -> None:
        async with serving({"/f": {"GET": flood}}, send_timeout_s=0.3) as server:
            _, writer = await connect(server)
            writer.transport.pause_reading()  # the client reads nothing
            writer.write(b"GET /f HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(cancelled.wait(), 10)

    asyncio.run(main())


def test_limits_must_be_positive() -> None:
    for name in ("header_timeout_s", "body_timeout_s", "send_timeout_s", "max_connections",
                 "keepalive_timeout_s", "max_head_bytes"):
        with pytest.raises(ValueError, match=name):
            HttpServer(ECHO, max_body_bytes=1024, **{name: 0})


def test_upgrade_requests_are_answered_over_http_1_1_or_refused() -> None:
    upgrade = "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"

    async def main() -> None:
        async with serving(ECHO) as server:
            reader, writer = await connect(server)
            writer.write(f"GET /echo HTTP/1.1\r\nHost: x\r\n{upgrade}\r\n".encode())
            status, headers, _ = await read_reply(reader)
            assert status == 200 and headers["connection"] == "close"
            assert await closed_by_server(reader)
            reader, writer = await connect(server)
            writer.write(post("/echo", b"{}", upgrade))
            status, _, body = await read_reply(reader)
            assert status == 400 and "Upgrade" in json.loads(body)["error"]["message"]
            assert await closed_by_server(reader)

    asyncio.run(main())


def test_close_lets_a_running_answer_finish_then_cancels_what_overruns() -> None:
    results: list[str] = []

    def sleeper(seconds: float) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            try:
                await asyncio.sleep(seconds)
            except asyncio.CancelledError:
                results.append(f"cancelled {seconds}")
                raise
            results.append(f"done {seconds}")
            return Response(200)
        return handler

    async def main() -> None:
        server = HttpServer({"/short": {"GET": sleeper(0.2)}, "/long": {"GET": sleeper(30)}},
                            max_body_bytes=100)
        await server.start("127.0.0.1", 0)
        r1, w1 = await connect(server)
        _r2, w2 = await connect(server)
        _, _idle = await connect(server)
        w1.write(b"GET /short HTTP/1.1\r\nHost: x\r\n\r\n")
        w2.write(b"GET /long HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.05)
        await asyncio.wait_for(server.close(grace_s=1.0), 5)
        status, _headers, _ = await read_reply(r1)
        assert status == 200
        assert sorted(results) == ["cancelled 30", "done 0.2"]
        with pytest.raises(ConnectionRefusedError):
            await connect(server)
        await close_clients()

    asyncio.run(main())


def test_server_and_engine_client_run_on_uvloop() -> None:
    """``kvroute serve --loop uvloop``: uvloop's transports are not ``asyncio.Transport``
    instances, and both protocols must take them (a whole and a streamed answer, relayed
    through the engine client, on one uvloop loop)."""
    import uvloop

    from kvroute.http.client import EngineClient

    async def stream(request: Request) -> StreamResponse:
        out = StreamResponse(200, headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"data: " + request.body + b"\n\n")
        await out.write_eof()
        return out

    async def main() -> None:
        async with serving({**ECHO, "/s": {"POST": stream}}) as server:
            client = EngineClient(connect_timeout_s=5.0, total_timeout_s=10.0)
            try:
                base = f"http://127.0.0.1:{server.port}"
                whole = await client.post(base + "/echo", b"hello")
                assert whole.status == 200 and json.loads(await whole.read())["body"] == "hello"
                streamed = await client.post(base + "/s", b"x")
                assert await streamed.read() == b"data: x\n\n"
            finally:
                await client.close()

    uvloop.run(main())
