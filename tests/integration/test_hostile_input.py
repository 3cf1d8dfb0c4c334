"""Hostile input against a real ``kvroute serve`` over raw sockets (issue #26, "Bad input").

One router process and one simulated engine serve the whole module. Two parts:

* **Generated**: ``hypothesis`` sends at least 10,000 requests per run (bodies shaped like
  OpenAI requests with wrong types, huge and non-finite numbers, unknown fields and nesting,
  raw bytes, mutated JSON; arbitrary headers; both inference endpoints and others) over
  keep-alive connections. Every answer is 2xx, or 4xx with an OpenAI-shaped error: never a
  5xx, never a broken connection.
* **A fixed corpus** of what a new user or an attacker sends: truncated and invalid JSON,
  100,000 nested brackets, invalid UTF-8, wrong types, huge numbers, oversized bodies and
  headers, a lying ``Content-Length``, TLS bytes on the plain port, a slowloris head, a
  stalled body, request smuggling framing, NUL bytes. Each gets its 4xx (or its close), and
  a valid request is served right after it.

At the end the router's memory has stayed bounded, its log holds no traceback and no error,
and it still answers. The router runs with short header/body timeouts (1 s) so the
slowloris cases take seconds; its defaults are nginx's (``docs/reliability.md``).
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rawhttp import RawAnswer, RawConnection, openai_error

from kvroute.sim.launcher import Fleet, ReplicaSpec, start_fleet

pytestmark = pytest.mark.integration

ROUTE = "assistant"
MAX_BODY = 256 * 1024
MAX_HEAD = 8192
GENERATED_EXAMPLES = 10_000
RSS_GROWTH_BOUND = 160 * 1024 * 1024
"""The router's resident memory may grow this much over the module (its index and
session maps fill; both are bounded): far below what unbounded buffering would cost."""


@dataclass(frozen=True, slots=True)
class Router:
    port: int
    pid: int
    log: Path


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="module")
def engine() -> Iterator[Fleet]:
    fleet = start_fleet([ReplicaSpec(name="s0", pool="small", model="sim-model",
                                     eos_after_tokens=4)], timeout_s=120.0)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def router(engine: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    where = tmp_path_factory.mktemp("hostile")
    rep = engine.replicas[0]
    (where / "kvroute.yaml").write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"small": {"model": rep.model, "replicas": [
            {"name": rep.name, "url": rep.url, "kv_events": rep.kv_events}]}},
        "routes": {ROUTE: {"pools": ["small"]}},
        "max_body_bytes": MAX_BODY,
        "http": {"max_header_bytes": MAX_HEAD, "header_timeout_s": 1, "body_timeout_s": 1,
                 "send_timeout_s": 5, "idle_timeout_s": 5},
        "log_level": "warning",
    }))
    log = where / "router.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from kvroute.cli import main; main()", "serve", "-c",
             str(where / "kvroute.yaml")], stdout=subprocess.PIPE, stderr=err, env=env)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline() or "{}")
        assert info.get("ready"), f"kvroute serve did not start: {log.read_text()[-2000:]}"
        yield Router(int(info["port"]), proc.pid, log)
        assert proc.poll() is None, f"the router exited: {log.read_text()[-2000:]}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def post(body: bytes, *, path: str = "/v1/chat/completions",
         headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),),
         method: str = "POST") -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
    head += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


VALID = json.dumps({"model": ROUTE, "messages": [{"role": "user", "content": "hello there"}],
                    "max_tokens": 2}).encode()


def check(answer: RawAnswer) -> None:
    """2xx, or 4xx with an OpenAI-shaped error."""
    assert answer.status < 500, (answer.status, answer.body[:300])
    if answer.status >= 400:
        openai_error(answer)


def served(router: Router) -> None:
    """A valid request on a fresh connection gets its answer."""
    with RawConnection(router.port) as conn:
        answer = conn.exchange(post(VALID))
    assert answer.status == 200, (answer.status, answer.body[:300])
    assert json.loads(answer.body)["choices"]


# --------------------------------------------------------------------------------------------
# Generated
# --------------------------------------------------------------------------------------------

# A request is drawn by hypothesis (a template: an OpenAI-shaped document, headers, a
# target), then sent with BATCH - 1 variants derived from it by a hypothesis-drawn
# ``random.Random`` (a field set to an odd value or dropped, the body cut or a byte changed,
# a header added): drawing costs milliseconds a request on a loaded 2-core machine, a
# variant microseconds, and the batch is pipelined on one keep-alive connection.

BATCH = 10
SENT: list[int] = [0]
"""Requests the generated test has sent (checked at the end: at least GENERATED)."""
STATUSES: collections.Counter[int] = collections.Counter()
"""How the generated requests were answered (printed at the end, for docs/reliability.md)."""
GENERATED = 10_000

ODD: list[Any] = [None, True, False, 0, -1, 1, 2**63, -(2**63) - 1, 10**40, 1.5, 1e308, -0.0,
                  float("inf"), float("nan"), "", "x", ROUTE, "\x00", "user", "\ud800", [], {},
                  [[]], {"": None}, "a" * 5000, [1] * 300, {"type": "object"}]
_odd = st.sampled_from(ODD)
_scalars = _odd | st.integers() | st.text(max_size=8)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=2), max_leaves=4)
_roles = st.sampled_from(["user", "system", "assistant", "tool", "developer", "nobody"])
_message = st.fixed_dictionaries({"role": _roles | _scalars},
                                  optional={"content": st.text(max_size=30) | _json})
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.lists(_message, max_size=2) | _json, "prompt": st.text(max_size=30) | _json,
    "max_tokens": st.integers(-2, 8) | _scalars,
    "max_completion_tokens": st.integers(-2, 8) | _scalars,
    "stream": st.booleans() | _scalars, "stream_options": _json,
    "n": st.integers(-1, 200) | _scalars, "temperature": st.floats() | _scalars,
    "stop": _json, "tools": _json, "user": _scalars, "session_id": _scalars,
    "cache_salt": st.text(max_size=10) | _scalars, "vllm_xargs": _json, "logprobs": _scalars,
    "response_format": _json, "seed": _scalars,
}
FIELD_NAMES = sorted(FIELDS)
HEADER_NAMES = ["Content-Type", "Authorization", "X-Session-Id", "X-Request-Id", "Accept",
                "Accept-Encoding", "Content-Encoding", "Expect", "Cookie", "User-Agent",
                "X-Forwarded-For", "Traceparent", "Connection", "Keep-Alive", "Upgrade", "X-Y"]
HEADER_VALUES = ["", "application/json", "text/plain", "close", "keep-alive", "100-continue",
                 "Bearer x", "gzip", "h2c", "\xff\xfe", "a" * 300, "1", "-1", "\t"]
TARGETS = ([("POST", "/v1/chat/completions")] * 6 + [("POST", "/v1/completions")] * 3
           + [("GET", "/v1/models"), ("PUT", "/v1/chat/completions"),
              ("POST", "/v1/embeddings"), ("GET", "/health"), ("POST", "/admin/state")])


@dataclass(frozen=True, slots=True)
class Template:
    doc: dict[str, Any]
    headers: tuple[tuple[str, str], ...]
    target: tuple[str, str]


@st.composite
def templates(draw: st.DrawFn) -> Template:
    doc: dict[str, Any] = {"model": draw(st.just(ROUTE) | _scalars)}
    if draw(st.booleans()):
        doc["messages"] = draw(st.lists(_message, min_size=1, max_size=2))
    for name in draw(st.lists(st.sampled_from(FIELD_NAMES), max_size=3, unique=True)):
        doc[name] = draw(FIELDS[name])
    values = st.sampled_from(HEADER_VALUES) | st.text(
        alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
        max_size=20)
    headers = draw(st.lists(st.tuples(st.sampled_from(HEADER_NAMES), values), max_size=3))
    return Template(doc, tuple(headers), draw(st.sampled_from(TARGETS)))


def _encode(doc: Any) -> bytes:
    return json.dumps(doc, allow_nan=True).encode("utf-8", "surrogatepass")


def variant(template: Template, rnd: random.Random) -> bytes:
    """One request derived from ``template``: its document changed (a field set to an odd
    value, dropped, or nested), its bytes changed (cut, a byte replaced or inserted), or a
    header added."""
    doc = dict(template.doc)
    headers = list(template.headers)
    how = rnd.randrange(6)
    if how == 0:
        doc[rnd.choice([*FIELD_NAMES, "model"])] = rnd.choice(ODD)
    elif how == 1 and doc:
        doc.pop(rnd.choice(list(doc)))
    elif how == 2:
        name = rnd.choice(list(doc) or ["model"])
        doc[name] = [{"x": doc.get(name)}] * rnd.randrange(1, 4)
    body = _encode(doc)
    if how == 3:
        body = body[:rnd.randrange(len(body) + 1)]
    elif how == 4:
        at = rnd.randrange(len(body))
        body = body[:at] + bytes([rnd.randrange(256)]) + body[at + rnd.randrange(2):]
    elif how == 5:
        headers.append((rnd.choice(HEADER_NAMES), rnd.choice(HEADER_VALUES)))
    method, path = template.target
    return post(body, path=path, method=method, headers=tuple(headers))


@pytest.fixture(scope="module", autouse=True)
def baseline_rss(router: Router) -> int:
    """The router's resident memory once it has served one request, before the rest."""
    served(router)
    return _rss(router.pid)


@pytest.fixture(scope="module")
def keep_alive(router: Router) -> Iterator[RawConnection]:
    with RawConnection(router.port) as conn:
        yield conn


@settings(max_examples=GENERATED // BATCH, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(template=templates(), rnd=st.randoms(use_true_random=False))
def test_generated_requests_get_an_answer_or_an_openai_error_never_a_5xx(
        keep_alive: RawConnection, template: Template, rnd: random.Random) -> None:
    method, path = template.target
    pending = [post(_encode(template.doc), path=path, method=method, headers=template.headers)]
    pending += [variant(template, rnd) for _ in range(BATCH - 1)]
    SENT[0] += len(pending)
    while pending:
        keep_alive.send(b"".join(pending))  # pipelined; answers come back in order
        answered = 0
        for _ in pending:
            answer = keep_alive.read_answer()
            check(answer)
            STATUSES[answer.status] += 1
            answered += 1
            if answer.closed:  # the rest were dropped with the connection: send them anew
                break
        pending = pending[answered:]


# --------------------------------------------------------------------------------------------
# The fixed corpus
# --------------------------------------------------------------------------------------------

def _deep(depth: int) -> bytes:
    return (b'{"model":"' + ROUTE.encode() + b'","messages":[{"role":"user","content":"x"}],'
            b'"x":' + b"[" * depth + b"]" * depth + b"}")


TLS_CLIENT_HELLO = bytes.fromhex(
    "16030100c4010000c00303" + "ab" * 32 + "20" + "cd" * 32
    + "0020c02bc02fc02cc030cca9cca8c013c014009c009d002f0035c00a01000057")

CORPUS: dict[str, tuple[bytes, set[int]]] = {
    "truncated json": (post(VALID[:-9]), {400}),
    "invalid json": (post(b"{model: assistant}"), {400}),
    "not an object": (post(b"[1, 2, 3]"), {400}),
    "100,000 nested brackets": (post(b'{"model":"assistant","messages":' + b"[" * 100_000
                                     + b"]" * 100_000 + b"}"), {400}),
    "150 nested arrays in an unknown field": (post(_deep(150)), {200}),
    **{f"{depth} nested arrays: decoded, maybe too deep to forward": (post(_deep(depth)), {200, 400})
       for depth in range(955, 1000, 5)},
    "invalid utf-8": (post(b'{"model":"assistant\xff\xfe","messages":[]}'), {400}),
    "model is a number": (post(b'{"model":5,"messages":[]}'), {400}),
    "messages is a string": (post(b'{"model":"assistant","messages":"hi"}'), {400}),
    "max_tokens is a string": (post(VALID[:-1] + b',"max_tokens":"5"}'), {400}),
    "max_tokens 1e30": (post(VALID[:-1] + b',"max_tokens":1e30}'), {200, 400}),
    "max_tokens 10**400": (post(VALID[:-1] + b',"max_tokens":1' + b"0" * 400 + b"}"), {200, 400}),
    "temperature 1e999": (post(VALID[:-1] + b',"temperature":1e999}'), {200, 400}),
    "n 10**30": (post(VALID[:-1] + b',"n":1' + b"0" * 30 + b"}"), {400}),
    "body over max_body_bytes": (post(b'{"model":"' + b"a" * MAX_BODY + b'"}'), {413}),
    "chunked body over max_body_bytes": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + (b"%x\r\n" % 140000 + b"a" * 140000 + b"\r\n") * 2 + b"0\r\n\r\n", {413}),
    "expect-continue over max_body_bytes": (
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        b"Content-Length: 999999999\r\n\r\n"), {413}),
    "headers over max_header_bytes": (post(VALID, headers=(("X-Big", "b" * MAX_HEAD),)), {431}),
    "many small headers": (post(VALID, headers=tuple((f"X-H{i}", "v") for i in range(2000))),
                           {431}),
    "content-length and chunked at once": (
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"), {400}),
    "two content-lengths": (
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Content-Length: 6\r\n\r\nhello!"), {400}),
    "negative content-length": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", {400}),
    "content-length of 30 digits": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 30
        + b"\r\n\r\n", {400, 413}),
    "content-length shorter than the body": (
        post(VALID)[:-len(VALID)].replace(b"Content-Length: %d" % len(VALID), b"Content-Length: 9")
        + VALID, {400}),
    "nul byte in a header": (post(VALID, headers=(("X-Nul", "a\x00b"),)), {400}),
    "bare LF line endings": ((b"POST /v1/chat/completions HTTP/1.1\nHost: x\nContent-Length: 2"
                             b"\n\n{}"), {400}),
    "tls client hello on the plain port": (TLS_CLIENT_HELLO, {400}),
    "garbage request line": (b"\x00\x01\x02 hello\r\n\r\n", {400}),
    "unknown method": (b"BREW /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", {400, 405}),
    "text/plain body": (post(VALID, headers=(("Content-Type", "text/plain"),)), {200}),
    "unknown role": (post(b'{"model":"assistant","messages":[{"role":"wizard","content":"x"}],'
                          b'"max_tokens":2}'), {200, 400}),
}


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_corpus_case_gets_its_4xx_and_the_next_request_is_served(router: Router,
                                                                 case: str) -> None:
    data, statuses = CORPUS[case]
    with RawConnection(router.port) as conn:
        answer = conn.exchange(data)
    assert answer.status in statuses, (case, answer.status, answer.body[:300])
    check(answer)
    served(router)


def test_a_lying_content_length_gets_a_408_once_the_body_stalls(router: Router) -> None:
    with RawConnection(router.port) as conn:
        conn.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                  b"\r\n" + VALID[:10])
        answer = conn.read_answer()  # the router's body_timeout_s is 1 s here
        assert answer.status == 408 and "body_timeout_s" in openai_error(answer)["message"]
        assert conn.closed_by_server()
    served(router)


def test_a_slowloris_head_gets_a_408_and_the_connection_closes(router: Router) -> None:
    with RawConnection(router.port) as conn:
        conn.send(b"POST /v1/chat/completions HTTP/1.1\r\n")
        answer: RawAnswer | None = None
        for i in range(100):  # a header line every 50 ms: up to 5 s, the router's limit is 1 s
            try:
                conn.send(b"X-Slow-%d: 1\r\n" % i)
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.05)
            if conn.pending():
                break
        answer = conn.read_answer()
        assert answer.status == 408 and "header_timeout_s" in openai_error(answer)["message"]
        assert conn.closed_by_server()
    served(router)


def test_a_connection_that_sends_nothing_is_closed(router: Router) -> None:
    with RawConnection(router.port) as conn:
        conn.send(b"")
        assert conn.closed_by_server()
    served(router)


def test_pipelined_requests_are_answered_in_order(router: Router) -> None:
    bodies = [json.dumps({"model": ROUTE, "messages": [{"role": "user", "content": f"n{i}"}],
                          "max_tokens": 2, "user": f"u{i}"}).encode() for i in range(20)]
    with RawConnection(router.port) as conn:
        conn.send(b"".join(post(b, headers=(("X-Request-Id", f"req-{i}"),))
                           for i, b in enumerate(bodies)))
        answers = [conn.read_answer() for _ in bodies]
    assert [a.status for a in answers] == [200] * len(bodies)


def test_the_router_survived_with_bounded_memory_and_a_clean_log(router: Router,
                                                                 baseline_rss: int) -> None:
    """Runs last in the module (pytest keeps file order): everything above has been sent."""
    rss = _rss(router.pid)
    served(router)
    log = router.log.read_text(errors="replace")
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert rss < baseline_rss + RSS_GROWTH_BOUND, (rss, baseline_rss)
    # (0: the generated test was deselected; when it runs it must send them all)
    assert SENT[0] in (0, *range(GENERATED, GENERATED + BATCH)), SENT[0]
    print(f"\n{SENT[0]} generated requests, answers {dict(sorted(STATUSES.items()))}; "
          f"router RSS {baseline_rss / 2**20:.0f} -> {rss / 2**20:.0f} MiB")
