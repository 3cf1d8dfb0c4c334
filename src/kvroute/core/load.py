"""Per-replica load as the router sees it: outstanding prefill, decoding requests, learned speed.

``LoadTracker`` is the single owner of this state. It is told about every request the router
dispatches (``on_dispatch``), its first token (``on_first_token``) and its end
(``on_complete``), and about what the engine itself reports (``on_engine_metrics``).

Why tokens and not request counts: a replica with three queued 40k-token prompts is far busier
than one with ten 200-token chats. Counting requests (what SGLang's router and vllm-router do)
is the root of their hot spots and of the "nothing in flight at decision time" failure
(Infera#103). Outstanding *prefill tokens* predict how long a new request waits for its first
token; the count of *decoding* requests predicts how much each engine step slows down.

Learning the speed: when a request's first token arrives, the router knows how many prefill
tokens were ahead of it and how many it had to compute itself; their sum over the observed
time to first token is one sample of the replica's prefill rate. An exponentially weighted
average of those samples (clamped to a sane band around the configured profile rate) makes
heterogeneous replicas (a slower GPU, a noisy neighbour) cost what they really cost.

Draining the queue between events: a replica that started a 100k-token prefill four seconds
ago has far less than 100k tokens left, but nothing tells the router until the first token
arrives. The tracker therefore keeps a *backlog* that drains at the learned rate while time
passes (``snapshot(replica, now_s)``), never above the outstanding tokens and reset to them
whenever a first token or a completion reports progress. Without it, every replica that
recently took a long prompt looks busy for the whole prefill, and long-context traffic piles
onto the others.

The engine's ``/metrics`` corrects the router-local view: several router processes share the
fleet, and an engine restart drops requests the router still counts. The effective queue is
the larger of the router's own outstanding tokens and the engine's waiting-request count times
the mean prompt size the router has seen there.

Invariants:
    * ``outstanding_prefill_tokens`` and ``num_decoding`` never go below zero;
    * a request id is counted at most once per replica, and completing or forgetting an unknown
      id is a no-op (it is counted in ``num_unknown_completions``), never an error: events
      arrive late, twice, or after a replica was removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvroute.core.types import ReplicaId, RequestId

DEFAULT_RATE_EWMA_ALPHA = 0.2
RATE_CLAMP_FACTOR = 10.0


class ReplicaLoad(NamedTuple):
    """A snapshot of one replica's load, the input every policy scores.

    A named tuple, not a frozen dataclass: every decision builds one per replica, and a
    tuple is built in a third of the time a frozen dataclass's ``__init__`` takes, immutable
    all the same.

    Attributes:
        outstanding_prefill_tokens: prompt tokens dispatched there that have not produced a
            first token yet (the engine's prefill queue, in the router's view, corrected by
            the engine's own waiting count).
        num_in_flight: requests dispatched and not completed (what count-based peers use).
        num_decoding: requests past their first token and still generating.
        prefill_rate_tps: learned prefill speed in tokens per second.
        engine_running: ``vllm:num_requests_running`` at the last scrape (``None`` unknown).
        engine_waiting: ``vllm:num_requests_waiting`` at the last scrape (``None`` unknown).
        kv_usage: ``vllm:kv_cache_usage_perc`` (0..1) at the last scrape (``None`` unknown).
        active_kv_tokens: prompt + expected output tokens of the requests in flight (the KV
            footprint Dynamo's decode term counts, in tokens).
        last_chosen_s: clock time this replica was last chosen (for least-recently-chosen ties).
    """

    outstanding_prefill_tokens: int = 0
    num_in_flight: int = 0
    num_decoding: int = 0
    prefill_rate_tps: float = 1.0
    engine_running: int | None = None
    engine_waiting: int | None = None
    kv_usage: float | None = None
    active_kv_tokens: int = 0
    last_chosen_s: float = float("-inf")


@dataclass(slots=True)
class _InFlight:
    prefill_tokens: int
    queue_ahead_tokens: int
    kv_tokens: int
    dispatched_s: float
    decoding: bool = False


@dataclass(slots=True)
class _ReplicaRecord:
    base_rate_tps: float
    rate_tps: float
    in_flight: dict[RequestId, _InFlight] = field(default_factory=dict)
    outstanding_prefill_tokens: int = 0
    num_decoding: int = 0
    active_kv_tokens: int = 0
    engine_running: int | None = None
    engine_waiting: int | None = None
    kv_usage: float | None = None
    mean_prompt_tokens: float = 0.0
    num_prompts_seen: int = 0
    last_chosen_s: float = float("-inf")
    backlog_tokens: float = 0.0
    backlog_at_s: float = 0.0

    def drained_backlog(self, now_s: float) -> float:
        """The backlog left at ``now_s`` if the replica kept prefilling at its learned rate."""
        elapsed = max(0.0, now_s - self.backlog_at_s)
        return max(0.0, min(float(self.outstanding_prefill_tokens),
                            self.backlog_tokens - self.rate_tps * elapsed))

    def set_backlog(self, tokens: float, now_s: float) -> None:
        self.backlog_tokens = max(0.0, min(float(self.outstanding_prefill_tokens), tokens))
        self.backlog_at_s = now_s


class LoadTracker:
    """Owns every replica's router-side load and learned prefill rate (see module docstring)."""

    def __init__(self, *, rate_ewma_alpha: float = DEFAULT_RATE_EWMA_ALPHA) -> None:
        if not 0.0 < rate_ewma_alpha <= 1.0:
            raise ValueError(f"rate_ewma_alpha must be in (0, 1], got {rate_ewma_alpha}")
        self._alpha = rate_ewma_alpha
        self._replicas: dict[ReplicaId, _ReplicaRecord] = {}
        self.num_unknown_completions = 0

    # -- membership -------------------------------------------------------------------------

    def add_replica(self, replica: ReplicaId, *, prefill_rate_tps: float) -> None:
        """Start tracking ``replica`` with a configured (profile) prefill rate.

        Re-adding a known replica keeps its learned state and only updates the base rate.
        """
        if prefill_rate_tps <= 0:
            raise ValueError(
                f"prefill_rate_tps for replica {replica!r} must be > 0, got {prefill_rate_tps}"
            )
        record = self._replicas.get(replica)
        if record is None:
            self._replicas[replica] = _ReplicaRecord(prefill_rate_tps, prefill_rate_tps)
        else:
            record.base_rate_tps = prefill_rate_tps

    def remove_replica(self, replica: ReplicaId) -> None:
        """Forget ``replica`` and everything in flight there."""
        self._replicas.pop(replica, None)

    def reset_replica(self, replica: ReplicaId) -> None:
        """Drop what is in flight on ``replica`` (it restarted), keeping its learned rate."""
        record = self._replicas.get(replica)
        if record is None:
            return
        record.in_flight.clear()
        record.outstanding_prefill_tokens = 0
        record.backlog_tokens = 0.0
        record.num_decoding = 0
        record.active_kv_tokens = 0

    def replicas(self) -> list[ReplicaId]:
        return list(self._replicas)

    # -- request lifecycle ------------------------------------------------------------------

    def on_dispatch(
        self,
        replica: ReplicaId,
        request_id: RequestId,
        *,
        prefill_tokens: int,
        prompt_tokens: int,
        expected_output_tokens: int,
        now_s: float,
    ) -> None:
        """Count a request sent to ``replica`` that must still compute ``prefill_tokens``."""
        record = self._record(replica)
        if request_id in record.in_flight:
            return
        prefill_tokens = max(0, prefill_tokens)
        kv_tokens = max(0, prompt_tokens) + max(0, expected_output_tokens)
        ahead = record.drained_backlog(now_s)
        record.in_flight[request_id] = _InFlight(
            prefill_tokens=prefill_tokens,
            # The work really ahead of it (drained backlog), not the raw outstanding count:
            # the raw count would credit the replica with tokens it computed before this
            # request arrived and inflate its learned rate.
            queue_ahead_tokens=int(ahead),
            kv_tokens=kv_tokens,
            dispatched_s=now_s,
        )
        backlog = ahead + prefill_tokens
        record.outstanding_prefill_tokens += prefill_tokens
        record.set_backlog(backlog, now_s)
        record.active_kv_tokens += kv_tokens
        record.num_prompts_seen += 1
        record.mean_prompt_tokens += (prompt_tokens - record.mean_prompt_tokens) / min(
            record.num_prompts_seen, 256
        )
        record.last_chosen_s = now_s

    def on_first_token(self, replica: ReplicaId, request_id: RequestId, *, now_s: float) -> None:
        """The request produced its first token: its prefill is done; learn the rate."""
        record = self._replicas.get(replica)
        flight = record.in_flight.get(request_id) if record else None
        if record is None or flight is None or flight.decoding:
            return
        flight.decoding = True
        backlog = record.drained_backlog(now_s)
        record.outstanding_prefill_tokens = max(
            0, record.outstanding_prefill_tokens - flight.prefill_tokens
        )
        record.set_backlog(backlog, now_s)
        record.num_decoding += 1
        ttft_s = now_s - flight.dispatched_s
        work_tokens = flight.queue_ahead_tokens + flight.prefill_tokens
        # Tiny prefills are dominated by fixed step costs and say little about the rate.
        if ttft_s > 0 and work_tokens >= 256:
            sample = work_tokens / ttft_s
            low = record.base_rate_tps / RATE_CLAMP_FACTOR
            high = record.base_rate_tps * RATE_CLAMP_FACTOR
            sample = min(max(sample, low), high)
            record.rate_tps += self._alpha * (sample - record.rate_tps)

    def on_complete(self, replica: ReplicaId, request_id: RequestId) -> None:
        """The request ended (finished, failed or cancelled): release all it counted."""
        record = self._replicas.get(replica)
        flight = record.in_flight.pop(request_id, None) if record else None
        if record is None or flight is None:
            self.num_unknown_completions += 1
            return
        if flight.decoding:
            record.num_decoding = max(0, record.num_decoding - 1)
        else:
            record.outstanding_prefill_tokens = max(
                0, record.outstanding_prefill_tokens - flight.prefill_tokens
            )
            record.backlog_tokens = min(record.backlog_tokens,
                                        float(record.outstanding_prefill_tokens))
        record.active_kv_tokens = max(0, record.active_kv_tokens - flight.kv_tokens)

    def on_engine_metrics(
        self,
        replica: ReplicaId,
        *,
        running: int | None,
        waiting: int | None,
        kv_usage: float | None,
    ) -> None:
        """Record what the engine's ``/metrics`` says about itself."""
        record = self._replicas.get(replica)
        if record is None:
            return
        record.engine_running = running
        record.engine_waiting = waiting
        record.kv_usage = kv_usage

    # -- reading ----------------------------------------------------------------------------

    def snapshot(self, replica: ReplicaId, now_s: float | None = None) -> ReplicaLoad:
        """The load a policy should score for ``replica``.

        With ``now_s``, outstanding prefill is the backlog drained at the learned rate since
        the last progress report (see the module docstring); without it, the raw count.
        """
        record = self._replicas.get(replica)
        if record is None:
            record = self._record(replica)  # raises the KeyError that names the replica
        outstanding = record.outstanding_prefill_tokens
        if now_s is not None and outstanding:  # nothing outstanding drains to 0 anyway
            outstanding = int(record.drained_backlog(now_s))
        if record.engine_waiting:
            # Work queued by other router processes (or before our restart) is invisible to
            # our own accounting; the engine's waiting count times a typical prompt is a floor.
            outstanding = max(outstanding, int(record.engine_waiting * record.mean_prompt_tokens))
        return ReplicaLoad(  # positional (field order): the fastest way to build one
            outstanding, len(record.in_flight), record.num_decoding, record.rate_tps,
            record.engine_running, record.engine_waiting, record.kv_usage,
            record.active_kv_tokens, record.last_chosen_s,
        )

    def _record(self, replica: ReplicaId) -> _ReplicaRecord:
        record = self._replicas.get(replica)
        if record is None:
            raise KeyError(f"replica {replica!r} is not tracked; call add_replica first")
        return record
