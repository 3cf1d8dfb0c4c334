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
``on_first_token`` returns the sample it learned from (``RateSample``: no id in it), and
sibling routers fold a peer's sample in with ``learn_rate`` (``core/peers.py``): each router
then learns from every first token of the fleet, not from its own share of them. The
inter-token factor below is shared the same way (``on_complete`` returns its sample,
``learn_itl_scale`` folds in a peer's).

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

Decoding, and what a new request would do to it: a replica's inter-token latency is one engine
step, ``fixed + seq·(sequences decoding) + context_token·(context tokens they read)``
(``DecodeTiming``, the engine model's step law without the prefill part). The tracker keeps,
per replica, the decoding requests' context (prompt plus half their predicted output) and
their predicted remaining output, which drains at the predicted inter-token latency since
each one's first token; and it learns a per-replica factor (``itl_scale``) from every answer
that ends with its token count: observed inter-token latency over the one the model
predicted at its first token. The cost policy prices a new request's own decode and the
slowdown it causes to the streams already there with these (docs/architecture.md, "The cost
model").

Sessions at rest, and the KV they hold: when a request of a session ends, its blocks stay in
the engine's prefix cache, free (no request holds them) but cached, until the engine's LRU
evicts them to make room. The tracker remembers each such session on the replica it ended
on (``resting``: its context, prompt plus answer, and when it ended) until the session sends
its next request (anywhere: then its blocks are in use again or it moved) or
``SESSION_RETURN_S`` passes (it is then unlikely to come back soon, and its blocks are the
oldest in the LRU order, evicted first). With the replica's KV capacity (from the engine's
``vllm:cache_config_info``) and what its requests in flight hold, the cost policy prices the
resting sessions' blocks a placement would evict (docs/architecture.md, "The cost model").

Learned speeds must not lock in: a replica that once looked slow would never be sent another
request to show otherwise. A prefill rate learned *below* the configured one therefore decays
back toward it with a half-life (``RATE_STALE_HALF_LIFE_S``) since its last sample, so an
idle replica is tried again and re-sampled; a rate above the configured one needs no such
care (the replica gets traffic, and samples, because it looks fast).

Invariants:
    * ``outstanding_prefill_tokens`` and ``num_decoding`` never go below zero;
    * a request id is counted at most once per replica, and completing or forgetting an unknown
      id is a no-op (it is counted in ``num_unknown_completions``), never an error: events
      arrive late, twice, or after a replica was removed.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from kvroute.core.types import ReplicaId, RequestId

DEFAULT_RATE_EWMA_ALPHA = 0.2
RATE_CLAMP_FACTOR = 10.0
RATE_STALE_HALF_LIFE_S = 30.0
"""A prefill rate learned below the configured one is halfway back to it after this long
without a new sample (module docstring)."""
ITL_SCALE_BOUNDS = (0.1, 10.0)
"""The learned inter-token factor stays within these (a sample outside is clamped)."""
MIN_RATE_SAMPLE_S = 0.01
"""A first token sooner than this after dispatch is mostly HTTP and a step's fixed cost, not
prefill: it teaches no rate (one such sample would make an idle replica look many times
faster than its peers and keep them out)."""
MIN_RATE_SAMPLE_TOKENS = 256
"""Work (queue ahead plus own prefill) below this is mostly fixed step costs: no rate sample."""
MIN_ITL_SAMPLE_TOKENS = 8
"""Answers shorter than this say little about the inter-token latency and teach nothing."""
SESSION_RETURN_S = 300.0
"""A session whose last request ended less than this long ago is likely to send its next
one: its cached context counts as ``resting_session_tokens`` (module docstring)."""
SESSION_REST_PRIOR_S = 60.0
"""The mean time a session rests between its requests before any session was seen to return
(``LoadTracker.session_rest_s``); the learned mean replaces it after a few returns."""
ANSWER_SAMPLE = 2048
"""Answer lengths kept (the most recent) to estimate how much longer an answer that has
outrun its prediction will go on (``AnswerLengths``)."""
MIN_LONGER_ANSWERS = 4
"""Answers longer than a request's output so far needed to estimate its remaining output
from them; with fewer, an answer past its prediction is taken to end now."""
MAX_RESTING_SESSIONS = 4096
"""Resting sessions remembered per replica (the oldest is forgotten first): a bound on
memory, far above the sessions one engine's KV holds."""


@dataclass(frozen=True, slots=True)
class DecodeTiming:
    """One decode step's duration, as the engine model times it without prefill:
    ``fixed_s + seq_s · sequences + context_token_s · context tokens read``.

    The defaults are the ``llama-3.1-8b-h100`` profile's (``sim/profiles.py``, derived from
    the model's size and the GPU's bandwidth); a pool of other engines sets its own
    (``pools.<name>.decode_timing``), and the per-replica ``itl_scale`` corrects the rest.
    """

    fixed_s: float = 6.0e-3
    seq_s: float = 20e-6
    context_token_s: float = 5.0e-8

    def __post_init__(self) -> None:
        if min(self.fixed_s, self.seq_s, self.context_token_s) < 0:
            raise ValueError(f"decode timing constants must be >= 0, got {self}")

    def step_s(self, num_sequences: float, context_tokens: float) -> float:
        """One step's duration with ``num_sequences`` decoding over ``context_tokens``."""
        return self.fixed_s + self.seq_s * num_sequences + self.context_token_s * context_tokens


DEFAULT_DECODE_TIMING: Final = DecodeTiming()


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
        decoding_context_tokens: context the decoding requests read each step (their prompts
            plus half their predicted outputs).
        decode_tokens_left: output tokens the decoding requests are predicted still to make
            (each one's prediction less what it made; 0 for one past its prediction).
        overdue_tokens_left: what the decoding requests that outran their predictions will
            likely still make: the mean residual of recent answers that long
            (``AnswerLengths``).
        prefill_duty: the share of the replica's time its recent prefills take: the prefill
            tokens dispatched there (a split's prefill half included), each decayed by
            ``exp(−age / PREFILL_DUTY_WINDOW_S)``, over ``PREFILL_DUTY_WINDOW_S`` seconds at
            the learned rate; at most ``PREFILL_DUTY_MAX``. Prefill chunks share the engine's
            steps with the decodes, so a stream there decodes about ``1 / (1 − duty)`` times
            slower than the step model says; a disaggregated pool prices that
            (``core/disagg.py``).
        waiting_context_tokens / waiting_output_tokens: the same for the requests still
            waiting for their first token (they will decode beside a request sent now).
        rate_age_s: seconds since ``prefill_rate_tps`` last learned from a sample (infinite
            when it never did: the rate is the configured one).
        itl_scale: learned factor on the decode step model for this replica (1: as modelled).
        kv_capacity_tokens: the replica's KV cache size in tokens (0: unknown).
        kv_used_tokens: KV tokens its requests in flight hold (the larger of the engine's
            reported usage and the router's own count of their contexts).
        resting_session_tokens: cached context of the sessions that ended a request there
            less than ``SESSION_RETURN_S`` ago and have not sent their next one.
        resting_sessions / resting_other_tokens: how many sessions rest there, and their
            cached context, leaving out the session of the request being routed (its own
            return is not a stranger joining its batch; ``snapshot(..., session=)``).
        session_rest_s: the fleet's learned mean time from a session's request ending to its
            next one being sent (``SESSION_REST_PRIOR_S`` until sessions were seen to return):
            how soon a resting session is likely to be back in a batch.
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
    decoding_context_tokens: int = 0
    decode_tokens_left: float = 0.0
    itl_scale: float = 1.0
    waiting_context_tokens: int = 0
    waiting_output_tokens: int = 0
    rate_age_s: float = 0.0
    kv_capacity_tokens: int = 0
    kv_used_tokens: int = 0
    resting_session_tokens: int = 0
    resting_sessions: int = 0
    resting_other_tokens: int = 0
    session_rest_s: float = SESSION_REST_PRIOR_S
    overdue_tokens_left: float = 0.0
    prefill_duty: float = 0.0


PREFILL_DUTY_WINDOW_S = 30.0
"""The time constant of a replica's prefill duty: the prefill tokens dispatched there decay
as ``exp(−age / window)``, so the duty is the recent prefill work over ``window`` seconds of
the replica's rate."""
PREFILL_DUTY_MAX = 0.9
"""The most a duty sample counts (a stream is never priced as stalled for good)."""


class AnswerLengths:
    """The lengths of recent answers, and what they say of an answer still running.

    ``remaining(k)``: the mean of ``L − k`` over the answers ``L`` longer than ``k``, the
    mean residual output of an answer that has made ``k`` tokens. It matters for answers
    that have outrun their prediction: counting them as about to end (0 left) is wrong when
    answer lengths are heavy-tailed. On the Claude Code agentic trace an answer that reached
    369 tokens (the mean) makes 633 more on average, one that reached 1,000 makes 1,257 more;
    on the Mooncake conversation trace 171 and 477. The load tracker counts an in-flight
    answer's left tokens as its prediction less what it made, or, once past its prediction,
    this (``overdue_tokens_left``).
    """

    __slots__ = ("_dirty", "_lengths", "_next", "_sorted", "_suffix")

    def __init__(self) -> None:
        self._lengths: list[int] = []
        self._next = 0
        self._sorted: list[int] = []
        self._suffix: list[int] = [0]
        self._dirty = False

    def __len__(self) -> int:
        return len(self._lengths)

    def add(self, tokens: int) -> None:
        """An answer ended with ``tokens`` output tokens."""
        if len(self._lengths) < ANSWER_SAMPLE:
            self._lengths.append(tokens)
        else:
            self._lengths[self._next] = tokens
            self._next = (self._next + 1) % ANSWER_SAMPLE
        self._dirty = True

    def remaining(self, made: float) -> float:
        """Mean output still to come of an answer that has made ``made`` tokens (0 when
        fewer than ``MIN_LONGER_ANSWERS`` known answers were longer)."""
        if self._dirty:
            self._sorted = sorted(self._lengths)
            suffix = [0] * (len(self._sorted) + 1)
            for i in range(len(self._sorted) - 1, -1, -1):
                suffix[i] = suffix[i + 1] + self._sorted[i]
            self._suffix = suffix
            self._dirty = False
        first = bisect.bisect_right(self._sorted, made)
        longer = len(self._sorted) - first
        if longer < MIN_LONGER_ANSWERS:
            return 0.0
        return self._suffix[first] / longer - made


@dataclass(frozen=True, slots=True)
class RateSample:
    """One measurement of a replica's prefill rate, taken where the request was timed:
    ``work_tokens`` (the drained queue ahead of the request plus its own prefill) computed in
    ``ttft_s`` (its dispatch to its first token, on the timing router's clock). Holds no id:
    it goes on the cluster bus as is (``core/peers.FirstToken``)."""

    work_tokens: int
    ttft_s: float

    def problem(self) -> str | None:
        """Why this is no measurement (a peer's garbage), or None."""
        if type(self.work_tokens) is not int or self.work_tokens < 0:
            return f"work_tokens must be an int >= 0, got {self.work_tokens!r}"
        if not isinstance(self.ttft_s, (int, float)) or isinstance(self.ttft_s, bool):
            return f"ttft_s must be a number, got {self.ttft_s!r}"
        if not (math.isfinite(self.ttft_s) and self.ttft_s > 0.0):
            return f"ttft_s must be finite and > 0 seconds, got {self.ttft_s!r}"
        return None

    def teaches(self) -> bool:
        """Whether the sample says something of the rate: tiny prefills and very quick first
        tokens are dominated by fixed step costs (``MIN_RATE_SAMPLE_S``, ``_TOKENS``)."""
        return self.ttft_s >= MIN_RATE_SAMPLE_S and self.work_tokens >= MIN_RATE_SAMPLE_TOKENS


@dataclass(slots=True)
class _InFlight:
    prefill_tokens: int
    queue_ahead_tokens: int
    kv_tokens: int
    dispatched_s: float
    context_tokens: int = 0
    predicted_output_tokens: int = 0
    decoding: bool = False
    first_token_s: float = 0.0
    predicted_step_s: float = 0.0
    prefill_mark: int = 0
    session: str | None = None


@dataclass(slots=True)
class _ReplicaRecord:
    base_rate_tps: float
    rate_tps: float
    timing: DecodeTiming = DEFAULT_DECODE_TIMING
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
    rate_sampled_s: float = float("-inf")
    decoding_context_tokens: int = 0
    decode_output_sum: int = 0
    itl_scale: float = 1.0
    prefill_dispatched_total: int = 0
    waiting_context_tokens: int = 0
    waiting_output_tokens: int = 0
    kv_capacity_tokens: int = 0
    resting: OrderedDict[str, tuple[int, float]] = field(default_factory=OrderedDict)
    """Sessions at rest here: session → (cached context tokens, end time), oldest first."""
    resting_tokens: int = 0
    recent_prefill_tokens: float = 0.0
    recent_prefill_at_s: float = 0.0

    def recent_prefill(self, now_s: float | None) -> float:
        """The prefill tokens dispatched here, each decayed by ``exp(−age / window)``."""
        if now_s is None or not self.recent_prefill_tokens:
            return self.recent_prefill_tokens
        age = max(0.0, now_s - self.recent_prefill_at_s)
        return self.recent_prefill_tokens * math.exp(-age / PREFILL_DUTY_WINDOW_S)

    def duty(self, now_s: float | None) -> float:
        """The share of the replica's time its recent prefills take (module docstring of
        ``ReplicaLoad.prefill_duty``), at most ``PREFILL_DUTY_MAX``."""
        tokens = self.recent_prefill(now_s)
        if not tokens:
            return 0.0
        return min(PREFILL_DUTY_MAX, tokens / (PREFILL_DUTY_WINDOW_S * max(self.rate_tps, 1e-9)))

    def drop_resting(self, session: str) -> None:
        entry = self.resting.pop(session, None)
        if entry is not None:
            self.resting_tokens -= entry[0]

    def oldest_resting(self, now_s: float | None) -> str | None:
        """The session resting longest if it is to be forgotten (more than
        ``MAX_RESTING_SESSIONS`` remembered, or at rest ``SESSION_RETURN_S``), else None."""
        if not self.resting:
            return None
        session, (_, ended_s) = next(iter(self.resting.items()))
        if len(self.resting) > MAX_RESTING_SESSIONS or (
                now_s is not None and ended_s <= now_s - SESSION_RETURN_S):
            return session
        return None

    def effective_rate(self, now_s: float | None) -> float:
        """The learned prefill rate; one below the configured rate decays back toward it
        since its last sample (module docstring)."""
        rate = self.rate_tps
        if now_s is None or rate >= self.base_rate_tps:
            return rate
        age = now_s - self.rate_sampled_s
        if age <= 0.0:
            return rate
        return self.base_rate_tps - (self.base_rate_tps - rate) * math.exp2(
            -age / RATE_STALE_HALF_LIFE_S)

    def step_s(self) -> float:
        """The replica's decode step now, as modelled and learned."""
        return self.timing.step_s(self.num_decoding, self.decoding_context_tokens) * self.itl_scale

    def decode_left_each(self, now_s: float,
                         answers: AnswerLengths) -> tuple[float, float]:
        """``(predicted, overdue)`` at ``now_s``: the output its decoding requests are
        predicted still to make, each one's prediction less what it made (one past its
        prediction counts 0, and takes nothing off the others'); and what those past their
        predictions will likely still make, the mean residual of answers that long."""
        if not self.num_decoding:
            return 0.0, 0.0
        step = self.step_s()
        if step <= 0:
            return float(self.decode_output_sum), 0.0
        predicted = overdue = 0.0
        for flight in self.in_flight.values():
            if flight.decoding:
                made = (now_s - flight.first_token_s) / step
                if made < flight.predicted_output_tokens:
                    predicted += flight.predicted_output_tokens - made
                elif answers:
                    overdue += answers.remaining(made)
        return predicted, overdue

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
        self._resting_on: dict[str, ReplicaId] = {}
        """Where each resting session rests (a session rests on one replica at most)."""
        self._rest_mean_s = SESSION_REST_PRIOR_S
        """Learned mean rest of a session between its requests (``session_rest_s``)."""
        self.answers = AnswerLengths()
        """Recent answer lengths: the output an answer past its prediction has left."""
        self.num_unknown_completions = 0

    # -- membership -------------------------------------------------------------------------

    def add_replica(self, replica: ReplicaId, *, prefill_rate_tps: float,
                    decode_timing: DecodeTiming = DEFAULT_DECODE_TIMING,
                    kv_capacity_tokens: int | None = None) -> None:
        """Start tracking ``replica`` with a configured (profile) prefill rate, decode step
        model and, when known, KV capacity (the engine may report it later,
        ``on_engine_metrics``).

        Re-adding a known replica keeps its learned state and only updates the base values.
        """
        if prefill_rate_tps <= 0:
            raise ValueError(
                f"prefill_rate_tps for replica {replica!r} must be > 0, got {prefill_rate_tps}"
            )
        record = self._replicas.get(replica)
        if record is None:
            record = self._replicas[replica] = _ReplicaRecord(prefill_rate_tps,
                                                              prefill_rate_tps, decode_timing)
        else:
            record.base_rate_tps = prefill_rate_tps
            record.timing = decode_timing
        if kv_capacity_tokens is not None:
            record.kv_capacity_tokens = max(0, kv_capacity_tokens)

    def remove_replica(self, replica: ReplicaId) -> None:
        """Forget ``replica``, everything in flight there and the sessions resting there."""
        record = self._replicas.pop(replica, None)
        if record is not None:
            for session in record.resting:
                self._resting_on.pop(session, None)

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
        record.decoding_context_tokens = 0
        record.decode_output_sum = 0
        record.waiting_context_tokens = 0
        record.waiting_output_tokens = 0
        for session in record.resting:  # a restarted engine's cache is empty
            self._resting_on.pop(session, None)
        record.resting.clear()
        record.resting_tokens = 0

    def forget_learned(self, replica: ReplicaId) -> None:
        """Forget what was learned of ``replica``'s speed (it now runs other weights):
        its prefill rate back to the configured one, its inter-token factor back to 1, and
        what is in flight dropped as by ``reset_replica``."""
        record = self._replicas.get(replica)
        if record is None:
            return
        self.reset_replica(replica)
        record.rate_tps = record.base_rate_tps
        record.rate_sampled_s = float("-inf")
        record.itl_scale = 1.0
        record.mean_prompt_tokens = 0.0
        record.num_prompts_seen = 0

    def move_resting(self, session: str, replica: ReplicaId) -> bool:
        """``session``'s next request is expected on ``replica`` now (a spread-ahead copy of
        its context went there, ``core/spread.py``): it rests there instead of where it
        ended, with the same context and end time, so other placements see it coming back
        there (the return and pressure terms) and its old replica looks as crowded as it
        will be. False, changing nothing, when it rests nowhere or ``replica`` is unknown."""
        home = self._resting_on.get(session)
        target = self._replicas.get(replica)
        home_record = self._replicas.get(home) if home is not None else None
        if home_record is None or target is None or home == replica:
            return False
        entry = home_record.resting.get(session)
        if entry is None:
            return False
        home_record.drop_resting(session)
        target.drop_resting(session)
        target.resting[session] = entry
        target.resting_tokens += entry[0]
        self._resting_on[session] = replica
        self._forget_resting(target, None)
        return True

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
        predicted_output_tokens: int | None = None,
        session: str | None = None,
    ) -> None:
        """Count a request sent to ``replica`` that must still compute ``prefill_tokens``.

        ``expected_output_tokens`` (the budget) counts in its KV footprint;
        ``predicted_output_tokens`` (what it will likely produce; the budget when None)
        in the decode it adds once its first token comes. ``session`` (a session key) is
        no longer at rest anywhere; it rests here once this request ends.
        """
        record = self._record(replica)
        if request_id in record.in_flight:
            return
        if session is not None:
            home = self._resting_on.pop(session, None)
            home_record = self._replicas.get(home) if home is not None else None
            if home_record is not None:
                entry = home_record.resting.get(session)
                if entry is not None:  # it came back: one sample of how long sessions rest
                    self._rest_mean_s += self._alpha * (max(0.0, now_s - entry[1])
                                                        - self._rest_mean_s)
                home_record.drop_resting(session)
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
            context_tokens=max(0, prompt_tokens),
            predicted_output_tokens=max(0, expected_output_tokens if predicted_output_tokens
                                        is None else predicted_output_tokens),
            session=session,
        )
        backlog = ahead + prefill_tokens
        flight = record.in_flight[request_id]
        record.waiting_context_tokens += flight.context_tokens + flight.predicted_output_tokens // 2
        record.waiting_output_tokens += flight.predicted_output_tokens
        record.outstanding_prefill_tokens += prefill_tokens
        record.prefill_dispatched_total += prefill_tokens
        record.recent_prefill_tokens = record.recent_prefill(now_s) + prefill_tokens
        record.recent_prefill_at_s = now_s
        record.set_backlog(backlog, now_s)
        record.active_kv_tokens += kv_tokens
        record.num_prompts_seen += 1
        record.mean_prompt_tokens += (prompt_tokens - record.mean_prompt_tokens) / min(
            record.num_prompts_seen, 256
        )
        record.last_chosen_s = now_s

    def on_first_token(self, replica: ReplicaId, request_id: RequestId, *, now_s: float,
                       learn: bool = True) -> RateSample | None:
        """The request produced its first token: its prefill is done; learn the rate from it
        (unless ``learn`` is False: its time since dispatch is no sample of the rate).

        Returns the sample learned from (None: none), for sibling routers to learn from too
        (``core/peers.FirstToken``): they cannot time this request themselves.
        """
        record = self._replicas.get(replica)
        flight = record.in_flight.get(request_id) if record else None
        if record is None or flight is None or flight.decoding:
            return None
        flight.decoding = True
        flight.first_token_s = now_s
        flight.prefill_mark = record.prefill_dispatched_total
        context = flight.context_tokens + flight.predicted_output_tokens // 2
        record.waiting_context_tokens = max(0, record.waiting_context_tokens - context)
        record.waiting_output_tokens = max(0, record.waiting_output_tokens
                                           - flight.predicted_output_tokens)
        record.decoding_context_tokens += context
        record.decode_output_sum += flight.predicted_output_tokens
        backlog = record.drained_backlog(now_s)
        record.outstanding_prefill_tokens = max(
            0, record.outstanding_prefill_tokens - flight.prefill_tokens
        )
        record.set_backlog(backlog, now_s)
        record.num_decoding += 1
        flight.predicted_step_s = record.timing.step_s(record.num_decoding,
                                                       record.decoding_context_tokens)
        if not learn:
            return None
        sample = RateSample(flight.queue_ahead_tokens + flight.prefill_tokens,
                            now_s - flight.dispatched_s)
        if not sample.teaches():
            return None
        self.learn_rate(replica, sample, now_s=now_s)
        return sample

    def learn_rate(self, replica: ReplicaId, sample: RateSample, *, now_s: float) -> bool:
        """Fold one sample of ``replica``'s prefill rate into the learned one (clamped to
        ``RATE_CLAMP_FACTOR`` around the configured rate, then smoothed); whether it taught
        anything (not: an unknown replica, or a sample too short to say much).

        Raises:
            ValueError: ``sample`` is not a measurement (``RateSample.problem``).
        """
        problem = sample.problem()
        if problem is not None:
            raise ValueError(f"rate sample {sample!r} for replica {replica!r}: {problem}")
        record = self._replicas.get(replica)
        if record is None or not sample.teaches():
            return False
        rate = sample.work_tokens / sample.ttft_s
        low = record.base_rate_tps / RATE_CLAMP_FACTOR
        high = record.base_rate_tps * RATE_CLAMP_FACTOR
        rate = min(max(rate, low), high)
        record.rate_tps += self._alpha * (rate - record.rate_tps)
        record.rate_sampled_s = now_s
        return True

    def on_complete(self, replica: ReplicaId, request_id: RequestId, *,
                    now_s: float | None = None, output_tokens: int | None = None,
                    learn_itl: bool = True) -> float | None:
        """The request ended (finished, failed or cancelled): release all it counted.

        With ``now_s`` and the answer's ``output_tokens``, a decoded answer also teaches the
        replica's inter-token factor (module docstring), unless ``learn_itl`` is False
        (another router's request: its times here are when the news arrived). Returns the
        inter-token sample learned (observed over predicted step; None: none), for sibling
        routers to learn too (``learn_itl_scale``).
        """
        record = self._replicas.get(replica)
        flight = record.in_flight.pop(request_id, None) if record else None
        if record is None or flight is None:
            self.num_unknown_completions += 1
            return None
        itl_sample: float | None = None
        if flight.decoding and output_tokens is not None and output_tokens > 0:
            self.answers.add(output_tokens)
        if flight.session is not None and now_s is not None:
            # Its prompt and answer stay cached here, free, until the LRU needs the room.
            answer = flight.predicted_output_tokens if output_tokens is None else output_tokens
            home = self._resting_on.get(flight.session)
            if home is not None and home != replica and home in self._replicas:
                self._replicas[home].drop_resting(flight.session)
            record.drop_resting(flight.session)
            tokens = flight.context_tokens + max(0, answer)
            record.resting[flight.session] = (tokens, now_s)
            record.resting_tokens += tokens
            self._resting_on[flight.session] = replica
            self._forget_resting(record, now_s)
        if flight.decoding:
            record.num_decoding = max(0, record.num_decoding - 1)
            record.decoding_context_tokens = max(0, record.decoding_context_tokens - (
                flight.context_tokens + flight.predicted_output_tokens // 2))
            record.decode_output_sum = max(0, record.decode_output_sum
                                           - flight.predicted_output_tokens)
            if (learn_itl and now_s is not None and output_tokens is not None
                    and output_tokens >= MIN_ITL_SAMPLE_TOKENS and flight.predicted_step_s > 0):
                # The prefill sent there while this answer decoded ran in the same steps: its
                # time is the other requests' doing, not the decode model's error.
                interference_s = ((record.prefill_dispatched_total - flight.prefill_mark)
                                  / max(record.rate_tps, 1e-9))
                observed = max(0.0, now_s - flight.first_token_s - interference_s) / (
                    output_tokens - 1)
                itl_sample = observed / flight.predicted_step_s
                self.learn_itl_scale(replica, itl_sample)
        else:
            record.waiting_context_tokens = max(0, record.waiting_context_tokens - (
                flight.context_tokens + flight.predicted_output_tokens // 2))
            record.waiting_output_tokens = max(0, record.waiting_output_tokens
                                               - flight.predicted_output_tokens)
            record.outstanding_prefill_tokens = max(
                0, record.outstanding_prefill_tokens - flight.prefill_tokens
            )
            record.backlog_tokens = min(record.backlog_tokens,
                                        float(record.outstanding_prefill_tokens))
        record.active_kv_tokens = max(0, record.active_kv_tokens - flight.kv_tokens)
        return itl_sample

    def learn_itl_scale(self, replica: ReplicaId, sample: float) -> bool:
        """Fold one sample of ``replica``'s inter-token factor (an answer's observed step over
        the step predicted at its first token) into the learned one (clamped to
        ``ITL_SCALE_BOUNDS``, then smoothed); whether it taught anything (not: unknown replica).

        Raises:
            ValueError: ``sample`` is not a finite number >= 0.
        """
        if (not isinstance(sample, (int, float)) or isinstance(sample, bool)
                or not math.isfinite(sample) or sample < 0.0):
            raise ValueError(f"inter-token sample for replica {replica!r} must be a finite "
                             f"number >= 0, got {sample!r}")
        record = self._replicas.get(replica)
        if record is None:
            return False
        low, high = ITL_SCALE_BOUNDS
        record.itl_scale += self._alpha * (min(max(sample, low), high) - record.itl_scale)
        return True

    def on_engine_metrics(
        self,
        replica: ReplicaId,
        *,
        running: int | None,
        waiting: int | None,
        kv_usage: float | None,
        kv_capacity_tokens: int | None = None,
    ) -> None:
        """Record what the engine's ``/metrics`` says about itself (``kv_capacity_tokens``:
        ``num_gpu_blocks`` × ``block_size`` of its ``vllm:cache_config_info``, if read)."""
        record = self._replicas.get(replica)
        if record is None:
            return
        record.engine_running = running
        record.engine_waiting = waiting
        record.kv_usage = kv_usage
        if kv_capacity_tokens is not None:
            record.kv_capacity_tokens = max(0, kv_capacity_tokens)

    # -- reading ----------------------------------------------------------------------------

    @property
    def session_rest_s(self) -> float:
        """The learned mean time a session rests between its requests (module docstring)."""
        return self._rest_mean_s

    def snapshot(self, replica: ReplicaId, now_s: float | None = None,
                 session: str | None = None) -> ReplicaLoad:
        """The load a policy should score for ``replica``.

        With ``now_s``, outstanding prefill is the backlog drained at the learned rate since
        the last progress report (see the module docstring); without it, the raw count.
        ``session`` (the routed request's session key, as ``on_dispatch`` takes it) is left
        out of ``resting_sessions`` and ``resting_other_tokens``.
        """
        record = self._replicas.get(replica)
        if record is None:
            record = self._record(replica)  # raises the KeyError that names the replica
        rate = record.effective_rate(now_s)
        left, overdue = (record.decode_left_each(now_s, self.answers) if now_s is not None
                         else (float(record.decode_output_sum), 0.0))
        outstanding = record.outstanding_prefill_tokens
        if now_s is not None and outstanding:  # nothing outstanding drains to 0 anyway
            outstanding = int(record.drained_backlog(now_s))
        if record.engine_waiting:
            # Work queued by other router processes (or before our restart) is invisible to
            # our own accounting; the engine's waiting count times a typical prompt is a floor.
            outstanding = max(outstanding, int(record.engine_waiting * record.mean_prompt_tokens))
        capacity = record.kv_capacity_tokens
        used = record.decoding_context_tokens + record.waiting_context_tokens
        if capacity and record.kv_usage is not None:
            used = max(used, int(record.kv_usage * capacity))
        resting_tokens = self._forget_resting(record, now_s)
        resting = record.resting
        others, other_tokens = len(resting), resting_tokens
        if session is not None and (own := resting.get(session)) is not None:
            others -= 1
            other_tokens -= own[0]
        return ReplicaLoad(  # positional (field order): the fastest way to build one
            outstanding, len(record.in_flight), record.num_decoding, rate,
            record.engine_running, record.engine_waiting, record.kv_usage,
            record.active_kv_tokens, record.last_chosen_s, record.decoding_context_tokens,
            left, record.itl_scale, record.waiting_context_tokens, record.waiting_output_tokens,
            float("inf") if now_s is None else now_s - record.rate_sampled_s,
            capacity, used, resting_tokens, others, other_tokens, self._rest_mean_s,
            overdue, record.duty(now_s),
        )

    def _forget_resting(self, record: _ReplicaRecord, now_s: float | None) -> int:
        """Forget ``record``'s sessions at rest too long (or too many); its resting tokens."""
        while (session := record.oldest_resting(now_s)) is not None:
            record.drop_resting(session)
            self._resting_on.pop(session, None)
        return record.resting_tokens

    def _record(self, replica: ReplicaId) -> _ReplicaRecord:
        record = self._replicas.get(replica)
        if record is None:
            raise KeyError(f"replica {replica!r} is not tracked; call add_replica first")
        return record
