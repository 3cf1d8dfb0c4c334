"""``kvroute bench tiers-live``: context-window tiers with real processes on loopback.

The live counterpart of ``bench/tiers_bench.py`` (virtual time). The same growing agent
sessions (``bench.workloads.growing_sessions(with_messages=True)``: closed-loop turns whose
prompt grows across the small pool's window) are sent, once per mode, through a real
``kvroute serve`` process in front of real ``kvroute sim serve`` engines:

* a **small** pool (fast profile, e.g. ``llama-3.1-8b-h100``, window 4,096 by default) and a
  **large** pool (slow profile, e.g. ``llama-3.1-70b-h100-tp4``, window 16,384), both with
  KV events wired to the router and ``tokenizer: engine``;
* one more large engine, the **cold probe**, that the router never sees: after each mode,
  every escalated turn's exact messages are sent to it once, with a fresh ``cache_salt`` and
  ``max_tokens: 1``, one at a time, so its TTFT is a cold prefill of that prompt on an idle
  large engine, measured in the same run on the same machine.

Modes (the router's config differs only in these two switches):

* ``reactive`` — ``routes.<name>.proactive: false`` and warm-ahead off: every turn goes to
  the small pool (or the one its session already escalated to) and only the small engine's
  overflow rejection escalates it (one doomed round trip per crossing);
* ``proactive`` — the estimate chooses the pool before sending; warm-ahead off;
* ``proactive+warm`` — as proactive, plus warm-ahead of the large pool.

Every engine's prefix cache is reset between modes (``POST /reset_prefix_cache``) and the
router is restarted, so no mode inherits another's cache or state.

Repeats (``repeats``): the small pool's p99 differs between modes by a few milliseconds on a
hundred-odd samples, where p99 is about the maximum, so one run cannot tell a 5% change from
the machine's noise (two cores shared by the engines, the router and the client). With
``repeats > 1`` the modes run interleaved, in order and then reversed (ABC, CBA, ABC, ...), so
a slow spell of the machine falls on every mode alike; each repeat is a *pair* (proactive vs
proactive+warm in the same repeat, minutes apart at most), and the small-p99 target is judged
on the **median of the paired ratios**, which one outlier cannot move. The escalated-turn
target is judged on the worst turn of every repeat. ``modes`` pools every repeat's turns.

Measured per mode (and repeat), on the client: every turn's TTFT (request written → first
SSE event with text) and its pool (``x-kvroute-pool``); failed turns (non-200, stream error,
timeout); the escalated turn of each session (its first turn answered by the large pool)
against the cold probe of the same prompt; small-pool TTFT p50/p99. From the router's
``/metrics``: doomed attempts (``kvroute_upstream_errors_total{kind="overflow"}``),
escalations by kind, warm-ups fired/completed/failed/skipped. CPU seconds per process group
during the mode (the router, the small engines, the large engines, this client), read from
``/proc`` where it exists: what competes for the two cores when warm-ahead is on.
``targets`` (shared with the virtual-time bench) checks the issue's goals and reports the
numbers whatever they are.

Bounds: the workload is a fixed list; each request has ``request_timeout_s``; each mode has
``duration_s`` (turns not sent by then are ``not_sent``, running ones are cancelled and
``deadline``); processes are started with deadlines and always stopped. Loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp

from kvroute.bench.live import reset_engine_caches
from kvroute.bench.live_client import read_stream
from kvroute.bench.processes import kvroute_command, log_tail, stop_process
from kvroute.bench.procfs import process_cpu_s
from kvroute.bench.provenance import git_sha
from kvroute.bench.tiers_bench import MODES, SMALL_P99_TOLERANCE, targets
from kvroute.bench.workloads import growing_sessions
from kvroute.core.errors import ConfigError, RouterError
from kvroute.core.stats import mean, percentile
from kvroute.sim.launcher import Fleet, ReplicaHandle, ReplicaSpec, read_ready_line, start_fleet
from kvroute.sim.profiles import get_profile
from kvroute.sim.workload import WorkloadRequest

__all__ = [
    "LiveTurn",
    "TiersLiveSpec",
    "format_repeats",
    "format_table",
    "live_mode_metrics",
    "live_targets",
    "mode_order",
    "paired",
    "run_tiers_live",
]

ROUTE: Final = "agent"
SMALL_MODEL: Final = "sim-small"
LARGE_MODEL: Final = "sim-large"


class LiveBenchError(RouterError):
    """The router did not come up (it exited, or was not ready in time); the message says which."""


@dataclass(frozen=True, slots=True)
class TiersLiveSpec:
    """What to run. Defaults: a run of a few minutes on a laptop-class machine.

    Attributes:
        sessions: growing sessions (each ends with its first turn over ``small_window``).
        small_window / large_window: the pools' ``max_model_len``.
        small_profile / large_profile: timing profiles (``sim.profiles``).
        replicas_small / replicas_large: engines per pool (plus one cold-probe engine).
        think_time_s: pause between a turn's last token and the session's next turn.
        session_interval_s: gap between session starts.
        system_prompt_tokens / user_tokens / output_tokens: the sessions' shape
            (``output_tokens`` is also each turn's ``max_tokens``).
        seed: the workload's seed (and the router policy's).
        warm_fraction / warm_rewarm_fraction: warm-ahead trigger and re-warm growth.
        warm_per_replica: ``warm_ahead.max_in_flight_per_replica`` (None: the router's
            default).
        warm_chunk_tokens: ``warm_ahead.chunk_tokens`` (None: the router's default; 0: each
            warm-up is one request).
        repeats: runs of every mode, interleaved (module docstring).
        modes: which of ``MODES`` to run, in order.
        request_timeout_s: per request.
        duration_s: per mode (the closed loop's deadline).
        log_dir: keep router configs and logs here (a temporary directory when None).
    """

    sessions: int = 8
    small_window: int = 4096
    large_window: int = 16_384
    small_profile: str = "llama-3.1-8b-h100"
    large_profile: str = "llama-3.1-70b-h100-tp4"
    replicas_small: int = 2
    replicas_large: int = 1
    think_time_s: float = 1.0
    session_interval_s: float = 0.5
    system_prompt_tokens: int = 512
    user_tokens: int = 256
    output_tokens: int = 64
    seed: int = 0
    warm_fraction: float = 0.6
    warm_rewarm_fraction: float = 0.1
    warm_per_replica: int | None = None
    warm_chunk_tokens: int | None = None
    repeats: int = 1
    modes: tuple[str, ...] = MODES
    request_timeout_s: float = 60.0
    duration_s: float = 300.0
    log_dir: Path | None = None

    def validate(self) -> None:
        """Raises ``ConfigError`` naming the bad field and the fix."""
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ConfigError(f"modes must be some of {', '.join(MODES)}, got {list(self.modes)}")
        if self.large_window <= self.small_window:
            raise ConfigError(
                f"large_window ({self.large_window}) must be larger than small_window "
                f"({self.small_window}): the large pool is where sessions escalate to")
        for name in ("sessions", "replicas_small", "replicas_large", "output_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "duration_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 < self.warm_fraction < 1:
            raise ConfigError(f"warm_fraction must be in (0, 1), got {self.warm_fraction}")
        if self.warm_per_replica is not None and self.warm_per_replica < 1:
            raise ConfigError(f"warm_per_replica must be >= 1, got {self.warm_per_replica}; "
                              "leave it unset for the router's default")
        if self.warm_chunk_tokens is not None and self.warm_chunk_tokens < 0:
            raise ConfigError(f"warm_chunk_tokens must be >= 0, got {self.warm_chunk_tokens}; "
                              "0 sends each warm-up as one request, unset is the router's "
                              "default")
        get_profile(self.small_profile)
        get_profile(self.large_profile)


@dataclass(slots=True)
class LiveTurn:
    """One turn as the client saw it (times in seconds; ``start_s`` from the mode's start).

    ``error`` is None when OK, else ``http_<status>``, ``no_output``, ``no_done``,
    ``timeout``, ``deadline``, ``not_sent``, ``connect`` or ``client:<Exception>``.
    """

    request_id: str
    session: str
    turn: int
    prompt_tokens: int
    pool: str | None = None
    status: int | None = None
    error: str | None = None
    start_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    cold_ttft_s: float | None = None
    escalated: bool = False
    repeat: int = 0


# -- processes ---------------------------------------------------------------------------------


def _blocks(window: int, block_size: int, sessions: int) -> int:
    """KV blocks that hold every session's longest prompt at once (no eviction noise)."""
    return (window // block_size + 2) * (sessions + 2)


def _fleet_specs(spec: TiersLiveSpec) -> list[ReplicaSpec]:
    small, large = get_profile(spec.small_profile), get_profile(spec.large_profile)
    small_blocks = max(small.num_gpu_blocks, _blocks(spec.small_window, small.block_size,
                                                     spec.sessions))
    large_blocks = max(large.num_gpu_blocks, _blocks(spec.large_window, large.block_size,
                                                     spec.sessions))
    out = [ReplicaSpec(name=f"s{i}", pool="small", model=SMALL_MODEL, profile=small.name,
                       max_model_len=spec.small_window, num_gpu_blocks=small_blocks)
           for i in range(spec.replicas_small)]
    out += [ReplicaSpec(name=f"l{i}", pool="large", model=LARGE_MODEL, profile=large.name,
                        max_model_len=spec.large_window, num_gpu_blocks=large_blocks)
            for i in range(spec.replicas_large)]
    out.append(ReplicaSpec(name="cold", pool="cold", model=LARGE_MODEL, profile=large.name,
                           max_model_len=spec.large_window, num_gpu_blocks=large_blocks,
                           replay=False))
    return out


def router_yaml(spec: TiersLiveSpec, mode: str, small: Sequence[ReplicaHandle],
                large: Sequence[ReplicaHandle]) -> str:
    """The ``kvroute serve`` config of one mode (module docstring): free port, events wired."""

    def replicas(handles: Sequence[ReplicaHandle], rate: float) -> list[dict[str, Any]]:
        out = []
        for r in handles:
            entry: dict[str, Any] = {"name": r.name, "url": r.url, "prefill_rate_tps": rate}
            if r.kv_events:
                entry["kv_events"] = r.kv_events
                if r.kv_replay:
                    entry["kv_replay"] = r.kv_replay
            out.append(entry)
        return out

    small_rate = 1.0 / get_profile(spec.small_profile).timing.prefill_token_s
    large_rate = 1.0 / get_profile(spec.large_profile).timing.prefill_token_s
    doc = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {
            "small": {"model": SMALL_MODEL, "tokenizer": "engine",
                      "replicas": replicas(small, small_rate)},
            "large": {"model": LARGE_MODEL, "tokenizer": "engine",
                      "replicas": replicas(large, large_rate)},
        },
        "routes": {ROUTE: {"pools": ["small", "large"], "proactive": mode != "reactive"}},
        "policy": {"name": "kvroute", "seed": spec.seed},
        "warm_ahead": {"enabled": mode == "proactive+warm", "fraction": spec.warm_fraction,
                       "rewarm_fraction": spec.warm_rewarm_fraction, "cooldown_s": 300,
                       "timeout_s": spec.request_timeout_s,
                       **({} if spec.warm_per_replica is None
                          else {"max_in_flight_per_replica": spec.warm_per_replica}),
                       **({} if spec.warm_chunk_tokens is None
                          else {"chunk_tokens": spec.warm_chunk_tokens})},
        "admission": {"max_in_flight": 4096, "max_queue": 4096, "queue_timeout_s": 60},
        "discovery": {"health_interval_s": 1.0, "metrics_interval_s": 1.0,
                      "models_interval_s": 30},
        "timeouts": {"connect_s": 2.0, "first_byte_s": spec.request_timeout_s,
                     "total_s": spec.request_timeout_s},
        "log_level": "info",
        "log_format": "kv",
    }
    return json.dumps(doc, indent=2) + "\n"  # JSON is YAML


@dataclass(slots=True)
class _Router:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log_tail(self, limit: int = 3000) -> str:
        return log_tail(self.log_path, limit)

    def stop(self, grace_s: float = 10.0) -> None:
        stop_process(self.process, grace_s)
        if self.process.stdout is not None:
            self.process.stdout.close()


def _start_router(config_path: Path, log_path: Path, timeout_s: float = 60.0) -> _Router:
    """``kvroute serve -c config_path``; returns once it printed its ready line.

    Raises:
        LiveBenchError: it exited or was not ready within ``timeout_s`` (it is stopped).
    """
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            kvroute_command("serve", "-c", str(config_path)),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file,
            start_new_session=True)
    router = _Router(proc, "", log_path)
    deadline = time.monotonic() + timeout_s
    try:
        info = read_ready_line(proc, deadline)
        if info is None and proc.poll() is None and time.monotonic() >= deadline:
            raise LiveBenchError(f"kvroute serve was not ready within {timeout_s:g} s; "
                                 f"its log ends with:\n{router.log_tail()}")
        if info is None:
            raise LiveBenchError(f"kvroute serve exited with code {proc.wait(5)} during start-up; "
                                 f"its log ends with:\n{router.log_tail()}")
        router.url = str(info["url"])
    except BaseException:
        router.stop()
        raise
    return router


# -- the client ----------------------------------------------------------------------------------


async def _send(session: aiohttp.ClientSession, url: str, body: Mapping[str, Any],
                headers: Mapping[str, str], turn: LiveTurn, timeout_s: float) -> None:
    """One streamed chat request; fills ``turn`` (status, pool, TTFT, E2E, error)."""
    started = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            turn.status = resp.status
            turn.pool = resp.headers.get("x-kvroute-pool")
            if resp.status != 200:
                await resp.read()
                turn.error = f"http_{resp.status}"
                return
            reading = await read_stream(resp, started)
            if reading.error_event:
                turn.error = "stream_error"
            turn.ttft_s = reading.ttft_s
            done = reading.done
            turn.e2e_s = time.perf_counter() - started
            if turn.error is None and turn.ttft_s is None:
                turn.error = "no_output"
            elif turn.error is None and not done:
                turn.error = "no_done"
    except TimeoutError:
        turn.error = "timeout"
    except aiohttp.ClientConnectorError:
        turn.error = "connect"
    except aiohttp.ClientError as exc:
        turn.error = f"client:{type(exc).__name__}"


def _body(request: WorkloadRequest, model: str, max_tokens: int,
          cache_salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": request.messages,
                            "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
                            "ignore_eos": True}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


async def _run_sessions(url: str, workload: Sequence[WorkloadRequest], spec: TiersLiveSpec,
                        on_turn: Callable[[], None] | None) -> tuple[list[LiveTurn], float]:
    """The closed loop: each session's turn ``k+1`` is sent ``think_time_s`` after turn
    ``k`` finished; sessions start ``arrival_s`` apart. Returns the turns and wall time."""
    by_session: dict[str, list[WorkloadRequest]] = {}
    for req in workload:
        by_session.setdefault(req.session_id or req.request_id, []).append(req)
    turns = {req.request_id: LiveTurn(req.request_id, req.session_id or "", req.turn or 0,
                                      req.num_prompt_tokens) for req in workload}
    t0 = time.perf_counter()
    deadline = t0 + spec.duration_s

    async def session_loop(http: aiohttp.ClientSession, reqs: list[WorkloadRequest]) -> None:
        release = t0 + reqs[0].arrival_s
        for req in sorted(reqs, key=lambda r: r.turn or 0):
            if req.depends_on is not None:  # closed loop: after the previous turn + think
                release = time.perf_counter() + (req.think_time_s or 0.0)
            await asyncio.sleep(max(0.0, release - time.perf_counter()))
            turn = turns[req.request_id]
            if time.perf_counter() >= deadline:
                turn.error = "not_sent"
                continue
            turn.start_s = time.perf_counter() - t0
            left = max(0.1, min(spec.request_timeout_s, deadline - time.perf_counter()))
            headers = {"x-session-id": turn.session}
            await _send(http, url, _body(req, ROUTE, req.output_tokens), headers, turn, left)
            if on_turn is not None:
                on_turn()

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        tasks = [asyncio.create_task(session_loop(http, reqs)) for reqs in by_session.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), spec.duration_s + 5.0)
        except TimeoutError:
            for turn in turns.values():
                if turn.start_s is not None and turn.status is None and turn.error is None:
                    turn.error = "deadline"
                elif turn.start_s is None and turn.error is None:
                    turn.error = "not_sent"
    return list(turns.values()), time.perf_counter() - t0


async def _cold_probes(cold_url: str, escalated: Sequence[tuple[LiveTurn, WorkloadRequest]],
                       timeout_s: float) -> None:
    """Each escalated prompt once on the idle cold engine, fresh salt, one at a time."""
    async with aiohttp.ClientSession() as http:
        for turn, req in escalated:
            probe = LiveTurn(req.request_id, turn.session, turn.turn, turn.prompt_tokens)
            salt = f"cold-{uuid.uuid4().hex}"
            await _send(http, cold_url, _body(req, LARGE_MODEL, 1, cache_salt=salt), {},
                        probe, timeout_s)
            if probe.error is None:
                turn.cold_ttft_s = probe.ttft_s


async def _scrape(url: str) -> dict[str, float]:
    """The router's counters that the report uses, summed over labels of interest."""
    async with aiohttp.ClientSession() as http, http.get(
            url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        text = await resp.text()
    out: defaultdict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name, _, labels = name_labels.partition("{")
        val = float(value)
        if name == "kvroute_upstream_errors_total" and 'kind="overflow"' in labels:
            out["doomed_attempts"] += val
        elif name == "kvroute_escalations_total":
            kind = _label(labels, "kind")
            out[f"escalations_{kind}"] += val
            out["escalations"] += val
        elif name == "kvroute_warm_total":
            outcome, reason = _label(labels, "outcome"), _label(labels, "reason")
            out[f"warm_{outcome}"] += val
            if outcome == "skipped":
                out[f"warm_skipped:{reason}"] += val
        elif name == "kvroute_cut_short_total":
            out["cut_short"] += val
    return dict(out)


def _label(labels: str, key: str) -> str:
    marker = f'{key}="'
    start = labels.find(marker)
    if start < 0:
        return ""
    start += len(marker)
    return labels[start:labels.find('"', start)]


# -- metrics --------------------------------------------------------------------------------------


def live_mode_metrics(turns: Sequence[LiveTurn], router: Mapping[str, float]) -> dict[str, Any]:
    """One mode's figures, with the keys ``tiers_bench.targets`` reads.

    Args:
        turns: every turn of the mode (escalated ones with ``cold_ttft_s`` filled in).
        router: the router's counters (``_scrape``).
    """
    ok = [t for t in turns if t.error is None]
    escalated = [(t.ttft_s, t.cold_ttft_s) for t in turns if t.escalated and t.ttft_s is not None]
    esc_ttfts = [ttft for ttft, _ in escalated]
    colds = [cold for _, cold in escalated if cold]
    ratios = [ttft / cold for ttft, cold in escalated if cold]
    small = [t.ttft_s for t in ok if t.pool == "small" and t.ttft_s is not None]
    large = [t.ttft_s for t in ok if t.pool == "large" and t.ttft_s is not None]
    errors = Counter(t.error for t in turns if t.error is not None)
    return {
        "requests": len(turns),
        "completed": len(ok),
        "failed": len(turns) - len(ok),
        "errors": dict(sorted(errors.items())),
        "doomed_attempts": int(router.get("doomed_attempts", 0)),
        "escalations": int(router.get("escalations", 0)),
        "escalations_proactive": int(router.get("escalations_proactive", 0)),
        "escalations_reactive": int(router.get("escalations_reactive", 0)),
        "escalated_turns": len(escalated),
        "escalated_ttft_mean_s": mean(esc_ttfts, 0.0),
        "escalated_ttft_max_s": max(esc_ttfts, default=0.0),
        "cold_ttft_mean_s": mean(colds, 0.0),
        "escalated_to_cold_mean": mean(ratios, 0.0),
        "escalated_to_cold_max": max(ratios, default=0.0),
        "small_ttft_p50_s": percentile(small, 50, 0.0),
        "small_ttft_p99_s": percentile(small, 99, 0.0),
        "large_ttft_p50_s": percentile(large, 50, 0.0),
        "large_ttft_p99_s": percentile(large, 99, 0.0),
        "requests_small": sum(1 for t in ok if t.pool == "small"),
        "requests_large": sum(1 for t in ok if t.pool == "large"),
        "warms_fired": int(router.get("warm_fired", 0)),
        "warms_completed": int(router.get("warm_completed", 0)),
        "warms_failed": int(router.get("warm_failed", 0)),
        "warm_chunks": int(router.get("warm_chunk", 0)),
        "warm_skips": {k.split(":", 1)[1]: int(v) for k, v in sorted(router.items())
                       if k.startswith("warm_skipped:")},
        "cut_short": int(router.get("cut_short", 0)),
    }


def format_table(report: Mapping[str, Any]) -> list[list[str]]:
    """Rows of the printed table: one per mode."""
    rows = [["mode", "failed", "doomed", "escal.", "esc. TTFT", "cold TTFT", "esc/cold mean/max",
             "small p50", "small p99", "warms", "done"]]
    for mode, m in report["modes"].items():
        rows.append([
            mode, str(m["failed"]), str(m["doomed_attempts"]), str(m["escalations"]),
            f"{m['escalated_ttft_mean_s']:.3f}s", f"{m['cold_ttft_mean_s']:.3f}s",
            f"{m['escalated_to_cold_mean']:.2f}/{m['escalated_to_cold_max']:.2f}",
            f"{m['small_ttft_p50_s']:.3f}s", f"{m['small_ttft_p99_s']:.3f}s",
            str(m["warms_fired"]), f"{m['completed']}/{m['requests']}",
        ])
    return rows


# -- the run --------------------------------------------------------------------------------------


def mode_order(modes: Sequence[str], repeat: int) -> list[str]:
    """The modes of repeat ``repeat`` (0-based): as given on even repeats, reversed on odd."""
    return list(modes) if repeat % 2 == 0 else list(reversed(modes))


def _group_cpu_s(handles: Sequence[ReplicaHandle]) -> float | None:
    values = [process_cpu_s(h.pid) for h in handles]
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else round(after - before, 3)


def paired(repeats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-repeat pairs of ``proactive`` and ``proactive+warm`` (module docstring).

    Returns the small pool's p99 ratio (warm / proactive) of every repeat that ran both,
    their median, and the worst escalated turn (escalated / cold) of every repeat's warm
    mode, with the maximum.
    """
    ratios: list[float] = []
    worst: list[float] = []
    for rep in repeats:
        modes = rep["modes"]
        warm, cold = modes.get("proactive+warm"), modes.get("proactive")
        if warm is not None:
            worst.append(warm["escalated_to_cold_max"])
        if warm is not None and cold is not None and cold["small_ttft_p99_s"] > 0:
            ratios.append(warm["small_ttft_p99_s"] / cold["small_ttft_p99_s"])
    return {
        "small_p99_ratio": ratios,
        "small_p99_ratio_median": statistics.median(ratios) if ratios else None,
        "escalated_to_cold_max": worst,
        "escalated_to_cold_max_max": max(worst, default=None),
    }


def live_targets(modes: dict[str, dict[str, Any]], pairs: Mapping[str, Any],
                 repeats: int) -> dict[str, Any]:
    """``tiers_bench.targets`` on the pooled modes; with several repeats the small-p99 goal
    is judged on the median paired ratio and the escalated goal on every repeat's worst."""
    out = targets(modes)
    if repeats > 1 and pairs["small_p99_ratio_median"] is not None:
        change = pairs["small_p99_ratio_median"] - 1.0
        out["small_p99_with_warm"] = {
            "target_max_change": SMALL_P99_TOLERANCE, "measured_change": change,
            "per_repeat_change": [r - 1.0 for r in pairs["small_p99_ratio"]],
            "pooled_change": out["small_p99_with_warm"]["measured_change"],
            "statistic": f"median of {len(pairs['small_p99_ratio'])} paired ratios",
            "met": change <= SMALL_P99_TOLERANCE}
    return out


def format_repeats(report: Mapping[str, Any]) -> list[list[str]]:
    """Rows of the per-repeat table: order, small p99 per mode, the paired ratio, worst
    escalated turn, router CPU per mode."""
    modes = report["config"]["modes"]
    rows = [["repeat", "order", *(f"small p99 {m}" for m in modes), "warm/proactive p99",
             "esc/cold max", *(f"router CPU {m}" for m in modes)]]
    pairs = report["paired"]["small_p99_ratio"]
    for i, rep in enumerate(report["repeats"]):
        ms = rep["modes"]
        ratio = (f"{pairs[i]:.3f}" if i < len(pairs) and "proactive" in ms
                 and "proactive+warm" in ms else "-")
        warm = ms.get("proactive+warm")
        rows.append([
            str(i), ",".join(rep["order"]),
            *(f"{ms[m]['small_ttft_p99_s'] * 1e3:.1f} ms" for m in modes), ratio,
            f"{warm['escalated_to_cold_max']:.2f}" if warm else "-",
            *(_fmt_cpu(ms[m]["cpu_s"].get("router")) for m in modes),
        ])
    return rows


def _fmt_cpu(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def run_tiers_live(
    spec: TiersLiveSpec,
    *,
    on_mode_start: Callable[[str, int], None] | None = None,
    on_turn: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Start the fleet, run every mode ``repeats`` times (module docstring), stop
    everything; the JSON report.

    Shape: ``{"modes": {MODE: {...pooled}}, "repeats": [{"order": [...], "modes": {MODE:
    {...}}}, ...], "paired": {...}, "targets": {...}, "config": {...}, "turns": {MODE:
    [LiveTurn as dict, ...]}}``.

    Raises:
        ConfigError: an invalid spec.
        LiveBenchError / FleetStartError: a process did not come up (it was stopped).
        RouterError: an engine would not reset its prefix cache between modes.
    """
    spec.validate()
    workload = growing_sessions(
        num_sessions=spec.sessions, window_tokens=spec.small_window,
        system_prompt_tokens=spec.system_prompt_tokens, user_tokens=spec.user_tokens,
        output_tokens=spec.output_tokens, think_time_s=spec.think_time_s,
        session_interval_s=spec.session_interval_s, seed=spec.seed, with_messages=True)
    by_id = {req.request_id: req for req in workload}
    repeats: list[dict[str, Any]] = []
    pooled_turns: dict[str, list[LiveTurn]] = {m: [] for m in spec.modes}
    pooled_counters: dict[str, Counter[str]] = {m: Counter() for m in spec.modes}
    wall: dict[str, list[float]] = {m: [] for m in spec.modes}
    with contextlib.ExitStack() as stack:
        if spec.log_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-tl-")))
        else:
            work = spec.log_dir
            work.mkdir(parents=True, exist_ok=True)
        fleet: Fleet = start_fleet(_fleet_specs(spec), timeout_s=60.0, log_dir=work / "engines")
        stack.callback(fleet.stop)
        small, large, cold = fleet.by_pool("small"), fleet.by_pool("large"), fleet.by_pool("cold")
        for repeat in range(spec.repeats):
            order = mode_order(spec.modes, repeat)
            rep_modes: dict[str, dict[str, Any]] = {}
            for mode in order:
                if on_mode_start is not None:
                    on_mode_start(mode if spec.repeats == 1 else f"{mode} (repeat {repeat})",
                                  len(workload))
                turns, counters, cpu, wall_s = _run_mode(spec, mode, repeat, workload, work,
                                                         small, large, cold, on_turn)
                escalated: list[tuple[LiveTurn, WorkloadRequest]] = []
                seen: set[str] = set()
                for turn in sorted(turns, key=lambda t: (t.session, t.turn)):
                    if turn.pool == "large" and turn.session not in seen:
                        seen.add(turn.session)
                        turn.escalated = True
                        escalated.append((turn, by_id[turn.request_id]))
                asyncio.run(_cold_probes(cold[0].url, escalated, spec.request_timeout_s))
                rep_modes[mode] = {**live_mode_metrics(turns, counters), "cpu_s": cpu,
                                   "wall_s": round(wall_s, 2)}
                pooled_turns[mode] += turns
                pooled_counters[mode].update(counters)
                wall[mode].append(round(wall_s, 2))
            repeats.append({"repeat": repeat, "order": order,
                            "modes": {m: rep_modes[m] for m in spec.modes}})
    modes = {m: live_mode_metrics(pooled_turns[m], pooled_counters[m]) for m in spec.modes}
    for m in spec.modes:
        modes[m]["cpu_s"] = _sum_cpu([rep["modes"][m]["cpu_s"] for rep in repeats])
    pairs = paired(repeats)
    config = asdict(spec)
    config.update(modes=list(spec.modes), log_dir=str(spec.log_dir) if spec.log_dir else None,
                  num_requests=len(workload), wall_s=wall,
                  small_profile_source=get_profile(spec.small_profile).source,
                  large_profile_source=get_profile(spec.large_profile).source,
                  git_sha=git_sha(), python=sys.version.split()[0],
                  machine=platform.machine(), cpus=os.cpu_count())
    return {"modes": modes, "repeats": repeats, "paired": pairs,
            "targets": live_targets(modes, pairs, spec.repeats), "config": config,
            "turns": {m: [asdict(t) for t in pooled_turns[m]] for m in spec.modes}}


_ModeRun = tuple[list[LiveTurn], dict[str, float], dict[str, float | None], float]


def _run_mode(spec: TiersLiveSpec, mode: str, repeat: int, workload: Sequence[WorkloadRequest],
              work: Path, small: Sequence[ReplicaHandle], large: Sequence[ReplicaHandle],
              cold: Sequence[ReplicaHandle], on_turn: Callable[[], None] | None,
              ) -> _ModeRun:  # fmt: skip
    """One mode once on fresh caches and a fresh router: turns, counters, CPU, wall time."""
    reset_engine_caches([*small, *large, *cold], timeout_s=5.0)
    slug = mode.replace("+", "-") + (f"-r{repeat}" if spec.repeats > 1 else "")
    config_path = work / f"router-{slug}.yaml"
    config_path.write_text(router_yaml(spec, mode, small, large))
    router = _start_router(config_path, work / f"router-{slug}.log")
    try:
        before = {"small_engines": _group_cpu_s(small), "large_engines": _group_cpu_s(large),
                  "router": process_cpu_s(router.process.pid), "client": time.process_time()}
        turns, wall_s = asyncio.run(_run_sessions(router.url, workload, spec, on_turn))
        after = {"small_engines": _group_cpu_s(small), "large_engines": _group_cpu_s(large),
                 "router": process_cpu_s(router.process.pid), "client": time.process_time()}
        counters = asyncio.run(_scrape(router.url))
    finally:
        router.stop()
    for turn in turns:
        turn.repeat = repeat
    cpu = {k: _delta(after[k], before[k]) for k in before}
    return turns, counters, cpu, wall_s


def _sum_cpu(values: Sequence[Mapping[str, float | None]]) -> dict[str, float | None]:
    keys = {k for v in values for k in v}
    out: dict[str, float | None] = {}
    for k in sorted(keys):
        parts = [v.get(k) for v in values]
        out[k] = None if any(p is None for p in parts) else round(
            sum(p for p in parts if p is not None), 3)
    return out
