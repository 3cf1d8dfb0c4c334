"""The load generator of ``kvroute bench live``: one bounded request stream over real HTTP.

Owns turning workload requests into OpenAI chat bodies, sending them to a router (or, for the
``direct`` baseline, round robin over the engines), and measuring each one on the client side:
time to first token, inter-token gaps, whole-response latency, errors. It knows nothing about
which router is behind the URL, nor about processes; ``bench/live.py`` does that.

Why the router's own lean HTTP client (``kvroute.http.client``) and not aiohttp's: the load
generator shares the benchmark machine with the routers and engines it measures, so every
CPU-ms it spends is taken from them, and every wake-up it is late for is added to what it
records; measured side by side it spends less CPU a request than aiohttp's client did
(docs/benchmarks.md, "The simulated engine and the load generator"). Streams are read on
the bytes (``StreamReading``): only events that may carry text, usage or an error are
decoded.

Bounds (every run ends, whatever the server does):

* at most ``len(requests)`` requests, each sent once, never retried;
* a per-request timeout (``request_timeout_s``) and a whole-run deadline (``duration_s``):
  requests not yet started at the deadline are counted ``not_sent``, those still running are
  cancelled and counted ``deadline``;
* open loop: request *i* starts at ``t0 + arrival_s[i] / rate_scale``; beyond
  ``max_in_flight`` concurrent requests a due request is not sent and counted
  ``over_max_in_flight`` (the open loop stays open, as the client of docs/reference/router-overhead-anchors.md did);
* closed loop (``concurrency=N``): N workers send back to back in workload order.

A control lane (``ControlLane``): in the same stream, every ``every``-th request goes straight
to the engines instead of to the target, and its result is marked ``control``. A router's
added latency can then be taken against requests sent direct *in the same seconds*, through
the same client, to the same engines, rather than against a baseline measured in another
window: on a shared VM the client's p99 moves by milliseconds from one window to the next,
for every router and for ``direct`` alike, which a same-window baseline cancels.

Latency definitions (every router is measured identically, so differences are the router's):
TTFT runs from just before the request is written to the first SSE event carrying output text;
ITL is every gap between consecutive text-carrying events of one response; E2E runs to the end
of the body. A request is OK only with status 200, at least one text event and ``[DONE]``.
Non-streamed requests (``build_live_requests(stream=False)``): TTFT is the whole response
(there is no earlier token to see), and the request is OK with status 200 and a JSON body
whose ``choices`` carry text.

NOTE: the client sets ``TCP_NODELAY`` on every connection it makes, reads it back on the
first response and reports it, because a Nagle delay on a kept-alive connection adds tens of
milliseconds to TTFT (sglang-router's added first-chunk latency, docs/benchmarks.md) and
must never be the client's own.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import msgspec

from kvroute.core.errors import ConfigError
from kvroute.core.stats import mean, percentile
from kvroute.http.client import (
    ConnectFailed,
    EngineClient,
    EngineClientError,
    EngineResponse,
)
from kvroute.sim.workload import WorkloadRequest
from kvroute.tokenize.words import to_text
from kvroute.wire.sse import SSEDecoder

__all__ = [
    "ClientRun",
    "ControlLane",
    "LiveRequest",
    "RequestResult",
    "build_live_requests",
    "replay",
    "run_client",
    "summarize",
]


@dataclass(frozen=True, slots=True)
class LiveRequest:
    """One request as sent on the wire: a chat body, encoded once for every router."""

    request_id: str
    arrival_s: float
    body: bytes
    prompt_tokens: int
    max_tokens: int
    group: str | None = None
    stream: bool = True
    session_id: str | None = None
    """Sent as ``x-session-id`` (what kvroute, LiteLLM and vLLM read) when set."""


@dataclass(frozen=True, slots=True)
class ControlLane:
    """Send request *i* of a stream straight to ``targets`` (round robin among them) when
    ``i % every == every - 1``: one request in ``every``, spread evenly through the stream.

    Raises:
        ConfigError: no targets, or ``every`` below 2 (every request would be a control one).
    """

    targets: tuple[str, ...]
    every: int

    def __post_init__(self) -> None:
        if not self.targets:
            raise ConfigError("a control lane needs at least one engine URL")
        if self.every < 2:
            raise ConfigError(f"control lane every={self.every} must be >= 2 (one request in "
                              "`every` goes direct; the others go to the router)")

    def has(self, i: int) -> bool:
        return i % self.every == self.every - 1


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request. Times are seconds; ``start_s`` is from run start.

    ``error`` is None for an OK request, else a short kind: ``http_<status>``, ``no_output``,
    ``no_done``, ``timeout``, ``deadline``, ``not_sent``, ``over_max_in_flight``,
    ``connect``, ``client:<ExceptionName>``. ``control`` marks a request of the control
    lane (sent straight to an engine, ``ControlLane``).
    """

    request_id: str
    control: bool = False
    start_s: float | None = None
    lag_s: float | None = None
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_events: int = 0
    usage_completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class ClientRun:
    """One replay of the stream: per-request results, wall time, and what was checked."""

    results: list[RequestResult]
    wall_s: float
    tcp_nodelay: bool | None


def build_live_requests(
    workload: Sequence[WorkloadRequest],
    *,
    model: str,
    max_tokens_cap: int | None = None,
    stream: bool = True,
) -> list[LiveRequest]:
    """Encode each workload request as a chat completion body (streamed unless ``stream`` is
    False).

    Requests with ``messages`` (generators called with ``with_messages=True``) send them as
    they are; others (trace replays) send their prompt as one user message of
    :func:`~kvroute.tokenize.words.to_text` words, so the simulated engines' built-in
    tokenizer sees the same ids. A request's ``session_id`` goes in an ``x-session-id``
    header. Closed-loop dependencies (``depends_on``) are ignored: the
    live replay is open loop on ``arrival_s``.

    Args:
        workload: the requests, in arrival order.
        model: the ``model`` field (the engines' served name; kvroute's route of that name).
        max_tokens_cap: lower every request's output length to at most this.
        stream: ask for an SSE stream (with usage) or for one whole JSON response.

    Raises:
        ConfigError: an empty workload or a cap below 1.
    """
    if not workload:
        raise ConfigError("the live benchmark needs at least one request; the workload is empty")
    if max_tokens_cap is not None and max_tokens_cap < 1:
        raise ConfigError(f"max_tokens_cap={max_tokens_cap} must be >= 1 (or None for no cap)")
    out = []
    for req in workload:
        messages = req.messages or [{"role": "user", "content": to_text(req.prompt_token_ids)}]
        max_tokens = req.output_tokens if max_tokens_cap is None else min(req.output_tokens,
                                                                           max_tokens_cap)
        body: dict[str, Any] = {
            "model": model, "messages": messages, "max_tokens": max_tokens, "stream": stream,
            "temperature": 0.0,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        out.append(LiveRequest(req.request_id, req.arrival_s, json.dumps(body).encode(),
                               req.num_prompt_tokens, max_tokens, req.group, stream,
                               req.session_id))
    return out


_TEXT_FIELD: Final = re.compile(rb'"(?:content|text)"\s*:\s*"')
"""An event that may carry output text: every text event matches, so only these are decoded
beside ``[DONE]``, usage and error events (the role delta and empty deltas match too and are
decoded, then found empty)."""


@dataclass(slots=True)
class StreamReading:
    """What one streamed (SSE) response carried, timed from the request's start.

    ``ttft_s`` is the first chunk with output text; ``itl_s`` the gaps between later ones;
    ``error_event`` a chunk that carried an ``error`` object; ``done`` the ``[DONE]`` sentinel.

    Fed chunk by chunk with the time each arrived (``feed``, on the clock of ``started``, the
    request's start: ``time.perf_counter``), then ``close``d. Events are cut
    at blank lines on the bytes; an event of one ``data:`` line (what engines and routers
    send) is read without a general SSE decoder. The first carriage return (a CRLF stream)
    or multi-line event hands the rest of the stream to ``wire.sse.SSEDecoder``, which reads
    every form the SSE standard allows, so the figures never depend on the framing.
    """

    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_events: int = 0
    usage_completion_tokens: int | None = None
    error_event: bool = False
    done: bool = False
    started: float = 0.0
    _last: float | None = field(default=None, init=False, repr=False, compare=False)
    _pending: bytes = field(default=b"", init=False, repr=False, compare=False)
    _decoder: SSEDecoder | None = field(default=None, init=False, repr=False, compare=False)

    def feed(self, chunk: bytes, now: float) -> None:
        """Read the events ``chunk`` completes; ``now`` is when it arrived."""
        if self._decoder is None and b"\r" in chunk:
            self._decode(self._pending + chunk, now)
            return
        if self._decoder is not None:
            self._decode(chunk, now)
            return
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._pending = data
            return
        self._pending = data[cut + 2:]
        events = data[:cut].split(b"\n\n")
        for i, raw in enumerate(events):
            if raw.startswith(b"data:") and b"\n" not in raw:
                self._data(raw[5:].lstrip(b" "), now)
            else:  # another field, a comment or a multi-line event: decode the rest in full
                rest = b"\n\n".join(events[i:]) + b"\n\n" + self._pending
                self._pending = b""
                self._decode(rest, now)
                return

    def _decode(self, data: bytes, now: float) -> None:
        if self._decoder is None:
            self._decoder = SSEDecoder()
            self._pending = b""
        for decoded in self._decoder.feed(data):
            self._data(decoded.data.encode(), now)

    def close(self) -> None:
        """The body ended: an unterminated last event is dropped (half an event is not an
        event)."""
        self._pending = b""

    def _data(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        if (_TEXT_FIELD.search(payload) is None and b'"usage"' not in payload
                and b'"error"' not in payload):
            return
        try:
            doc = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            return
        if not isinstance(doc, dict):
            return
        if "error" in doc:
            self.error_event = True
        usage = doc.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_completion_tokens = usage["completion_tokens"]
        if not has_text(doc):
            return
        self.output_events += 1
        if self._last is None:
            self.ttft_s = now - self.started
        else:
            self.itl_s.append(now - self._last)
        self._last = now


async def read_stream(resp: aiohttp.ClientResponse, started: float) -> StreamReading:
    """Read an aiohttp streamed response to its end (``bench tiers-live``'s client)."""
    reading = StreamReading(started=started)
    async for chunk in resp.content.iter_any():
        reading.feed(chunk, time.perf_counter())
    reading.close()
    return reading


def has_text(payload: Any) -> bool:
    """True when a streamed chunk carries output text (chat ``delta.content`` or ``text``)."""
    if not isinstance(payload, dict):
        return False
    for choice in payload.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            return True
    return False


async def _one(
    client: EngineClient,
    url: str,
    req: LiveRequest,
    result: RequestResult,
    timeout_s: float,
    nodelay: list[bool | None],
) -> None:
    started = time.perf_counter()
    resp: EngineResponse | None = None
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.post(url, req.body, None if req.session_id is None
                                     else {"x-session-id": req.session_id})
            result.status = resp.status
            if not nodelay:
                nodelay.append(resp.tcp_nodelay)
            if resp.status != 200:
                await resp.read()
                result.error = f"http_{resp.status}"
                return
            if not req.stream:
                _read_whole(await resp.read(), result, started)
                return
            reading = StreamReading(started=started)
            while chunk := await resp.readany():
                reading.feed(chunk, time.perf_counter())
            reading.close()
            result.ttft_s = reading.ttft_s
            result.itl_s = reading.itl_s
            result.output_events = reading.output_events
            if reading.usage_completion_tokens is not None:
                result.usage_completion_tokens = reading.usage_completion_tokens
            result.e2e_s = time.perf_counter() - started
            if result.output_events == 0:
                result.error = "no_output"
            elif not reading.done:
                result.error = "no_done"
    except TimeoutError:
        result.error = "timeout"
    except ConnectFailed:
        result.error = "connect"
    except EngineClientError as exc:
        result.error = f"client:{type(exc).__name__}"
    finally:
        if resp is not None:
            resp.close()


def _read_whole(raw: bytes, result: RequestResult, started: float) -> None:
    """Record a non-streamed response: TTFT = E2E = now; OK when its choices carry text."""
    result.e2e_s = result.ttft_s = time.perf_counter() - started
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        result.error = "no_output"
        return
    choices = doc.get("choices") if isinstance(doc, dict) else None
    texts = [((c.get("message") or {}).get("content") or c.get("text"))
             for c in choices or () if isinstance(c, dict)]
    if not any(texts):
        result.error = "no_output"
        return
    result.output_events = 1
    usage = doc.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        result.usage_completion_tokens = usage["completion_tokens"]


async def run_client(
    targets: Sequence[str],
    requests: Sequence[LiveRequest],
    *,
    rate_scale: float = 1.0,
    concurrency: int | None = None,
    max_in_flight: int = 512,
    request_timeout_s: float = 60.0,
    duration_s: float = 300.0,
    on_done: Callable[[int], None] | None = None,
    control: ControlLane | None = None,
    on_start: Callable[[], None] | None = None,
) -> ClientRun:
    """Send ``requests`` once each and measure them (see the module docstring for bounds).

    Args:
        targets: base URLs; request *i* goes to ``targets[i % len(targets)]`` (one URL for a
            router; the engines' URLs for the ``direct`` baseline).
        requests: the stream, in arrival order.
        rate_scale: arrival-rate multiplier of the open loop.
        concurrency: closed loop with this many workers instead of the open loop.
        max_in_flight: open-loop cap on concurrent requests.
        request_timeout_s: bound on one request, start to last byte.
        duration_s: bound on the whole run.
        on_done: called with 1 after each request (progress bars).
        control: send one request in ``control.every`` straight to ``control.targets``
            instead (marked ``control`` in the results); each lane takes its targets round
            robin among its own requests.
        on_start: called once every request's result slot exists, before the first is
            sent (``bench soak`` freezes the collector's view of them there).

    Returns:
        Per-request results in ``requests`` order, the wall time, the TCP_NODELAY check.

    Raises:
        ConfigError: no targets, or a non-positive bound.
    """
    if not targets:
        raise ConfigError("run_client needs at least one target URL")
    for name, value in (("rate_scale", rate_scale), ("max_in_flight", max_in_flight),
                        ("request_timeout_s", request_timeout_s), ("duration_s", duration_s)):
        if not value > 0:
            raise ConfigError(f"{name}={value!r} must be > 0")
    if concurrency is not None and concurrency < 1:
        raise ConfigError(f"concurrency={concurrency} must be >= 1 (or None for open loop)")
    urls = _lane_urls(targets, control, len(requests))
    results = [RequestResult(r.request_id, control=control is not None and control.has(i))
               for i, r in enumerate(requests)]
    nodelay: list[bool | None] = []
    client = EngineClient(connect_timeout_s=request_timeout_s,
                          total_timeout_s=request_timeout_s)
    if on_start is not None:
        on_start()
    started = time.perf_counter()
    deadline = started + duration_s

    async def send(i: int, scheduled: float) -> None:
        res = results[i]
        now = time.perf_counter()
        res.start_s = now - started
        res.lag_s = max(0.0, now - scheduled)
        try:
            await _one(client, urls[i], requests[i], res, request_timeout_s, nodelay)
        finally:
            if on_done is not None:
                on_done(1)

    tasks: set[asyncio.Task[None]] = set()
    try:
        if concurrency is None:
            in_flight = 0

            async def tracked(i: int, scheduled: float) -> None:
                nonlocal in_flight
                in_flight += 1
                try:
                    await send(i, scheduled)
                finally:
                    in_flight -= 1

            for i, req in enumerate(requests):
                scheduled = started + req.arrival_s / rate_scale
                if scheduled >= deadline:
                    break
                delay = scheduled - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if in_flight >= max_in_flight:
                    results[i].error = "over_max_in_flight"
                    if on_done is not None:
                        on_done(1)
                    continue
                task = asyncio.create_task(tracked(i, scheduled))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        else:
            queue = iter(range(len(requests)))

            async def worker() -> None:
                for i in queue:
                    if time.perf_counter() >= deadline:
                        return
                    await send(i, time.perf_counter())

            for _ in range(min(concurrency, len(requests))):
                task = asyncio.create_task(worker())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        if tasks:
            _, pending = await asyncio.wait(set(tasks),
                                            timeout=max(0.0, deadline - time.perf_counter()))
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await client.close()
    wall = time.perf_counter() - started
    for res in results:
        if res.error is None and res.start_s is None:
            res.error = "not_sent"
        elif res.error is None and res.e2e_s is None:
            res.error = "deadline"
    return ClientRun(results, wall, nodelay[0] if nodelay else None)


def _lane_urls(targets: Sequence[str], control: ControlLane | None, count: int) -> list[str]:
    """Each request's URL: the targets round robin, and with a control lane, its requests
    round robin over the lane's targets (each lane counts only its own requests)."""
    path = "/v1/chat/completions"
    main = [t.rstrip("/") + path for t in targets]
    if control is None:
        return [main[i % len(main)] for i in range(count)]
    direct = [t.rstrip("/") + path for t in control.targets]
    out: list[str] = []
    sent = [0, 0]  # main lane, control lane
    for i in range(count):
        lane = 1 if control.has(i) else 0
        pool = direct if lane else main
        out.append(pool[sent[lane] % len(pool)])
        sent[lane] += 1
    return out


def replay(targets: Sequence[str], requests: Sequence[LiveRequest],
           **options: Any) -> ClientRun:
    """``run_client`` on an event loop of its own, uvloop's when it is installed.

    uvloop's loop spends less CPU per callback than asyncio's, and the client's share of the
    machine is taken from what it measures; every router is measured with the same client
    either way.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run_client(targets, requests, **options))
    return uvloop.run(run_client(targets, requests, **options))


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 3)


def meets_slo(result: RequestResult, ttft_slo_s: float, itl_slo_s: float) -> bool:
    """OK, first token within ``ttft_slo_s`` and mean gap between tokens within ``itl_slo_s``
    (an answer of one output event has no gap, so only its TTFT is judged): the same test
    as the simulator's ``RequestRecord.meets_slo``, so live and simulated SLO goodput compare."""
    if not result.ok or result.ttft_s is None or result.ttft_s > ttft_slo_s:
        return False
    return not result.itl_s or mean(result.itl_s, 0.0) <= itl_slo_s


def summarize(run: ClientRun, *, control: bool | None = None, ttft_slo_s: float = 2.0,
              itl_slo_s: float = 0.03) -> dict[str, Any]:
    """Client-side figures of one run (milliseconds, nearest-rank percentiles over OK requests).

    ``errors`` counts every non-OK request by kind; ``achieved_rps`` is OK requests over wall.
    ``itl_request_*`` summarise each OK request's own mean gap, ``slo_goodput_*`` count the
    requests that meet both objectives (:func:`meets_slo`), per second of wall time and as a
    fraction of every request, as ``kvroute bench sim`` reports them.
    ``control``: None summarizes every request; False only those sent to the target, True
    only the control lane's (``ControlLane``).
    """
    results = (run.results if control is None
               else [r for r in run.results if r.control == control])
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    lag = [r.lag_s for r in results if r.lag_s is not None]
    out: dict[str, Any] = {"requests": len(results), "completed": len(ok), "errors": errors}
    for name, values in (("ttft", ttft), ("e2e", e2e), ("itl", itl)):
        out[f"{name}_mean_ms"] = _ms(mean(values))
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = _ms(percentile(values, q))
    request_itl = [mean(r.itl_s, 0.0) for r in ok if r.itl_s]
    out["itl_request_mean_ms"] = _ms(mean(request_itl))
    out["itl_request_p99_ms"] = _ms(percentile(request_itl, 99))
    slo_good = sum(1 for r in results if meets_slo(r, ttft_slo_s, itl_slo_s))
    out["slo_goodput_rps"] = round(slo_good / run.wall_s, 3) if run.wall_s > 0 else None
    out["slo_goodput_fraction"] = round(slo_good / len(results), 4) if results else None
    out["start_lag_p99_ms"] = _ms(percentile(lag, 99))
    out["wall_s"] = round(run.wall_s, 3)
    out["achieved_rps"] = round(len(ok) / run.wall_s, 2) if run.wall_s > 0 else None
    out["tcp_nodelay"] = run.tcp_nodelay
    return out
