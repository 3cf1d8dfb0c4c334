"""``kvroute bench soak``: does the router hold steady over a long run?

Owns the plan and the report of a long, steady run of ``kvroute serve`` in front of simulated
engines, watched from outside: the router's resident memory (``/proc/<pid>/status``), its CPU,
its prefix index and piece cache (``/metrics``), and the client's latency and errors, window
by window. A router in production runs for weeks; a map that grows with every session, prompt
or request id would show here as memory that keeps climbing, and a structure that gets slower
as it fills as latency that drifts up.

The traffic is built to reach every bound the router keeps within a few minutes, so that a
plateau can be told from slow growth:

* ``shared`` (half the requests): one of 64 system prompts and a question of its own, the
  prefix-reuse case;
* ``session`` (three in ten): multi-turn conversations, each under a new session id (the
  OpenAI ``user`` field, which kvroute reads as one), four turns each with the history
  growing; new sessions keep arriving, so the pin map and the tier-session map fill up to
  ``state.max_pins`` (set low here, ``max_pins``) and then evict;
* ``unique`` (one in five): a prompt nobody else sends, so the block-hash memo and the piece
  cache churn.

With ``long_sessions`` = *n* (off by default), *n* growing agentic sessions run beside that mix
at ``long_rate`` turns a second in all (``bench/overhead_long.py``: a system prompt, then a
~7.8 KB tool result a turn, to 128K real tokens; a finished session is followed by a new one),
so the per-session chains (``state.max_chain_tokens``) and the piece cache hold long prompts
while the short traffic churns; the engines' window is then 262,144 tokens, which needs
``num_gpu_blocks`` above 16,384. Their answers are summarized apart (``long_*`` in
``summary``): a 128K-token turn is not the short traffic's latency.

The engines run with ``num_gpu_blocks`` small enough that they evict within seconds, so the
index, which follows their events, has a steady size too.

Report: ``windows`` (one per ``sample_s``: requests finished in it, their p50/p99/max, errors
and the client's sending lag; the router's own p99 over them, its RSS, CPU per request, index
entries, piece-cache tokens, KV-event gaps, replays and resets, and garbage collections; the
engines' cores; ``soak_windows``) and
``summary`` (requests, completions and errors; the RSS at the first, middle and last sample
and its growth over the second half; the p99 of the first and last quarter of the run), and
``verdict`` (``soak_verdict``: the worst window's p99 over the median window's, against
issue #26's 3x, the router's own p99 the same way, and the RSS slope over the second half).
Each window also says what tells the router's own stalls from the machine's: the router's
CPU (cores), the time its threads waited for a CPU (``router_runq_ms``, from the kernel's
schedstat), how late its event loop woke (``router_loop_late_*``), the load average; the
engines' step lateness, collections and run-queue wait; the load generator's sending lag, its
own loop stalls, collections and run-queue wait; steal and iowait per CPU (``/proc/stat``);
and the client's p99 from the intended send time beside the one from the actual send, which
the verdict judges (the generator is open loop, so its lag is its own scheduling, never the
router's back-pressure). ``soak_verdict`` sets apart, as an explicit category, windows whose
excess the generator's own stall or steal covers (``machine_stall_ms``). The figures are
recorded in ``docs/benchmarks.md``.

Bounds: ``rate * seconds`` requests, open loop, at most 512 in flight, each at most
``request_timeout_s``; the run is cut at ``seconds + request_timeout_s + 30``. Loopback only;
ports picked at run time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import math
import os
import random
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

import aiohttp

from kvroute.bench.live_client import ClientRun, LiveRequest, run_client, summarize
from kvroute.bench.live_routers import RouterSpec, start_router
from kvroute.bench.overhead_long import (
    LONG_MAX_MODEL_LEN,
    LONG_TARGET_TOKENS,
    long_session_requests,
)
from kvroute.bench.procfs import (
    apparatus_cpus,
    cpu_wait_s,
    pin_process_tree,
    pinned_self,
    process_cpu_s,
    process_run_delay_s,
    process_tree_cpu_s,
    renice_process_tree,
    tree_cpus,
)
from kvroute.bench.router_time import Buckets, bucket_counts, phase_counts, quantile_ms
from kvroute.core.errors import ConfigError
from kvroute.core.stats import percentile
from kvroute.shell.heap import watch_gc_pauses
from kvroute.sim.launcher import ReplicaSpec, start_fleet
from kvroute.tokenize.hf import bundled_tokenizer_dir
from kvroute.wire.prom import parse_exposition

__all__ = ["MACHINE_WINDOWS_SHARE", "P99_RATIO_BOUND", "RSS_SLOPE_BOUND_MB_PER_MIN", "WARMUP_S",
           "SoakSpec", "machine_stall_ms", "read_rss_mb", "run_soak", "soak_requests",
           "soak_verdict", "soak_windows", "verdict_line"]

_SYSTEM_PROMPTS = 64
_SESSION_TURNS = 4
_ACTIVE_SESSIONS = 64
_OUTPUT_TOKENS = 8
_MAX_MODEL_LEN = 8192
"""The engines' window: the longest prompt here is a few thousand tokens, and an engine must
hold one full window in its ``num_gpu_blocks`` (as vLLM checks at start)."""
_BLOCK_SIZE = 16
_LONG_MAX_TARGET = LONG_MAX_MODEL_LEN // 2
_EVENT_COUNTERS = {f"kvroute_kv_event_{kind}_total": f"kv_{kind}"
                   for kind in ("gaps", "replays", "resets")}
"""The KV-event subscribers' troubles, summed over replicas: each is work (a replay) or lost
knowledge (a reset) that a steady run should not need."""
WARMUP_S: Final = 30.0
"""The soak's warm-up, fixed: windows that start in the first 30 s (three of 10 s) are
reported apart and not judged. Why: the router starts with empty caches (piece cache,
block-hash memo, prefix index) and the engines with empty KV caches, so its first windows
tokenize and hash every prompt in full and the collector runs on a young heap; that is a
restart's cost, not the steady state issue #26 bounds, and it is shown, not hidden."""
_CLIENT_GC = ("python", "freeze", "off")
_CLIENT_LOOPS = ("asyncio", "uvloop")
_HEARTBEAT_S: Final = 0.01
"""The load generator's loop is asked to wake this often (``_StallWatch``): a wake-up later
than that is the generator's own stall (its core given to others, its collector, its own
work in one turn), during which it neither sends nor timestamps answers."""
_STALL_SERIES = ("kvroute_sim_step_lateness_seconds", "kvroute_sim_gc_pause_seconds")
_LOOP_LAG = "kvroute_event_loop_lag_seconds"
_KINDS = ("shared",) * 5 + ("session",) * 3 + ("unique",) * 2
"""The kind of request *i* is ``_KINDS[i % 10]``: the mix is exact in every ten."""


@dataclass(frozen=True, slots=True)
class SoakSpec:
    """What to run. ``validate`` says what is wrong with a bad one."""

    seconds: float = 300.0
    rate: float = 200.0
    engines: int = 4
    sample_s: float = 10.0
    max_pins: int = 2000
    num_gpu_blocks: int = 4096
    seed: int = 0
    model: str = "sim-model"
    request_timeout_s: float = 30.0
    log_dir: Path | None = None
    policy: str = "kvroute"
    tokenizer: str = "auto"
    long_sessions: int = 0
    """Growing agentic sessions at once beside the mix (module docstring; 0: none)."""
    long_rate: float = 1.0
    """Turns a second of the long sessions, all of them together."""
    long_target_tokens: int = LONG_TARGET_TOKENS
    router_cpus: frozenset[int] | None = None
    """The router's own CPUs (its process and every thread it starts); the engines and the
    load generator get the others. None: every process shares every CPU."""
    warmup_s: float = WARMUP_S
    """Windows that start before this are warm-up: reported apart, not judged (``soak_verdict``;
    a run no longer than this has no judged window, and so fails)."""
    engine_nice: int = 0
    """Nice value given to the simulated engines (every thread): above 0, the load generator
    is served first when the two want the same core, as a deployment's load generator would
    never share the engines' core at all. On a machine shared with other jobs it starves the
    engines behind them too (``docs/benchmarks.md``: their steps up to 250 ms late)."""
    client_gc: str = "freeze"
    """The load generator's collector during the run: ``freeze`` (the default: ``gc.freeze``
    once the stream and its result slots are built, so that a full collection of the
    generator does not walk them: 1.1 million tracked objects for 30 minutes at 200 req/s,
    220 CPU-ms a full collection, measured in ``docs/benchmarks.md``), ``python`` (Python's
    collector as it is, the runs before 2026-12-02 08:50 UTC) or ``off`` (``gc.disable`` for
    the run, re-enabled after). The router's and engines' collectors are never touched."""
    client_loop: str = "asyncio"
    """The load generator's event loop: ``asyncio`` or ``uvloop``."""

    @property
    def max_model_len(self) -> int:
        return LONG_MAX_MODEL_LEN if self.long_sessions else _MAX_MODEL_LEN

    def validate(self) -> None:
        """Raises ``ConfigError`` naming the value and the fix."""
        checks = (
            (self.seconds > 0, f"seconds={self.seconds} must be > 0"),
            (self.rate > 0, f"rate={self.rate} must be > 0 requests a second"),
            (self.engines >= 1, f"engines={self.engines} must be >= 1"),
            (0 < self.sample_s <= self.seconds,
             f"sample_s={self.sample_s} must be > 0 and at most seconds={self.seconds}"),
            (self.max_pins >= 1, f"max_pins={self.max_pins} must be >= 1"),
            (self.num_gpu_blocks > self.max_model_len // _BLOCK_SIZE,
             (f"num_gpu_blocks={self.num_gpu_blocks} must be > "
              f"{self.max_model_len // _BLOCK_SIZE} (one window of {self.max_model_len} "
              f"tokens in blocks of {_BLOCK_SIZE}"
              + (", the window long sessions need)" if self.long_sessions else ")"))),
            (self.long_sessions >= 0, f"long_sessions={self.long_sessions} must be >= 0"),
            (self.long_rate > 0, f"long_rate={self.long_rate} must be > 0 turns a second"),
            (0 < self.long_target_tokens <= _LONG_MAX_TARGET,
             f"long_target_tokens={self.long_target_tokens} must be in 1..{_LONG_MAX_TARGET}"),
            (self.request_timeout_s > 0, f"request_timeout_s={self.request_timeout_s} must be > 0"),
            (self.warmup_s >= 0, f"warmup_s={self.warmup_s} must be >= 0 (0: judge all)"),
            (0 <= self.engine_nice <= 19,
             f"engine_nice={self.engine_nice} must be in 0..19 (0: as the load generator)"),
            (self.client_gc in _CLIENT_GC,
             f"client_gc={self.client_gc!r} must be one of {', '.join(_CLIENT_GC)}"),
            (self.client_loop in _CLIENT_LOOPS,
             f"client_loop={self.client_loop!r} must be one of {', '.join(_CLIENT_LOOPS)}"),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"soak: {message}")
        if self.router_cpus is not None:
            apparatus_cpus(self.router_cpus)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.getrandbits(24):06x}" for _ in range(n))


@dataclass(slots=True)
class _Session:
    user: str
    messages: list[dict[str, str]]
    turns: int = 0


def soak_requests(spec: SoakSpec) -> list[LiveRequest]:
    """The whole stream, ``rate * seconds`` requests at fixed spacing (module doc).

    Deterministic for a seed. Invariants: request *i* arrives at ``i / rate`` and is of kind
    ``_KINDS[i % 10]`` (its ``group``: ``shared-<g>``, ``session`` or ``unique``); a session
    has at most ``_SESSION_TURNS`` requests, each one's messages extending the previous one's.
    """
    spec.validate()
    rng = random.Random(spec.seed)
    systems = [_words(rng, 120) for _ in range(_SYSTEM_PROMPTS)]
    active: deque[_Session] = deque()
    started = 0
    out: list[LiveRequest] = []
    for i in range(int(spec.rate * spec.seconds)):
        kind = _KINDS[i % len(_KINDS)]
        extra: dict[str, Any] = {}
        if kind == "shared":
            g = rng.randrange(_SYSTEM_PROMPTS)
            messages = [{"role": "system", "content": systems[g]},
                        {"role": "user", "content": _words(rng, 12)}]
            group = f"shared-{g}"
        elif kind == "unique":
            messages = [{"role": "user", "content": _words(rng, 150)}]
            group = "unique"
        else:
            if len(active) < _ACTIVE_SESSIONS or rng.random() < 0.25:
                session = _Session(f"soak-{spec.seed}-{started}",
                                   [{"role": "user", "content": _words(rng, 60)}])
                started += 1
            else:
                session = active.popleft()
                session.messages += [{"role": "assistant", "content": _words(rng, 8)},
                                     {"role": "user", "content": _words(rng, 30)}]
            session.turns += 1
            if session.turns < _SESSION_TURNS:
                active.append(session)
            messages = list(session.messages)
            extra["user"] = session.user
            group = "session"
        body = {"model": spec.model, "messages": messages, "max_tokens": _OUTPUT_TOKENS,
                "stream": False, **extra}
        words = sum(len(m["content"].split()) for m in messages)
        out.append(LiveRequest(f"soak-{i}", i / spec.rate, json.dumps(body).encode(),
                               prompt_tokens=words, max_tokens=_OUTPUT_TOKENS, group=group,
                               stream=False))
    if spec.long_sessions:
        out = sorted(out + _long_requests(spec), key=lambda r: r.arrival_s)
    return out


def _long_requests(spec: SoakSpec) -> list[LiveRequest]:
    """The long sessions' turns over the run: batches of ``long_sessions`` sessions, each
    batch starting when the one before has sent its last turn, at ``long_rate`` in all."""
    out: list[LiveRequest] = []
    start, batch = 0.0, 0
    while start < spec.seconds:
        turns = long_session_requests(spec.long_sessions, model=spec.model,
                                      seed=spec.seed * 1000 + batch, rate=spec.long_rate,
                                      stream=False, max_tokens=_OUTPUT_TOKENS,
                                      target_tokens=spec.long_target_tokens,
                                      prefix=f"soak-long-{batch}")
        out += [replace(t, arrival_s=start + t.arrival_s) for t in turns
                if start + t.arrival_s < spec.seconds]
        start += len(turns) / spec.long_rate
        batch += 1
    return out


def read_rss_mb(pid: int) -> float | None:
    """Resident memory of process ``pid`` in MB (``VmRSS``), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


async def _scrape(http: aiohttp.ClientSession,
                  metrics_url: str) -> tuple[dict[str, float], Buckets, dict[str, float]]:
    """The gauges the soak follows, from the router's ``/metrics``, its own time's
    histogram (``router_time_seconds``, stage ``total``) and its event loop's lateness
    (``event_loop_lag_seconds``: cumulative buckets by ``le``, and ``sum``)."""
    async with http.get(metrics_url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        text = await resp.text()
    out: dict[str, float] = dict.fromkeys(_EVENT_COUNTERS.values(), 0.0)
    loop_lag: dict[str, float] = {}
    decisions = 0.0
    out["gc_full_s"] = out["gc_s"] = out["gc_over_50ms"] = 0.0
    for s in parse_exposition(text, names=("kvroute_index_", "kvroute_token_piece_cache",
                                           "kvroute_decisions_total", "kvroute_kv_event_",
                                           "kvroute_gc_pause_seconds",
                                           _LOOP_LAG)).samples:
        if s.name == _LOOP_LAG + "_bucket" and "le" in s.labels:
            loop_lag[s.labels["le"]] = s.value
        elif s.name == _LOOP_LAG + "_sum":
            loop_lag["sum"] = s.value
        elif s.name in ("kvroute_index_entries", "kvroute_index_hashes"):
            out[s.name.removeprefix("kvroute_")] = s.value
        elif s.name in _EVENT_COUNTERS:
            key = _EVENT_COUNTERS[s.name]
            out[key] = out.get(key, 0.0) + s.value
        elif s.name == "kvroute_token_piece_cache" and s.labels.get("stat") == "cached_tokens":
            out["piece_cache_tokens"] = out.get("piece_cache_tokens", 0.0) + s.value
        elif s.name == "kvroute_decisions_total":
            decisions += s.value
        elif s.name == "kvroute_gc_pause_seconds_sum":
            out["gc_s"] += s.value
            if s.labels.get("generation") == "2":
                out["gc_full_s"] = s.value
        elif s.name == "kvroute_gc_pause_seconds_count":
            out["gc_over_50ms"] += s.value
        elif s.name == "kvroute_gc_pause_seconds_bucket" and s.labels.get("le") == "0.05":
            out["gc_over_50ms"] -= s.value
    out["decisions"] = decisions
    return out, bucket_counts(text, "total"), loop_lag


class _StallWatch:
    """The load generator's own stalls since the last ``take``: the longest its event loop
    woke late for a ``_HEARTBEAT_S`` timer (``run``), and its collections (``on_gc``: their
    total and longest pause).

    Why: the client timestamps each answer when its loop reads it, so a stall of the
    client adds up to its length to every answer that arrives meanwhile and delays every
    send due meanwhile; this is that length, measured where it happens."""

    def __init__(self) -> None:
        self.late_max_s = 0.0
        self.gc_s = 0.0
        self.gc_max_s = 0.0

    async def run(self, done: asyncio.Event) -> None:
        clock = time.perf_counter
        while not done.is_set():
            asked = clock() + _HEARTBEAT_S
            await asyncio.sleep(_HEARTBEAT_S)
            late = clock() - asked
            self.late_max_s = max(self.late_max_s, late)

    def on_gc(self, _generation: int, seconds: float) -> None:
        """``watch_gc_pauses``'s callback: cheap, no allocation worth a collection."""
        self.gc_s += seconds
        self.gc_max_s = max(self.gc_max_s, seconds)

    def take(self) -> dict[str, float]:
        out = {"client_stall_max_s": self.late_max_s, "client_gc_s": self.gc_s,
               "client_gc_max_s": self.gc_max_s}
        self.late_max_s = self.gc_s = self.gc_max_s = 0.0
        return out


async def _scrape_engines(http: aiohttp.ClientSession,
                          urls: Sequence[str]) -> dict[str, dict[str, float]]:
    """The engines' stall histograms (``sim/stalls.py``), cumulative buckets by ``le``
    (and ``sum``), summed over engines: ``{"kvroute_sim_step_lateness_seconds": {...},
    "kvroute_sim_gc_pause_seconds": {...}}``."""
    out: dict[str, dict[str, float]] = {name: {} for name in _STALL_SERIES}
    for url in urls:
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            text = await resp.text()
        for smp in parse_exposition(text, names=_STALL_SERIES).samples:
            for name in _STALL_SERIES:
                if smp.name == name + "_bucket" and "le" in smp.labels:
                    key = smp.labels["le"]
                elif smp.name == name + "_sum":
                    key = "sum"
                else:
                    continue
                out[name][key] = out[name].get(key, 0.0) + smp.value
    return out


async def _soak(targets: Sequence[str], requests: Sequence[LiveRequest], spec: SoakSpec,
                pid: int, engine_pids: Sequence[int], engine_urls: Sequence[str],
                metrics_url: str, on_sample: Callable[[Mapping[str, Any]], None] | None,
                ) -> tuple[ClientRun, list[dict[str, Any]]]:
    """The client and, beside it on the same loop, a sample every ``sample_s`` and the
    client's own stall watch (``_StallWatch``)."""
    samples: list[dict[str, Any]] = []
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    started = loop.time()
    client_pid = os.getpid()
    watch = _StallWatch()

    own_before: list[Buckets] = []

    def read_proc() -> dict[str, Any]:
        return {"rss_mb": read_rss_mb(pid), "cpu_s": process_tree_cpu_s(pid),
                "runq_s": process_run_delay_s(pid), "load_1m": round(os.getloadavg()[0], 2),
                "engines_cpu_s": sum(process_tree_cpu_s(p) for p in engine_pids),
                "engines_runq_s": sum(process_run_delay_s(p) or 0.0 for p in engine_pids),
                "client_cpu_s": process_cpu_s(client_pid),
                "client_runq_s": process_run_delay_s(client_pid),
                "cpu_wait": cpu_wait_s()}

    async def sample(http: aiohttp.ClientSession) -> None:
        # The /proc reads walk every process on the machine (a process tree's CPU): 9 CPU-ms
        # and ~30 ms of wall a sample with 145 processes at load 20. On a thread, so the load
        # generator's loop, which times the answers, does not stop for them once a window.
        row: dict[str, Any] = {"t_s": loop.time() - started, **watch.take(),
                               **await asyncio.to_thread(read_proc)}
        try:
            gauges, own, loop_lag = await _scrape(http, metrics_url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            # A router too busy to answer /metrics within its timeout is a finding, not the
            # end of the run: the gauges of this sample are missing, and the next good
            # scrape's own p99 covers the answers since the last good one.
            row["scrape_error"] = f"{type(exc).__name__}: {exc}"[:200]
        else:
            row.update(gauges)
            if loop_lag:
                row["router_stalls"] = {_LOOP_LAG: loop_lag}
            if own_before:  # the router's own p99 over the answers since the last scrape
                row["own_p99_ms"] = _round(quantile_ms(phase_counts(own_before[-1], own),
                                                       0.99), 2)
            own_before[:] = [own]
        try:
            row["engine_stalls"] = await _scrape_engines(http, engine_urls)
        except (aiohttp.ClientError, TimeoutError) as exc:
            row["engine_scrape_error"] = f"{type(exc).__name__}: {exc}"[:200]
        samples.append(row)
        if on_sample is not None:
            on_sample(row)

    async def sampler() -> None:
        async with aiohttp.ClientSession() as http:
            while True:
                await sample(http)
                try:
                    await asyncio.wait_for(done.wait(), spec.sample_s)
                except TimeoutError:
                    continue
                await sample(http)
                return

    def client_started() -> None:
        # The windows place each answer by its end on the client's clock (from its first
        # send), so the samples' clock starts there too: a collection in ``_freeze`` before
        # it once put ~0.15 s between the two and left the first answers out of every window.
        nonlocal started
        if spec.client_gc == "freeze":
            _freeze()
        started = loop.time()

    stop_gc_watch = watch_gc_pauses(watch.on_gc)
    heartbeat = asyncio.create_task(watch.run(done))
    task = asyncio.create_task(sampler())
    try:
        run = await run_client(targets, requests, max_in_flight=512,
                               request_timeout_s=spec.request_timeout_s,
                               duration_s=spec.seconds + spec.request_timeout_s + 30.0,
                               on_start=client_started)
    finally:
        done.set()
        await task
        await heartbeat
        stop_gc_watch()
    return run, samples


def soak_windows(run: ClientRun, samples: Sequence[Mapping[str, Any]], *,
                 warmup_s: float = 0.0) -> list[dict[str, Any]]:
    """One row per sample after the first: the requests that finished since the sample
    before (count, req/s, p50/p99 of the whole answer in ms, errors), and the router's state
    at this sample (RSS, CPU per decision since the sample before, index, piece cache), with
    the router's own p99 over those answers (its code: no network hop, no engine time) and
    the cores the engines used meanwhile (they share the machine with the router), how late
    the client sent its requests (a stalled load generator shows there), and the router's
    garbage collections and KV-event gaps, replays and resets since the sample before (full
    collections in ms, all collections in ms, and how many of any kind took over 50 ms).
    Stall sources (module docstring): ``p99_intended_ms`` (from the intended send time:
    the lag plus the answer), ``lag_p99_ms``; ``client_*`` (the generator's longest loop stall
    and its collections, from the sample that closes the window; its run-queue wait and
    cores); ``steal_ms`` and ``iowait_ms`` per CPU; ``engines_runq_ms`` and the engines'
    ``engine_*`` histograms, ``router_loop_*`` the router's loop lag (``*_max_le_ms``: the
    bound of the bucket holding the worst, ``inf`` past the last; ``*_over_50ms``: how many
    over 50 ms). A figure a sample lacks is None, never made up. A window that starts before
    ``warmup_s`` is marked ``warmup`` (``soak_verdict`` reports it apart)."""
    ends: list[tuple[float, float | None, str | None, float | None]] = []
    lags: list[tuple[float, float]] = []
    for r in run.results:
        if r.start_s is None:
            continue
        end = r.start_s + (r.e2e_s or 0.0)
        intended = (r.e2e_s + (r.lag_s or 0.0)) if r.ok and r.e2e_s is not None else None
        ends.append((end, r.e2e_s if r.ok else None, r.error, intended))
        if r.lag_s is not None:
            lags.append((r.start_s, r.lag_s))
    rows = []
    last = len(samples) - 2
    for i, (before, now) in enumerate(itertools.pairwise(samples)):
        lo, hi = float(before["t_s"]), float(now["t_s"])
        # The last sample is taken once the client is done: whatever ended after the one
        # before belongs to the last window, whichever clock's rounding put it past the end.
        inside = [(e2e, err, from_intended) for end, e2e, err, from_intended in ends
                  if lo <= end and (end < hi or i == last)]
        e2e = [v for v, _, _ in inside if v is not None]
        e2e_intended = [v for _, _, v in inside if v is not None]
        errors = sum(1 for _, err, _ in inside if err is not None)
        late = [lag for start, lag in lags if lo <= start < hi]
        decided = _delta(before, now, "decisions")
        engines = _delta(before, now, "engines_cpu_s")
        cpu = _delta(before, now, "cpu_s")
        client = _delta(before, now, "client_cpu_s")
        late_steps = _hist_delta(before, now, _STALL_SERIES[0])
        engine_gc = _hist_delta(before, now, _STALL_SERIES[1])
        router_lag = _hist_delta(before, now, _LOOP_LAG, "router_stalls")
        rows.append({
            "t_s": round(hi, 2), "warmup": lo < warmup_s, "finished": len(inside),
            "rps": round(len(inside) / (hi - lo), 1) if hi > lo else None,
            "p50_ms": _ms(percentile(e2e, 50)), "p99_ms": _ms(percentile(e2e, 99)),
            "max_ms": _ms(max(e2e)) if e2e else None, "own_p99_ms": now.get("own_p99_ms"),
            "p99_intended_ms": _ms(percentile(e2e_intended, 99)),
            "start_lag_max_ms": _ms(max(late)) if late else None,
            "lag_p99_ms": _ms(percentile(late, 99)),
            "client_stall_max_ms": _ms(now.get("client_stall_max_s")),
            "client_gc_ms": _ms(now.get("client_gc_s")),
            "client_gc_max_ms": _ms(now.get("client_gc_max_s")),
            "client_runq_ms": _delta_ms(before, now, "client_runq_s"),
            "client_cores": (round(client / (hi - lo), 2)
                             if client is not None and hi > lo else None),
            "steal_ms": _cpu_wait_ms(before, now, "steal"),
            "iowait_ms": _cpu_wait_ms(before, now, "iowait"),
            "errors": errors, "rss_mb": _round(now.get("rss_mb"), 1),
            "cpu_ms_per_decision": (round(1e3 * cpu / decided, 3)
                                    if cpu is not None and decided else None),
            "router_cores": round(cpu / (hi - lo), 2) if cpu is not None and hi > lo else None,
            "router_runq_ms": _delta_ms(before, now, "runq_s"),
            "router_loop_late_max_le_ms": _max_le_ms(router_lag),
            "router_loop_late_over_50ms": _over(router_lag, "0.05"),
            "load_1m": now.get("load_1m"),
            "engines_cores": (round(engines / (hi - lo), 2)
                              if engines is not None and hi > lo else None),
            "engines_runq_ms": _delta_ms(before, now, "engines_runq_s"),
            "engine_steps_late_over_50ms": _over(late_steps, "0.05"),
            "engine_late_max_le_ms": _max_le_ms(late_steps),
            "engine_gc_ms": (None if engine_gc is None
                             else round(1e3 * engine_gc.get("sum", 0.0), 1)),
            "engine_gc_over_50ms": _over(engine_gc, "0.05"),
            "gc_full_ms": _delta_ms(before, now, "gc_full_s"),
            "gc_ms": _delta_ms(before, now, "gc_s"),
            "gc_over_50ms": _delta(before, now, "gc_over_50ms"),
            "index_entries": now.get("index_entries"),
            **{key: _delta(before, now, key) for key in _EVENT_COUNTERS.values()},
            "piece_cache_tokens": now.get("piece_cache_tokens"),
        })
    return rows


P99_RATIO_BOUND: Final = 3.0
"""Issue #26's bound: no window's p99 more than this times the median window's."""
RSS_SLOPE_BOUND_MB_PER_MIN: Final = 0.5
"""Flat memory: the RSS over the second half of the run, fitted by least squares, grows by at
most this much a minute (30 MB an hour; a map that grows with every request at 200 req/s
grows faster than that by a wide margin)."""


MACHINE_WINDOWS_SHARE: Final = 0.05
"""At most this share of the judged windows (at least one) may be set apart as the machine's
(``machine_stall_ms``) for the p99 bound to be judged at all; beyond it the verdict is
``inconclusive``: the machine stalled too often for the run to say anything of the router."""


def machine_stall_ms(window: Mapping[str, Any]) -> float | None:
    """The longest the machine itself may have stopped the measurement in ``window``, in ms:
    the load generator's own longest stall (``client_stall_max_ms``: how late its loop woke,
    which covers its core given to others, its collector and its own work) or the CPU time
    the hypervisor stole from any one CPU in the window (``steal_ms``: a bound on any stall it
    caused, since the window's steal on a CPU is at least as long as its longest one), the
    larger; None when the window has neither figure.

    Why these and not the engines' or the router's: while the generator is stalled it
    neither sends nor timestamps answers, so each answer it reads meanwhile is measured late
    by up to the stall's length, and steal stops every process on the stolen CPU; neither
    is what a user of the router would feel. The engines' and the router's own stalls are
    what they would feel, and are never set apart."""
    parts = [float(window["client_stall_max_ms"])] if window.get("client_stall_max_ms") \
        is not None else []
    steal = window.get("steal_ms")
    if steal:
        parts.append(max(float(v) for v in steal.values()))
    return round(max(parts), 2) if parts else None


def soak_verdict(windows: Sequence[Mapping[str, Any]], samples: Sequence[Mapping[str, Any]],
                 *, ratio_bound: float = P99_RATIO_BOUND,
                 rss_slope_bound: float = RSS_SLOPE_BOUND_MB_PER_MIN,
                 machine_share: float = MACHINE_WINDOWS_SHARE) -> dict[str, Any]:
    """Judge a run: the worst window's p99 over the median window's, and the RSS slope.

    Windows marked ``warmup`` (``soak_windows``: those that start in the fixed warm-up) are
    not judged, and are reported apart against the same median: ``warmup_windows`` (how
    many), ``warmup_worst_p99_ms`` and its time and ratio, and ``warmup_over_bound``.

    ``p99_ratio`` is the worst judged window's client p99 over the median of the judged
    windows' p99s (windows with no answer are left out); ``own_ratio`` the same for the
    router's own p99 (its code, measured in process: what the router causes, apart from the
    network, the engines and the client). ``over_bound`` lists every judged window above
    ``ratio_bound`` times the median with what tells the router's own time from the
    machine's: its own p99, the time the router's threads waited for a CPU
    (``router_runq_ms``, against ``median_window_runq_ms`` of the judged windows), the load
    average, the client's sending lag and own stall, steal, the engines' step lateness and
    collections, and the router's collections.

    **The machine's windows, an explicit category.** Each window over the bound has a
    ``category``: ``machine`` when its p99 less ``machine_stall_ms`` (the generator's own
    longest stall, or the most CPU time stolen from one CPU) is within the bound, so the
    excess may be the measurement's and not the router's or the engines'; ``system``
    otherwise. ``machine_windows`` counts the first kind and ``system_p99_ratio`` is the
    worst of the other judged windows over the median (the median is of every judged
    window). ``p99_result`` is ``ok`` when ``system_p99_ratio`` is within the bound and at
    most ``machine_windows_allowed`` (``machine_share`` of the judged windows, at least one)
    are the machine's; ``inconclusive`` when only the machine's windows exceed and there
    are more of them; ``fail`` otherwise. Nothing is dropped: the machine's windows stay in
    ``over_bound`` and in ``p99_ratio``.

    ``rss_slope_mb_per_min`` is the least-squares slope of the RSS samples taken in the
    second half of the run (at least two; None otherwise). ``ok`` needs ``p99_result`` ok
    and the slope within its bound; anything missing is not ok.
    """
    judged = [w for w in windows if not w.get("warmup")]
    warm = [w for w in windows if w.get("warmup")]

    def ratio(rows: Sequence[Mapping[str, Any]], key: str,
              median: float | None = None) -> tuple[float | None, float | None, float | None,
                                                     float | None]:
        timed = [(float(w["t_s"]), float(w[key])) for w in rows if w.get(key) is not None]
        if not timed:
            return median, None, None, None
        if median is None:
            median = round(statistics.median(v for _, v in timed), 2)
        worst_t, worst = max(timed, key=lambda tv: tv[1])
        return (median, worst, worst_t,
                round(worst / median, 2) if median > 0 else None)

    def category(w: Mapping[str, Any], median: float) -> str:
        stall = machine_stall_ms(w)
        return ("machine" if stall is not None
                and float(w["p99_ms"]) - stall <= ratio_bound * median else "system")

    def over_bound(rows: Sequence[Mapping[str, Any]],
                   median: float | None) -> list[dict[str, Any]]:
        if median is None:
            return []
        return [{**{k: w.get(k) for k in _OVER_BOUND_KEYS},
                 "machine_stall_ms": machine_stall_ms(w), "category": category(w, median)}
                for w in rows
                if w.get("p99_ms") is not None and float(w["p99_ms"]) > ratio_bound * median]

    median, worst, worst_t, p99_ratio = ratio(judged, "p99_ms")
    own_median, own_worst, own_worst_t, own_ratio = ratio(judged, "own_p99_ms")
    _, warm_worst, warm_worst_t, warm_ratio = ratio(warm, "p99_ms", median)
    over = over_bound(judged, median)
    machine_t = {w["t_s"] for w in over if w["category"] == "machine"}
    _, system_worst, system_worst_t, system_ratio = ratio(
        [w for w in judged if w["t_s"] not in machine_t], "p99_ms", median)
    allowed = max(1, int(machine_share * len(judged)))
    if system_ratio is None or system_ratio > ratio_bound:
        p99_result = "fail"
    elif len(machine_t) > allowed:
        p99_result = "inconclusive"
    else:
        p99_result = "ok"
    runq = [float(w["router_runq_ms"]) for w in judged if w.get("router_runq_ms") is not None]
    rss = [(float(s["t_s"]), float(s["rss_mb"])) for s in samples if s.get("rss_mb") is not None]
    half = [(t, mb) for t, mb in rss if rss and t >= rss[-1][0] / 2]
    slope = None
    if len(half) >= 2 and half[-1][0] > half[0][0]:
        fit = statistics.linear_regression([t / 60.0 for t, _ in half], [mb for _, mb in half])
        slope = round(fit.slope, 3)
    p99_ok = p99_result == "ok"
    rss_ok = slope is not None and slope <= rss_slope_bound
    return {
        "median_window_p99_ms": median, "worst_window_p99_ms": worst,
        "worst_window_t_s": worst_t, "p99_ratio": p99_ratio,
        "own_median_window_p99_ms": own_median, "own_worst_window_p99_ms": own_worst,
        "own_worst_window_t_s": own_worst_t, "own_ratio": own_ratio,
        "ratio_bound": ratio_bound, "over_bound": over,
        "machine_windows": len(machine_t), "machine_windows_allowed": allowed,
        "system_worst_window_p99_ms": system_worst, "system_worst_window_t_s": system_worst_t,
        "system_p99_ratio": system_ratio, "p99_result": p99_result,
        "median_window_runq_ms": round(statistics.median(runq), 1) if runq else None,
        "judged_windows": len(judged), "warmup_windows": len(warm),
        "warmup_worst_p99_ms": warm_worst, "warmup_worst_t_s": warm_worst_t,
        "warmup_ratio": warm_ratio, "warmup_over_bound": over_bound(warm, median),
        "rss_slope_mb_per_min": slope, "rss_slope_bound_mb_per_min": rss_slope_bound,
        "rss_second_half_mb": ([half[0][1], half[-1][1]] if half else None),
        "p99_ok": p99_ok, "rss_ok": rss_ok, "ok": p99_ok and rss_ok,
    }


_OVER_BOUND_KEYS: Final = (
    "t_s", "p99_ms", "p99_intended_ms", "own_p99_ms", "router_runq_ms",
    "router_loop_late_max_le_ms", "load_1m",
    "start_lag_max_ms", "client_stall_max_ms", "client_gc_max_ms", "steal_ms",
    "engine_late_max_le_ms", "engine_steps_late_over_50ms", "engine_gc_ms", "engines_runq_ms",
    "gc_ms", "gc_full_ms", "router_cores")
"""What ``soak_verdict`` lists of each window over the bound (``soak_windows``' keys)."""


_P99_WORDS: Final = {"ok": "ok", "fail": "FAIL", "inconclusive": "INCONCLUSIVE (the machine)"}


def verdict_line(verdict: Mapping[str, Any]) -> str:
    """``soak_verdict`` in one line, for the terminal."""
    def word(ok: bool) -> str:
        return "ok" if ok else "FAIL"

    def windows(rows: Sequence[Mapping[str, Any]]) -> str:
        return ", ".join(f"{w['t_s']:g} s ({w['p99_ms']} ms, own {w['own_p99_ms']}, "
                         f"run queue {w['router_runq_ms']} ms, load {w['load_1m']}, "
                         f"machine stall {w.get('machine_stall_ms')} ms, engine step late "
                         f"<= {w.get('engine_late_max_le_ms')} ms: {w.get('category')})"
                         for w in rows)

    over = windows(verdict["over_bound"])
    warm = ""
    if verdict.get("warmup_windows"):
        warm_over = windows(verdict["warmup_over_bound"])
        warm = (f"; warm-up ({verdict['warmup_windows']} windows, not judged): worst "
                f"{verdict['warmup_worst_p99_ms']} ms at {verdict['warmup_worst_t_s']:g} s = "
                f"{verdict['warmup_ratio']}x" + (f", over the bound: {warm_over}"
                                                 if warm_over else ""))
    return (f"verdict over {verdict.get('judged_windows')} windows: worst window p99 "
            f"{verdict['worst_window_p99_ms']} ms at "
            f"{verdict['worst_window_t_s']} s / median window {verdict['median_window_p99_ms']} "
            f"ms = {verdict['p99_ratio']}x (bound {verdict['ratio_bound']:g}x); the machine's "
            f"windows {verdict.get('machine_windows')} (allowed "
            f"{verdict.get('machine_windows_allowed')}), the others' worst "
            f"{verdict.get('system_worst_window_p99_ms')} ms = "
            f"{verdict.get('system_p99_ratio')}x: {_P99_WORDS[verdict['p99_result']]}; "
            f"router's own p99 {verdict['own_worst_window_p99_ms']} / "
            f"{verdict['own_median_window_p99_ms']} ms = {verdict['own_ratio']}x; RSS slope over "
            f"the second half {verdict['rss_slope_mb_per_min']} MB/min (bound "
            f"{verdict['rss_slope_bound_mb_per_min']:g}): {word(verdict['rss_ok'])}"
            + (f"; over the bound (median window's run queue "
               f"{verdict.get('median_window_runq_ms')} ms): {over}" if over else "") + warm)


def _cpu_wait_ms(before: Mapping[str, Any], now: Mapping[str, Any],
                 kind: str) -> dict[str, float] | None:
    """Per CPU, the ms of ``kind`` (``steal`` or ``iowait``, ``procfs.cpu_wait_s``) between
    two samples; None where a sample has no ``cpu_wait``."""
    a, b = before.get("cpu_wait"), now.get("cpu_wait")
    if not a or not b:
        return None
    return {cpu: round(1e3 * (b[cpu][kind] - a[cpu][kind]), 1) for cpu in b if cpu in a}


def _hist_delta(before: Mapping[str, Any], now: Mapping[str, Any], name: str,
                group: str = "engine_stalls") -> dict[str, float] | None:
    """What histogram ``name`` of a sample's ``group`` (``engine_stalls``, summed over the
    engines, or ``router_stalls``; cumulative buckets by ``le``, and ``sum``) gained between
    two samples; None where either sample lacks it."""
    a = (before.get(group) or {}).get(name)
    b = (now.get(group) or {}).get(name)
    if not a or not b:
        return None
    return {key: b[key] - a.get(key, 0.0) for key in b}


def _over(hist: Mapping[str, float] | None, le: str) -> float | None:
    """Observations above bound ``le`` in a histogram delta (``_hist_delta``)."""
    if hist is None or "+Inf" not in hist or le not in hist:
        return None
    return hist["+Inf"] - hist[le]


def _max_le_ms(hist: Mapping[str, float] | None) -> float | None:
    """The upper bound, in ms, of the bucket holding the largest observation of a histogram
    delta (the largest was at most this); ``inf`` past the last bound, None when empty."""
    if hist is None or not hist.get("+Inf"):
        return None
    total = hist["+Inf"]
    bounds = sorted(float(le) for le in hist if le not in ("+Inf", "sum"))
    for bound in bounds:
        if hist[_le_key(hist, bound)] >= total:
            return round(bound * 1e3, 1)
    return math.inf


def _le_key(hist: Mapping[str, float], bound: float) -> str:
    return next(le for le in hist if le not in ("+Inf", "sum") and float(le) == bound)


def _delta(before: Mapping[str, Any], now: Mapping[str, Any], key: str) -> float | None:
    """A counter's growth between two samples (None where the router does not export it)."""
    if now.get(key) is None or before.get(key) is None:
        return None
    return float(now[key]) - float(before[key])


def _delta_ms(before: Mapping[str, Any], now: Mapping[str, Any], key: str) -> float | None:
    seconds = _delta(before, now, key)
    return None if seconds is None else round(seconds * 1e3, 1)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 2)


def _round(value: Any, digits: int) -> float | None:
    return None if value is None else round(float(value), digits)


def _summary(run: ClientRun, samples: Sequence[Mapping[str, Any]],
             spec: SoakSpec) -> dict[str, Any]:
    counts = summarize(run)
    timed = [(r.start_s, r.e2e_s) for r in run.results
             if r.ok and r.start_s is not None and r.e2e_s is not None]
    quarter = spec.seconds / 4

    def p99_between(lo: float, hi: float) -> float | None:
        return _ms(percentile([e2e for start, e2e in timed if lo <= start < hi], 99))

    long = summarize(ClientRun([r for r in run.results if r.request_id.startswith("soak-long-")],
                               run.wall_s, run.tcp_nodelay))
    rss = [float(s["rss_mb"]) for s in samples if s.get("rss_mb") is not None]
    mid = rss[len(rss) // 2] if rss else None
    last = rss[-1] if rss else None
    return {
        "requests": counts["requests"], "completed": counts["completed"],
        "errors": counts["errors"],
        "wall_s": round(run.wall_s, 1),
        "p99_first_quarter_ms": p99_between(0.0, quarter),
        "p99_last_quarter_ms": p99_between(spec.seconds - quarter, spec.seconds),
        "rss_first_mb": _round(rss[0], 1) if rss else None,
        "rss_mid_mb": _round(mid, 1), "rss_last_mb": _round(last, 1),
        "rss_max_mb": _round(max(rss), 1) if rss else None,
        "rss_growth_second_half_mb": (round(last - mid, 1)
                                      if last is not None and mid is not None else None),
        "long_requests": long["requests"], "long_completed": long["completed"],
        "long_p50_ms": long["e2e_p50_ms"], "long_p99_ms": long["e2e_p99_ms"],
    }


def _freeze() -> None:
    """Move everything the load generator holds now (the stream, every request's result
    slot) out of its collector's walks (``SoakSpec.client_gc`` ``freeze``)."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def _client_collector(mode: str) -> Iterator[None]:
    """The load generator's collector for the run (``SoakSpec.client_gc``), restored after
    (``freeze`` itself happens in ``run_client``'s ``on_start``: ``_freeze``)."""
    if mode == "freeze":
        try:
            yield
        finally:
            gc.unfreeze()
    elif mode == "off":
        was = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if was:
                gc.enable()
    else:  # "python"
        yield


def run_soak(spec: SoakSpec,
             on_sample: Callable[[Mapping[str, Any]], None] | None = None) -> dict[str, Any]:
    """Start the engines and one kvroute router, run the stream, return the report
    (``{"windows", "samples", "summary", "config"}``; module doc)."""
    spec.validate()
    requests = soak_requests(spec)
    tokenizer = str(bundled_tokenizer_dir())
    engines = [ReplicaSpec(name=f"e{i}", model=spec.model, profile="zero",
                           num_gpu_blocks=spec.num_gpu_blocks, block_size=_BLOCK_SIZE,
                           max_model_len=spec.max_model_len,
                           extra_args=("--tokenizer", tokenizer)) for i in range(spec.engines)]
    router_spec = RouterSpec(f"kvroute-{spec.tokenizer}", "kvroute", spec.policy,
                             spec.tokenizer)
    extra = f"state: {{backend: memory, max_pins: {spec.max_pins}}}\n"
    apparatus = None if spec.router_cpus is None else apparatus_cpus(spec.router_cpus)
    # The engines and the router start from this process and inherit its CPUs; the router is
    # then moved to its own (every thread it has; those it starts later inherit them).
    with tempfile.TemporaryDirectory(prefix="kvroute-soak-") as tmp, pinned_self(apparatus):
        work_dir = spec.log_dir or Path(tmp)
        with start_fleet(engines, log_dir=work_dir / "engines") as fleet, \
                start_router(router_spec, fleet.replicas, work_dir=work_dir, model=spec.model,
                             seed=spec.seed, kvroute_extra=extra) as router:
            assert router.pid is not None
            if spec.router_cpus is not None:
                pin_process_tree(router.pid, spec.router_cpus)
            engine_pids = [e.pid for e in fleet.replicas if e.pid is not None]
            if spec.engine_nice:
                for engine_pid in engine_pids:
                    renice_process_tree(engine_pid, spec.engine_nice)
            placement = {"router_cpus": tree_cpus([router.pid]),
                         "apparatus_cpus": sorted(os.sched_getaffinity(0)),
                         "engine_cpus": tree_cpus(engine_pids),
                         "pinned": spec.router_cpus is not None}
            soak = _soak(router.targets, requests, spec, router.pid, engine_pids,
                         [e.url for e in fleet.replicas], router.targets[0] + "/metrics",
                         on_sample)
            began = time.monotonic()
            with _client_collector(spec.client_gc):
                if spec.client_loop == "uvloop":
                    import uvloop
                    run, samples = uvloop.run(soak)
                else:
                    run, samples = asyncio.run(soak)
            elapsed = time.monotonic() - began
    windows = soak_windows(run, samples, warmup_s=spec.warmup_s)
    return {
        "windows": windows,
        "verdict": soak_verdict(windows, samples),
        "samples": samples,
        "summary": _summary(run, samples, spec),
        "config": {"seconds": spec.seconds, "rate": spec.rate, "engines": spec.engines,
                   "sample_s": spec.sample_s, "max_pins": spec.max_pins,
                   "num_gpu_blocks": spec.num_gpu_blocks, "seed": spec.seed,
                   "policy": spec.policy, "tokenizer": spec.tokenizer,
                   "mix": {"shared": 0.5, "session": 0.3, "unique": 0.2},
                   "long_sessions": spec.long_sessions, "long_rate": spec.long_rate,
                   "long_target_tokens": spec.long_target_tokens,
                   "max_model_len": spec.max_model_len, "warmup_s": spec.warmup_s,
                   "engine_nice": spec.engine_nice, "client_gc": spec.client_gc,
                   "client_loop": spec.client_loop,
                   "latency_from": "actual send time (lag apart; p99_intended_ms from the "
                                   "intended one)",
                   "cpus": placement,
                   "elapsed_s": round(elapsed, 1), "date": time.strftime("%Y-%m-%d")},
    }
