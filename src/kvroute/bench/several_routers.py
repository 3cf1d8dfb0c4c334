"""One router against several behind a round-robin front, on the same session workload.

Owns the run the "Several routers" question of docs/benchmarks.md and
``tests/integration/test_several_routers.py`` share: ``kvroute sim serve`` engines, N
``kvroute serve`` processes (sharing session records through Redis and, with ``cluster``,
their fresh placements and in-flight load through NATS), a front that spreads requests over
the routers, a bounded workload, and what the engines themselves say about it.

The front (``RoundRobinFront``) is a client-side balancer, what an L4 balancer or a client
library would do in front of the routers: each request goes to the next router in turn on a
fresh connection, and a refused connection (the router is down) is retried on the next one.
A request whose connection was accepted and then cut reached that router: it counts as
``cut``, not retried (it may have run).

The workload (``Workload``; deterministic for a seed):

* ``sessions`` conversations of ``turns`` turns each, run concurrently, each turn sent when the
  previous answer ended, with ``x-session-id``; a turn's prompt is the session's system prompt
  (``system_words`` words) and every user message so far (``turn_words`` each);
* before turns 1, 1 + ``burst_every``, ... of session 0 (not at the start, when every session's
  first turn arrives at once), a *sibling burst*: ``siblings`` requests that share
  a fresh ``burst_words``-word prefix, each sent to a different router, which land together
  when every sibling reports the same ``x-kvroute-replica``. How the later siblings are
  paced depends on the run:

  - *with the bus* (every router exports ``kvroute_cluster_info``), on what the routers say,
    not on a clock: once the first sibling's response headers arrive (it is placed: the
    router queues its ``Placed`` announcement before it calls the engine), the bench waits
    until that router's outbox is empty (``kvroute_cluster{stat="outbox"}`` 0), reads its
    last batch number ``S`` (``{stat="seq"}``), and sends each later sibling once that
    sibling's router has applied batch ``S`` or later from it
    (``kvroute_cluster_peer_seq{peer=...}``). A wait longer than ``pace_timeout_s`` sends
    the sibling anyway and is counted in ``RoutersResult.unpaced`` (so is a router that
    could not be read). What is measured is then whether an announcement that *arrived*
    is used, whatever the machine's speed: with a fixed gap (200 ms before), a router
    delayed longer on a loaded 2-core box (load average ~4 was enough once) placed a
    sibling blind;
  - *without the bus* (the control), ``burst_gap_s`` (200 ms) apart, as blind as they come:
    the prefix (5,000 tokens, 500 ms of prefill at the engines' 10k tokens/s) is long enough
    that no router learns of the first sibling from the engine's KV events before the last
    one arrives.

  Siblings that reach different routers before the first one is placed anywhere cannot be
  co-located by announcements; that case is not what this measures.

What is measured: the engines' prefix-cache hit rate (``vllm:prefix_cache_hits_total`` over
``..._queries_total``, read from every engine before and after: counted by the engines, not timed),
TTFT, ITL and E2E (client side, streamed), how many bursts landed together, and the count of
requests ok / failed / hung / cut.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import secrets
import signal
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.bench.live_routers import RouterSpec, RunningRouter, http_text, start_router
from kvroute.sim.launcher import ReplicaHandle
from kvroute.wire.prom import parse_vllm_metrics, wanted_samples

__all__ = [
    "ClusterReading",
    "RoundRobinFront",
    "RoutersResult",
    "Workload",
    "engine_prefix_counters",
    "kill_router",
    "read_cluster",
    "reset_prefix_caches",
    "run_workload",
    "start_routers",
]


@dataclass(frozen=True, slots=True)
class Workload:
    """The bounded session workload (module docstring)."""

    sessions: int = 16
    turns: int = 10
    system_words: int = 600
    turn_words: int = 40
    burst_every: int = 3
    siblings: int = 3
    burst_words: int = 5000
    burst_gap_s: float = 0.2
    """Between siblings without the bus (the control); with it they are paced on the bus."""
    pace_timeout_s: float = 10.0
    """With the bus, the longest wait for an announcement before a sibling is sent anyway."""
    max_tokens: int = 8
    timeout_s: float = 30.0
    seed: int = 0

    @property
    def num_bursts(self) -> int:
        return len(range(1, self.turns, max(1, self.burst_every)))

    @property
    def num_requests(self) -> int:
        return self.sessions * self.turns + self.num_bursts * self.siblings


@dataclass(slots=True)
class RoutersResult:
    """What one run measured."""

    routers: int
    ok: int = 0
    failed: int = 0
    hung: int = 0
    cut: int = 0
    refused_retried: int = 0
    bursts: int = 0
    bursts_together: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    hit_rate: float = 0.0
    queries: int = 0
    hits: int = 0
    wall_s: float = 0.0
    load_avg: tuple[float, float, float] = (0.0, 0.0, 0.0)
    errors: list[str] = field(default_factory=list)
    paced: bool = False
    """Later siblings were paced on the bus (every router exported its cluster stats)."""
    unpaced: int = 0
    """Later siblings sent without their router having applied the first one's placement
    (the wait timed out, or a router could not be read): ``unpaced_why`` says which."""
    unpaced_why: list[str] = field(default_factory=list)
    pace_wait_s: list[float] = field(default_factory=list)
    """Per later sibling paced on the bus, from the first one's response headers to its send."""
    burst_landings: list[list[str]] = field(default_factory=list)
    session_landings: dict[int, list[str]] = field(default_factory=dict)
    """Per session, each turn's ``replica:expected cached tokens``."""
    """Per burst, each sibling's ``replica:expected cached tokens`` (empty: it failed)."""

    def summary(self) -> dict[str, Any]:
        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs) if xs else 0.0

        def p99(xs: list[float]) -> float:
            return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else 0.0

        return {
            "routers": self.routers, "ok": self.ok, "failed": self.failed, "hung": self.hung,
            "cut": self.cut, "refused_retried": self.refused_retried,
            "bursts": self.bursts, "bursts_together": self.bursts_together,
            "hit_rate": round(self.hit_rate, 4), "queries": self.queries, "hits": self.hits,
            "ttft_ms": [round(mean(self.ttft_s) * 1e3, 1), round(p99(self.ttft_s) * 1e3, 1)],
            "itl_ms": [round(mean(self.itl_s) * 1e3, 2), round(p99(self.itl_s) * 1e3, 2)],
            "e2e_ms": [round(mean(self.e2e_s) * 1e3, 1), round(p99(self.e2e_s) * 1e3, 1)],
            "wall_s": round(self.wall_s, 1), "load_avg": self.load_avg,
            "errors": self.errors[:5], "paced": self.paced, "unpaced": self.unpaced,
            "unpaced_why": self.unpaced_why[:5],
            "pace_wait_ms": [round(mean(self.pace_wait_s) * 1e3, 1),
                             round(max(self.pace_wait_s, default=0.0) * 1e3, 1)],
            "burst_landings": self.burst_landings,
            "session_landings": self.session_landings,
        }


class RefusedEverywhere(RuntimeError):
    """Every router refused the connection."""


class RoundRobinFront:
    """Spreads requests over ``targets`` in turn; a refused connection goes to the next.

    Args:
        targets: the routers' base URLs.
        session: an ``aiohttp`` session whose connector does not keep connections alive
            (``force_close``), so a dead router is a refused connection, not a stale one.
    """

    def __init__(self, targets: Sequence[str], session: aiohttp.ClientSession) -> None:
        self.targets = list(targets)
        self.session = session
        self._next = 0
        self.refused_retried = 0

    def pick(self) -> int:
        i = self._next % len(self.targets)
        self._next += 1
        return i

    async def stream(self, body: dict[str, Any], headers: dict[str, str], *,
                     start: int | None = None, on_headers: Callable[[int], None] | None = None
                     ) -> tuple[int, str, list[float], bytes]:
        """POST ``body`` streamed to the router ``start`` (the next in turn when None),
        retrying refused connections on the others. Returns (status, ``replica:expected
        cached tokens`` from the routing headers, arrival times of the chunks, whole body).
        ``on_headers`` is called with the answering router's index once its response
        headers arrived."""
        first = self.pick() if start is None else start
        for k in range(len(self.targets)):
            index = (first + k) % len(self.targets)
            url = self.targets[index] + "/v1/chat/completions"
            try:
                async with self.session.post(url, json=body, headers=headers) as resp:
                    if on_headers is not None:
                        on_headers(index)
                    times: list[float] = []
                    raw = bytearray()
                    async for chunk in resp.content.iter_any():
                        times.append(time.perf_counter())
                        raw += chunk
                    where = (f'{resp.headers.get("x-kvroute-replica", "")}'
                             f':{resp.headers.get("x-kvroute-cached-tokens", "")}')
                    return resp.status, where, times, bytes(raw)
            except aiohttp.ClientConnectorError:
                self.refused_retried += 1
                continue
        raise RefusedEverywhere(f"all {len(self.targets)} routers refused the connection")


def engine_prefix_counters(engines: Sequence[ReplicaHandle]) -> tuple[int, int]:
    """(queries, hits) of the engines' prefix caches, summed over ``engines``."""
    queries = hits = 0
    for engine in engines:
        metrics = parse_vllm_metrics(http_text(engine.url + "/metrics"))
        queries += int(metrics.prefix_cache_queries_total or 0)
        hits += int(metrics.prefix_cache_hits_total or 0)
    return queries, hits


def reset_prefix_caches(engines: Sequence[ReplicaHandle]) -> None:
    """Empty every engine's prefix cache (``POST /reset_prefix_cache``), so runs start alike;
    the routers learn it from the engines' ``AllBlocksCleared`` events."""
    for engine in engines:
        req = urllib.request.Request(engine.url + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=5.0) as resp:  # loopback only
            resp.read()


def _words(rng: random.Random, n: int, tag: str) -> str:
    return " ".join(f"{tag}{rng.getrandbits(36):x}" for _ in range(n))


@dataclass(frozen=True, slots=True)
class ClusterReading:
    """What a router's ``/metrics`` says of its side of the cluster bus."""

    router_id: str
    seq: int
    """Its last batch published."""
    outbox: int
    """Its announcements not yet in a batch."""
    peer_seq: dict[str, int]
    """Per peer, the last batch applied from it."""


async def read_cluster(session: aiohttp.ClientSession, target: str) -> ClusterReading | None:
    """``target``'s cluster stats from its (open) ``/metrics``; None when it exports none
    (no ``cluster.bus``)."""
    async with session.get(target + "/metrics") as resp:
        resp.raise_for_status()
        text = await resp.text()
    samples, _ = wanted_samples(text, ("kvroute_cluster",))
    router_id = ""
    stats: dict[str, float] = {}
    peer_seq: dict[str, int] = {}
    for sample in samples:
        if sample.name == "kvroute_cluster_info":
            router_id = sample.labels.get("router_id", "")
        elif sample.name == "kvroute_cluster":
            stats[sample.labels.get("stat", "")] = sample.value
        elif sample.name == "kvroute_cluster_peer_seq":
            peer_seq[sample.labels.get("peer", "")] = int(sample.value)
    if not router_id or "seq" not in stats or "outbox" not in stats:
        return None
    return ClusterReading(router_id, int(stats["seq"]), int(stats["outbox"]), peer_seq)


class _Pacer:
    """Holds a burst's later siblings until their routers have applied the first one's
    placement (module docstring). Each wait is bounded by ``timeout_s``; a sibling sent
    without it is counted in ``result.unpaced`` with the reason."""

    POLL_S = 0.005

    def __init__(self, session: aiohttp.ClientSession, targets: Sequence[str],
                 result: RoutersResult, timeout_s: float) -> None:
        self.session = session
        self.targets = targets
        self.result = result
        self.timeout_s = timeout_s

    def unpaced(self, why: str) -> None:
        self.result.unpaced += 1
        self.result.unpaced_why.append(why)

    async def _read(self, router: int) -> ClusterReading | str:
        try:
            reading = await read_cluster(self.session, self.targets[router])
        except aiohttp.ClientError as exc:
            return f"router {router} unreadable: {type(exc).__name__}: {exc}"
        return reading if reading is not None else f"router {router} exports no cluster stats"

    async def _until(self, router: int, ready: Callable[[ClusterReading], bool],
                     late: str) -> ClusterReading | str:
        """``router``'s first reading for which ``ready`` holds, read every ``POLL_S``; or
        why not: it could not be read, or ``late`` once ``timeout_s`` has passed."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            reading = await self._read(router)
            if isinstance(reading, str) or ready(reading):
                return reading
            if time.monotonic() > deadline:
                return late
            await asyncio.sleep(self.POLL_S)

    async def announced(self, router: int) -> tuple[str, int] | str:
        """(id, last batch) of ``router`` once everything it announced went out, or why not
        within the bound."""
        reading = await self._until(
            router, lambda r: r.outbox == 0,
            f"router {router}'s outbox not empty after {self.timeout_s} s")
        return reading if isinstance(reading, str) else (reading.router_id, reading.seq)

    async def applied(self, router: int, peer: str, seq: int) -> str | None:
        """None once ``router`` has applied batch ``seq`` or later from ``peer``, or why not
        within the bound."""
        reading = await self._until(
            router, lambda r: r.peer_seq.get(peer, -1) >= seq,
            f"router {router} had not applied {peer}'s batch {seq} after {self.timeout_s} s")
        return reading if isinstance(reading, str) else None


async def _one(front: RoundRobinFront, result: RoutersResult, body: dict[str, Any],
               headers: dict[str, str], timeout_s: float, start: int | None = None,
               on_headers: Callable[[int], None] | None = None) -> str:
    sent = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            status, replica, times, raw = await front.stream(body, headers, start=start,
                                                             on_headers=on_headers)
    except TimeoutError:
        result.hung += 1
        return ""
    except RefusedEverywhere as exc:
        result.failed += 1
        result.errors.append(str(exc))
        return ""
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
            aiohttp.ClientPayloadError) as exc:
        result.cut += 1
        result.errors.append(f"cut: {type(exc).__name__}: {exc}")
        return ""
    whole = raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw
    if status != 200 or not whole:
        result.failed += 1
        result.errors.append(f"{status}: {raw[-200:]!r}")
        return ""
    result.ok += 1
    data_times = times
    if data_times:
        result.ttft_s.append(data_times[0] - sent)
        result.e2e_s.append(data_times[-1] - sent)
        result.itl_s += [b - a for a, b in itertools.pairwise(data_times)]
    return replica


async def run_workload(targets: Sequence[str], engines: Sequence[ReplicaHandle],
                       workload: Workload, *, model: str = "sim-model",
                       kill_after: int | None = None,
                       kill: Any = None) -> RoutersResult:
    """Run ``workload`` through a round-robin front over ``targets``.

    ``kill`` (called once, after ``kill_after`` requests have been answered) stops a router
    mid-run. Bursts are paced on the bus when every router in ``targets`` exports its
    cluster stats, else ``burst_gap_s`` apart (module docstring).
    """
    result = RoutersResult(routers=len(targets))
    rng = random.Random(workload.seed)
    reset_prefix_caches(engines)
    await asyncio.sleep(0.2)  # the AllBlocksCleared batches reach the routers
    q0, h0 = engine_prefix_counters(engines)
    answered = 0
    killed = asyncio.Event()

    def count() -> None:
        nonlocal answered
        answered += 1
        if kill is not None and kill_after is not None and answered >= kill_after \
                and not killed.is_set():
            killed.set()
            kill()

    def chat(messages: list[dict[str, str]]) -> dict[str, Any]:
        return {"model": model, "messages": messages, "max_tokens": workload.max_tokens,
                "stream": True}

    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector) as session:
        front = RoundRobinFront(targets, session)
        readings = [await read_cluster(session, target) for target in targets]
        result.paced = all(reading is not None for reading in readings)
        pacer = _Pacer(session, targets, result, workload.pace_timeout_s)
        systems = [_words(rng, workload.system_words, f"s{i}x") for i in range(workload.sessions)]
        turns = [[_words(rng, workload.turn_words, f"t{i}.{t}x") for t in range(workload.turns)]
                 for i in range(workload.sessions)]
        bursts = [(_words(rng, workload.burst_words, f"b{k}x"),
                   [_words(rng, 12, f"b{k}.{j}x") for j in range(workload.siblings)])
                  for k in range(workload.turns // max(1, workload.burst_every) + 1)]

        async def burst(k: int) -> None:
            prefix, tails = bursts[k]
            first = front.pick()

            async def sibling(j: int, on_headers: Callable[[int], None] | None = None) -> str:
                replica = await _one(front, result, chat([
                    {"role": "system", "content": prefix}, {"role": "user", "content": tails[j]}]),
                    {}, workload.timeout_s, start=(first + j) % len(targets),
                    on_headers=on_headers)
                count()
                return replica

            async def after_gap(j: int) -> str:
                await asyncio.sleep(j * workload.burst_gap_s)
                return await sibling(j)

            async def paced() -> list[str]:
                answered: list[int] = []  # the router that placed the first sibling
                placed = asyncio.Event()

                def headers_arrived(index: int) -> None:
                    answered.append(index)
                    placed.set()

                tasks = [asyncio.create_task(sibling(0, headers_arrived))]
                waiter = asyncio.create_task(placed.wait())
                await asyncio.wait([tasks[0], waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                headers_at = time.perf_counter()
                announced = (await pacer.announced(answered[0]) if answered
                             else "the first sibling got no response headers")
                for j in range(1, workload.siblings):
                    router = (first + j) % len(targets)
                    if isinstance(announced, str):
                        pacer.unpaced(announced)
                    elif router != answered[0]:  # the same router knows its own placement
                        why = await pacer.applied(router, *announced)
                        if why is not None:
                            pacer.unpaced(why)
                    if answered:
                        result.pace_wait_s.append(time.perf_counter() - headers_at)
                    tasks.append(asyncio.create_task(sibling(j)))
                return list(await asyncio.gather(*tasks))

            if result.paced:
                landed = await paced()
            else:
                landed = await asyncio.gather(*(after_gap(j) for j in range(workload.siblings)))
            result.bursts += 1
            result.burst_landings.append(landed)
            replicas = {where.split(":")[0] for where in landed}
            if all(landed) and len(replicas) == 1:
                result.bursts_together += 1

        async def conversation(i: int) -> None:
            messages = [{"role": "system", "content": systems[i]}]
            headers = {"x-session-id": f"bench-{workload.seed}-{i}"}
            for t in range(workload.turns):
                if i == 0 and t % max(1, workload.burst_every) == 1:
                    await burst(t // max(1, workload.burst_every))
                messages.append({"role": "user", "content": turns[i][t]})
                where = await _one(front, result, chat(messages), headers, workload.timeout_s)
                result.session_landings.setdefault(i, []).append(where)
                count()

        await asyncio.gather(*(conversation(i) for i in range(workload.sessions)))
        result.refused_retried = front.refused_retried
    result.wall_s = time.perf_counter() - started
    await asyncio.sleep(0.3)  # the engines' counters are read after their last request ends
    q1, h1 = engine_prefix_counters(engines)
    result.queries, result.hits = q1 - q0, h1 - h0
    result.hit_rate = result.hits / result.queries if result.queries else 0.0
    la = os.getloadavg()
    result.load_avg = (round(la[0], 2), round(la[1], 2), round(la[2], 2))
    return result


def start_routers(n: int, engines: Sequence[ReplicaHandle], *, work_dir: Path,
                  redis_url: str, nats_url: str | None, namespace: str,
                  model: str = "sim-model", extra: str = "",
                  policy_params: Mapping[str, float | int | bool] | None = None,
                  ) -> list[RunningRouter]:
    """``n`` ``kvroute serve`` processes in front of ``engines``: session records in Redis
    under ``namespace``; with ``nats_url``, sharing placements on subject ``namespace``.
    The routers share a cluster secret drawn for this call (written in their config files,
    which live in ``work_dir``: a benchmark's throwaway fleet). ``policy_params``: the
    policy's parameters when not its defaults (``live_routers.kvroute_yaml``)."""
    routers: list[RunningRouter] = []
    secret = json.dumps(secrets.token_hex(32))
    try:
        for i in range(n):
            lines = [(f"state: {{backend: redis, url: {json.dumps(redis_url)}, "
                      f"namespace: {namespace}}}")]
            if nats_url is not None:
                lines.append(f"cluster: {{bus: nats, url: {json.dumps(nats_url)}, "
                             f"subject: {namespace}, router_id: r{i}, heartbeat_s: 0.25, "
                             f"peer_expiry_s: 1.0, secret: {secret}}}")
            else:
                lines.append(f"cluster: {{secret: {secret}}}")
            routers.append(start_router(
                RouterSpec(f"{namespace}-r{i}", "kvroute", "kvroute"), engines,
                work_dir=work_dir, model=model, seed=i,
                kvroute_extra="\n".join(lines) + "\n" + extra, policy_params=policy_params))
    except BaseException:
        for router in routers:
            router.stop()
        raise
    return routers


def kill_router(router: RunningRouter) -> None:
    """SIGKILL ``router``'s process (no goodbye: its peers must expire it)."""
    if router.process is not None and router.process.poll() is None:
        os.kill(router.process.pid, signal.SIGKILL)
