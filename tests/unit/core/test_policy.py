"""kvroute's cost model and the tie-breaking rules shared by every policy."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.index import PrefixMatch
from kvroute.core.load import ReplicaLoad
from kvroute.core.policy import (
    NO_MATCH,
    Candidate,
    KvrouteCostPolicy,
    PolicyInput,
    cached_tokens_for,
    rank_by_cost,
)
from kvroute.core.types import ReplicaId


def cand(name: str, *, queue: int = 0, gpu: int = 0, predicted: int = 0, rate: float = 10_000.0,
         in_flight: int = 0, last: float = float("-inf")) -> Candidate:
    return Candidate(
        ReplicaId(name),
        ReplicaLoad(outstanding_prefill_tokens=queue, prefill_rate_tps=rate,
                    num_in_flight=in_flight, last_chosen_s=last),
        PrefixMatch(num_gpu_blocks=gpu, num_predicted_blocks=predicted),
    )


def test_worked_example_from_the_docstring() -> None:
    """The first-token part of the cost (no decoding anywhere: the turn terms are off)."""
    policy = KvrouteCostPolicy(random.Random(0), work_weight=0.5, decode_slowdown=0.0,
                               step_tokens=0.0, decode_weight=0.0, harm_weight=0.0)
    req = PolicyInput("r", num_prompt_tokens=1000, block_size=16)
    sel = policy.select(req, [cand("A", queue=9000, gpu=62), cand("B"), cand("C", queue=2000, gpu=31)])
    assert sel.ranking == ("B", "C", "A")
    assert sel.scores[ReplicaId("A")] == pytest.approx(0.9012)
    assert sel.scores[ReplicaId("B")] == pytest.approx(0.15)
    assert sel.scores[ReplicaId("C")] == pytest.approx(0.2756)
    assert sel.expected_cached_tokens == {"A": 992, "B": 0, "C": 496}


def test_hit_never_covers_the_last_token() -> None:
    # 64 tokens fully cached in 4 blocks of 16: vLLM recomputes the last block.
    assert cached_tokens_for(PrefixMatch(num_gpu_blocks=4), 64, 16) == 48
    assert cached_tokens_for(PrefixMatch(num_gpu_blocks=4), 65, 16) == 64
    assert cached_tokens_for(PrefixMatch(num_cpu_blocks=4), 65, 16) == 48  # 0.75 credit


def test_sibling_with_predicted_prefix_colocates() -> None:
    """A burst sibling prefers the replica already computing the same prompt."""
    policy = KvrouteCostPolicy(random.Random(0))
    req = PolicyInput("r", num_prompt_tokens=1000, block_size=16)
    sel = policy.select(req, [cand("B"), cand("A", queue=1000, predicted=62)])
    assert sel.replica == "A"


def test_hot_replica_loses_once_its_queue_costs_more_than_a_recompute() -> None:
    policy = KvrouteCostPolicy(random.Random(0))
    req = PolicyInput("r", num_prompt_tokens=1000, block_size=16)
    assert policy.select(req, [cand("hot", queue=500, gpu=62), cand("cold")]).replica == "hot"
    assert policy.select(req, [cand("hot", queue=5000, gpu=62), cand("cold")]).replica == "cold"


def test_faster_replica_wins_on_learned_rate() -> None:
    policy = KvrouteCostPolicy(random.Random(0))
    req = PolicyInput("r", num_prompt_tokens=4000, block_size=16)
    sel = policy.select(req, [cand("slow", rate=2000.0), cand("fast", rate=8000.0)])
    assert sel.replica == "fast"


def test_ties_are_not_broken_by_list_order() -> None:
    policy = KvrouteCostPolicy(random.Random(7))
    req = PolicyInput("r", num_prompt_tokens=100, block_size=16)
    firsts = Counter(
        policy.select(req, [cand("a"), cand("b"), cand("c"), cand("d")]).replica
        for _ in range(400)
    )
    assert set(firsts) == {"a", "b", "c", "d"}
    assert min(firsts.values()) > 60


def test_ties_prefer_the_least_recently_chosen() -> None:
    costs = {ReplicaId("a"): 1.0, ReplicaId("b"): 1.0}
    order = rank_by_cost(costs, [cand("a", last=5.0), cand("b", last=1.0)], random.Random(0))
    assert order == ("b", "a")


def test_negative_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="work_weight"):
        KvrouteCostPolicy(random.Random(0), work_weight=-1)


def test_a_session_pin_wins_ties_but_not_costs() -> None:
    policy = KvrouteCostPolicy(random.Random(0))
    req = PolicyInput("r", num_prompt_tokens=100, block_size=16, preferred_replica=ReplicaId("c"))
    assert all(policy.select(req, [cand("a"), cand("b"), cand("c")]).replica == "c"
               for _ in range(20))
    assert policy.select(req, [cand("a"), cand("c", queue=5000)]).replica == "a"


def test_waiting_requests_cost_a_step_each() -> None:
    """A burst of short suffixes behind a cached prefix moves on once its steps add up."""
    policy = KvrouteCostPolicy(random.Random(0), step_tokens=64.0, decode_weight=0.0,
                               harm_weight=0.0)
    req = PolicyInput("r", num_prompt_tokens=632, block_size=16)
    # 'hot' holds 600 cached tokens; 8 requests of 32 new tokens each already wait there.
    hot = cand("hot", queue=8 * 32, gpu=37, in_flight=8)
    assert policy.select(req, [hot, cand("cold")]).replica == "hot"
    hotter = cand("hot", queue=12 * 32, gpu=37, in_flight=12)
    assert policy.select(req, [hotter, cand("cold")]).replica == "cold"


def test_waiting_cost_charges_requests_without_a_first_token_only() -> None:
    """``waiting_cost_s`` prices queued requests, not decoding streams (``inflight_cost_s``
    prices both)."""
    def loaded(name: str, *, in_flight: int, decoding: int) -> Candidate:
        return Candidate(ReplicaId(name), ReplicaLoad(prefill_rate_tps=10_000.0,
                                                       num_in_flight=in_flight,
                                                       num_decoding=decoding))

    req = PolicyInput("r", num_prompt_tokens=1000, block_size=16)
    policy = KvrouteCostPolicy(random.Random(0), decode_slowdown=0.0, inflight_cost_s=0.0,
                               waiting_cost_s=0.003, decode_weight=0.0, harm_weight=0.0)
    streams = loaded("streams", in_flight=10, decoding=10)  # ten decoding: not charged
    queued = loaded("queued", in_flight=2, decoding=0)      # two waiting: 6 ms
    sel = policy.select(req, [streams, queued])
    assert sel.replica == "streams"
    assert sel.scores[ReplicaId("queued")] - sel.scores[ReplicaId("streams")] == pytest.approx(0.006)
    # The default in-flight term charges the ten decoding streams instead.
    default = KvrouteCostPolicy(random.Random(0), decode_slowdown=0.0, decode_weight=0.0,
                                harm_weight=0.0)
    assert default.select(req, [streams, queued]).replica == "queued"
    with pytest.raises(ValueError, match="waiting_cost_s"):
        KvrouteCostPolicy(random.Random(0), waiting_cost_s=-0.001)


_counts = st.integers(min_value=0, max_value=200)


@settings(max_examples=300)
@given(
    prompt=st.integers(min_value=0, max_value=5000),
    block_size=st.sampled_from([1, 16, 32]),
    weights=st.tuples(*(st.floats(0.0, 2.0) for _ in range(8))),
    replicas=st.lists(st.tuples(
        st.integers(0, 50_000), _counts, _counts, st.floats(1e-3, 1e6),
        st.one_of(st.none(), st.tuples(_counts, _counts, _counts, _counts))),
        min_size=1, max_size=8),
)
def test_select_scores_are_exactly_the_documented_formula(
    prompt: int, block_size: int, weights: tuple[float, ...],
    replicas: list[tuple[int, int, int, float, tuple[int, int, int, int] | None]],
) -> None:
    """``select`` computes the cost inline; it must equal ``predicted_ttft_s`` plus the
    charges to the last bit, for held and unheld (``NO_MATCH``) replicas alike."""
    work, slow, credit, step, inflight, waiting_cost, decode_w, harm_w = weights
    policy = KvrouteCostPolicy(random.Random(0), work_weight=work, decode_slowdown=slow,
                               predicted_credit=credit, step_tokens=step,
                               inflight_cost_s=inflight, waiting_cost_s=waiting_cost,
                               decode_weight=decode_w, harm_weight=harm_w)
    cands = []
    for i, (queue, in_flight, decoding, rate, held) in enumerate(replicas):
        load = ReplicaLoad(outstanding_prefill_tokens=queue, num_in_flight=in_flight,
                           num_decoding=min(decoding, in_flight), prefill_rate_tps=rate)
        match = NO_MATCH if held is None else PrefixMatch(*held)
        cands.append(Candidate(ReplicaId(f"r{i}"), load, match))
    req = PolicyInput("r", num_prompt_tokens=prompt, block_size=block_size)
    sel = policy.select(req, cands)
    for c in cands:
        ttft, prefill = policy.predicted_ttft_s(req, c)
        rate = max(c.load.prefill_rate_tps, 1e-9)
        waiting = max(0, c.load.num_in_flight - c.load.num_decoding)
        expected = (ttft + work * prefill / rate + inflight * c.load.num_in_flight
                    + waiting_cost * waiting)
        if decode_w > 0 or harm_w > 0:
            decode, harm = policy.turn_terms_s(req, c, prefill)
            expected += decode_w * decode
            expected += harm_w * harm
        assert sel.scores[c.replica] == expected
        assert sel.expected_cached_tokens[c.replica] == int(max(0.0, prompt - prefill))
