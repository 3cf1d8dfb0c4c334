"""A blocking HTTP/1.1 client over a raw socket, for tests that must control every byte.

``RawConnection.exchange`` writes exactly the bytes given and reads one answer (framed by
``Content-Length``, chunked, or by the connection's end), keeping the connection for the
next request while the server keeps it alive. Errors in the answer's framing raise
``AssertionError`` with what was read.
"""

from __future__ import annotations

import json
import select
import socket
from dataclasses import dataclass
from typing import Any, Self

__all__ = ["RawAnswer", "RawConnection", "openai_error"]


@dataclass(frozen=True, slots=True)
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool
    """The server ended the connection after this answer."""


def openai_error(answer: RawAnswer) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-shaped error answer, or an AssertionError saying
    what is wrong with the answer's shape."""
    try:
        doc = json.loads(answer.body)
    except ValueError as exc:
        raise AssertionError(f"{answer.status} answer is not JSON: {answer.body[:200]!r}") from exc
    error = doc.get("error") if isinstance(doc, dict) else None
    assert isinstance(error, dict), f"{answer.status} answer has no error object: {doc!r}"
    assert isinstance(error.get("message"), str) and error["message"], error
    assert isinstance(error.get("type"), str) and "code" in error, error
    return error


class RawConnection:
    """One client connection to ``127.0.0.1:port``, reopened when the server closed it."""

    def __init__(self, port: int, timeout_s: float = 10.0) -> None:
        self.port = port
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buf = b""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buf = b""

    def send(self, data: bytes) -> None:
        if self._sock is None:
            self._sock = socket.create_connection(("127.0.0.1", self.port), self.timeout_s)
            self._sock.settimeout(self.timeout_s)
        self._sock.sendall(data)

    def exchange(self, data: bytes) -> RawAnswer:
        """Send ``data`` (one request), read one answer."""
        try:
            self.send(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close()  # the server had closed the kept connection: once more, anew
            self.send(data)
        return self.read_answer()

    def read_answer(self) -> RawAnswer:
        head = self._until(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        assert len(parts) >= 2 and parts[0] == "HTTP/1.1", f"not an HTTP answer: {head[:200]!r}"
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if status == 100:
            return self.read_answer()
        if "content-length" in headers:
            body = self._exactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            pieces = []
            while True:
                size = int(self._until(b"\r\n").split(b";")[0], 16)
                pieces.append(self._exactly(size))
                assert self._exactly(2) == b"\r\n"
                if size == 0:
                    break
            body = b"".join(pieces)
        else:
            body = self._rest()
        closed = headers.get("connection", "").lower() == "close"
        if closed:
            self.close()
        return RawAnswer(status, headers, body, closed)

    def pending(self) -> bool:
        """Whether the server has sent something not read yet."""
        if self._buf:
            return True
        if self._sock is None:
            return False
        readable, _, _ = select.select([self._sock], [], [], 0)
        return bool(readable)

    def closed_by_server(self) -> bool:
        """Whether the server ends the connection (EOF or reset) within the timeout."""
        if self._sock is None:
            return True
        try:
            while self._sock.recv(65536):
                pass
        except TimeoutError:
            return False
        except OSError:
            pass
        self.close()
        return True

    def _fill(self) -> bool:
        assert self._sock is not None, "no connection to read from"
        chunk = self._sock.recv(65536)
        self._buf += chunk
        return bool(chunk)

    def _until(self, mark: bytes) -> bytes:
        while mark not in self._buf:
            if not self._fill():
                raise AssertionError(f"connection ended before {mark!r}; read {self._buf[:200]!r}")
        head, _, self._buf = self._buf.partition(mark)
        return head

    def _exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not self._fill():
                raise AssertionError(f"connection ended {n - len(self._buf)} bytes early")
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def _rest(self) -> bytes:
        while self._fill():
            pass
        out, self._buf = self._buf, b""
        self.close()
        return out
