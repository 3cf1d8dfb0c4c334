"""``EngineClient`` against real loopback servers that answer exactly as each test scripts.

Each test runs a raw asyncio TCP server on a free loopback port whose handler reads the
request head and body and writes the bytes the test wants (well-formed answers, chunked
streams, bodies framed by the connection's end, broken and garbled answers), so the
client's parsing, pooling, retry, flow-control and timeout rules are checked on real
sockets.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Self

import pytest

from kvroute.http.client import (
    ConnectFailed,
    Disconnected,
    EngineClient,
    ProtocolError,
)

pytestmark = pytest.mark.integration

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


class Server:
    """A loopback server: counts connections and requests, runs ``handler`` per connection."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self.closed_by_client = asyncio.Event()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}/v1/completions"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bool:
        """Read one request; False at the client's end of stream."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.closed_by_client.set()
            return False
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length)
        self.requests.append((head, body))
        return True


def whole(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s"
            b"\r\n" % (len(body), extra)) + body


def chunked_head() -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20.0))


def client(**kwargs: float) -> EngineClient:
    return EngineClient(connect_timeout_s=kwargs.get("connect", 2.0),
                        total_timeout_s=kwargs.get("total", 10.0),
                        keepalive_s=kwargs.get("keepalive", 60.0))


def test_whole_answers_reuse_one_connection_and_send_the_request_intact() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        while await server.read_request(reader):
            writer.write(whole(b'{"ok": %d}' % len(server.requests), b"X-Engine: e0\r\n"))
            await writer.drain()

    async def main() -> None:
        async with Server(handler) as server:
            c = client()
            for i in range(1, 4):
                resp = await c.post(server.url, b'{"prompt": "hi"}', {"X-Request-Id": f"r{i}"})
                assert resp.status == 200
                assert resp.headers["x-engine"] == "e0"
                assert resp.headers["content-type"] == "application/json"
                assert await resp.read() == b'{"ok": %d}' % i
                assert resp.at_eof()
                assert resp._timer is None  # no deadline timer outlives a finished answer
            await c.close()
            assert server.connections == 1
            head, body = server.requests[0]
            assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
            assert b"\r\nHost: 127.0.0.1:%d\r\n" % server.port in head
            assert b"\r\nX-Request-Id: r1\r\n" in head
            assert body == b'{"prompt": "hi"}'

    run(main())


def test_a_chunked_stream_arrives_piece_by_piece_and_ends() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        writer.write(chunked_head())
        for i in range(3):
            writer.write(chunk(b"data: %d\n\n" % i))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await server.read_request(reader)  # keep the connection open until the client goes

    async def main() -> None:
        async with Server(handler) as server:
            c = client()
            resp = await c.post(server.url, b"{}")
            assert resp.headers["content-type"] == "text/event-stream"
            pieces = []
            while piece := await resp.readany():
                pieces.append(piece)
            assert pieces == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
            assert resp.at_eof()
            await c.close()

    run(main())


def test_a_body_framed_by_the_connection_end_is_complete_at_close() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npart one, ")
        await writer.drain()
        writer.write(b"part two")
        await writer.drain()

    async def main() -> None:
        async with Server(handler) as server:
            c = client()
            resp = await c.post(server.url, b"{}")
            assert await resp.read() == b"part one, part two"
            resp2 = await c.post(server.url, b"{}")  # not reused: the server said close
            assert await resp2.read() == b"part one, part two"
            assert server.connections == 2
            await c.close()

    run(main())


def test_an_answer_sent_a_byte_at_a_time_parses_the_same() -> None:
    answer = whole(b'{"slow": true}', b"X-Long-Header-Name: " + b"v" * 300 + b"\r\n")

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        for i in range(len(answer)):
            writer.write(answer[i : i + 1])
            await writer.drain()

    async def main() -> None:
        async with Server(handler) as server:
            c = client()
            resp = await c.post(server.url, b"{}")
            assert resp.status == 200
            assert resp.headers["x-long-header-name"] == "v" * 300
            assert await resp.read() == b'{"slow": true}'
            await c.close()

    run(main())


def test_an_idle_connection_the_engine_closed_is_replaced_transparently() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        writer.write(whole(b"{}"))
        await writer.drain()
        # keep-alive was offered, but this engine closes the connection once idle

    async def main() -> None:
        async with Server(handler) as server:
            c = client()
            for _ in range(3):
                resp = await c.post(server.url, b"{}")
                assert await resp.read() == b"{}"
                await asyncio.sleep(0.05)  # let the close arrive (or race it: both must work)
            assert server.connections == 3
            await c.close()

    run(main())


def test_a_reused_connection_closed_before_any_answer_byte_is_retried_once_fresh() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        writer.write(whole(b'{"n": 1}'))
        await writer.drain()
        if server.connections == 1:
            await server.read_request(reader)  # the reused connection: closed unanswered
            return
        while await server.read_request(reader):
            writer.write(whole(b'{"n": 2}'))
            await writer.drain()

    async def main() -> None:
        async with Server(handler) as server:
            c = client()
            assert await (await c.post(server.url, b"{}")).read() == b'{"n": 1}'
            assert await (await c.post(server.url, b"{}")).read() == b'{"n": 1}'
            assert server.connections == 2
            assert len(server.requests) == 3  # the lost one, then its retry
            await c.close()

    run(main())


def test_an_engine_dying_mid_body_fails_the_read_after_the_bytes_it_sent() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        writer.write(chunked_head() + chunk(b"data: 0\n\n"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    async def main() -> None:
        async with Server(handler) as server:
            c = client()
            resp = await c.post(server.url, b"{}")
            assert await resp.readany() == b"data: 0\n\n"
            with pytest.raises(Disconnected):
                await resp.readany()
            await c.close()

    run(main())


def test_garbage_is_a_protocol_error_and_refused_connections_a_connect_failure() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)

    async def main() -> None:
        async with Server(handler) as server:
            c = client()
            with pytest.raises(ProtocolError):
                await c.post(server.url, b"{}")
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                dead = probe.getsockname()[1]
            with pytest.raises(ConnectFailed) as info:
                await c.post(f"http://127.0.0.1:{dead}/v1/completions", b"{}")
            assert isinstance(info.value.os_error, OSError)
            await c.close()

    run(main())


def test_closing_a_response_early_closes_the_connection_so_the_engine_can_cancel() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        writer.write(chunked_head() + chunk(b"data: 0\n\n"))
        await writer.drain()
        await server.read_request(reader)  # returns False when the client closes

    async def main() -> None:
        async with Server(handler) as server:
            c = client()
            resp = await c.post(server.url, b"{}")
            assert await resp.readany() == b"data: 0\n\n"
            resp.close()
            await asyncio.wait_for(server.closed_by_client.wait(), 5.0)
            with pytest.raises(Disconnected):
                await resp.readany()
            await c.close()

    run(main())


def test_cancelling_while_waiting_for_headers_closes_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        await server.read_request(reader)  # never answers; sees the client go

    async def main() -> None:
        async with Server(handler) as server:
            c = client()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await c.post(server.url, b"{}")
            await asyncio.wait_for(server.closed_by_client.wait(), 5.0)
            await c.close()

    run(main())


def test_the_total_deadline_ends_a_stream_that_stalls() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        writer.write(chunked_head() + chunk(b"data: 0\n\n"))
        await writer.drain()
        await server.read_request(reader)

    async def main() -> None:
        async with Server(handler) as server:
            c = client(total=0.3)
            resp = await c.post(server.url, b"{}")
            assert await resp.readany() == b"data: 0\n\n"
            with pytest.raises(TimeoutError):
                await resp.readany()
            await asyncio.wait_for(server.closed_by_client.wait(), 5.0)
            await c.close()

    run(main())


def test_a_watched_stream_that_goes_silent_fails_and_frees_the_engine() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        writer.write(chunked_head() + chunk(b"data: 0\n\n"))
        await writer.drain()
        await read_first.wait()
        writer.write(chunk(b"data: 1\n\n"))  # a live engine: the stall time starts again
        await writer.drain()
        await server.read_request(reader)  # then silent until the client goes

    read_first = asyncio.Event()

    async def main() -> None:
        async with Server(handler) as server:
            c = client(total=30.0)
            resp = await c.post(server.url, b"{}")
            resp.watch_stall(2.0)  # generous: a loaded machine must not look like a stall
            assert await resp.readany() == b"data: 0\n\n"
            read_first.set()
            assert await resp.readany() == b"data: 1\n\n"
            with pytest.raises(TimeoutError, match="stall_s"):
                await resp.readany()
            await asyncio.wait_for(server.closed_by_client.wait(), 5.0)
            await c.close()

    run(main())


def test_a_watched_stream_read_slowly_is_not_a_stall() -> None:
    total = 8 * 1024 * 1024

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        block = b"x" * 65536
        for _ in range(total // len(block)):
            writer.write(block)
            await writer.drain()

    async def main() -> None:
        async with Server(handler) as server:
            c = client()
            resp = await c.post(server.url, b"{}")
            for _ in range(500):  # bounded: until the engine's first bytes wait unread
                if resp.buffered:
                    break
                await asyncio.sleep(0.01)
            resp.watch_stall(0.2)
            await asyncio.sleep(0.8)  # nobody reads: the socket pauses, the engine waits
            resp.watch_stall(60.0)  # no stall so far, or the read below raises it
            assert len(await resp.read()) == total
            await c.close()

    run(main())


def test_a_slow_reader_pauses_the_socket_instead_of_buffering_everything() -> None:
    total = 8 * 1024 * 1024

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        block = b"x" * 65536
        for _ in range(total // len(block)):
            writer.write(block)
            await writer.drain()

    async def main() -> None:
        async with Server(handler) as server:
            c = client()
            resp = await c.post(server.url, b"{}")
            await asyncio.sleep(0.5)  # the engine keeps sending; nobody reads
            assert resp.buffered < 2 * 1024 * 1024
            assert len(await resp.read()) == total
            await c.close()

    run(main())


def test_header_injection_and_non_http_urls_are_refused() -> None:
    async def main() -> None:
        c = client()
        with pytest.raises(ValueError, match="line break"):
            await c.post("http://127.0.0.1:9/v1/completions", b"{}",
                         {"X-Request-Id": "a\r\nX-Evil: 1"})
        with pytest.raises(ValueError, match="http"):
            await c.post("ftp://127.0.0.1:9/x", b"{}")
        await c.close()

    run(main())


@pytest.mark.skipif(shutil.which("openssl") is None,
                    reason="needs the openssl command to make a self-signed certificate "
                           "(apt-get install openssl)")
def test_https_engines_are_reached_over_tls(tmp_path: Path) -> None:
    """An external provider over https: a self-signed certificate for 127.0.0.1, trusted by
    the client's context and by nothing else."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    trusted = ssl.create_default_context(cafile=str(cert))

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      server: Server) -> None:
        while await server.read_request(reader):
            writer.write(whole(b'{"tls": true}'))
            await writer.drain()

    async def main() -> None:
        async with Server(handler, tls=server_tls) as server:
            c = EngineClient(connect_timeout_s=5.0, total_timeout_s=10.0, ssl_context=trusted)
            for _ in range(2):
                assert await (await c.post(server.url, b"{}")).read() == b'{"tls": true}'
            assert server.connections == 1
            await c.close()
            untrusting = client()  # the system's trust store does not know this certificate
            with pytest.raises(ConnectFailed, match="certificate"):
                await untrusting.post(server.url, b"{}")
            await untrusting.close()

    run(main())
