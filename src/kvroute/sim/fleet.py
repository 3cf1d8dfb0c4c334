"""Virtual-time fleet simulation: N engine models behind one ``RouterCore``.

The simulation runs the production decision code (``core.router.RouterCore`` with any policy
of ``core.policy``/``core.peer_policies``) against ``core.engine_model.EngineModel`` engines on
a virtual clock, with no sleeps and no asyncio, so a benchmark of the simulator measures the
code that routes production traffic.

Theory of operation (a discrete-event loop over a heap of timed events):

* ``ARRIVE``: a workload request is routed (the router hashes it, looks it up in its index,
  scores replicas) and added to the chosen engine. An idle engine starts a step at once.
* ``STEP_DONE``: an engine finished the step it started ``duration_s`` earlier. Its outputs
  become visible now: first tokens (TTFT), further tokens (inter-token gaps), finished
  requests (which release closed-loop follow-up turns after their think time). Its KV events
  are delivered to the router ``event_latency_s`` later (engines publish after the step; the
  router applies them a little after), its metrics are scraped, and the engine starts its next
  step if it has work.
* ``EVENTS``: a KV-event batch reaches the router's index.
* ``SAMPLE``: every ``sample_interval_s``, each replica's running + waiting count is recorded
  (load imbalance over time, and the per-replica load plot).

Everything random is seeded: the policy's ``random.Random(seed)`` and the workload's own seed.
Two runs with the same inputs give identical results.

Prompt block digests are computed once per request (``DigestCache``) and shared by the router
and the engine, and across the policies of one benchmark: they are the same vLLM hashes either
way, and hashing a long trace is the most expensive part of a run.
"""

from __future__ import annotations

import heapq
import random
from array import array
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvroute.bench.workloads import WorkloadRequest
from kvroute.core.clock import ManualClock
from kvroute.core.engine_model import (
    EngineConfig,
    EngineModel,
    EngineRequest,
    Rejection,
    StepResult,
)
from kvroute.core.errors import ConfigError
from kvroute.core.events import EventBatch
from kvroute.core.hashing import BlockHasher
from kvroute.core.index import TenantScope
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouteRequest, RouterCore
from kvroute.core.types import BlockHash, PoolName, ReplicaId, RequestId, TenantName, WireHash
from kvroute.sim.profiles import TimingProfile

POOL = PoolName("sim")
DEFAULT_TENANT = TenantName("default")

_ARRIVE, _STEP_DONE, _EVENTS, _SAMPLE = 0, 1, 2, 3

# One character per token for text-matching peers (SGLang's char radix tree, production-
# stack's 128-char chunks): the text then has exactly the token stream's prefix structure.
# CJK ideographs are used so that Python stores the text at 2 bytes per character and
# distinct tokens rarely share a character.
_TEXT_BASE = 0x4E00
_TEXT_SPAN = 20_000
_TEXT_CHARS = [chr(_TEXT_BASE + i) for i in range(_TEXT_SPAN)]


def tokens_as_text(tokens: Sequence[int]) -> str:
    """The routing text a text-matching peer sees for ``tokens`` (one char per token)."""
    chars = _TEXT_CHARS
    return "".join([chars[t % _TEXT_SPAN] for t in tokens])


class DigestCache:
    """Prompt block hashes per (request id, salt), computed once and shared across runs.

    Holds both forms: the raw digests the engine keys its cache by, and the 64-bit wire form
    the router's index is keyed by.
    """

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        self._hashes: dict[tuple[str, str | None], tuple[list[BlockHash], tuple[WireHash, ...]]] = {}

    def get(
        self, request: WorkloadRequest, salt: str | None
    ) -> tuple[list[BlockHash], tuple[WireHash, ...]]:
        key = (request.request_id, salt)
        found = self._hashes.get(key)
        if found is None:
            digests = self.hasher.hash_blocks(request.prompt_token_ids, cache_salt=salt)
            from_bytes = int.from_bytes
            wire = tuple([WireHash(from_bytes(d[-8:], "big")) for d in digests])
            found = (digests, wire)
            self._hashes[key] = found
        return found


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """One simulated fleet and how to drive it.

    Attributes:
        num_replicas: engines in the pool.
        profile: timing and engine shape (block size, KV capacity, window, batch limits).
        policy: the routing policy's name; ``policy_params`` overrides its defaults.
        seed: seeds the policy's random choices.
        event_latency_s: delay between an engine step's end and its events reaching the index.
        ttft_slo_s: the TTFT objective for goodput.
        sample_interval_s: period of the per-replica load samples.
        metrics_interval_s: how often the router scrapes each engine's metrics (running,
            waiting, KV usage): at most once per interval, at the end of a step.
        hash_algo: the engines' prefix-caching hash algorithm.
        salt_tenants: give each tenant its own ``cache_salt`` (tenant isolation on).
        max_virtual_s: stop the run at this virtual time (requests still open are counted
            as unfinished).
    """

    num_replicas: int
    profile: TimingProfile
    policy: str = "kvroute"
    policy_params: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    event_latency_s: float = 0.005
    ttft_slo_s: float = 2.0
    sample_interval_s: float = 1.0
    metrics_interval_s: float = 0.05
    hash_algo: str = "sha256"
    salt_tenants: bool = False
    max_virtual_s: float = 7 * 24 * 3600.0

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ConfigError(f"num_replicas must be >= 1, got {self.num_replicas}")
        for name in ("event_latency_s", "ttft_slo_s", "sample_interval_s", "max_virtual_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ConfigError(f"FleetConfig.{name} must be >= 0, got {value!r}")
        if self.sample_interval_s <= 0:
            raise ConfigError("FleetConfig.sample_interval_s must be > 0")


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request."""

    request_id: str
    arrival_s: float
    replica: str = ""
    num_prompt_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    last_token_s: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    expected_cached_tokens: int = 0
    finish_reason: str | None = None
    rejected: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(slots=True)
class FleetResult:
    """Per-request records and per-replica series of one run, with derived metrics."""

    config: FleetConfig
    records: list[RequestRecord]
    itl_s: array  # type: ignore[type-arg]
    load_samples: list[tuple[float, tuple[int, ...]]]
    replica_names: tuple[str, ...]
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    end_s: float

    def summary(self) -> dict[str, float | int | dict[str, int]]:
        """The benchmark's metrics (keys as ``kvroute bench sim --json`` writes them)."""
        done = [r for r in self.records if r.finish_s is not None]
        ttfts = sorted(r.ttft_s for r in self.records if r.ttft_s is not None)
        e2e = sorted(r.finish_s - r.arrival_s for r in done)  # type: ignore[operator]
        itl = sorted(self.itl_s)
        start = min((r.arrival_s for r in self.records), default=0.0)
        span = max(self.end_s - start, 1e-9)
        good = sum(1 for t in ttfts if t <= self.config.ttft_slo_s)
        per_replica: dict[str, int] = {name: 0 for name in self.replica_names}
        for r in self.records:
            if r.replica:
                per_replica[r.replica] += 1
        ratios = []
        for _, loads in self.load_samples:
            total = sum(loads)
            if total > 0:
                ratios.append(max(loads) / (total / len(loads)))
        return {
            "requests": len(self.records),
            "completed": len(done),
            "rejected": sum(1 for r in self.records if r.rejected),
            "unfinished": sum(1 for r in self.records if r.finish_s is None and not r.rejected),
            "ttft_mean_s": _mean(ttfts),
            "ttft_p50_s": _pct(ttfts, 50),
            "ttft_p90_s": _pct(ttfts, 90),
            "ttft_p99_s": _pct(ttfts, 99),
            "itl_mean_s": _mean(itl),
            "itl_p50_s": _pct(itl, 50),
            "itl_p90_s": _pct(itl, 90),
            "itl_p99_s": _pct(itl, 99),
            "e2e_mean_s": _mean(e2e),
            "e2e_p99_s": _pct(e2e, 99),
            "token_hit_rate": (
                self.prefix_cache_hits / self.prefix_cache_queries
                if self.prefix_cache_queries else 0.0
            ),
            "router_expected_hit_rate": (
                sum(r.expected_cached_tokens for r in done)
                / max(1, sum(r.num_prompt_tokens for r in done))
            ),
            "goodput_rps": good / span,
            "throughput_rps": len(done) / span,
            "output_tokens_per_s": sum(r.num_output_tokens for r in done) / span,
            "preemptions": self.preemptions,
            "load_imbalance_mean": _mean(ratios) if ratios else 1.0,
            "requests_per_replica": per_replica,
            "makespan_s": span,
        }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _pct(sorted_values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending sequence (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(1, -(-len(sorted_values) * pct // 100))
    return float(sorted_values[int(rank) - 1])


class FleetSimulation:
    """One run of a workload through a simulated fleet (see the module docstring)."""

    def __init__(
        self,
        config: FleetConfig,
        workload: Sequence[WorkloadRequest],
        *,
        digests: DigestCache | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        profile = config.profile
        self.config = config
        self.clock = ManualClock()
        self.hasher = BlockHasher(config.hash_algo, profile.block_size)
        if digests is not None and (
            digests.hasher.block_size != profile.block_size or digests.hasher.algo != config.hash_algo
        ):
            raise ConfigError("the digest cache was built for another block size or algorithm")
        self.digests = digests or DigestCache(self.hasher)
        engine_config = EngineConfig(
            num_gpu_blocks=profile.num_gpu_blocks,
            max_model_len=profile.max_model_len,
            block_size=profile.block_size,
            max_num_seqs=profile.max_num_seqs,
            max_num_batched_tokens=profile.max_num_batched_tokens,
            timing=profile.timing,
        )
        self.names = tuple(ReplicaId(f"r{i}") for i in range(config.num_replicas))
        self.engines = {name: EngineModel(engine_config, hasher=self.hasher) for name in self.names}
        rate = _profile_prefill_rate(profile)
        rng = random.Random(config.seed)
        self.router = RouterCore(
            [PoolSpec(POOL, tuple(ReplicaSpec(n, rate) for n in self.names),
                      block_size=profile.block_size, hash_algo=config.hash_algo)],
            lambda: make_policy(config.policy, rng, **config.policy_params),
            clock=self.clock,
        )
        self._needs_text = self.router._pools[POOL].policy.needs_text  # noqa: SLF001
        self.workload = list(workload)
        self._progress = progress
        self._heap: list[tuple[float, int, int, object]] = []
        self._counter = 0
        self._busy: set[ReplicaId] = set()
        self._event_seq: dict[ReplicaId, int] = defaultdict(int)
        self._scraped_at: dict[ReplicaId, float] = {}
        self._records: dict[str, RequestRecord] = {}
        self._where: dict[str, ReplicaId] = {}
        self._dependents: dict[str, list[WorkloadRequest]] = defaultdict(list)
        self._itl = array("d")
        self._samples: list[tuple[float, tuple[int, ...]]] = []

    # -- driving ----------------------------------------------------------------------

    def run(self) -> FleetResult:
        for request in self.workload:
            if request.depends_on is None:
                self._push(request.arrival_s, _ARRIVE, request)
            else:
                self._dependents[request.depends_on].append(request)
        if self._heap:
            self._push(self._heap[0][0], _SAMPLE, None)
        open_requests = len(self.workload)
        done = 0
        while self._heap:
            when, _, kind, data = heapq.heappop(self._heap)
            if when > self.config.max_virtual_s:
                break
            self.clock.set(max(when, self.clock.now()))
            if kind == _ARRIVE:
                self._arrive(data)  # type: ignore[arg-type]
            elif kind == _STEP_DONE:
                replica, result = data  # type: ignore[misc]
                finished = self._step_done(replica, result)
                done += finished
                if finished and self._progress is not None:
                    self._progress(finished)
            elif kind == _EVENTS:
                replica, batch = data  # type: ignore[misc]
                self.router.apply_events(replica, batch)
            elif kind == _SAMPLE:
                self._sample()
                if done + self._num_rejected() < open_requests:
                    self._push(when + self.config.sample_interval_s, _SAMPLE, None)
        metrics = [engine.metrics() for engine in self.engines.values()]
        return FleetResult(
            config=self.config,
            records=[self._records[r.request_id] for r in self.workload if r.request_id in self._records],
            itl_s=self._itl,
            load_samples=self._samples,
            replica_names=tuple(self.names),
            prefix_cache_queries=sum(m.prefix_cache_queries_total for m in metrics),
            prefix_cache_hits=sum(m.prefix_cache_hits_total for m in metrics),
            preemptions=sum(m.num_preemptions_total for m in metrics),
            end_s=self.clock.now(),
        )

    def _num_rejected(self) -> int:
        return sum(1 for r in self._records.values() if r.rejected)

    def _push(self, when: float, kind: int, data: object) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (when, self._counter, kind, data))

    def _arrive(self, request: WorkloadRequest) -> None:
        now = self.clock.now()
        tenant = TenantName(request.tenant) if request.tenant else DEFAULT_TENANT
        salt = f"salt-{tenant}" if self.config.salt_tenants and request.tenant else None
        digests, wire = self.digests.get(request, salt)
        tokens = request.prompt_token_ids
        record = RequestRecord(request.request_id, now, num_prompt_tokens=len(tokens))
        self._records[request.request_id] = record
        decision = self.router.route(RouteRequest(
            request_id=RequestId(request.request_id),
            pool=POOL,
            scope=TenantScope(tenant),
            num_prompt_tokens=len(tokens),
            prompt_token_ids=tokens,
            block_hashes=wire,
            routing_text=tokens_as_text(tokens) if self._needs_text else "",
            cache_salt=salt,
            session_id=request.session_id,
            expected_output_tokens=request.output_tokens,
        ))
        replica = decision.replica
        record.replica = replica
        record.expected_cached_tokens = decision.expected_cached_tokens
        admission = self.engines[replica].add_request(EngineRequest(
            request_id=request.request_id,
            prompt_token_ids=tokens,
            max_tokens=request.output_tokens,
            output_length=request.output_tokens,
            cache_salt=salt,
            prompt_block_hashes=digests,
            arrival_s=now,
        ))
        if isinstance(admission, Rejection):
            record.rejected = admission.kind.value
            self.router.on_complete(replica, RequestId(request.request_id))
            self._release_dependents(request.request_id, now)
            return
        self._where[request.request_id] = replica
        if replica not in self._busy:
            self._start_step(replica)

    def _start_step(self, replica: ReplicaId) -> None:
        engine = self.engines[replica]
        if not engine.has_work():
            self._busy.discard(replica)
            return
        self._busy.add(replica)
        result = engine.step()
        self._push(self.clock.now() + result.duration_s, _STEP_DONE, (replica, result))

    def _step_done(self, replica: ReplicaId, result: StepResult) -> int:
        now = self.clock.now()
        finished = 0
        for out in result.outputs:
            record = self._records[out.request_id]
            if out.new_token_ids:
                if out.first_token:
                    record.first_token_s = now
                    record.num_cached_tokens = out.num_cached_tokens
                    self.router.on_first_token(replica, RequestId(out.request_id))
                elif record.last_token_s is not None:
                    gap = now - record.last_token_s
                    for _ in out.new_token_ids:
                        self._itl.append(gap / len(out.new_token_ids))
                record.last_token_s = now
            record.num_output_tokens = out.num_output_tokens
            if out.finished:
                record.finish_s = now
                record.finish_reason = out.finish_reason
                self.router.on_complete(replica, RequestId(out.request_id))
                self._where.pop(out.request_id, None)
                self._release_dependents(out.request_id, now)
                finished += 1
        if result.events:
            seq = self._event_seq[replica]
            self._event_seq[replica] = seq + 1
            batch = EventBatch(seq=seq, ts=now, events=tuple(result.events), data_parallel_rank=0)
            self._push(now + self.config.event_latency_s, _EVENTS, (replica, batch))
        if now - self._scraped_at.get(replica, -1e18) >= self.config.metrics_interval_s:
            self._scraped_at[replica] = now
            metrics = self.engines[replica].metrics()
            self.router.on_engine_metrics(
                replica, running=metrics.num_requests_running,
                waiting=metrics.num_requests_waiting, kv_usage=metrics.kv_cache_usage_perc,
            )
        self._start_step(replica)
        return finished

    def _release_dependents(self, request_id: str, now: float) -> None:
        for follower in self._dependents.pop(request_id, ()):
            self._push(now + (follower.think_time_s or 0.0), _ARRIVE, follower)

    def _sample(self) -> None:
        loads = []
        for name in self.names:
            m = self.engines[name].metrics()
            loads.append(m.num_requests_running + m.num_requests_waiting)
        self._samples.append((self.clock.now(), tuple(loads)))


def _profile_prefill_rate(profile: TimingProfile) -> float:
    """The prefill rate (tokens/s) a profile implies for a full-budget chunk: the router's
    starting point before it learns each replica's real rate."""
    t = profile.timing
    chunk = profile.max_num_batched_tokens
    step = t.fixed_s + t.prefill_token_s * chunk + t.context_token_s * chunk
    return chunk / step if step > 0 else 1e9


def simulate(
    workload: Sequence[WorkloadRequest],
    config: FleetConfig,
    *,
    digests: DigestCache | None = None,
) -> FleetResult:
    """Run ``workload`` through a fleet built from ``config`` and return the result."""
    return FleetSimulation(config, workload, digests=digests).run()
