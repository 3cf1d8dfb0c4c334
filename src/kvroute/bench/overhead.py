"""``kvroute bench overhead``: what a router adds in front of fast engines, side by side.

Owns the run plan and the report of the overhead measurement the router issue asks for, in
the shape of the reference anchors (``router-overhead-anchors``): the same engines, every
router in turn, the same phases, two passes in opposite router order, added latency taken
against ``direct`` *of the same pass*.

Set-up: ``engines`` ``kvroute sim serve`` processes with the ``zero`` timing profile (no
engine time, so what remains is HTTP and routing) serving the bundled Hugging Face tokenizer
(``tokenize.hf.bundled_tokenizer_dir``), so kvroute can tokenize either way: ``kvroute``
asks the engines' ``/tokenize``, ``kvroute-local`` uses the same tokenizer in-process, and
``kvroute-auto`` runs the default ``tokenizer: auto`` (it finds the engines' tokenizer
directory from their model cards, checks it and adopts it during the warm-up).
Requests: chat completions of the ``generated_shared_prefix`` workload (32 groups of a
~2,200-character system prompt and a short question, 8 output tokens).

Phases, per router (``PHASES``): ``r<rate>`` fixed-rate non-streamed requests (request *i*
starts at ``i / rate``), ``s<rate>`` fixed-rate streamed requests (time to the first text
chunk), ``c<n>`` a closed loop of ``n`` workers (the saturation figures: achieved req/s and
CPU per request), ``u<n>`` the same closed loop of short unique prompts instead
(``bench/overhead_short.py``: ~600-token chats nobody sent before, fresh for every router,
pass and phase, so no router's or engine's cache of earlier requests helps; at most
``_UNIQUE_MAX_RPS`` a second of phase are built, before the phase starts). Each phase lasts ``phase_s`` seconds; a short warm-up precedes the first.
Before the first router, every engine is shown every prompt group once (``_warm_engines``), so
the router measured first does not pay the engines' cold caches for the others.

Figures per (router, pass, phase): completed, errors, achieved req/s, latency p50/p99 (whole
response; for ``s`` phases time to first token), the router's CPU per request (its process
tree, from ``/proc``), the engines' CPU per request (a router that calls the engines more,
like vllm-router's ``/render``, shows here), and ``added_p50_ms``/``added_p99_ms`` against
``direct``'s same phase of the same pass. For kvroute, also ``router_own_p50_ms`` and
``router_own_p99_ms``: its own share of each answer as it measures it
(``router_time_seconds``, total: request read → forwarded, engine's answer → written), the
part of the added latency that is its code rather than the extra hop and the machine
(``bench/router_time.py``), and the same per stage in ``router_own_stages_ms``.

Same-window baseline (``same_window``, off by default): ``direct`` of the same pass runs in
another window of seconds, and on a shared VM the client's p99 moves by milliseconds from one
window to the next for every router, ``direct`` included, so an added p99 taken across
windows carries that drift. With ``same_window`` = *K*, each fixed-rate phase also sends one
request straight to the engines (round robin) for every *K* it sends to the router, mixed into
the same stream (``live_client.ControlLane``); the router still gets the phase's rate. Each
row then also has ``same_window_direct_p50_ms``/``_p99_ms`` (those requests' latency) and
``added_same_window_p50_ms``/``_p99_ms``: the router's requests against them. ``direct``'s own
row gets the same columns, which should be near zero: that is the noise of the method. The
engines and the client carry ``(K + 1) / K`` times the rate; closed-loop phases have no
control lane.

Steady state: a kvroute router is measured once its KV-event catch-up is over
(``bench/settle.py``); its rows record ``catch_up_wait_s`` and ``caught_up``.

CPU placement (``router_cpus``): by default every process shares every CPU, as in the
reference anchors; a router then competes for the cores with the engines and the load
generator, and on a small machine part of what it "adds" is that contention rather than its
own work. With ``router_cpus`` set, each router (peers included) runs on those CPUs and the
engines and the client on the others, as a router on a host of its own would; ``direct``
gets the same placement, so the added figures compare like with like.

Bounds: every phase is bounded by its request count and ``phase_s`` (plus the client's
per-request timeout); the whole run by ``len(routers) * passes`` phases of that. Loopback
only; ports picked at run time.
"""

from __future__ import annotations

import platform
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from kvroute.bench.live_client import (
    ClientRun,
    ControlLane,
    LiveRequest,
    build_live_requests,
    replay,
    summarize,
)
from kvroute.bench.live_routers import (
    PEER_VERSIONS,
    PeerRouters,
    RouterSpec,
    find_peer_routers,
    http_text,
    start_router,
)
from kvroute.bench.overhead_long import (
    DEFAULT_GROWTH_CHARS,
    LONG_MAX_MODEL_LEN,
    LONG_TARGET_TOKENS,
    long_session_requests,
    plot_long_sweep,
    run_long_sweep,
)
from kvroute.bench.overhead_short import SHORT_SYSTEM, SHORT_WORDS, short_unique_requests
from kvroute.bench.procfs import (
    apparatus_cpus,
    parse_cpus,
    pin_process_tree,
    pinned_self,
    process_tree_cpu_s,
)
from kvroute.bench.router_time import Buckets, bucket_counts, phase_counts, quantile_ms
from kvroute.bench.settle import settle_kvroute
from kvroute.bench.workloads import WORKLOADS
from kvroute.core.errors import ConfigError
from kvroute.core.peer_policies import POLICY_NAMES
from kvroute.shell.metrics import ROUTER_TIME_STAGES
from kvroute.sim.launcher import Fleet, ReplicaSpec, start_fleet
from kvroute.tokenize.hf import bundled_tokenizer_dir

__all__ = [
    "DEFAULT_PHASES",
    "ROUTER_CHOICES",
    "OverheadSpec",
    "Phase",
    "format_rows",
    "parse_cpus",
    "parse_overhead_routers",
    "parse_phases",
    "run_overhead_bench",
]

DEFAULT_PHASES: Final = ("r100", "r200", "r400", "s100", "c32")

ROUTER_CHOICES: Final = ("direct", "passthrough", "kvroute", "kvroute-local", "kvroute-auto",
                         "sglang-router", "vllm-router")

_WORKLOAD: Final = {"num_groups": 32, "prompts_per_group": 64, "system_prompt_len": 300,
                    "question_len": 24, "output_len": 8}
_WARMUP_RATE: Final = 50.0
_UNIQUE_MAX_RPS: Final = 1_500
"""A ``u`` phase builds this many unique requests per second of phase (building and counting
their tokens costs ~0.15 ms each); a router faster than that ends the phase early, which
leaves its per-request figures right."""
_LONG_TURNS_PER_S: Final = 1.0
"""Turns a second per session in a ``g`` phase."""
_LONG_NEAR: Final = 0.75
"""A ``g`` phase's ``long_*`` figures are over turns of at least this share of the target
(96K-131K tokens; each adds ~6K)."""


@dataclass(frozen=True, slots=True)
class Phase:
    """One measured phase: ``kind`` r (fixed rate, whole), s (fixed rate, streamed), c
    (closed loop, whole), u (closed loop of short unique prompts, whole,
    ``bench/overhead_short.py``), g (growing agentic sessions, streamed at a fixed rate,
    ``bench/overhead_long.py``); ``value`` is the rate in req/s, the number of workers or
    the number of sessions at once."""

    name: str
    kind: str
    value: float

    @property
    def stream(self) -> bool:
        return self.kind in ("s", "g")

    @property
    def fixed_rate(self) -> bool:
        """Requests arrive on a schedule (r, s, g), not from a closed loop (c, u)."""
        return self.kind not in ("c", "u")


def parse_phases(text: str) -> tuple[Phase, ...]:
    """``r100,s100,c32`` -> phases; raises ``ConfigError`` naming a bad item."""
    out: list[Phase] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        kind, number = item[:1], item[1:]
        try:
            value = float(number)
        except ValueError:
            value = -1.0
        if kind not in ("r", "s", "c", "u", "g") or not value > 0 or (
                kind in ("c", "u", "g") and value != int(value)):
            raise ConfigError(
                f"phase {item!r} is not r<rate> (fixed-rate, whole responses), s<rate> "
                "(fixed-rate, streamed), c<workers> (closed loop), u<workers> (closed loop of "
                "short unique prompts) or g<sessions> (growing agentic sessions to 128K "
                "tokens, streamed), e.g. r400,s100,c32,u32,g4")
        out.append(Phase(item, kind, value))
    if not out:
        raise ConfigError("give at least one phase, e.g. --phases r100,r400,s100,c32")
    return tuple(out)


def parse_overhead_routers(text: str) -> tuple[RouterSpec, ...]:
    """Router names of ``ROUTER_CHOICES`` -> specs (``direct`` is added first if missing:
    every added-latency figure needs it).

    A kvroute router may carry another of its policies, ``kvroute-auto:round_robin``: the
    same router and work per request, placed as the named policy places. Beside the default
    it separates what the router's code adds from what its placement does to the engines'
    queues (on these zero-time engines a prefix hit saves nothing, while two requests on one
    engine still wait for each other's tokenization).
    """
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n.partition(":")[0] not in ROUTER_CHOICES]
    if unknown:
        raise ConfigError(f"unknown router(s) {unknown}; choose from {', '.join(ROUTER_CHOICES)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"routers are listed twice: {names}")
    if "direct" not in names:
        names.insert(0, "direct")
    tokenizer = str(bundled_tokenizer_dir())
    specs = {
        "direct": RouterSpec("direct", "direct", "round_robin"),
        "passthrough": RouterSpec("passthrough", "passthrough", "round_robin"),
        "kvroute": RouterSpec("kvroute", "kvroute", "kvroute"),
        "kvroute-local": RouterSpec("kvroute-local", "kvroute", "kvroute", tokenizer),
        "kvroute-auto": RouterSpec("kvroute-auto", "kvroute", "kvroute", "auto"),
        "sglang-router": RouterSpec("sglang-router", "sglang", "cache_aware"),
        "vllm-router": RouterSpec("vllm-router", "vllm", "cache_aware"),
    }
    out = []
    for name in names:
        base, _, policy = name.partition(":")
        spec = specs[base]
        if policy:
            if spec.kind != "kvroute":
                raise ConfigError(f"{name!r}: only kvroute routers take a policy here "
                                  "(e.g. kvroute-auto:round_robin)")
            if policy not in POLICY_NAMES:
                raise ConfigError(f"{name!r}: unknown kvroute policy {policy!r}; choose from: "
                                  f"{', '.join(POLICY_NAMES)}")
            spec = replace(spec, name=name, policy=policy)
        out.append(spec)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class OverheadSpec:
    """What to run (see the module docstring)."""

    routers: tuple[RouterSpec, ...]
    phases: tuple[Phase, ...] = field(default_factory=lambda: parse_phases(
        ",".join(DEFAULT_PHASES)))
    engines: int = 8
    phase_s: float = 10.0
    warmup_s: float = 2.0
    passes: int = 2
    seed: int = 0
    request_timeout_s: float = 30.0
    max_in_flight: int = 512
    model: str = "sim-model"
    log_dir: Path | None = None
    router_cpus: frozenset[int] | None = None
    """Pin every router to these CPUs and the engines and the client to the rest (None: all
    share every CPU, as in the reference anchors)."""
    same_window: int = 0
    """Per this many requests to a router in a fixed-rate phase, one more straight to the
    engines in the same stream (0: no same-window baseline; see the module docstring)."""
    long_sweep: bool = False
    """After the passes, each router once more, one growing session at a time, turn by turn,
    with its CPU per turn (``bench/overhead_long.run_long_sweep``)."""
    long_target_tokens: int = LONG_TARGET_TOKENS
    """Where ``g`` phases' and the sweep's sessions stop growing."""
    long_growth_chars: tuple[int, ...] = DEFAULT_GROWTH_CHARS
    """The sweep's sessions: one per per-turn growth, in characters of tool result."""
    plot: Path | None = None
    """Where the sweep's plot goes (router CPU against new and against total tokens)."""

    @property
    def long(self) -> bool:
        """Long sessions are sent: the engines need a window above the target."""
        return self.long_sweep or any(p.kind == "g" for p in self.phases)

    def apparatus_cpus(self) -> frozenset[int] | None:
        """The CPUs left to the engines and the load generator (None when not pinned)."""
        if self.router_cpus is None:
            return None
        return apparatus_cpus(self.router_cpus)

    def validate(self) -> None:
        if not self.routers:
            raise ConfigError("give at least one router")
        for name, value in (("engines", self.engines), ("passes", self.passes)):
            if value < 1:
                raise ConfigError(f"{name}={value} must be >= 1")
        for name, fvalue in (("phase_s", self.phase_s), ("request_timeout_s",
                                                         self.request_timeout_s)):
            if not fvalue > 0:
                raise ConfigError(f"{name}={fvalue} must be > 0")
        if self.warmup_s < 0:
            raise ConfigError(f"warmup_s={self.warmup_s} must be >= 0")
        if self.same_window < 0:
            raise ConfigError(f"same_window={self.same_window} must be >= 0 (0: off; K: one "
                              "request straight to the engines per K sent to the router)")
        if self.router_cpus is not None:
            apparatus_cpus(self.router_cpus)
        if self.long and not 0 < self.long_target_tokens <= LONG_MAX_MODEL_LEN // 2:
            raise ConfigError(f"long_target_tokens={self.long_target_tokens} must be > 0 and "
                              f"at most {LONG_MAX_MODEL_LEN // 2} (the engines' window is "
                              f"{LONG_MAX_MODEL_LEN})")
        if self.plot is not None and not self.long_sweep:
            raise ConfigError("a plot is drawn from the long sweep: add --long-sweep")
        if self.phase_s > 120:
            raise ConfigError(f"phase_s={self.phase_s} is over 120 s; a phase is a sample, "
                              "not a soak test: use at most 120")


def _requests(spec: OverheadSpec, stream: bool) -> list[LiveRequest]:
    workload = WORKLOADS["generated_shared_prefix"](**_WORKLOAD, seed=spec.seed,
                                                    with_messages=True)
    return build_live_requests(workload, model=spec.model, stream=stream)


def _schedule(pool: Sequence[LiveRequest], phase: Phase, phase_s: float,
              same_window: int = 0) -> list[LiveRequest]:
    """The phase's requests: fixed-rate arrivals over ``phase_s``, or enough for a closed
    loop to run ``phase_s`` at up to 5,000 req/s; bodies cycle through ``pool``.

    With ``same_window`` = *K* (fixed-rate phases), the stream runs at ``(K + 1) / K`` times
    the rate, so that the router still gets the phase's rate once ``_control_lane`` has taken
    one request in ``K + 1`` straight to the engines.
    """
    fixed = phase.fixed_rate
    rate = phase.value * (same_window + 1) / same_window if fixed and same_window else phase.value
    count = int(rate * phase_s) if fixed else int(5000 * phase_s)
    out = []
    for i in range(max(1, count)):
        req = pool[i % len(pool)]
        arrival = i / rate if fixed else 0.0
        out.append(replace(req, request_id=f"{phase.name}-{i}", arrival_s=arrival))
    return out


def _unique_schedule(phase: Phase, spec: OverheadSpec, run: str) -> list[LiveRequest]:
    """A ``u`` phase's requests: ``_UNIQUE_MAX_RPS`` a second of phase of short prompts
    nobody sent before, drawn for ``run`` (a router and pass: what one router is sent, no
    other router or pass is, so each meets engines that never saw its prompts either)."""
    return short_unique_requests(max(1, int(_UNIQUE_MAX_RPS * spec.phase_s)),
                                 model=spec.model, label=f"{run}-{phase.name}", seed=spec.seed)


def _long_schedule(phase: Phase, spec: OverheadSpec) -> list[LiveRequest]:
    """A ``g`` phase's requests: every turn of ``phase.value`` sessions once, each session a
    turn every ``1 / _LONG_TURNS_PER_S`` s (faster by ``(K + 1) / K`` with a same-window
    lane, so the router still gets its rate); bodies built once per run and phase size."""
    sessions = int(phase.value)
    rate = _LONG_TURNS_PER_S * sessions
    if spec.same_window:
        rate *= (spec.same_window + 1) / spec.same_window
    return long_session_requests(sessions, model=spec.model, seed=spec.seed, rate=rate,
                                 target_tokens=spec.long_target_tokens,
                                 prefix=f"{phase.name}")


def _long_figures(run: ClientRun, requests: Sequence[LiveRequest], spec: OverheadSpec,
                  control: bool | None) -> dict[str, Any]:
    """TTFT p50/p99 over the turns near the target (``_LONG_NEAR``) of a ``g`` phase."""
    near = {r.request_id for r in requests
            if r.prompt_tokens >= _LONG_NEAR * spec.long_target_tokens}
    picked = ClientRun([r for r in run.results if r.request_id in near], run.wall_s,
                       run.tcp_nodelay)
    summary = summarize(picked, control=control)
    return {"long_p50_ms": summary["ttft_p50_ms"], "long_p99_ms": summary["ttft_p99_ms"],
            "long_completed": summary["completed"]}


def _control_lane(phase: Phase, spec: OverheadSpec, fleet: Fleet) -> ControlLane | None:
    """The same-window baseline of a fixed-rate phase (None: off, or a closed loop)."""
    if not spec.same_window or not phase.fixed_rate:
        return None
    return ControlLane(tuple(e.url for e in fleet.replicas), spec.same_window + 1)


def _engine_cpu_s(fleet: Fleet) -> float:
    return sum(process_tree_cpu_s(e.pid) for e in fleet.replicas if e.pid is not None)


def _router_time_buckets(metrics_url: str | None) -> dict[str, Buckets] | None:
    """kvroute's ``router_time_seconds`` now, per stage, or None for another router."""
    if metrics_url is None:
        return None
    text = http_text(metrics_url, timeout_s=5.0)
    return {stage: bucket_counts(text, stage) for stage in ROUTER_TIME_STAGES}


def _run_phase(router_targets: list[str], requests: list[LiveRequest], phase: Phase,
               spec: OverheadSpec, cpu: Callable[[], float | None], fleet: Fleet,
               metrics_url: str | None = None) -> dict[str, Any]:
    control = _control_lane(phase, spec, fleet)
    own0 = _router_time_buckets(metrics_url)
    router0, engines0, client0 = cpu(), _engine_cpu_s(fleet), time.process_time()
    span_s = max((r.arrival_s for r in requests), default=0.0) if phase.kind == "g" else 0.0
    run = replay(
        router_targets, requests,
        concurrency=None if phase.fixed_rate else int(phase.value),
        max_in_flight=spec.max_in_flight, request_timeout_s=spec.request_timeout_s,
        duration_s=max(spec.phase_s, span_s)
        + (spec.request_timeout_s if phase.fixed_rate else 0.0),
        control=control)
    router1, engines1, client1 = cpu(), _engine_cpu_s(fleet), time.process_time()
    own1 = _router_time_buckets(metrics_url)
    summary = summarize(run, control=None if control is None else False)
    errors = dict(summary["errors"])
    if not phase.fixed_rate:
        errors.pop("not_sent", None)  # a closed loop stops at its deadline by design:
        errors.pop("deadline", None)  # requests unsent or in flight then are not failures
    done = summary["completed"]
    key = "ttft" if phase.stream else "e2e"
    row: dict[str, Any] = {
        "completed": done, "errors": errors, "achieved_rps": summary["achieved_rps"],
        "p50_ms": summary[f"{key}_p50_ms"], "p99_ms": summary[f"{key}_p99_ms"],
        "mean_ms": summary[f"{key}_mean_ms"], "start_lag_p99_ms": summary["start_lag_p99_ms"],
        "tcp_nodelay": summary["tcp_nodelay"],
        "engine_cpu_ms_per_req": round(1e3 * (engines1 - engines0) / done, 4) if done else None,
        "client_cpu_ms_per_req": round(1e3 * (client1 - client0) / done, 4) if done else None,
        "router_cpu_ms_per_req": None,
    }
    if control is not None:
        _add_same_window(row, summarize(run, control=True), key)
    if phase.kind == "g":
        row.update(_long_figures(run, requests, spec, None if control is None else False))
        if control is not None:
            lane = _long_figures(run, requests, spec, True)
            row["same_window_direct_long_p50_ms"] = lane["long_p50_ms"]
            row["same_window_direct_long_p99_ms"] = lane["long_p99_ms"]
            for q in ("p50", "p99"):
                mine, ref = row[f"long_{q}_ms"], lane[f"long_{q}_ms"]
                row[f"added_same_window_long_{q}_ms"] = (
                    None if mine is None or ref is None else round(mine - ref, 3))
    if router0 is not None and router1 is not None and done:
        row["router_cpu_ms_per_req"] = round(1e3 * (router1 - router0) / done, 4)
        row["router_cores"] = round((router1 - router0) / max(run.wall_s, 1e-9), 3)
    if own0 is not None and own1 is not None:
        # The router's own share of each answer (its code; no network hop), from its metric:
        # the total in the table, each stage in the report.
        stages: dict[str, dict[str, float | None]] = {}
        for stage in ROUTER_TIME_STAGES:
            own = phase_counts(own0[stage], own1[stage])
            stages[stage] = {name: None if (v := quantile_ms(own, q)) is None else round(v, 3)
                             for q, name in ((0.5, "p50"), (0.99, "p99"))}
        row["router_own_p50_ms"] = stages["total"]["p50"]
        row["router_own_p99_ms"] = stages["total"]["p99"]
        row["router_own_stages_ms"] = stages
    return row


def _add_same_window(row: dict[str, Any], lane: Mapping[str, Any], key: str) -> None:
    """The control lane's figures, and the router's requests against them (``row``'s
    ``p50_ms``/``p99_ms`` are already the router's requests only)."""
    row["same_window_direct_completed"] = lane["completed"]
    row["same_window_direct_errors"] = dict(lane["errors"])
    for q in ("p50", "p99"):
        ref = lane[f"{key}_{q}_ms"]
        mine = row[f"{q}_ms"]
        row[f"same_window_direct_{q}_ms"] = ref
        row[f"added_same_window_{q}_ms"] = (None if ref is None or mine is None
                                            else round(mine - ref, 3))


def run_overhead_bench(
    spec: OverheadSpec,
    *,
    peers: PeerRouters | None = None,
    on_phase: Callable[[str, int, str, Mapping[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every router through every phase, ``passes`` times, and return the report.

    Routers whose program is missing (the peers without their venv) are reported under
    ``skipped`` with the reason.

    Report: ``{"results": [{"router", "pass", "phase", ...figures}], "skipped": {...},
    "config": {...}}``.
    """
    spec.validate()
    peers = peers if peers is not None else find_peer_routers()
    routers = list(spec.routers)
    skipped: dict[str, str] = {}
    for r in list(routers):
        if r.kind in ("sglang", "vllm") and not peers.available:
            skipped[r.name] = peers.reason or "peer routers not installed"
            routers.remove(r)
    pools = {False: _requests(spec, stream=False), True: _requests(spec, stream=True)}
    long_pools = {p.name: _long_schedule(p, spec) for p in spec.phases if p.kind == "g"}
    tokenizer = str(bundled_tokenizer_dir())
    window = LONG_MAX_MODEL_LEN if spec.long else None
    specs = [ReplicaSpec(name=f"e{i}", model=spec.model, profile="zero", max_model_len=window,
                         extra_args=("--tokenizer", tokenizer)) for i in range(spec.engines)]
    sweeps: dict[str, list[dict[str, Any]]] = {}
    results: list[dict[str, Any]] = []
    # The engines and every router start from this process and inherit its CPUs; a router is
    # then moved to its own.
    with tempfile.TemporaryDirectory(prefix="kvroute-overhead-") as tmp, \
            pinned_self(spec.apparatus_cpus()):
        work_dir = spec.log_dir or Path(tmp)
        with start_fleet(specs, log_dir=work_dir / "engines") as fleet:
            if spec.warmup_s > 0:
                _warm_engines(fleet, pools[False], spec)
            for pass_no in range(1, spec.passes + 1):
                order = routers if pass_no % 2 else list(reversed(routers))
                for router_spec in order:
                    router = start_router(router_spec, fleet.replicas, work_dir=work_dir,
                                          peers=peers, model=spec.model, seed=spec.seed)
                    if spec.router_cpus is not None and router.process is not None:
                        pin_process_tree(router.process.pid, spec.router_cpus)
                    with router:
                        metrics_url = (router.targets[0] + "/metrics"
                                       if router_spec.kind == "kvroute" else None)
                        if spec.warmup_s > 0:
                            warm = Phase("warmup", "r", _WARMUP_RATE)
                            replay(
                                router.targets, _schedule(pools[False], warm, spec.warmup_s),
                                request_timeout_s=spec.request_timeout_s,
                                duration_s=spec.warmup_s + spec.request_timeout_s)
                        settled: dict[str, Any] = {}
                        if metrics_url is not None and spec.warmup_s > 0:
                            settled = settle_kvroute(
                                metrics_url, fleet.replicas, f"{router_spec.name}-{pass_no}",
                                model=spec.model, request_timeout_s=spec.request_timeout_s)
                        for phase in spec.phases:
                            requests = (
                                long_pools[phase.name] if phase.kind == "g" else
                                _unique_schedule(phase, spec, f"{router_spec.name}-p{pass_no}")
                                if phase.kind == "u" else
                                _schedule(pools[phase.stream], phase, spec.phase_s,
                                          spec.same_window))
                            row = _run_phase(router.targets, requests, phase, spec,
                                             router.cpu_s, fleet, metrics_url)
                            row = {"router": router_spec.name, "pass": pass_no,
                                   "phase": phase.name, **row, **settled}
                            results.append(row)
                            if on_phase is not None:
                                on_phase(router_spec.name, pass_no, phase.name, row)
                            time.sleep(0.5)
            if spec.long_sweep:
                sweeps = _long_sweeps(spec, routers, fleet, work_dir, peers)
    _add_overheads(results)
    report: dict[str, Any] = {"results": results, "skipped": skipped,
                              "config": _config(spec, pools[False], peers)}
    if spec.long_sweep:
        report["long_sweep"] = sweeps
        if spec.plot is not None:
            plot_long_sweep(sweeps, spec.plot, title=(
                f"router CPU per turn of growing sessions to {spec.long_target_tokens} tokens, "
                f"{spec.engines} zero-time engines, {time.strftime('%Y-%m-%d')}"))
    return report


def _long_sweeps(spec: OverheadSpec, routers: Sequence[RouterSpec], fleet: Fleet,
                 work_dir: Path, peers: PeerRouters) -> dict[str, list[dict[str, Any]]]:
    """Each router (its own fresh process) through ``run_long_sweep``; a kvroute router once
    its KV-event catch-up is over (the engines' earlier phases left thousands of batches to
    replay, which would be counted in its first turns' CPU)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for router_spec in routers:
        router = start_router(router_spec, fleet.replicas, work_dir=work_dir, peers=peers,
                              model=spec.model, seed=spec.seed)
        if spec.router_cpus is not None and router.process is not None:
            pin_process_tree(router.process.pid, spec.router_cpus)
        with router:
            if router_spec.kind == "kvroute":
                settle_kvroute(router.targets[0] + "/metrics", fleet.replicas,
                               f"{router_spec.name}-sweep", model=spec.model,
                               request_timeout_s=spec.request_timeout_s)
            out[router_spec.name] = run_long_sweep(
                router.targets[0], router.pid, model=spec.model, seed=spec.seed,
                target_tokens=spec.long_target_tokens, growth_chars=spec.long_growth_chars,
                request_timeout_s=spec.request_timeout_s)
    return out


def _engine_warmup(pool: Sequence[LiveRequest], engines: int) -> list[LiveRequest]:
    """One request of every prompt group for every engine, in an order that sends request
    *i* to engine *i* mod ``engines`` (the client's round robin over direct targets)."""
    first_of_group: dict[str | None, LiveRequest] = {}
    for req in pool:
        first_of_group.setdefault(req.group, req)
    return [replace(req, request_id=f"engine-warmup-{g}-{e}", arrival_s=0.0)
            for g, req in enumerate(first_of_group.values()) for e in range(engines)]


def _warm_engines(fleet: Fleet, pool: Sequence[LiveRequest], spec: OverheadSpec) -> None:
    """Show every engine every prompt group once before anything is measured.

    Why: fresh engines meet each shared system prompt for the first time (their tokenizer's
    piece cache, their block-hash memo and their prefix cache are cold). Without this the
    first router measured, ``direct`` in pass 1, paid those misses and every router after it
    did not, which flattered every router's added latency in pass 1.
    """
    targets = [e.url for e in fleet.replicas]
    replay(targets, _engine_warmup(pool, len(targets)), concurrency=len(targets),
           request_timeout_s=spec.request_timeout_s, duration_s=spec.request_timeout_s)


def _add_overheads(results: list[dict[str, Any]]) -> None:
    direct = {(r["pass"], r["phase"]): r for r in results if r["router"] == "direct"}
    for row in results:
        base = direct.get((row["pass"], row["phase"]))
        for q in ("p50", "p99", "long_p50", "long_p99"):
            if q.startswith("long") and f"{q}_ms" not in row:
                continue
            mine = row.get(f"{q}_ms")
            ref = base.get(f"{q}_ms") if base is not None else None
            row[f"added_{q}_ms"] = (None if mine is None or ref is None or row is base
                                    else round(mine - ref, 3))


def _config(spec: OverheadSpec, pool: Sequence[LiveRequest],
            peers: PeerRouters) -> dict[str, Any]:
    return {
        "engines": spec.engines, "engine_profile": "zero",
        "engine_tokenizer": "bundled kvroute-tiny-bpe",
        "phases": [p.name for p in spec.phases], "phase_s": spec.phase_s,
        "warmup_s": spec.warmup_s, "passes": spec.passes, "seed": spec.seed,
        "workload": {"generator": "generated_shared_prefix", **_WORKLOAD},
        "unique_workload": {"generator": "bench/overhead_short.py", "user_words": SHORT_WORDS,
                            "system_prompt": SHORT_SYSTEM, "output_len": 8,
                            "requests_per_phase_s": _UNIQUE_MAX_RPS}
        if any(p.kind == "u" for p in spec.phases) else None,
        "mean_body_bytes": round(sum(len(r.body) for r in pool) / len(pool)),
        "long_sessions": {"generator": "bench/overhead_long.py", "target_tokens":
                          spec.long_target_tokens, "turns_per_s_per_session": _LONG_TURNS_PER_S,
                          "near_target_share": _LONG_NEAR, "sweep": spec.long_sweep,
                          "engines_max_model_len": LONG_MAX_MODEL_LEN} if spec.long else None,
        "routers": [r.name for r in spec.routers],
        "router_cpus": sorted(spec.router_cpus) if spec.router_cpus is not None else None,
        "same_window": spec.same_window,
        "apparatus_cpus": (sorted(apparatus) if (apparatus := spec.apparatus_cpus()) is not None
                           else None),
        "peer_versions": PEER_VERSIONS if peers.available else None,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "machine": platform.machine()},
        "date": time.strftime("%Y-%m-%d"),
    }


def format_rows(report: Mapping[str, Any]) -> list[list[str]]:
    """Table rows: router, phase, then per-pass ``p1 / p2`` cells of the main figures (``-``
    where a router has no such figure: kvroute's own time for the others, the same-window
    columns without ``same_window`` or in a closed loop)."""
    by_key: dict[tuple[str, str], dict[int, Mapping[str, Any]]] = {}
    for row in report["results"]:
        by_key.setdefault((row["router"], row["phase"]), {})[row["pass"]] = row

    def cell(rows: Mapping[int, Mapping[str, Any]], key: str, fmt: str = "{:.2f}") -> str:
        vals = [rows[p].get(key) for p in sorted(rows)]
        return " / ".join("-" if v is None else fmt.format(v) for v in vals)

    out = []
    for (router, phase), rows in by_key.items():
        errors = sum(sum(rows[p]["errors"].values()) for p in rows)
        out.append([router, phase, cell(rows, "achieved_rps", "{:.0f}"), cell(rows, "p50_ms"),
                    cell(rows, "p99_ms"), cell(rows, "added_p50_ms"),
                    cell(rows, "added_p99_ms"), cell(rows, "added_same_window_p50_ms"),
                    cell(rows, "added_same_window_p99_ms"), cell(rows, "router_own_p50_ms"),
                    cell(rows, "router_own_p99_ms"),
                    cell(rows, "router_cpu_ms_per_req", "{:.3f}"),
                    cell(rows, "engine_cpu_ms_per_req", "{:.3f}"), str(errors)])
    return out
