"""Replica selection: the policy seam and kvroute's own cost model.

Every policy answers one question: given a request and the candidate replicas of one pool
(each with its load snapshot and its prefix match from the index), which replica, and in
which order should the others be tried if it fails? Policies are pure: they take a seeded
``random.Random`` and read time only from the request (``now_s``).

kvroute's policy (``KvrouteCostPolicy``) scores each replica by the whole turn this request
would take there (its first token, then its decode at the batch it would join), plus what it
would cost the streams already decoding there, plus a small charge for the prefill work:

    credit_r    = gpu_r·1.0 + cpu_r·c_cpu,r + storage_r·c_storage,r + predicted_r·1.0  (blocks)
    c_tier,r    = max(0, 1 − load_s_per_token_tier · rate_r)    a tier hit saves its prefill
                  less the time its load takes (``tier_credit``)
    cached_r    = min(credit_r·B, ⌊(n−1)/B⌋·B)        a hit never covers the last token
    prefill_r   = n − cached_r                        tokens this replica would still compute
    queue_r     = outstanding prefill tokens already sent to r
                  + step_tokens · (requests waiting for their first token on r)
    ttft_r      = (queue_r + prefill_r) / rate_r · (1 + decode_slowdown · decoding_r)
    step(b, k)  = (fixed + seq·b + context_token·k) · itl_scale         one decode step on r
    decode_r    = m · step(in_flight_r + 1, context_r + n + m/2)          its own decode
    harm_r      = left_r · [step(in_flight_r + 1, …) − step(in_flight_r, context_r)]
                  + decoding_r · prefill_r / rate_r                   the others' lost time
    left_r      = predicted_left_r + residual_weight · overdue_left_r
    share_r     = (1 − exp(−m · step_with_r / rest)) / 2
    return_r    = decode_weight · m · share_r · (seq·N_r + context_token·(K_r + N_r·m/2))
                  + harm_weight · share_r · N_r · m · [step with it − step without it]
    free_r      = kv_capacity_r − kv_used_r                    KV no request in flight holds
    resting_r   = min(resting_session_tokens_r, free_r)      live sessions' cached context
    evicted_r   = min(max(0, prefill_r + m − (free_r − resting_r)), resting_r − cached_r)
    pressure_r  = evicted_r / rate_r                the returning sessions' lost prefill
    cost_r      = ttft_r + work_weight · prefill_r / rate_r + inflight_cost_s · in_flight_r
                  + waiting_cost_s · waiting_r + decode_weight · decode_r + harm_weight · harm_r
                  + return_weight · return_r + pressure_weight · pressure_r
                  + kv_wait_weight · kv_wait_r                         (0 by default)

``m`` is the output the request will likely produce (``PolicyInput.predicted_output_tokens``:
the session's last answer, else the route's mean, at most ``max_tokens``); ``context_r`` and
``left_r`` are the context and the predicted remaining output of every request in flight on
r (those still prefilling will decode beside it too); ``fixed``, ``seq`` and
``context_token`` are the pool's ``DecodeTiming`` and ``itl_scale`` the mean of its replicas'
learned factors on it (``core/load.py``).

Worked example of the first-token part (B = 16, n = 1,000, every rate 10,000 tok/s,
decode_slowdown 0, work_weight 0.5, no decoding anywhere, so the turn terms are equal):

    replica  cached  queue   prefill  ttft     cost
    A        992     9,000   8        0.9008   0.9012      holds the prefix, but deep queue
    B        0       0       1,000    0.1000   0.1500      cold and idle  ← chosen
    C        496     2,000   504      0.2504   0.2756      half cached, some queue

Lifetime load: the batch a request decodes in is the batch over its decode, not at its
arrival. Two corrections follow. (1) Requests there that outran their predicted answers
(``overdue_left_r``) count the mean residual of recent answers as long as they are so far
(``core/load.AnswerLengths``), not zero: with heavy-tailed answers they are the ones most
likely to go on (on the agentic trace an answer past 1,000 tokens makes 1,257 more on
average). (2) ``N_r`` sessions rest on r (other than the request's own), ``K_r`` tokens of
cached context: sessions stick to the replica that caches them, so each comes back into r's
batch during the request's decode window with probability ``1 − exp(−window / rest)``
(``rest``: the fleet's learned mean time from a session's answer to its next request), and
then shares on average half the window; ``return_r`` prices that share like the requests in
flight (their steps slow its tokens, its context slows theirs).

``kv_wait_r`` (an option, ``kv_wait_weight`` 0 by default): vLLM admits a waiting request
only when blocks for its whole uncached prompt are free; when the KV its requests in flight
hold leaves too little, the request waits until decoding requests end and free theirs
(``kv_wait_s``). ``lifetime_stall`` (off by default) counts, in the prefill-stall part of
the harm, the requests queued ahead (they decode by the time the prefill runs) and only the
decoders that outlast the queue's wait. Both were measured and left off
(docs/benchmarks.md, "The whole turn").

The pressure term prices KV a placement takes from sessions likely to return. A session
whose request ended on r less than ``SESSION_RETURN_S`` ago and has not sent its next one
rests there: its prompt and answer stay cached in blocks no request holds, which the
engine's LRU evicts, oldest first, when new blocks are needed (``core/load.py``). The
request allocates ``prefill_r + m`` tokens of blocks; the free KV that holds nothing live
(empty blocks, and sessions gone quiet, which are older in the LRU order) gives them first;
past that each token evicts a resting session's, which that session recomputes when it
returns, at r's rate. The request's own cached prefix is taken, not evicted, so it does not
count. The capacity is the engine's (``num_gpu_blocks``·``block_size`` of
``vllm:cache_config_info``); while it is unknown the term is 0. Worked example: 396k tokens
of KV, 250k held by requests in flight, 120k of resting sessions: a cold 60k-token prompt
with a 1k answer finds 26k tokens of spare KV and evicts 35k of the resting sessions'
tokens, 1.4 s of prefill at 25k tokens/s that they pay on return; on a replica with the
same load and no resting session it evicts nothing.

And of the turn terms (the 8B/H100 step: 6 ms + 20 µs a sequence + 50 ns a context token;
m = 256): a request that A holds entirely but where 5 streams decode over 400k tokens of
context would take 26 ms a token there against 6 ms on idle B, 5.1 s more for its answer
than the 8 ms of prefill A saves; and 25,000 uncached tokens sent to a replica with 30
decoding streams stall each of them about a second (25,000 / 25,000 tokens/s), 30 s of other
users' time, which is why a cold prefill goes where few streams decode.

Why the whole turn and not the first token: a TTFT-only score wins the first token and loses
the answer. On long-context, decode-heavy traffic (coding agents) it piles sessions onto the
replicas that hold their prefixes, whose batches then read so much KV per step that every
token of every stream there slows down, while other replicas idle. The decode term makes a
cache hit pay for the batch it joins; the harm term makes every other user's time count like
this request's own, at ``harm_weight`` (0.5 by default: 1 would minimise the sum of everyone's
latency, but its tails were longer on both the Mooncake and the agentic traces, where it
held long prefills back from replicas with many streams; docs/benchmarks.md, "The whole
turn").

Why a cost and not a rule: thresholds ("stick to the cached replica unless the gap exceeds 64
requests and 1.5×") are what send 48 concurrent requests 48/0/0/0 in SGLang's router and
vllm-router. Cache affinity expressed in seconds trades off against queueing automatically:
a hot replica loses as soon as its queue costs more than the prefill another would redo, a
fresh replica wins as soon as it is faster, and prompts with no shared prefix reduce to
least-outstanding-work balancing.

Why ``step_tokens`` exists and is 0 by default: it charges every request still waiting for
its first token a fixed number of tokens, as if each cost an engine step of its own. That is
not how vLLM v1 behaves: waiting requests that fit the step's token budget are prefilled in
the same step (and a request can hit blocks another one in the same step is computing, since
blocks are registered at allocation), so a burst of siblings or of short suffixes behind a
cached prompt shares one step's fixed cost. Charging it per request split sibling bursts that
the engine would have served together faster. It stays available for engines whose
per-request overhead (an API server that is CPU-bound on many streams) dominates.

Why ``decode_slowdown``: every running sequence adds its decode to each step that prefills
the new request (default 0.002: 50 decoding sequences slow its prefill by 10%).

Why ``inflight_cost_s`` (default 1 ms per request in flight): every request a replica is
serving shares its engine steps and its API server. Token counts do not see that cost when
prefills are short or already cached, so without this term a cached replica could take an
unbounded burst of tiny suffixes (and, in a fleet where prefill is nearly free, everything),
and replicas serving many streams would keep winning ties. One millisecond per request is the
order of a decode step's share on a busy engine: it lets about twenty siblings of a long
prompt share one replica, while a hot system prompt with short suffixes spreads after a few.

Why ``waiting_cost_s`` exists and is 0 by default: it charges only the requests still
waiting for their first token, so a burst of short suffixes spreads just as with the
in-flight term, while replicas serving many *decoding* streams are not pushed away from
(the decode slowdown already prices them). It is an option, not the default, because in
place of the in-flight term nothing keeps new prefills off replicas whose streams are
decoding: on the Mooncake trace it won on some arrival orders and lost on others, and it
raised inter-token latency on unique prompts (``docs/benchmarks.md#cost-model-variants``).

Why the ``work_weight`` term: when the time to first token ties (sibling requests sent in one
burst: waiting behind the first sibling's prefill on A costs as much as computing it anew on
idle B), the replica that reuses the cache should win, because it saves the fleet's compute
for everyone else. At 0.5 a request accepts waiting behind up to half the prefill it saves:
a burst of about ten siblings of one prompt stays together, while distinct suffixes behind a
shared system prompt spread as soon as their own queue builds up.

Ties are broken by the session's pin, then the fewest requests in flight, then the most free
KV, then the rendezvous replica of the prompt's first block that no candidate holds (or is
predicted to hold), then least-recently-chosen, then randomly; never by list order (list
order is how peers send every cold request at low load to the first worker).

Why the rendezvous step (``tie_hash``, on by default): several routers each break ties their
own way (the least recently chosen is each router's history; the draw its own seed), so
siblings of a new prefix that reach different routers before any of them is placed (nothing
announced yet) split. The rendezvous weight (``core/rendezvous.py``) depends only on a block
hash and a replica's name, so every router with the same view picks the same replica; the
block is the first new one, so siblings share it while unrelated prompts behind one cached
system prompt do not (keyed on block 0 they would all tie towards one replica), and two
tenants' identical prompts, salted, do not either. On one router it replaces the least
recently chosen only where everything before it ties: the agentic and Mooncake figures in
virtual time are unchanged (docs/benchmarks.md, "Sibling ties"). ``tie_band`` (0: exact
ties only) widens the tie to costs within a relative band where the rendezvous applies; 5%
made the Mooncake trace's first tokens 6% slower, so it stays off.
A replica whose prefill rate was not sampled for ``stale_rate_s`` (30 s, or never) is scored
at the fastest candidate's rate: an estimate that has gone stale is re-sampled instead of
keeping the replica out, so idle replicas share unique prompts sent one after another rather
than all going to the one whose learned rate once came out a little higher.

The peers' policies live in ``core/peer_policies.py`` and implement the same ``Policy`` seam.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from kvroute.core.index import PrefixMatch
from kvroute.core.load import DEFAULT_DECODE_TIMING, DecodeTiming, ReplicaLoad
from kvroute.core.rendezvous import rendezvous_weight
from kvroute.core.spread import DEFAULT_SPREAD, SpreadSettings
from kvroute.core.types import ReplicaId, WireHash

GPU_CREDIT = 1.0
CPU_CREDIT = 0.75
STORAGE_CREDIT = 0.25
"""Constant per-medium credits: what the peers' scorers use (``peer_policies``); kvroute's own
policy prices a tier hit by its load time instead (``tier_credit``)."""
CPU_LOAD_S_PER_TOKEN = 131_072 / 25e9
"""Seconds to load one token's KV back from host memory: Llama-3.1-8B's 128 KiB in BF16
(``kvroute plan``) at 25 GB/s (PCIe 5 x16 in practice). Set per deployment from
``kvroute plan``: bytes per token / the tier's bandwidth."""
STORAGE_LOAD_S_PER_TOKEN = 131_072 / 3e9
"""The same from local NVMe at 3 GB/s: slower than recomputing on an H100 (40 us a token)."""


def tier_credit(load_s_per_token: float, rate_tps: float) -> float:
    """The share of a tier hit's prefill that loading it saves, in ``[0, 1]``: recomputing a
    token takes ``1 / rate_tps`` seconds, loading it ``load_s_per_token``, so a hit is worth
    ``1 − load · rate`` of a device hit, and nothing when loading is slower than recomputing.

    Example: 5.2 µs a token from host memory on a replica prefilling 25,000 tokens/s (40 µs a
    token) is worth 0.87 of a device hit; 44 µs from a 3 GB/s disk is worth nothing.
    """
    return max(0.0, 1.0 - load_s_per_token * rate_tps)
# Relative tolerance within which two costs count as a tie.
TIE_TOLERANCE = 1e-9


NO_MATCH = PrefixMatch()


@dataclass(frozen=True, slots=True)
class PolicyInput:
    """What a policy may know about the request being routed.

    Attributes:
        request_id: unique id of the request.
        num_prompt_tokens: exact or estimated prompt length in tokens.
        block_size: the pool's engine block size (tokens per hashed block).
        block_hashes: the prompt's full-block hashes in the engines' wire form (may be empty
            in approximate mode).
        expected_output_tokens: the output budget the request asked for (or a default).
        predicted_output_tokens: the output it will likely produce (learned per route and
            session, at most the budget); None: take the budget.
        decode_timing: the pool's decode step model (``core/load.DecodeTiming``).
        now_s: the router clock at decision time.
        session_id: the session the request belongs to, if any.
        routing_text: the prompt as text, for text-matching peer policies (``needs_text``).
        preferred_replica: the replica the session is pinned to (shared session state), if
            any: it wins ties, and the ``session`` policy follows it while it is a candidate.
    """

    request_id: str
    num_prompt_tokens: int
    block_size: int
    block_hashes: Sequence[WireHash] = ()
    expected_output_tokens: int = 256
    predicted_output_tokens: int | None = None
    decode_timing: DecodeTiming = DEFAULT_DECODE_TIMING
    now_s: float = 0.0
    session_id: str | None = None
    routing_text: str = ""
    preferred_replica: ReplicaId | None = None


class Candidate(NamedTuple):
    """One replica a policy may choose, with what is known about it (a named tuple: one is
    built per replica and decision, see ``ReplicaLoad``)."""

    replica: ReplicaId
    load: ReplicaLoad
    match: PrefixMatch = NO_MATCH


@dataclass(frozen=True, slots=True)
class Selection:
    """A policy's answer.

    Attributes:
        ranking: every candidate, best first; ``ranking[0]`` is the choice and the rest are
            the order in which a failed attempt is retried.
        expected_cached_tokens: prefix tokens the policy expects the chosen replica to serve
            from cache (``x-kvroute-cached-tokens``), per replica.
        scores: the score each replica got (cost or score, policy-specific), for logs.
        reason: a short word for metrics and logs (``cost``, ``cache``, ``balance``...).
    """

    ranking: tuple[ReplicaId, ...]
    expected_cached_tokens: dict[ReplicaId, int] = field(default_factory=dict)
    scores: dict[ReplicaId, float] = field(default_factory=dict)
    reason: str = ""

    @property
    def replica(self) -> ReplicaId:
        return self.ranking[0]


class Policy(Protocol):
    """A replica-selection policy (kvroute's or a peer's)."""

    name: str
    needs_text: bool
    """True when ``PolicyInput.routing_text`` must be filled in (text-matching peers)."""
    uses_predicted: bool
    """True when the router should record predicted index entries for this policy."""

    def select(self, request: PolicyInput, candidates: Sequence[Candidate]) -> Selection:
        """Rank ``candidates`` (non-empty) for ``request``."""
        ...

    def forget_replica(self, replica: ReplicaId) -> None:
        """Drop any per-replica state (the replica left the pool)."""
        ...


def cached_tokens_for(match: PrefixMatch, num_prompt_tokens: int, block_size: int,
                      *, predicted_credit: float = 1.0, cpu_credit: float = CPU_CREDIT,
                      storage_credit: float = STORAGE_CREDIT) -> float:
    """Prefix tokens a replica is expected to serve from cache, in credit-weighted tokens.

    Caps at the largest whole-block count below the prompt's last token, as vLLM does
    (``max_cache_hit_length = num_tokens - 1``).
    """
    credit = (
        match.num_gpu_blocks * GPU_CREDIT
        + match.num_cpu_blocks * cpu_credit
        + match.num_storage_blocks * storage_credit
        + match.num_predicted_blocks * predicted_credit
    )
    cap = ((num_prompt_tokens - 1) // block_size) * block_size if num_prompt_tokens > 0 else 0
    return min(credit * block_size, float(cap))


def rank_by_cost(
    costs: dict[ReplicaId, float],
    candidates: Sequence[Candidate],
    rng: random.Random,
    *,
    lower_is_better: bool = True,
    preferred: ReplicaId | None = None,
    spread: bool = False,
    rendezvous: WireHash | None = None,
    band: float = 0.0,
) -> tuple[ReplicaId, ...]:
    """Order replicas by cost; ties go to ``preferred`` (a session pin), then (``spread``)
    to the fewest requests in flight and the most free KV, then (``rendezvous``, a prompt's
    first block hash) to the replica of highest rendezvous weight for it, then to the least
    recently chosen, then at random.

    Costs within ``TIE_TOLERANCE`` (float noise) or ``band`` (relative) of the lowest of their
    run count as equal. The random key is drawn for every candidate so that the order never
    depends on the candidates' list order.
    """
    sign = 1.0 if lower_is_better else -1.0
    # Plain tuples sort natively (no key function); the replica name at the end is never
    # reached, the random draw before it being unique.
    if spread:
        keyed = [(sign * costs[cand.replica], cand.replica != preferred,
                  cand.load.num_in_flight,
                  cand.load.kv_used_tokens - cand.load.kv_capacity_tokens,
                  0 if rendezvous is None else -rendezvous_weight(rendezvous, cand.replica),
                  cand.load.last_chosen_s, rng.random(), cand.replica) for cand in candidates]
    else:
        keyed = [(sign * costs[cand.replica], cand.replica != preferred, 0, 0,
                  0 if rendezvous is None else -rendezvous_weight(rendezvous, cand.replica),
                  cand.load.last_chosen_s, rng.random(), cand.replica) for cand in candidates]
    keyed.sort()
    # Collapse float noise (or the band): costs within the tolerance compare as equal.
    collapsed = False
    for i in range(1, len(keyed)):
        prev, item = keyed[i - 1][0], keyed[i]
        if item[0] != prev and abs(item[0] - prev) <= max(TIE_TOLERANCE * max(1.0, abs(prev)),
                                                          band * abs(prev)):
            keyed[i] = (prev, *item[1:])
            collapsed = True
    if collapsed:
        keyed.sort()
    return tuple(item[7] for item in keyed)


class KvrouteCostPolicy:
    """kvroute's policy: the whole turn this request would take on a replica (its first
    token, then its decode at the batch it would join), plus the time it would cost the
    streams already decoding there, plus a small work charge.

    See the module docstring for the formula and a worked example.
    """

    name = "kvroute"
    needs_text = False
    uses_predicted = True

    def __init__(
        self,
        rng: random.Random,
        *,
        work_weight: float = 0.5,
        decode_slowdown: float = 0.002,
        predicted_credit: float = 1.0,
        step_tokens: float = 0.0,
        inflight_cost_s: float = 0.001,
        waiting_cost_s: float = 0.0,
        decode_weight: float = 1.0,
        harm_weight: float = 0.5,
        stale_rate_s: float = 30.0,
        cpu_load_s_per_token: float = CPU_LOAD_S_PER_TOKEN,
        storage_load_s_per_token: float = STORAGE_LOAD_S_PER_TOKEN,
        pressure_weight: float = 1.0,
        return_weight: float = 1.0,
        lifetime_stall: bool = False,
        kv_wait_weight: float = 0.0,
        residual_weight: float = 0.75,
        spread_ahead: bool = DEFAULT_SPREAD.enabled,
        spread_per_s: float = DEFAULT_SPREAD.per_s,
        spread_budget_tokens: float = DEFAULT_SPREAD.budget_tokens,
        spread_overlap: float = DEFAULT_SPREAD.overlap,
        spread_min_tokens: int = DEFAULT_SPREAD.min_tokens,
        spread_target_in_flight: int = DEFAULT_SPREAD.max_target_in_flight,
        tie_hash: bool = True,
        tie_hash_cold_only: bool = False,
        tie_band: float = 0.0,
        spread_rest_on_copy: bool = DEFAULT_SPREAD.rest_on_copy,
    ) -> None:
        if min(cpu_load_s_per_token, storage_load_s_per_token) < 0:
            raise ValueError(
                f"kvroute tier load times must be >= 0 s per token (cpu_load_s_per_token="
                f"{cpu_load_s_per_token}, storage_load_s_per_token={storage_load_s_per_token})")
        if min(work_weight, decode_slowdown, predicted_credit, step_tokens, inflight_cost_s,
               waiting_cost_s, decode_weight, harm_weight, stale_rate_s, pressure_weight,
               return_weight, kv_wait_weight, residual_weight, tie_band) < 0:
            raise ValueError(
                "kvroute policy weights must be >= 0 (work_weight="
                f"{work_weight}, decode_slowdown={decode_slowdown}, "
                f"predicted_credit={predicted_credit}, step_tokens={step_tokens}, "
                f"inflight_cost_s={inflight_cost_s}, waiting_cost_s={waiting_cost_s}, "
                f"decode_weight={decode_weight}, harm_weight={harm_weight}, "
                f"stale_rate_s={stale_rate_s}, pressure_weight={pressure_weight}, "
                f"return_weight={return_weight}, kv_wait_weight={kv_wait_weight}, "
                f"residual_weight={residual_weight}, tie_band={tie_band})"
            )
        self._rng = rng
        self.work_weight = work_weight
        self.decode_slowdown = decode_slowdown
        self.predicted_credit = predicted_credit
        self.step_tokens = step_tokens
        self.inflight_cost_s = inflight_cost_s
        self.waiting_cost_s = waiting_cost_s
        self.decode_weight = decode_weight
        self.harm_weight = harm_weight
        self.stale_rate_s = stale_rate_s
        self.cpu_load_s_per_token = cpu_load_s_per_token
        self.storage_load_s_per_token = storage_load_s_per_token
        self.pressure_weight = pressure_weight
        self.return_weight = return_weight
        self.lifetime_stall = lifetime_stall
        self.kv_wait_weight = kv_wait_weight
        self.residual_weight = residual_weight
        self.tie_hash = tie_hash
        """Ties go to the rendezvous replica of the prompt's first block no candidate holds
        (``rank_by_cost``) before the least recently chosen: what every router computes
        alike, so siblings that reach several routers at once land together (module
        docstring, "Ties")."""
        self.tie_hash_cold_only = tie_hash_cold_only
        """Only for a prompt no candidate holds any block of (an option: the first design,
        which almost never applies once a system prompt is cached somewhere)."""
        self.tie_band = tie_band
        """Where the rendezvous applies, costs within this relative band of the lowest
        count as tied (0, the default: exact ties only; docs/benchmarks.md, "Sibling
        ties")."""
        self.spread = SpreadSettings(
            enabled=spread_ahead, per_s=spread_per_s, budget_tokens=spread_budget_tokens,
            overlap=spread_overlap, min_tokens=spread_min_tokens,
            max_target_in_flight=spread_target_in_flight, rest_on_copy=spread_rest_on_copy)
        """Spread-ahead (``core/spread.py``): copies of resting sessions' contexts to idle
        replicas, planned by the walk when a session's request ends; on by default."""

    def turn_terms_s(self, request: PolicyInput, cand: Candidate, prefill_tokens: float,
                     scale: float = 1.0) -> tuple[float, float]:
        """``(decode_s, harm_s)``: the request's own decode on this replica, and what it
        costs the streams already decoding there (module docstring); ``scale`` is the
        pool's learned factor on the step model (``select`` uses the candidates' mean)."""
        timing, load = request.decode_timing, cand.load
        m = (request.expected_output_tokens if request.predicted_output_tokens is None
             else request.predicted_output_tokens)
        n = request.num_prompt_tokens
        batch = load.num_in_flight  # those ahead decode beside it once it decodes
        context = load.decoding_context_tokens + load.waiting_context_tokens
        step_now = timing.step_s(batch, context) * scale
        step_with = timing.step_s(batch + 1, context + n + m // 2) * scale
        rate = max(load.prefill_rate_tps, 1e-9)
        others_left = (load.decode_tokens_left + self.residual_weight * load.overdue_tokens_left
                       + load.waiting_output_tokens)
        harm = (others_left * (step_with - step_now)
                + self.stalled_streams(load, rate, step_now) * prefill_tokens / rate)
        return m * step_with, harm

    def kv_wait_s(self, load: ReplicaLoad, prefill_tokens: float, scale: float = 1.0,
                  timing: DecodeTiming = DEFAULT_DECODE_TIMING) -> float:
        """How long the request would wait on this replica for KV to start its prefill
        (module docstring): the engine admits a waiting request only when blocks for its
        whole uncached prompt are free, so when the KV held by the requests in flight (those
        ahead take theirs first) leaves too little, it waits until decoding requests end
        and free theirs. Their ends are taken as spread exponentially around their mean
        remaining decode time. 0 when the capacity is unknown or the KV suffices."""
        capacity = load.kv_capacity_tokens
        if not capacity:
            return 0.0
        short = prefill_tokens + load.kv_used_tokens - capacity
        decoding = load.num_decoding
        if short <= 0 or decoding <= 0 or load.decoding_context_tokens <= 0:
            return 0.0
        step = timing.step_s(load.num_in_flight, load.decoding_context_tokens
                             + load.waiting_context_tokens) * scale
        left_s = (load.decode_tokens_left + self.residual_weight
                  * load.overdue_tokens_left) / decoding * step
        if left_s <= 0:
            return 0.0
        return -left_s * math.log1p(-min(short / load.decoding_context_tokens, 0.99))

    def stalled_streams(self, load: ReplicaLoad, rate: float, step_now: float) -> float:
        """The streams decoding on the replica when the request's prefill runs there, which
        it stalls for its duration (module docstring): with ``lifetime_stall``, the requests
        queued ahead of it (they decode by then) plus those decoding now that are still
        decoding after the queue's wait; without, those decoding now."""
        decoding = load.num_decoding
        if not self.lifetime_stall:
            return float(decoding)
        waiting = max(0, load.num_in_flight - decoding)
        if decoding <= 0:
            return float(waiting)
        wait_s = ((load.outstanding_prefill_tokens + self.step_tokens * waiting) / rate
                  * (1.0 + self.decode_slowdown * decoding))
        left_s = (load.decode_tokens_left + self.residual_weight
                  * load.overdue_tokens_left) / decoding * step_now
        if wait_s <= 0.0:
            return float(waiting + decoding)
        survive = math.exp(-wait_s / left_s) if left_s > 0 else 0.0
        return waiting + decoding * survive

    def returning_terms_s(self, request: PolicyInput, cand: Candidate,
                          scale: float = 1.0) -> tuple[float, float]:
        """``(decode_s, harm_s)`` added by the sessions resting on this replica that are
        likely to come back while the request decodes there (module docstring, "lifetime
        load"): their expected share of its batch slows its tokens, and its context slows
        theirs. 0 when no other session rests there."""
        load = cand.load
        others = load.resting_sessions
        if others <= 0:
            return 0.0, 0.0
        timing = request.decode_timing
        m = (request.expected_output_tokens if request.predicted_output_tokens is None
             else request.predicted_output_tokens)
        n = request.num_prompt_tokens
        batch = load.num_in_flight
        context = load.decoding_context_tokens + load.waiting_context_tokens
        step_with = timing.step_s(batch + 1, context + n + m // 2) * scale
        window_s = m * step_with
        share = 0.5 * -math.expm1(-window_s / max(load.session_rest_s, 1e-9))
        sessions = share * others
        joined = timing.seq_s * sessions + timing.context_token_s * share * (
            load.resting_other_tokens + others * (m // 2))
        delta = timing.seq_s + timing.context_token_s * (n + m // 2)
        return m * joined * scale, sessions * m * delta * scale

    def evicted_resting_tokens(self, request: PolicyInput, cand: Candidate,
                               prefill_tokens: float) -> float:
        """Tokens of sessions at rest on this replica that placing the request there would
        evict (module docstring): the blocks it allocates (its prefill and its answer) come
        first out of the free KV that holds no resting session's context; past that, the
        engine's LRU takes resting sessions' blocks. Its own cached prefix is not evicted
        (it takes those blocks), so it does not count. 0 when the capacity is unknown."""
        load = cand.load
        if not load.kv_capacity_tokens:
            return 0.0
        m = (request.expected_output_tokens if request.predicted_output_tokens is None
             else request.predicted_output_tokens)
        free = max(0, load.kv_capacity_tokens - load.kv_used_tokens)
        resting = min(load.resting_session_tokens, free)
        cached = request.num_prompt_tokens - prefill_tokens
        spare = free - resting
        return min(max(0.0, prefill_tokens + m - spare), max(0.0, resting - cached))

    def predicted_ttft_s(self, request: PolicyInput, cand: Candidate) -> tuple[float, float]:
        """Return ``(ttft_s, prefill_tokens)`` this replica would give the request."""
        n = request.num_prompt_tokens
        load = cand.load
        rate = max(load.prefill_rate_tps, 1e-9)
        cached = cached_tokens_for(
            cand.match, n, request.block_size, predicted_credit=self.predicted_credit,
            cpu_credit=tier_credit(self.cpu_load_s_per_token, rate),
            storage_credit=tier_credit(self.storage_load_s_per_token, rate),
        )
        prefill = max(float(n) - cached, 1.0)
        slowdown = 1.0 + self.decode_slowdown * load.num_decoding
        waiting = max(0, load.num_in_flight - load.num_decoding)
        queue = load.outstanding_prefill_tokens + self.step_tokens * waiting
        ttft = (queue + prefill) / rate * slowdown
        return ttft, prefill

    def select(self, request: PolicyInput, candidates: Sequence[Candidate]) -> Selection:
        """Score every candidate and rank them.

        The loop is ``predicted_ttft_s`` and ``cached_tokens_for`` written out inline, with
        the same float operations in the same order (a unit test checks the scores are
        equal to the last bit): it runs for every replica of every request, and the calls
        were a fifth of its cost. A replica that holds none of the prompt (``NO_MATCH``,
        most of them) skips the credit sum.
        """
        n = request.num_prompt_tokens
        block_size = request.block_size
        cap = float(((n - 1) // block_size) * block_size if n > 0 else 0)
        predicted_credit = self.predicted_credit
        decode_slowdown, step_tokens = self.decode_slowdown, self.step_tokens
        work_weight, inflight_cost_s = self.work_weight, self.inflight_cost_s
        waiting_cost_s = self.waiting_cost_s
        decode_weight, harm_weight = self.decode_weight, self.harm_weight
        cpu_load, storage_load = self.cpu_load_s_per_token, self.storage_load_s_per_token
        pressure_weight = self.pressure_weight
        return_weight = self.return_weight
        lifetime_stall = self.lifetime_stall
        kv_wait_weight = self.kv_wait_weight
        residual_weight = self.residual_weight
        turn = decode_weight > 0 or harm_weight > 0
        timing = request.decode_timing
        t_fixed, t_seq, t_ctx = timing.fixed_s, timing.seq_s, timing.context_token_s
        m = (request.expected_output_tokens if request.predicted_output_tokens is None
             else request.predicted_output_tokens)
        added_context = n + m // 2
        # A replica whose rate has not been sampled for stale_rate_s is scored as fast as the
        # fastest candidate, so it gets a request, and a fresh sample (learned speeds must
        # not lock a replica out).
        stale_rate_s = self.stale_rate_s
        best_rate = max(cand.load.prefill_rate_tps for cand in candidates)
        # NOTE: one decode factor for the pool, the candidates' mean: its replicas share an
        # engine build and hardware, so the model's error is the pool's, and a per-replica
        # factor from a few noisy answers would prefer one idle replica over its twin.
        scale = sum(cand.load.itl_scale for cand in candidates) / len(candidates)
        costs: dict[ReplicaId, float] = {}
        cached_tokens: dict[ReplicaId, int] = {}
        for cand in candidates:
            match = cand.match
            load = cand.load
            rate = max(load.prefill_rate_tps if load.rate_age_s < stale_rate_s else best_rate,
                       1e-9)
            if match is NO_MATCH:
                cached = 0.0
            else:
                credit = (
                    match.num_gpu_blocks * GPU_CREDIT
                    + match.num_cpu_blocks * tier_credit(cpu_load, rate)
                    + match.num_storage_blocks * tier_credit(storage_load, rate)
                    + match.num_predicted_blocks * predicted_credit
                )
                cached = min(credit * block_size, cap)
            prefill = max(float(n) - cached, 1.0)
            in_flight = load.num_in_flight
            waiting = max(0, in_flight - load.num_decoding)
            slowdown = 1.0 + decode_slowdown * load.num_decoding
            ttft = (load.outstanding_prefill_tokens + step_tokens * waiting + prefill) / rate \
                * slowdown
            cost = (ttft + work_weight * prefill / rate
                    + inflight_cost_s * in_flight + waiting_cost_s * waiting)
            if turn:  # turn_terms_s written out inline (same operations, same order)
                context = load.decoding_context_tokens + load.waiting_context_tokens
                step_now = (t_fixed + t_seq * in_flight + t_ctx * context) * scale
                step_with = (t_fixed + t_seq * (in_flight + 1)
                             + t_ctx * (context + added_context)) * scale
                stalled = (self.stalled_streams(load, rate, step_now) if lifetime_stall
                           else float(load.num_decoding))
                harm = ((load.decode_tokens_left + residual_weight * load.overdue_tokens_left
                         + load.waiting_output_tokens)
                        * (step_with - step_now) + stalled * prefill / rate)
                cost += decode_weight * (m * step_with)
                cost += harm_weight * harm
                if return_weight > 0 and load.resting_sessions > 0:
                    ret_decode, ret_harm = self.returning_terms_s(request, cand, scale)
                    cost += return_weight * (decode_weight * ret_decode + harm_weight * ret_harm)
            capacity = load.kv_capacity_tokens
            if capacity and kv_wait_weight > 0:
                cost += kv_wait_weight * self.kv_wait_s(load, prefill, scale, timing)
            if capacity and pressure_weight > 0:  # evicted_resting_tokens written out inline
                free = max(0, capacity - load.kv_used_tokens)
                resting = min(load.resting_session_tokens, free)
                evicted = min(max(0.0, prefill + m - (free - resting)),
                              max(0.0, resting - (n - prefill)))
                cost += pressure_weight * (evicted / rate)
            costs[cand.replica] = cost
            cached_tokens[cand.replica] = int(max(0.0, n - prefill))
        ranking = rank_by_cost(costs, candidates, self._rng, preferred=request.preferred_replica,
                               spread=True, rendezvous=self.tie_key(request, candidates),
                               band=self.tie_band)
        return Selection(
            ranking=ranking, expected_cached_tokens=cached_tokens, scores=costs, reason="cost"
        )

    def tie_key(self, request: PolicyInput, candidates: Sequence[Candidate]) -> WireHash | None:
        """The hash whose rendezvous replica wins this request's ties: its first block that no
        candidate holds or is predicted to hold (block 0 for a prompt cached nowhere). Every
        router that sees the same index computes the same one, and siblings of one new
        prefix share it while unrelated prompts behind a shared system prompt do not. None
        (least recently chosen, then random) when the rule is off, every block is held
        somewhere, or (``tie_hash_cold_only``) some block is."""
        if not self.tie_hash:
            return None
        held = max(cand.match.num_blocks for cand in candidates)
        if held >= len(request.block_hashes) or (held and self.tie_hash_cold_only):
            return None
        return request.block_hashes[held]

    def forget_replica(self, replica: ReplicaId) -> None:
        """Stateless across requests: nothing to forget."""
