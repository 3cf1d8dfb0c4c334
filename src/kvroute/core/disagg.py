"""Disaggregated prefill/decode: each replica's role and the per-request split decision.

A replica serves one of three roles (``ReplicaSpec.role``): ``both`` (an ordinary engine:
it prefills and decodes its own requests), ``prefill`` (it only computes prompts, for a
decode replica to pull: vLLM's ``kv_transfer_params: {do_remote_decode: true}`` with
``max_tokens: 1``) or ``decode`` (it decodes requests whose prompts another replica computed,
``do_remote_prefill``, and may also prefill a request itself when that is cheaper: vLLM's
NixlConnector runs as ``kv_both``). A pool with a :class:`DisaggSpec` decides, for every
request, between

* **colocated**: one replica (role ``both`` or ``decode``) prefills and decodes it, priced by
  the policy's own whole-turn score; and
* **split**: a prefill replica P (role ``both`` or ``prefill``) computes the prompt, the KV
  moves over the link to a decode replica D ≠ P, which decodes it.

The split is priced from the same whole-turn terms as the colocated score (``core/policy.py``;
symbols as there, ``s`` the link's seconds per token of KV = bytes per token ÷ bandwidth):

    prefill_part(P) = ttft_P + work_weight·prefill_P/rate_P + inflight_cost_s·in_flight_P
                      + harm_weight·stalled_P·prefill_P/rate_P     P's streams stall meanwhile
    pulled_D        = n − cached_D                      D pulls what its own cache lacks
    decode_part(D)  = queue_D/rate_D + s·pulled_D       it waits for D's queue and the transfer
                      + decode_weight·m·step_D(in_flight_D + 1, context_D + n + m/2)
                      + harm_weight·left_D·(step with it − step without it)
                      + inflight_cost_s·in_flight_D + pressure_weight·pressure_D
    split           = min over P of prefill_part(P) + min over D ≠ P of decode_part(D)

(``stalled_P``: the policy's ``stalled_streams``; with ``kv_wait_weight`` or ``return_weight``
on, each half gets its share of those terms too.)

and the request is split when ``split`` is below the best colocated cost. What a split saves is
the stall of D's decoding streams during a prefill on D (``decoding_D·prefill/rate`` in the
colocated harm) and D's queue of other prefills; what it costs is the transfer and P's
queue. No threshold: a short or mostly cached prompt has little prefill to move and goes
straight to a decode replica; a long cold prompt arriving where many streams decode goes to
a prefill replica when the link is fast enough.

Worked example (8B/H100 step law, rates 25,000 tok/s, ``s`` = 10.5 µs a token: 128 KiB at
12.5 GB/s, m = 256, D decoding 30 streams): a 20,000-token cold prompt colocated on D stalls
its 30 streams 0.8 s each, ``harm_weight``·24 s = 12 s; split, it queues on an idle P for
0.8 s and moves in 0.21 s: split. A 500-token suffix of a cached conversation stalls them
20 ms each (0.3 s weighted) and would move 20,500 tokens it mostly has already, but its
prefill on an idle P (with none of its prefix) costs 0.8 s: colocated.

Prefill duty. In ``auto`` and ``always`` every decode, colocated or a split's decode half,
is also charged ``decode_weight·m·step_with·d/(1 − d)``, ``d`` the replica's learned
``prefill_duty`` (``core/load.py``: the prefill tokens recently dispatched there, decayed
over 30 s, as a share of 30 s of its prefill rate; at most 0.9). A replica that keeps taking prefills runs
a prefill chunk in most of its steps, so a stream decoding there is that much slower than
the step model says. Without it, a pool of ``both`` replicas sorts itself into prefill hubs
(the replicas with the fewest streams have the cheapest stall, so they get the splits'
prefills) whose few remaining streams, colocated returns of the prefixes the hubs hold,
decode at a prefill step's pace and make the E2E tail (docs/disaggregation.md). ``never``
prices no duty: it is the ordinary fleet the modes are measured against.

Modes (``DisaggSpec.mode``): ``auto`` (the comparison above; policies without the cost
terms, the peers', always split), ``always`` and ``never`` (the baselines the comparison is
measured against). ``never`` leaves prefill-only replicas idle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from kvroute.core.policy import Candidate, KvrouteCostPolicy, Policy, PolicyInput, Selection
from kvroute.core.types import ReplicaId

Role = Literal["both", "prefill", "decode"]
ROLES: Final[tuple[Role, ...]] = ("both", "prefill", "decode")
SplitMode = Literal["auto", "always", "never"]
SPLIT_MODES: Final[tuple[SplitMode, ...]] = ("auto", "always", "never")

LINK_S_PER_TOKEN: Final = 131_072 / 12.5e9
"""Seconds to move one token's KV from P to D: Llama-3.1-8B's 128 KiB in BF16 (``kvroute
plan``) over a 100 Gb/s RDMA link (12.5 GB/s). Set per deployment: bytes per token ÷ the
link's bandwidth."""


@dataclass(frozen=True, slots=True)
class DisaggSpec:
    """A pool's prefill/decode settings.

    Attributes:
        mode: ``auto``, ``always`` or ``never`` (module docstring).
        link_s_per_token: the KV transfer's seconds per token (bytes per token ÷ bandwidth).
    """

    mode: SplitMode = "auto"
    link_s_per_token: float = LINK_S_PER_TOKEN

    def __post_init__(self) -> None:
        if self.mode not in SPLIT_MODES:
            raise ValueError(f"disaggregation mode {self.mode!r} is not one of "
                             f"{', '.join(SPLIT_MODES)}")
        if not self.link_s_per_token >= 0:
            raise ValueError(f"link_s_per_token={self.link_s_per_token!r} must be >= 0 "
                             "(bytes per token / the link's bytes per second)")


def check_role(role: str, where: str) -> Role:
    """``role`` as a :data:`Role`, or a ValueError naming ``where`` and the choices."""
    for known in ROLES:
        if role == known:
            return known
    raise ValueError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")


def can_prefill(role: Role) -> bool:
    return role != "decode"


def can_colocate(role: Role) -> bool:
    """A replica that may prefill and decode one request itself."""
    return role != "prefill"


@dataclass(frozen=True, slots=True)
class SplitParts:
    """One candidate's two halves of a split (seconds; ``None`` when its role forbids it)."""

    prefill_s: float | None
    decode_s: float | None
    prefill_tokens: float
    pulled_tokens: float


@dataclass(frozen=True, slots=True)
class SplitChoice:
    """The split decision for one request.

    Attributes:
        selection: the ranking of the replicas that decode it (colocated or split), best
            first: ``selection.replica`` answers the client; a retry takes the next one,
            colocated.
        prefill: the prefill replica of a split, or None (colocated).
        prefill_cached_tokens: tokens the prefill replica is expected to hold already.
        split_cost_s / colocated_cost_s: the two prices compared (inf when impossible).
        refused: the pair ``(prefill, decode)`` that would have been chosen but ``may_pair``
            refused (the fidelity gate: other weights, no passing verdict), else None.
        refused_tokens: tokens that pair would have moved over the link (the decode
            replica's own cache lacked them); recomputed natively instead.
    """

    selection: Selection
    prefill: ReplicaId | None
    prefill_cached_tokens: int = 0
    split_cost_s: float = float("inf")
    colocated_cost_s: float = float("inf")
    refused: tuple[ReplicaId, ReplicaId] | None = None
    refused_tokens: int = 0


def duty_stretch_s(policy: KvrouteCostPolicy, request: PolicyInput, cand: Candidate,
                   scale: float) -> float:
    """What the prefills a replica keeps taking add to a decode there (module docstring,
    "Prefill duty"): ``decode_weight·m·step_with·duty/(1 − duty)``."""
    duty = cand.load.prefill_duty
    if duty <= 0.0:
        return 0.0
    own_decode, _ = policy.turn_terms_s(request, cand, 0.0, scale)
    return policy.decode_weight * own_decode * duty / (1.0 - duty)


def split_parts(policy: KvrouteCostPolicy, request: PolicyInput, cand: Candidate, role: Role,
                link_s_per_token: float, scale: float) -> SplitParts:
    """``prefill_part`` and ``decode_part`` of one candidate (module docstring)."""
    load = cand.load
    rate = max(load.prefill_rate_tps, 1e-9)
    ttft, prefill = policy.predicted_ttft_s(request, cand)
    timing = request.decode_timing
    kv_wait = policy.kv_wait_weight > 0 and load.kv_capacity_tokens
    prefill_s = None
    if can_prefill(role):
        step_now = timing.step_s(load.num_in_flight, load.decoding_context_tokens
                                 + load.waiting_context_tokens) * scale
        prefill_s = (ttft + policy.work_weight * prefill / rate
                     + policy.inflight_cost_s * load.num_in_flight
                     + policy.harm_weight * policy.stalled_streams(load, rate, step_now)
                     * prefill / rate)
        if kv_wait:
            prefill_s += policy.kv_wait_weight * policy.kv_wait_s(load, prefill, scale, timing)
    decode_s = None
    pulled = prefill  # what this replica's own cache lacks (a hit never covers the last token)
    if can_colocate(role):
        own_decode, harm = policy.turn_terms_s(request, cand, 0.0, scale)
        evicted = policy.evicted_resting_tokens(request, cand, prefill)
        decode_s = (load.outstanding_prefill_tokens / rate + link_s_per_token * pulled
                    + policy.decode_weight * own_decode + policy.harm_weight * harm
                    + duty_stretch_s(policy, request, cand, scale)
                    + policy.inflight_cost_s * load.num_in_flight
                    + policy.pressure_weight * evicted / rate)
        if policy.return_weight > 0 and load.resting_sessions > 0:
            ret_decode, ret_harm = policy.returning_terms_s(request, cand, scale)
            decode_s += policy.return_weight * (policy.decode_weight * ret_decode
                                                + policy.harm_weight * ret_harm)
        if kv_wait:  # the pulled blocks need room as a prefill's would
            decode_s += policy.kv_wait_weight * policy.kv_wait_s(load, pulled, scale, timing)
    return SplitParts(prefill_s, decode_s, prefill, pulled)


PairCheck = Callable[[ReplicaId, ReplicaId], bool]
"""``may_pair(prefill, decode)``: may the KV ``prefill`` writes be decoded on ``decode``?"""


def choose_split(policy: Policy, request: PolicyInput, candidates: Sequence[Candidate],
                 roles: Mapping[ReplicaId, Role], spec: DisaggSpec,
                 may_pair: PairCheck | None = None) -> SplitChoice:
    """Rank ``candidates`` of a disaggregated pool and decide colocated or split.

    ``may_pair`` (the fidelity gate, ``core/verdict_book.py``) vetoes pairs whose prefill
    replica runs other weights than the decode replica without a passing verdict: the best
    allowed pair is priced instead (within the version group), and when none is allowed
    the request is colocated (the decode side recomputes). The best refused pair is
    reported (``SplitChoice.refused``) when it would have been chosen.

    Raises:
        ValueError: no candidate may decode (every healthy one is prefill-only).
    """
    decoders = [c for c in candidates if can_colocate(roles.get(c.replica, "both"))]
    if not decoders:
        raise ValueError("no healthy replica of the pool may decode (all are prefill-only)")
    colocated = policy.select(request, decoders)
    prefillers = [c for c in candidates if can_prefill(roles.get(c.replica, "both"))]
    if spec.mode == "never" or not prefillers or (len(prefillers) == 1
                                                   and len(decoders) == 1
                                                   and prefillers[0] is decoders[0]):
        return SplitChoice(colocated, None)
    best_colocated = colocated.scores.get(colocated.replica, float("inf"))
    if not isinstance(policy, KvrouteCostPolicy):
        # A policy without the turn terms cannot price a split: always split, each half
        # chosen by the policy among the replicas of that role (as llm-d and Dynamo do).
        first = policy.select(request, prefillers)
        others = [r for r in first.ranking if r != colocated.replica]
        prefill = next((r for r in others if may_pair is None
                        or may_pair(r, colocated.replica)), None)
        vetoed = (None if not others or others[0] == prefill
                  else (others[0], colocated.replica))
        if prefill is None:
            held = colocated.expected_cached_tokens.get(colocated.replica, 0)
            return SplitChoice(colocated, None, refused=vetoed, refused_tokens=0 if vetoed is None
                               else max(0, request.num_prompt_tokens - held))
        return SplitChoice(colocated, prefill,
                           first.expected_cached_tokens.get(prefill, 0), refused=vetoed)
    scale = sum(c.load.itl_scale for c in candidates) / len(candidates)
    colocated = _with_duty(policy, request, decoders, colocated, scale)
    best_colocated = colocated.scores.get(colocated.replica, float("inf"))
    parts = {c.replica: split_parts(policy, request, c, roles.get(c.replica, "both"),
                                    spec.link_s_per_token, scale) for c in candidates}
    # Ties go to the fewest requests in flight, then the least recently chosen (never to
    # the list's order: idle twins would otherwise always send the first one the work).
    loads = {c.replica: c.load for c in candidates}
    by_prefill = sorted((p.prefill_s, loads[r].num_in_flight, loads[r].last_chosen_s, str(r))
                        for r, p in parts.items() if p.prefill_s is not None)
    by_decode = sorted((p.decode_s, loads[r].num_in_flight, loads[r].last_chosen_s, str(r))
                       for r, p in parts.items() if p.decode_s is not None)
    best = _best_pair(by_prefill[:2], by_decode[:2], None)
    refused: tuple[ReplicaId, ReplicaId] | None = None
    if best is not None and may_pair is not None and not may_pair(best[1], best[2]):
        if spec.mode == "always" or best[0] < best_colocated:  # it would have been chosen
            refused = (best[1], best[2])
        best = _best_pair(by_prefill, by_decode, may_pair)
    # Colocated because of a refusal: the decode replica recomputes what the pair would
    # have moved to it (what its own cache lacks).
    recomputed = 0 if refused is None else int(parts[colocated.replica].pulled_tokens)
    if best is None:
        return SplitChoice(colocated, None, colocated_cost_s=best_colocated, refused=refused,
                           refused_tokens=recomputed)
    split_cost, prefill, decode = best
    if spec.mode == "auto" and split_cost >= best_colocated:
        return SplitChoice(colocated, None, split_cost_s=split_cost,
                           colocated_cost_s=best_colocated, refused=refused,
                           refused_tokens=recomputed)
    ranking = (decode, *(r for r in colocated.ranking if r != decode))
    cached = dict(colocated.expected_cached_tokens)
    selection = Selection(ranking=ranking, expected_cached_tokens=cached,
                          scores=colocated.scores, reason="split")
    prefill_cached = int(request.num_prompt_tokens - parts[prefill].prefill_tokens)
    return SplitChoice(selection, prefill, max(0, prefill_cached), split_cost, best_colocated,
                       refused=refused)


_Ranked = tuple[float, int, float, str]


def _best_pair(by_prefill: Sequence[_Ranked], by_decode: Sequence[_Ranked],
               may_pair: PairCheck | None) -> tuple[float, ReplicaId, ReplicaId] | None:
    """The cheapest (prefill, decode) pair of two different replicas that ``may_pair``
    allows (every pair when None). ``by_decode`` is sorted by cost, so each prefill
    replica's first allowed decode replica is its best one."""
    best: tuple[float, ReplicaId, ReplicaId] | None = None
    for p_cost, _, _, p_name in by_prefill:
        for d_cost, _, _, d_name in by_decode:
            if p_name == d_name:
                continue
            p, d = ReplicaId(p_name), ReplicaId(d_name)
            if may_pair is not None and not may_pair(p, d):
                continue
            if best is None or p_cost + d_cost < best[0]:
                best = (p_cost + d_cost, p, d)
            break
    return best


def _with_duty(policy: KvrouteCostPolicy, request: PolicyInput, decoders: Sequence[Candidate],
               colocated: Selection, scale: float) -> Selection:
    """The colocated ranking with each replica's prefill duty priced into its decode (module
    docstring, "Prefill duty"); the policy's own order among equal scores is kept."""
    stretch = {c.replica: duty_stretch_s(policy, request, c, scale) for c in decoders}
    if not any(stretch.values()):
        return colocated
    scores = {r: cost + stretch.get(r, 0.0) for r, cost in colocated.scores.items()}
    order = {r: i for i, r in enumerate(colocated.ranking)}
    ranking = tuple(sorted(colocated.ranking, key=lambda r: (scores[r], order[r])))
    return Selection(ranking=ranking, expected_cached_tokens=colocated.expected_cached_tokens,
                     scores=scores, reason=colocated.reason)
